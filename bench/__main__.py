"""Entry point of the benchmark suite: `python -m bench NAME [options] [--json PATH]`."""

import argparse
import importlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from aiollm.heap import keep_freed_memory
from aiollm.report import print_figures
from bench.table import this_cpu

# benchmark name -> module under bench/
BENCHMARKS = {
    "transport": "bench.transport",
    "attention": "bench.attention",
    "kvalloc": "bench.kvalloc",
    "model": "bench.model",
    "fastdecode": "bench.fastdecode",
    "serve": "bench.serve",
    "planner": "bench.planner",
    "faults": "bench.faults",
    "cluster": "bench.cluster",
    "prefix": "bench.prefix",
    "peers": "bench.peers",
}
# other commands -> module with add_arguments(parser) and main(args) -> exit status
COMMANDS = {
    "table": "bench.table",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        child = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        child.add_argument("--json", type=Path, help="write the figures to this JSON file")
        module.add_arguments(child)
        child.set_defaults(module=module)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        child = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(child)
        child.set_defaults(command=module)
    args = parser.parse_args(argv)
    if getattr(args, "command", None) is not None:
        return args.command.main(args)
    keep_freed_memory()  # as the roles' processes run (aiollm.heap): the bench hosts S-workers and baselines
    figures = args.module.run(args)
    # where and when, for the README's table (bench table) and any history kept under bench/results/
    figures.setdefault("cpu", this_cpu())
    figures.setdefault("date", datetime.now(UTC).strftime("%Y-%m-%d"))
    print_figures(args.name, figures)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
