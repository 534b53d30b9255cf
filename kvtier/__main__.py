"""`python -m kvtier ...` is the `kvtier` command."""
import sys

from kvtier.cli import main

sys.exit(main())
