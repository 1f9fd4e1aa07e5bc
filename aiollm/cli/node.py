"""`python -m aiollm.node --role ROLE --secret-file F [--config cluster.toml] [--listen URL] [--advertise URL]
[--peer URL ...] [role options]`

Starts one node hosting a role's actors and runs until SIGTERM/SIGINT or a remote `Shutdown`. The role is
configured by the cluster spec (`--config`, else the defaults) with the role's own flags on top; `--role R
--help` lists them. Once serving it prints one JSON line on stdout — {"ready": true, "addresses": [...],
"actors": {...}, "pid": N} — so a launcher that asked for port 0 learns the real port (aiollm.deploy.graph).
Logs go to stderr. Bad arguments, a bad spec (a role's `memory` that cannot hold its weights and KV included) or an
unreadable secret print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from aiollm.deploy.roles import ROLES, Wiring, role_module, spec_flag, spec_from_args, wiring_from_args
from aiollm.deploy.spec import ClusterSpec, SpecError


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line and exit status 2 (argparse would print the usage as well)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser(add_help: bool = True) -> _Parser:
    roles = "\n".join(f"  {name:10} {role.help}" for name, role in ROLES.items())
    parser = _Parser(
        prog="python -m aiollm.node",
        description="Run one aiollm node hosting the actors of a role (`--role R --help`: that role's options).",
        epilog=f"roles:\n{roles}\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=add_help,
    )
    parser.add_argument("--role", required=add_help, help=f"what this node hosts: {', '.join(ROLES)}")
    parser.add_argument("--config", type=Path, metavar="TOML", help="cluster spec to configure the role from")
    parser.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="URL",
        help="address to listen on, repeatable (default: the role's `listen` in the spec, tcp://127.0.0.1:0)",
    )
    parser.add_argument(
        "--advertise",
        default=None,
        metavar="URL",
        help="address other nodes reach this one at, if not the bound one (NAT, 0.0.0.0); port 0: the bound port",
    )
    parser.add_argument(
        "--secret-file", required=add_help, type=Path, metavar="F", help="file holding the cluster secret (>= 16 bytes)"
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="another node to connect to (and authenticate with) at start, repeatable",
    )
    parser.add_argument("--name", default="", help="name of the node's inproc address")
    parser.add_argument(
        "--launcher-head",
        default=None,
        metavar="HOST:PORT",
        help="started by a cluster launcher whose head listens here (Ray's GCS): when the launching process exits "
        "the node stops if the head still answers (the launcher starts the instance again) and serves on if not "
        "(the head is lost)",
    )
    spec_flag(parser, "--heartbeat-interval", "node.heartbeat_interval", "seconds between heartbeats", metavar="S")
    spec_flag(parser, "--heartbeat-timeout", "node.heartbeat_timeout", "seconds of silence: peer dead", metavar="S")
    spec_flag(parser, "--mailbox-size", "node.mailbox_size", "messages a mailbox holds before senders wait")
    spec_flag(parser, "--max-frame-bytes", "node.max_frame_bytes", "largest frame accepted or sent")
    spec_flag(parser, "--tls-cert", "node.tls_cert", "tls://: this node's certificate chain (PEM)", metavar="PEM")
    spec_flag(parser, "--tls-key", "node.tls_key", "tls://: this node's private key (PEM)", metavar="PEM")
    spec_flag(parser, "--tls-ca", "node.tls_ca", "tls://: the cluster's CA certificate (PEM)", metavar="PEM")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of key=value")
    return parser


def read_secret(path: Path) -> bytes:
    """The cluster secret in `path`; ValueError when others than its owner may read it (whoever reads the
    secret can join the cluster and spawn actors on it)."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ValueError(
            f"the secret file {path} is readable by others (mode {mode & 0o777:03o}); restrict it: chmod 600 {path}"
        )
    return path.read_bytes().strip()


@dataclass(frozen=True)
class NodeLaunch:
    """Everything `python -m aiollm.node` was asked to run, parsed and validated."""

    role: str
    spec: ClusterSpec
    wiring: Wiring
    # addresses to bind, the one to advertise ("" : the first bound), nodes to connect to at start
    listen: tuple[str, ...]
    advertise: str
    peers: tuple[str, ...]
    # the node's runtime settings, the secret included
    node_config: object
    log_level: str
    log_json: bool
    # the launcher's cluster head (HOST:PORT), watched once the launching process exits; None: not watched
    launcher_head: tuple[str, int] | None = None


