"""`python -m kvtier ...` is the `kvtier` command."""
import os
import sys

try:
    from kvtier.cli import main
    code = main()
except KeyboardInterrupt:  # Ctrl-C while the command's modules were still loading
    print("kvtier: interrupted", file=sys.stderr, flush=True)
    # at once: nothing was started yet, and an interpreter stopped midway through its
    # imports sometimes re-raised the interrupt on its way out (exit -2, not 130)
    os._exit(130)
sys.exit(code)
