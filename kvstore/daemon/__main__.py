"""`python -m kvstore.daemon [FLAGS]` runs one store node, as `kvtier serve [FLAGS]` does:
what programs that start daemons (tests, benchmarks, the cluster launcher) run, so they
depend on the storage layer only."""
import argparse
import sys

from kvstore.daemon.serve import configure, run
from kvstore.errors import KVStoreError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.daemon",
                                description="run a kvtier store daemon node",
                                allow_abbrev=False)  # `--token` is not `--token-file`
    configure(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except KVStoreError as e:
        print(f"kvtier serve: {e}", file=sys.stderr)
        return 2


sys.exit(main())