def parse(argv: list[str] | None) -> NodeLaunch:
    """Parse and validate everything at the edge; exits 2 naming what is wrong."""
    from aiollm.actors.node import NodeConfig
    from aiollm.transports.base import parse_address

    known, _ = _parser(add_help=False).parse_known_args(argv)
    parser = _parser()
    if known.role is None:
        parser.parse_args(argv)  # prints the help, or the error that --role is missing
    if known.role not in ROLES:
        parser.error(f"unknown role {known.role!r}; roles: {', '.join(ROLES)}")
    role_module(known.role).add_arguments(parser.add_argument_group(f"{known.role} role"))
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args, ClusterSpec.from_toml(args.config) if args.config else ClusterSpec())
    except SpecError as exc:
        parser.error(str(exc))
    section = ROLES[args.role].section
    if section in ("prefill", "decode", "s_worker", "r_worker"):
        from aiollm.deploy.memory import check_memory

        try:
            check_memory(spec, [section], offloaded=bool(getattr(args, "r_workers", ())))
        except SpecError as exc:
            parser.error(str(exc))
    role_spec = getattr(spec, section) if section else None
    listen = args.listen or [role_spec.listen if role_spec else "tcp://127.0.0.1:0"]
    advertise = args.advertise if args.advertise is not None else (role_spec.advertise if role_spec else "")
    for url in [*listen, *args.peer, *filter(None, [advertise])]:
        try:
            address = parse_address(url)
        except ValueError as exc:
            parser.error(str(exc))
        if address.path:
            parser.error(f"address {url!r}: a node address has no actor path")
    head = None
    if args.launcher_head is not None:
        host, _, port = args.launcher_head.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--launcher-head: expected HOST:PORT, got {args.launcher_head!r}")
        head = (host.strip("[]"), int(port))
    try:
        secret = read_secret(args.secret_file)
    except OSError as exc:
        parser.error(f"cannot read the secret file: {exc.strerror}: {args.secret_file}")
    except ValueError as exc:
        parser.error(str(exc))
    n = spec.node
    try:
        config = NodeConfig(
            secret=secret,
            heartbeat_interval=n.heartbeat_interval,
            heartbeat_timeout=n.heartbeat_timeout,
            mailbox_size=n.mailbox_size,
            max_frame_bytes=n.max_frame_bytes,
            name=args.name,
            transport_options=n.transport_options,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return NodeLaunch(
        args.role,
        spec,
        wiring_from_args(args),
        tuple(listen),
        advertise,
        tuple(args.peer),
        config,
        args.log_level,
        args.log_json,
        head,
    )


async def serve(launch: NodeLaunch) -> int:
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
    node = Node(launch.node_config)
    try:
        await node.start(launch.listen, launch.advertise)
    except OSError as exc:
        listen = list(launch.listen)
        print(f"python -m aiollm.node: error: cannot listen on {listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        actors = await role_module(launch.role).start(node, launch.spec, launch.wiring)
        for url in launch.peers:
            try:
                await node.peer(url)
            except AiollmError as exc:
                log.warning("peer not reachable at start", peer=url, error=str(exc))
        ready = {"ready": True, "role": launch.role, "addresses": node.addresses, "actors": actors, "pid": os.getpid()}
        print(json.dumps(ready), flush=True)
        stopped = asyncio.ensure_future(node.wait_stopped())
        signalled = asyncio.ensure_future(stop.wait())
        watched = asyncio.ensure_future(_watch_launcher(launch.launcher_head, log)) if launch.launcher_head else None
        await asyncio.wait({stopped, signalled}, return_when=asyncio.FIRST_COMPLETED)
        for task in (signalled, stopped, watched):
            if task is not None:
                task.cancel()
    finally:
        await node.stop()
    return 0


async def _watch_launcher(head: tuple[str, int], log, poll_s: float = 0.5) -> None:
    """Once the process that launched this node exits: end the node at once if the launcher's cluster head
    still answers, since the launcher starts this instance again (elsewhere, or here on the same port); serve
    on if the head is lost, since then nothing would start it again and its requests would be lost with it."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(poll_s)
    if await _answers(head):
        log.warning("launcher exited while its cluster head answers: the instance ends here", head=_hostport(head))
        os._exit(1)  # at once: the instance that replaces it may need this port
    # the launcher's pipes have no reader any more: the node's output goes to a file of its own
    path = Path(tempfile.gettempdir()) / f"aiollm-node-{os.getpid()}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # what is buffered for the dead pipe is lost with it
            stream.flush()
        os.dup2(fd, stream.fileno())
    os.close(fd)
    log.warning("launcher exited and its cluster head is lost: serving on", head=_hostport(head), log=str(path))


async def _answers(head: tuple[str, int], tries: int = 3, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at `head` (in `tries` attempts a second apart)."""
    for attempt in range(tries):
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*head), timeout_s)
        except (OSError, TimeoutError):
            if attempt + 1 < tries:
                await asyncio.sleep(1.0)
            continue
        writer.close()
        return True
    return False


def _hostport(head: tuple[str, int]) -> str:
    return f"{head[0]}:{head[1]}"


def main(argv: list[str] | None = None) -> int:
    launch = parse(argv)
    from aiollm import log
    from aiollm.heap import keep_freed_memory

    keep_freed_memory()
    log.configure(launch.log_level, json=launch.log_json)
    import uvloop

    return uvloop.run(serve(launch))


if __name__ == "__main__":
    sys.exit(main())
