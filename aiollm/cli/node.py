"""`python -m aiollm.node --role ROLE --listen tcp://127.0.0.1:PORT --secret-file F [--peer URL ...]`

Starts one node hosting a role's actors and runs until SIGTERM/SIGINT or a remote `Shutdown`.
Once serving it prints one JSON line on stdout — {"ready": true, "addresses": [...], "actors":
{...}, "pid": N} — so a launcher that asked for port 0 learns the real port (see graph.py).
Logs go to stderr. Bad arguments print one line and exit with status 2.

Roles live in a registry: a name, the module that implements it (imported only when chosen) and
a line of help. A role module has `add_arguments(parser)` for its own options and
`async start(node, args) -> {actor name: url}`; later issues add their roles here.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

# role -> (module implementing it, one line of help)
ROLES: dict[str, tuple[str, str]] = {
    "echo": ("aiollm.actors.echo", "an `echo` actor answering Ping/Echo/Count/Sleep/Fail (demo, tests, bench)"),
    "empty": ("aiollm.actors.system", "no actor of its own; actors are spawned on it remotely (graph.py)"),
    "prefill": (
        "aiollm.deploy.roles.prefill",
        "DistServe prefill instance: FCFS, batches to L_m, holds KV until pulled",
    ),
    "decode": ("aiollm.deploy.roles.decode", "DistServe decode instance: continuous batching, pulls KV"),
    "controller": ("aiollm.deploy.roles.controller", "DistServe controller: dispatch, failover, timings"),
    "frontend": ("aiollm.deploy.roles.frontend", "OpenAI-compatible HTTP API in front of a controller"),
    "r-worker": (
        "aiollm.serving.fastdecode.r_worker",
        "FastDecode R-worker: sequences' KV in RAM under --kv-memory, attention",
    ),
    "s-worker": (
        "aiollm.serving.fastdecode.s_worker",
        "FastDecode S-worker: weights, batched S-part over --r-workers, generate",
    ),
}


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line and exit status 2 (argparse would print the usage as well)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> _Parser:
    roles = "\n".join(f"  {name:8} {text}" for name, (_, text) in ROLES.items())
    parser = _Parser(
        prog="python -m aiollm.node",
        description="Run one aiollm node hosting the actors of a role.",
        epilog=f"roles:\n{roles}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--role", required=True, help=f"what this node hosts: {', '.join(ROLES)}")
    parser.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="URL",
        help="address to listen on, repeatable (default tcp://127.0.0.1:0: a free port)",
    )
    parser.add_argument(
        "--secret-file",
        required=True,
        type=Path,
        metavar="F",
        help="file holding the cluster secret (at least 16 bytes)",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="another node to connect to (and authenticate with) at start, repeatable",
    )
    parser.add_argument("--name", default="", help="name of the node's inproc address")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="S")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="S")
    parser.add_argument("--mailbox-size", type=int, default=256)
    parser.add_argument("--max-frame-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of key=value")
    return parser


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, object, object]:
    """Parse and validate everything at the edge: (args, NodeConfig, role module); exits 2 on bad input."""
    from aiollm.actors.node import NodeConfig
    from aiollm.transports.base import parse_address

    parser = _parser()
    known, _ = parser.parse_known_args(argv)
    if known.role not in ROLES:
        parser.error(f"unknown role {known.role!r}; roles: {', '.join(ROLES)}")
    role = importlib.import_module(ROLES[known.role][0])
    role.add_arguments(parser.add_argument_group(f"{known.role} role"))
    args = parser.parse_args(argv)
    args.listen = args.listen or ["tcp://127.0.0.1:0"]
    for url in [*args.listen, *args.peer]:
        try:
            address = parse_address(url)
        except ValueError as exc:
            parser.error(str(exc))
        if address.path:
            parser.error(f"address {url!r}: a node address has no actor path")
    try:
        secret = args.secret_file.read_bytes().strip()
    except OSError as exc:
        parser.error(f"cannot read the secret file: {exc.strerror}: {args.secret_file}")
    try:
        config = NodeConfig(
            secret=secret,
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            mailbox_size=args.mailbox_size,
            max_frame_bytes=args.max_frame_bytes,
            name=args.name,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return args, config, role


async def serve(args: argparse.Namespace, config: object, role: object) -> int:
    """Start the node and the role, print the ready line, run until a signal or a remote Shutdown."""
    from aiollm.actors.node import Node
    from aiollm.errors import AiollmError
    from aiollm.log import get_logger

    log = get_logger("node")
    # Handlers first: a launcher may send SIGTERM as soon as it has read the ready line.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = Node(config)
    try:
        await node.start(args.listen)
    except OSError as exc:
        print(f"python -m aiollm.node: error: cannot listen on {args.listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        actors = await role.start(node, args)
        for url in args.peer:
            try:
                await node.peer(url)
            except AiollmError as exc:
                log.warning("peer not reachable at start", peer=url, error=str(exc))
        ready = {"ready": True, "role": args.role, "addresses": node.addresses, "actors": actors, "pid": os.getpid()}
        print(json.dumps(ready), flush=True)
        stopped = asyncio.ensure_future(node.wait_stopped())
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopped, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        stopped.cancel()
    finally:
        await node.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args, config, role = parse(argv)
    from aiollm import log
    from aiollm.heap import keep_freed_memory

    keep_freed_memory()

    log.configure(args.log_level, json=args.log_json)
    import uvloop

    return uvloop.run(serve(args, config, role))


if __name__ == "__main__":
    sys.exit(main())
