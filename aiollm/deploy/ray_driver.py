"""The process that holds `python -m aiollm serve --ray`'s connection to Ray.

    python -m aiollm.deploy.ray_driver --config cluster.toml [--address ADDR]

Deploys the spec (`RayCluster`) and reports on stdout, one JSON line each: {"base_url", "secret", "nodes"}
once the frontend answers, then {"nodes": {name: url}} whenever Ray moves an instance. It tears the
deployment down when its stdin closes. Ray ends this process if the cluster's head is lost; `serve`, its
parent, then still knows every node and the secret (see `aiollm.deploy.ray.serve`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from aiollm import log
from aiollm.deploy.ray import RayCluster
from aiollm.deploy.spec import ClusterSpec

POLL_S = 1.0


def _report(report: dict) -> None:
    print(json.dumps(report), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiollm.deploy.ray_driver")
    parser.add_argument("--config", type=Path, required=True, metavar="TOML")
    parser.add_argument("--address", default=None, metavar="ADDR")
    args = parser.parse_args(argv)
    spec = ClusterSpec.from_toml(args.config)
    log.configure(spec.log_level)  # logs on stderr: stdout carries the reports
    closed = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    with RayCluster(spec, args.address) as cluster:
        nodes = cluster.nodes()
        _report({"base_url": cluster.base_url, "secret": cluster.secret, "nodes": nodes})
        while not closed.wait(POLL_S):
            current = cluster.nodes()
            if current != nodes:
                nodes = current
                _report({"nodes": nodes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
