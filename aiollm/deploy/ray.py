"""Deploying a cluster spec on Ray: Ray places, starts, restarts and discovers; aiollm's own transport carries
every message between roles.

    with RayCluster(spec, address=None) as cluster:      # None: start a local Ray cluster for the deployment
        print(cluster.base_url)

Each role instance is one Ray actor (`RoleHost`) in its own process, scheduled with the role section's
`threads` as `num_cpus` and its `ray_resources` (custom resources such as `{prefill = 1}`, which `ray start
--resources` gives the nodes meant for prefill). The actor runs `python -m aiollm.node` as its child and exits
when the node does: Ray's restart of the actor (unbounded) restarts the node. A restarted instance binds the
port it had when it lands on the same Ray node and joins the controller under its name (`--controller`, from
the registry), so a node lost with its host comes back elsewhere and the controller resumes its requests. The
registry actor keeps each instance's address for that.

The node outlives its actor only when the cluster's head is lost (`--launcher-head`): when its actor exits
it ends at once if the head still answers (Ray starts the instance again) and serves on if not, since then
nothing would. Losing the head thus costs restarts, not service. `stop()` kills the actors, then stops every
node still up over aiollm's own transport, then shuts a local Ray down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiollm.deploy.local import answers
from aiollm.deploy.roles import Wiring
from aiollm.deploy.roles.common import served_model
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

    def all(self) -> dict[str, dict[str, Any]]:
        return self.entries

    def record(self, name: str, entry: dict[str, Any]) -> None:
        self.entries[name] = entry


class RoleHost:
    """One role instance in its own Ray actor process (see the module's docstring)."""

    def __init__(
        self, role: str, name: str, spec_toml: str, secret: str, wiring: list[str], registry, links: dict | None = None
    ) -> None:
        ray = _ray()
        self.role, self.name = role, name
        ip = ray.util.get_node_ip_address()
        node_id = ray.get_runtime_context().get_node_id()
        previous = ray.get(registry.lookup.remote(name))
        port = previous["port"] if previous and previous["node_id"] == node_id else 0
        args = list(wiring)
        controller = ray.get(registry.lookup.remote("controller"))
        if role in ("prefill", "decode") and controller is not None:  # a restart: join the running controller
            args += ["--controller", controller["actors"]["controller"]]
        links = links or {}
        if previous is not None and links.get("r_workers"):  # a restart: its R-workers where they are now
            entries = [ray.get(registry.lookup.remote(n)) for n in links["r_workers"]]
            args[args.index("--r-workers") + 1] = ",".join(e["actors"]["r-worker"] for e in entries)
        directory = Path(tempfile.mkdtemp(prefix="aiollm-ray-"))
        secret_file, spec_file = directory / "secret", directory / "cluster.toml"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secret)
        spec_file.write_text(spec_toml)
        cmd = [sys.executable, "-m", "aiollm.node", "--role", role, "--secret-file", str(secret_file)]
        cmd += ["--config", str(spec_file), "--listen", f"tcp://{ip}:{port}", *args]
        cmd += ["--launcher-head", ray.get_runtime_context().gcs_address]
        # a process group of its own (setsid): no signal meant for the actor's group reaches it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
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
            "node_id": node_id,
            "pid": self.proc.pid,
        }
        ray.get(registry.record.remote(name, self.entry))
        if previous is not None and "decode" in links and previous["url"] != self.entry["url"]:
            self._tell_decode(ray.get(registry.lookup.remote(links["decode"])), links, secret)
        threading.Thread(target=self._exit_with_node, daemon=True).start()

    def _tell_decode(self, decode: dict | None, links: dict, secret: str) -> None:
        """This R-worker came back at another address: tell its decode instance, which follows it there."""
        if decode is None:
            return  # not started yet: it reads every R-worker's address from the registry when it starts
        from aiollm.serving.fastdecode.messages import RWorkerMoved

        url = decode["actors"][links["decode"]]
        moved = RWorkerMoved(links["index"], self.entry["actors"]["r-worker"])
        [failed] = _run(ask_each([(url, moved)], secret))
        if failed:
            _log.warning("the decode instance did not take the R-worker's new address", decode=url, error=failed)

    def _exit_with_node(self) -> None:
        status = self.proc.wait()
        _log.warning("node exited: the actor exits so Ray restarts it", role=self.role, name=self.name, status=status)
        os._exit(1)

    def info(self) -> dict[str, Any]:
        return self.entry


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
        self.registry = None
        self.secret = secrets.token_hex(32)
        self._nodes: dict[str, str] = {}
        self._started_ray = False

    def __enter__(self) -> RayCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.address is None:  # a local Ray keeps to loopback (read when Ray is imported)
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray = _ray()
        if not ray.is_initialized():
            # None: a new local Ray for this deployment, never one found on this machine ("auto" joins that)
            ray.init(address=self.address or "local", include_dashboard=False, logging_level="WARNING")
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
        toml = spec.to_toml()

        def place(role: str, name: str, wiring: Wiring, links: dict | None = None):
            section = getattr(spec, role.replace("-", "_"))
            options = {
                "num_cpus": getattr(section, "threads", 0) if role not in ("controller", "frontend") else 0,
                "resources": dict(section.ray_resources),
                "max_restarts": -1,
                "max_task_retries": -1,
                # the node process outlives its actor by its own rule (`--launcher-head`), not by Ray's
                "runtime_env": {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "false"}},
            }
            host = ray.remote(RoleHost).options(**options)
            handle = host.remote(role, name, toml, self.secret, wiring.to_args(), self.registry, links)
            self.placed.append(_Placed(name, role, handle))
            return handle

        def info(handles) -> list[dict]:
            return ray.get([h.info.remote() for h in handles], timeout=READY_TIMEOUT_S)

        prefill = [place("prefill", f"prefill{i}", Wiring(actor=f"prefill{i}")) for i in range(spec.prefill.count)]
        decode = []
        for i in range(spec.decode.count):
            # an R-worker restarted elsewhere tells its decode instance, a decode instance restarted reads them
            names = [f"r-worker{i}.{j}" for j in range(spec.decode.r_workers)]
            r_workers = info(
                [place("r-worker", n, Wiring(), {"decode": f"decode{i}", "index": j}) for j, n in enumerate(names)]
            )
            wiring = Wiring(actor=f"decode{i}", r_workers=tuple(r["actors"]["r-worker"] for r in r_workers))
            decode.append(place("decode", f"decode{i}", wiring, {"r_workers": names}))
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
        while not answers(f"{self.base_url}/health"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the frontend at {self.base_url} did not answer within {READY_TIMEOUT_S:g} s")
            time.sleep(0.2)

    def where(self, name: str) -> dict[str, Any]:
        """The registry's entry of a role instance: its address, actors, Ray node and pid."""
        return _ray().get(self.registry.lookup.remote(name))

    def nodes(self) -> dict[str, str]:
        """Every role instance's node address, by name (as the registry has it now)."""
        entries = _ray().get(self.registry.all.remote(), timeout=30)
        self._nodes = {name: entry["url"] for name, entry in entries.items()}
        return dict(self._nodes)

    def stop(self) -> None:
        """Kill every role actor, then ask every node still up to stop over aiollm's transport, and only then
        shut a local Ray down: a node outlives its actor while the head does not answer, so a head shut down
        first would leave it serving."""
        ray = _ray()
        try:
            urls = list(self.nodes().values()) if self.registry is not None else []
        except Exception:  # Ray is failing: the addresses known last
            urls = list(self._nodes.values())
        for placed in self.placed:
            try:
                ray.kill(placed.handle, no_restart=True)
            except Exception:  # already gone
                pass
        self.placed.clear()
        if urls:
            _run(shutdown_nodes(urls, self.secret))
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


async def ask_each(asks: list[tuple[str, Any]], secret: str, timeout_s: float = 10.0) -> list[str]:
    """Ask each actor URL its message, from a node of its own (outside any running node: no Ray involved, its
    head may be lost); per ask, "" when it answered, else what went wrong."""
    from aiollm.actors.node import Node, NodeConfig

    node = Node(NodeConfig(secret=secret.encode()))
    await node.start([])
    try:
        answers = await asyncio.gather(
            *(node.ref(url).ask(msg, timeout_s) for url, msg in asks), return_exceptions=True
        )
    finally:
        await node.stop(timeout_s)
    return [f"{type(a).__name__}: {a}" if isinstance(a, BaseException) else "" for a in answers]


async def shutdown_nodes(urls: list[str], secret: str, timeout_s: float = 5.0) -> list[str]:
    """Ask the nodes at `urls` to stop over aiollm's own transport; returns the addresses that did not answer."""
    from aiollm.actors.messages import Shutdown
    from aiollm.actors.system import SYSTEM_ACTOR

    failed = await ask_each([(f"{url}/{SYSTEM_ACTOR}", Shutdown()) for url in urls], secret, timeout_s)
    return [url for url, error in zip(urls, failed) if error]


def _run(work) -> Any:
    """Run a coroutine to its end from synchronous code, also when the caller runs an event loop itself."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


def serve(spec: ClusterSpec, address: str | None) -> int:
    """`python -m aiollm serve --ray`: deploy, print where it serves, run until SIGINT/SIGTERM, tear down.

    The Ray connection lives in a child process (`aiollm.deploy.ray_driver`): Ray ends every process connected
    to a cluster whose head is lost, and the instances keep serving then, so this process outlives the head
    with every instance's address and the secret, and still stops them all over aiollm's own transport."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="aiollm-ray-") as directory:
        config = Path(directory) / "cluster.toml"
        config.write_text(spec.to_toml())
        cmd = [sys.executable, "-m", "aiollm.deploy.ray_driver", "--config", str(config)]
        cmd += ["--address", address] if address else []
        # a process group of its own (setsid): a terminal's ^C reaches this process only, which tears it all down
        driver = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        state = _DriverState()
        threading.Thread(target=state.follow, args=(driver.stdout,), daemon=True).start()
        while not state.ready.wait(0.2):
            if driver.poll() is not None or stop.is_set():
                _stop_driver(driver)
                print("python -m aiollm serve: error: the deployment on Ray did not start", file=sys.stderr)
                return 1
        where = f"Ray at {address}" if address else "a local Ray"
        print(
            f"aiollm: serving {served_model(spec)} at {state.base_url}/v1 ({spec.describe()}, on {where})",
            flush=True,
        )
        lost = False
        while not stop.wait(0.5):
            if driver.poll() is not None and not lost:
                lost = True
                _log.warning(
                    "the connection to Ray is lost (its head is gone): the instances serve on, none is restarted",
                    status=driver.returncode,
                )
        if _stop_driver(driver) != 0:  # Ray could not tear it down: stop every node directly
            left = _run(shutdown_nodes(list(state.nodes.values()), state.secret))
            if left:
                _log.error("nodes that did not answer the shutdown", nodes=left)
    return 0


def _stop_driver(driver: subprocess.Popen) -> int:
    """Close the driver's stdin (it tears the deployment down on Ray) and wait for it; its exit status."""
    try:
        driver.stdin.close()
    except OSError:
        pass
    try:
        return driver.wait(READY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        driver.kill()
        return driver.wait()


class _DriverState:
    """What the driver process reports, one JSON line at a time: where the frontend serves, the secret, and
    every node's address (updated when Ray moves an instance)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.base_url = self.secret = ""
        self.nodes: dict[str, str] = {}

    def follow(self, lines) -> None:
        import json

        for line in lines:
            report = json.loads(line)
            self.nodes = report.get("nodes", self.nodes)
            if "base_url" in report:
                self.base_url, self.secret = report["base_url"], report["secret"]
                self.ready.set()
