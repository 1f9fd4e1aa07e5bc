"""`python -m aiollm COMMAND`: `serve` starts a local serving cluster (see aiollm/cli/serve.py)."""

import argparse
import sys

from aiollm.cli import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiollm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_arguments(sub.add_parser("serve", help="start a local DistServe cluster with an OpenAI-compatible API"))
    args = parser.parse_args(argv)
    return serve.run(args)


if __name__ == "__main__":
    sys.exit(main())
