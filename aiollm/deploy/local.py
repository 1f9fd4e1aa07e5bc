"""The local launcher: a cluster spec run as processes on this host (or the colocated engine in this process).

Disaggregated: every prefill and decode instance, the controller and the frontend is its own
`python -m aiollm.node --role ...` subprocess (started through `Graph`, which shares a fresh cluster secret and
always reaps its processes), each configured by the same spec file. The instances start first, in parallel
(each loads the model; an offloaded decode instance's R-worker processes start just before it and it is pointed
at them), then the controller, then the frontend. `serve` returns once the frontend answers /health, and
`supervise` runs until interrupted and starts every node whose process exits (crashed, killed, OOM) again at the
address it had, so every reference to it stays valid: an instance re-registers with the controller under its
name (the controller resumed its requests elsewhere or held them meanwhile), a restarted controller takes the
instances back while the frontend submits its requests again, a frontend serves on its port again. `serve` never
exits because one node died.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from aiollm.actors.node import NodeConfig
from aiollm.deploy.graph import Graph, NodeHandle
from aiollm.deploy.roles import Wiring
from aiollm.deploy.roles.common import served_model
from aiollm.deploy.spec import ClusterSpec
from aiollm.log import get_logger

_log = get_logger("deploy.local")

READY_TIMEOUT_S = 300.0
# a node restarted this many times within RESTART_WINDOW_S seconds is left down (it dies of itself)
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


@dataclass(frozen=True)
class Started:
    """How one node was started, to start it again at the same address."""

    role: str
    wiring: Wiring
    # the address it bound (a restart binds it again, so every peer's ref to it stays valid)
    listen: str
    # role flags beside the spec (a frontend's HTTP port)
    args: tuple[str, ...] = ()


@dataclass
class LocalCluster:
    """A running local cluster: its graph, the API's base URL, and how each node was started."""

    graph: Graph
    # the spec as started (a free frontend port chosen), which restarts use too
    spec: ClusterSpec
    # the API's base URL of each frontend
    base_urls: list[str]
    controller: str
    # node URL -> how it was started
    nodes: dict[str, Started] = field(default_factory=dict)
    # set when nodes were added or retired on purpose (the supervisor then watches the new set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def answers(url: str) -> bool:
    """Whether a GET of `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _step_log(spec: ClusterSpec, name: str) -> str:
    return str(Path(spec.step_log, f"{name}.jsonl")) if spec.step_log else ""


def node_config(spec: ClusterSpec, secret: bytes) -> NodeConfig:
    n = spec.node
    return NodeConfig(
        secret=secret,
        heartbeat_interval=n.heartbeat_interval,
        heartbeat_timeout=n.heartbeat_timeout,
        mailbox_size=n.mailbox_size,
        max_frame_bytes=n.max_frame_bytes,
        transport_options=n.transport_options,
    )


def check_addresses(spec: ClusterSpec) -> None:
    """SpecError naming the first role section whose listen address this host cannot bind (a typo, another
    host's address), before anything starts."""
    from aiollm.deploy.spec import SpecError
    from aiollm.transports.base import parse_address

    sections = ["prefill", "decode", "controller", "frontend"] + (["r_worker"] if spec.decode.r_workers else [])
    for section in sections:
        address = parse_address(getattr(spec, section).listen)
        if address.scheme not in ("tcp", "tls"):
            continue
        with socket.socket(socket.AF_INET6 if ":" in address.host else socket.AF_INET) as sock:
            try:
                sock.bind((address.host, 0))
            except OSError as exc:
                raise SpecError(f"{section}.listen: cannot bind {address.host} here: {exc.strerror}") from None


async def start_cluster(graph: Graph, spec: ClusterSpec) -> LocalCluster:
    """Start every node of `spec` on `graph` (instances in parallel, then controller, then frontend) and wait
    until the frontend answers."""
    check_addresses(spec)
    host = spec.frontend.host
    if spec.frontend.port:
        ports = [spec.frontend.port + i for i in range(spec.frontend.count)]
    else:
        ports = [free_port(host) for _ in range(spec.frontend.count)]
        spec = spec.override({"frontend.port": ports[0]})
    cluster = LocalCluster(graph, spec, [f"http://{host}:{port}" for port in ports], "")

    async def node(role: str, wiring: Wiring = Wiring(), args: tuple[str, ...] = ()) -> NodeHandle:
        handle = await graph.start_node(role, process=True, spec=spec, wiring=wiring, args=args)
        cluster.nodes[handle.url] = Started(role, wiring, handle.url, args)
        return handle

    async def decode(i: int) -> NodeHandle:
        r_workers = await asyncio.gather(*(node("r-worker") for _ in range(spec.decode.r_workers)))
        urls = tuple(h.actors["r-worker"] for h in r_workers)
        return await node("decode", Wiring(actor=f"decode{i}", r_workers=urls, step_log=_step_log(spec, f"decode{i}")))

    prefills = [
        node("prefill", Wiring(actor=f"prefill{i}", step_log=_step_log(spec, f"prefill{i}")))
        for i in range(spec.prefill.count)
    ]
    handles = await asyncio.gather(*prefills, *(decode(i) for i in range(spec.decode.count)))
    actors = [item for handle in handles for item in handle.actors.items()]
    wiring = Wiring(
        prefill={n: u for n, u in actors if n.startswith("prefill")},
        decode={n: u for n, u in actors if n.startswith("decode")},
    )
    cluster.controller = next(iter((await node("controller", wiring)).actors.values()))
    frontend = Wiring(controller=cluster.controller)
    await asyncio.gather(*(node("frontend", frontend, ("--http-port", str(port))) for port in ports))
    for base in cluster.base_urls:
        while not await asyncio.to_thread(answers, f"{base}/health"):
            await asyncio.sleep(0.2)
    return cluster


async def supervise(cluster: LocalCluster, stop: asyncio.Event) -> int:
    """Run until `stop` is set (0), starting every node that exits again at its address: an instance re-registers
    with the controller, a controller takes the instances back, a frontend serves on its port again, an R-worker's
    decode instance takes it back. A node that keeps dying (`MAX_RESTARTS` within `RESTART_WINDOW_S`) is left
    down, and the rest serve on; nothing one node does stops the others."""
    graph = cluster.graph
    stopped = asyncio.ensure_future(stop.wait())
    restarts: dict[str, list[float]] = defaultdict(list)
    try:
        while True:
            cluster.changed.clear()
            changed = asyncio.ensure_future(cluster.changed.wait())
            exits = {asyncio.ensure_future(h.process.wait()): h for h in graph.nodes if h.process.returncode is None}
            done, _ = await asyncio.wait({stopped, changed, *exits}, return_when=asyncio.FIRST_COMPLETED)
            for future in (changed, *exits):
                future.cancel()
            if stopped in done:
                return 0
            for handle in (exits[f] for f in done if f in exits):
                if handle not in graph.nodes:  # stopped on purpose (Graph.stop_node): no fault
                    continue
                graph.nodes.remove(handle)
                await _restart(cluster, handle, restarts[handle.url])
    finally:
        stopped.cancel()


async def _restart(cluster: LocalCluster, handle: NodeHandle, times: list[float]) -> None:
    started = cluster.nodes.get(handle.url)
    status = handle.process.returncode
    now = time.monotonic()
    times[:] = [t for t in times if t > now - RESTART_WINDOW_S]
    if started is None or len(times) >= MAX_RESTARTS:
        print(f"aiollm: node {handle.url} exited with status {status}; left down", file=sys.stderr, flush=True)
        return
    times.append(now)
    name = started.wiring.actor or started.role
    print(
        f"aiollm: {name} ({handle.url}) exited with status {status}; starting it again "
        f"({len(times)}/{MAX_RESTARTS} in {RESTART_WINDOW_S:g} s)",
        file=sys.stderr,
        flush=True,
    )
    wiring = started.wiring
    if started.role in ("prefill", "decode"):  # join the running controller under its name
        wiring = replace(wiring, controller=cluster.controller)
    try:
        await cluster.graph.start_node(
            started.role, process=True, spec=cluster.spec, wiring=wiring, listen=started.listen, args=started.args
        )
    except RuntimeError as exc:  # it did not come up; the next exit check sees no process for it
        print(f"aiollm: {name} did not start again: {exc}", file=sys.stderr, flush=True)


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_cluster(spec: ClusterSpec) -> int:
    """Start the spec's cluster, print where it serves, and supervise it until SIGINT/SIGTERM."""
    import secrets

    config = node_config(spec, secrets.token_hex(32).encode())
    async with Graph(config, startup_timeout=READY_TIMEOUT_S, log_level=spec.log_level) as graph:
        cluster = await start_cluster(graph, spec)
        replanning = asyncio.create_task(_replan(cluster)) if spec.planner.replan else None
        print(
            f"aiollm: serving {served_model(spec)} at {cluster.base_urls[0]}/v1"
            + "".join(f" (+ {url}/v1)" for url in cluster.base_urls[1:])
            + f" ({spec.describe()})",
            flush=True,
        )
        try:
            return await supervise(cluster, _stop_on_signals())
        finally:
            if replanning is not None:
                replanning.cancel()


async def _replan(cluster: LocalCluster) -> None:
    """The planner's loop on this cluster (spec `[planner] replan = true`): see aiollm.deploy.scale."""
    from aiollm.deploy.scale import Replanner, Scaler, placement_policy
    from aiollm.planner.replan import MonitorConfig

    p = cluster.spec.planner
    monitor = MonitorConfig(p.window_s, p.min_requests, p.threshold, p.cooldown_s)
    try:
        await Replanner(Scaler(cluster), placement_policy(cluster.spec), monitor, p.max_instances).run()
    except Exception:  # replanning stops; serving goes on
        _log.exception("replanning stopped")


def run_colocated(spec: ClusterSpec) -> int:
    """The colocated baseline: one process batching prefill and decode together, behind the same HTTP API."""
    import torch

    from aiollm.deploy.roles.frontend import frontend_config
    from aiollm.deploy.roles.prefill import compute_bound_length
    from aiollm.frontend.app import Frontend, start_server
    from aiollm.model.loader import load
    from aiollm.serving.backend import ModelInfo
    from aiollm.serving.colocated import ColocatedEngine, EngineConfig

    torch.set_num_threads(spec.decode.threads)
    model = load(spec.model.name, dtype=spec.model.dtype)
    f = spec.frontend

    async def main() -> None:
        engine = ColocatedEngine(
            model,
            EngineConfig(
                kv_blocks=spec.decode.kv_blocks,
                block_size=spec.kv.block_size,
                kv_dtype=spec.kv.dtype,
                max_batch_tokens=spec.prefill.max_batch_tokens or compute_bound_length(spec.model.name),
                max_running=spec.decode.max_running,
                attn_threads=spec.decode.threads,
                prefix_cache=spec.kv.prefix_cache,
            ),
        )
        await engine.start()
        frontend = Frontend(
            engine,
            model.tokenizer,
            ModelInfo(served_model(spec), model.config.max_context),
            frontend_config(spec, model.config.vocab),
        )
        server, task, port = await start_server(frontend.app, f.host, f.port)
        print(f"aiollm: serving {served_model(spec)} at http://{f.host}:{port}/v1 (colocated)", flush=True)
        await _stop_on_signals().wait()
        server.should_exit = True
        await task
        await engine.stop()

    asyncio.run(main())
    return 0


def run(spec: ClusterSpec) -> int:
    """Serve `spec` on this host until interrupted: the colocated engine or the whole cluster."""
    if spec.colocated:
        return run_colocated(spec)
    try:
        return asyncio.run(serve_cluster(spec))
    except RuntimeError as exc:  # a node did not start
        print(f"python -m aiollm serve: error: {exc}", file=sys.stderr)
        return 1
