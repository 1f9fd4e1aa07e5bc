"""Programmatic actor graphs: start nodes (in this process or as subprocesses on 127.0.0.1), spawn actors, get refs.

    async with Graph() as graph:
        node = await graph.start_node(process=True)            # python -m aiollm.node --role empty
        echo = await graph.spawn(node, EchoActor, "echo")      # an ActorRef usable from this script
        print(await echo.ask(Ping(1)))
    # every node stopped (Shutdown, then SIGTERM, then SIGKILL), every process reaped

The script itself runs a *driver* node (listening on a free loopback port) through which its refs
talk to the graph. All nodes share one random cluster secret, handed to subprocesses in a 0600
temporary file. Subprocess nodes announce their bound port on a ready line, so ports are never
guessed. Actors spawned in a subprocess are named by import path, so their class must live in an
importable module (not in the script's `__main__`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from aiollm.actors.actor import Actor
from aiollm.actors.messages import Shutdown, Spawn, Spawned
from aiollm.actors.node import Node, NodeConfig
from aiollm.actors.ref import ActorRef
from aiollm.actors.system import SYSTEM_ACTOR
from aiollm.deploy.roles import Wiring, parse_role_args, role_module
from aiollm.deploy.spec import ClusterSpec
from aiollm.errors import AiollmError, ProtocolError
from aiollm.log import get_logger

_log = get_logger("graph")


@dataclass
class NodeHandle:
    """A node of the graph: its advertised URL, its process (subprocess nodes) or Node (in-process ones)."""

    # The node's advertised address, e.g. tcp://127.0.0.1:41234.
    url: str
    # The OS process, for subprocess nodes.
    process: asyncio.subprocess.Process | None = None
    # The Node object, for in-process nodes.
    node: Node | None = None
    # Actors its role started: name -> URL.
    actors: dict[str, str] = field(default_factory=dict)


class Graph:
    """Starts and owns a set of nodes; `close()` (or leaving `async with`) stops all of them."""

    def __init__(
        self, config: NodeConfig | None = None, startup_timeout: float = 30.0, log_level: str = "WARNING"
    ) -> None:
        self.config = config or NodeConfig(secret=secrets.token_hex(32).encode())
        self.startup_timeout = startup_timeout
        # Log level of subprocess nodes (their logs go to this process's stderr).
        self.log_level = log_level
        self.nodes: list[NodeHandle] = []
        self.driver: Node | None = None
        self._dir: str | None = None

    async def __aenter__(self) -> Graph:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the driver node (loopback, free port)."""
        self._dir = tempfile.mkdtemp(prefix="aiollm-graph-")
        secret_file = Path(self._dir, "secret")
        secret_file.touch(mode=0o600)
        secret_file.write_bytes(self.config.secret)
        self.driver = Node(replace(self.config, name=""))
        await self.driver.start(["tcp://127.0.0.1:0"])

    async def start_node(
        self,
        role: str = "empty",
        *,
        process: bool = False,
        spec: ClusterSpec | None = None,
        wiring: Wiring = Wiring(),
        listen: str | None = None,
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ) -> NodeHandle:
        """Start a node hosting `role`, configured by `spec` (default: the defaults) and placed by `wiring`:
        a subprocess (`process=True`; it listens where the spec's section for the role says, by default a
        free loopback port) or a Node in this process (default listen: its inproc address only).

        `listen` overrides the address; `args` are extra role flags on top of the spec (as on the command
        line: `("--kv-blocks", "64")`); `prefix` runs the subprocess under a wrapper (e.g. ("taskset", "-c",
        "0")). Raises `RuntimeError` if a subprocess exits or stays silent instead of becoming ready,
        `ValueError` (SpecError) for a bad flag or spec before anything starts.
        """
        role_module(role)  # an unknown role fails here, naming the roles
        argv = (*wiring.to_args(), *args)
        if process:
            return await self._start_process(role, spec, listen, argv, prefix)
        return await self._start_in_process(role, spec, listen, argv)

    def _spec_file(self, spec: ClusterSpec) -> Path:
        """The spec as TOML in the graph's directory, written once per distinct spec."""
        text = spec.to_toml()
        path = Path(self._dir, f"spec-{hashlib.sha256(text.encode()).hexdigest()[:16]}.toml")
        if not path.exists():
            path.write_text(text)
        return path

    async def _start_process(
        self, role: str, spec: ClusterSpec | None, listen: str | None, args: tuple[str, ...], prefix: tuple[str, ...]
    ) -> NodeHandle:
        c = self.config
        cmd = [*prefix, sys.executable, "-m", "aiollm.node", "--role", role]
        cmd += ["--secret-file", str(Path(self._dir, "secret"))]
        if spec is not None:
            cmd += ["--config", str(self._spec_file(spec))]
        if listen is not None:
            cmd += ["--listen", listen]
        cmd += ["--heartbeat-interval", str(c.heartbeat_interval), "--heartbeat-timeout", str(c.heartbeat_timeout)]
        cmd += ["--mailbox-size", str(c.mailbox_size), "--max-frame-bytes", str(c.max_frame_bytes)]
        for key, value in c.transport_options:  # tls.cert -> --tls-cert
            cmd += [f"--{key.replace('.', '-')}", value]
        cmd += ["--log-level", self.log_level, *args]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
        handle = NodeHandle(url="", process=proc)
        self.nodes.append(handle)  # so close() reaps it even if it never becomes ready
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.startup_timeout)
        except TimeoutError:
            raise RuntimeError(f"node {role!r} not ready within {self.startup_timeout} s") from None
        if not line:
            raise RuntimeError(f"node {role!r} exited with status {await proc.wait()} before it was ready")
        ready = json.loads(line)
        handle.url, handle.actors = ready["addresses"][0], ready["actors"]
        return handle

    async def _start_in_process(
        self, role: str, spec: ClusterSpec | None, listen: str | None, args: tuple[str, ...]
    ) -> NodeHandle:
        spec, wiring = parse_role_args(role, list(args), spec)
        node = Node(replace(self.config, name=""))
        await node.start([listen] if listen else [])
        handle = NodeHandle(url=node.url, node=node)
        self.nodes.append(handle)  # so close() stops it even if the role fails to start
        handle.actors = await role_module(role).start(node, spec, wiring)
        return handle

    async def spawn(
        self, node: NodeHandle, actor: type[Actor], name: str, timeout: float = 30.0, **kwargs: object
    ) -> ActorRef:
        """Create `actor(**kwargs)` named `name` on `node`; returns a ref usable from this script."""
        if node.node is not None:
            ref = await node.node.spawn(actor, name, **kwargs)
            return self.ref(ref.url)
        if actor.__module__ == "__main__":
            raise ValueError(
                f"{actor.__qualname__} is defined in __main__; subprocess nodes import actors "
                "by module path, so define it in a module"
            )
        system = self.ref(f"{node.url}/{SYSTEM_ACTOR}")
        spawned = await system.ask(Spawn(f"{actor.__module__}:{actor.__qualname__}", name, dict(kwargs)), timeout)
        if not isinstance(spawned, Spawned):
            raise ProtocolError(f"{node.url} answered Spawn with {type(spawned).__name__}")
        return self.ref(spawned.url)

    def ref(self, url: str) -> ActorRef:
        """A ref to any actor of the graph, bound to the driver node."""
        return self.driver.ref(url)

    async def stop_node(self, handle: NodeHandle, timeout: float = 5.0) -> None:
        """Stop one node of the graph (Shutdown, then SIGTERM, then SIGKILL) and forget it."""
        if handle in self.nodes:
            self.nodes.remove(handle)
        await self._stop(handle, timeout)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop every node: Shutdown, then SIGTERM, then SIGKILL for processes; always reap them."""
        try:
            await asyncio.gather(*(self._stop(h, timeout) for h in self.nodes), return_exceptions=True)
        finally:
            for handle in self.nodes:  # whatever happened above, no process outlives the graph
                if handle.process is not None and handle.process.returncode is None:
                    handle.process.kill()
                    await handle.process.wait()
            self.nodes.clear()
            if self.driver is not None:
                await self.driver.stop(timeout)
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)

    async def _stop(self, handle: NodeHandle, timeout: float) -> None:
        if handle.node is not None:
            await handle.node.stop(timeout)
            return
        proc = handle.process
        if proc.returncode is None and handle.url:
            try:
                await self.ref(f"{handle.url}/{SYSTEM_ACTOR}").ask(Shutdown(), timeout)
            except (AiollmError, TimeoutError) as exc:
                _log.info("shutdown request failed", node=handle.url, error=str(exc))
        for attempt in (None, proc.terminate, proc.kill):
            if proc.returncode is not None:
                return
            if attempt is not None:
                attempt()
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                continue
