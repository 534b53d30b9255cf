"""`python -m kvtier ...` is the `kvtier` command."""
import sys

try:
    from kvtier.cli import main
    code = main()
except KeyboardInterrupt:  # Ctrl-C while the command's modules were still loading
    print("kvtier: interrupted", file=sys.stderr)
    code = 130
sys.exit(code)
