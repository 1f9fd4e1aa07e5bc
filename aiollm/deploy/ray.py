"""Deploying a cluster spec on Ray: Ray places, starts, restarts and discovers; aiollm's own transport carries
every message between roles.

    with RayCluster(spec, address=None) as cluster:      # None: start a local Ray cluster for the deployment
        print(cluster.base_url)

Each role instance is one Ray actor (`RoleHost`) in its own process, scheduled with the role section's
`threads` as `num_cpus` and its `ray_resources` (custom resources such as `{prefill = 1}`, which `ray start
--resources` gives the nodes meant for prefill). The actor runs `python -m aiollm.node` as its child, which dies
with it, and the actor exits when the node does: Ray's restart of the actor (unbounded) restarts the node. A
restarted instance binds the port it had when it lands on the same Ray node and joins the controller under its
name (`--controller`, from the registry), so a node lost with its host comes back elsewhere and the controller
resumes its requests. The registry actor keeps each instance's address for that.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiollm.deploy.roles import Wiring
from aiollm.deploy.roles.common import served_name
from aiollm.deploy.spec import ClusterSpec
from aiollm.log import get_logger

_log = get_logger("deploy.ray")

READY_TIMEOUT_S = 300.0


def _ray():
    """Ray, imported on use (an optional dependency: pip install 'aiollm[ray]')."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError("serving on Ray needs Ray: pip install 'aiollm[ray]'") from exc
    return ray


class Registry:
    """Where each role instance listens, by name (a Ray actor: restarted instances look themselves up here)."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}

    def lookup(self, name: str) -> dict[str, Any] | None:
        return self.entries.get(name)

    def record(self, name: str, entry: dict[str, Any]) -> None:
        self.entries[name] = entry


class RoleHost:
    """One role instance in its own Ray actor process (see the module's docstring)."""

    def __init__(self, role: str, name: str, spec_toml: str, secret: str, wiring: list[str], registry) -> None:
        ray = _ray()
        self.role, self.name = role, name
        ip = ray.util.get_node_ip_address()
        previous = ray.get(registry.lookup.remote(name))
        port = previous["port"] if previous and previous["ip"] == ip else 0
        args = list(wiring)
        controller = ray.get(registry.lookup.remote("controller"))
        if role in ("prefill", "decode") and controller is not None:  # a restart: join the running controller
            args += ["--controller", controller["actors"]["controller"]]
        directory = Path(tempfile.mkdtemp(prefix="aiollm-ray-"))
        secret_file, spec_file = directory / "secret", directory / "cluster.toml"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secret)
        spec_file.write_text(spec_toml)
        cmd = [sys.executable, "-m", "aiollm.node", "--role", role, "--secret-file", str(secret_file)]
        cmd += ["--config", str(spec_file), "--listen", f"tcp://{ip}:{port}", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{role} {name} exited with status {self.proc.wait()} before it was ready")
        import json

        ready = json.loads(line)
        self.entry = {
            "ip": ip,
            "port": int(ready["addresses"][0].rsplit(":", 1)[1]),
            "url": ready["addresses"][0],
            "actors": ready["actors"],
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": self.proc.pid,
        }
        ray.get(registry.record.remote(name, self.entry))
        threading.Thread(target=self._exit_with_node, daemon=True).start()

    def _exit_with_node(self) -> None:
        status = self.proc.wait()
        _log.warning("node exited: the actor exits so Ray restarts it", role=self.role, name=self.name, status=status)
        os._exit(1)

    def info(self) -> dict[str, Any]:
        return self.entry


def _die_with_parent() -> None:
    """In the node process: SIGKILL it when its actor process dies (nothing outlives a killed actor)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class _Placed:
    name: str
    role: str
    handle: Any


class RayCluster:
    """A cluster spec deployed on a Ray cluster (`address`, or a local one started for it); `stop()` (or leaving
    `with`) kills every role actor, and with it every node process, and shuts a local Ray down."""

    def __init__(self, spec: ClusterSpec, address: str | None = None) -> None:
        self.spec, self.address = spec, address
        self.placed: list[_Placed] = []
        self.base_url = ""
        self._started_ray = False

    def __enter__(self) -> RayCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            if self.address is None:  # a local Ray: keep it on loopback
                os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            ray.init(address=self.address, include_dashboard=False, logging_level="WARNING")
            self._started_ray = True
        try:
            self._start_roles(ray)
        except BaseException:
            self.stop()
            raise

    def _start_roles(self, ray) -> None:
        spec = self.spec
        # the registry lives on this process's Ray node: it outlives any role's node (a restarted role reads it)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.registry = ray.remote(Registry).options(num_cpus=0, scheduling_strategy=here).remote()
        self.secret = secrets.token_hex(32)
        toml = spec.to_toml()

        def place(role: str, name: str, wiring: Wiring):
            section = getattr(spec, role.replace("-", "_"))
            options = {
                "num_cpus": getattr(section, "threads", 0) if role not in ("controller", "frontend") else 0,
                "resources": dict(section.ray_resources),
                "max_restarts": -1,
                "max_task_retries": -1,
            }
            host = ray.remote(RoleHost).options(**options)
            handle = host.remote(role, name, toml, self.secret, wiring.to_args(), self.registry)
            self.placed.append(_Placed(name, role, handle))
            return handle

        def info(handles) -> list[dict]:
            return ray.get([h.info.remote() for h in handles], timeout=READY_TIMEOUT_S)

        prefill = [place("prefill", f"prefill{i}", Wiring(actor=f"prefill{i}")) for i in range(spec.prefill.count)]
        decode = []
        for i in range(spec.decode.count):
            r_workers = info([place("r-worker", f"r-worker{i}.{j}", Wiring()) for j in range(spec.decode.r_workers)])
            wiring = Wiring(actor=f"decode{i}", r_workers=tuple(r["actors"]["r-worker"] for r in r_workers))
            decode.append(place("decode", f"decode{i}", wiring))
        actors = {k: v for entry in info(prefill + decode) for k, v in entry["actors"].items()}
        wiring = Wiring(
            prefill={n: u for n, u in actors.items() if n.startswith("prefill")},
            decode={n: u for n, u in actors.items() if n.startswith("decode")},
        )
        controller = info([place("controller", "controller", wiring)])[0]
        frontend = place("frontend", "frontend", Wiring(controller=controller["actors"]["controller"]))
        host = info([frontend])[0]["ip"] if spec.frontend.host in ("0.0.0.0", "") else spec.frontend.host
        self.base_url = f"http://{host}:{spec.frontend.port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _healthy(f"{self.base_url}/health"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the frontend at {self.base_url} did not answer within {READY_TIMEOUT_S:g} s")
            time.sleep(0.2)

    def where(self, name: str) -> dict[str, Any]:
        """The registry's entry of a role instance: its address, actors, Ray node and pid."""
        return _ray().get(self.registry.lookup.remote(name))

    def stop(self) -> None:
        ray = _ray()
        for placed in self.placed:
            try:
                ray.kill(placed.handle, no_restart=True)
            except Exception:  # already gone
                pass
        self.placed.clear()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def serve(spec: ClusterSpec, address: str | None) -> int:
    """`python -m aiollm serve --ray`: deploy, print where it serves, run until SIGINT/SIGTERM, tear down."""
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    with RayCluster(spec, address) as cluster:
        where = f"Ray at {address}" if address else "a local Ray"
        print(
            f"aiollm: serving {served_name(spec.model.name)} at {cluster.base_url}/v1 ({spec.describe()}, on {where})",
            flush=True,
        )
        asyncio.run(wait())
    return 0
