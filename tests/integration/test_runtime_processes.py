"""The actor runtime between OS processes over TCP: asks, streams, cancellation, liveness, auth, the CLI, the demo.

Every node process is started through `aiollm.deploy.graph.Graph` (or `subprocess` for the CLI checks)
and stopped in a `finally`, killed if it does not stop by itself.
"""

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import numpy as np
import pytest

from aiollm.actors import Node, NodeConfig
from aiollm.actors.echo import Count, Echo, EchoActor, Fail, GetStats, Ping, PingPeer, Pong, Sleep
from aiollm.deploy.graph import Graph
from aiollm.errors import AuthenticationFailed, RemoteError
from aiollm.testing.actor_helpers import SECRET, Watcher

ROOT = Path(__file__).resolve().parents[2]
# Liveness settings for these tests: a dead peer must be noticed within HEARTBEAT_TIMEOUT.
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.2, 1.0
CONFIG = NodeConfig(secret=SECRET, heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_timeout=HEARTBEAT_TIMEOUT)


async def test_ask_tell_stream_between_processes() -> None:
    async with Graph(CONFIG) as graph:
        alpha = await graph.start_node("echo", process=True)
        beta = await graph.start_node("empty", process=True)
        echo_a = graph.ref(alpha.actors["echo"])
        echo_b = await graph.spawn(beta, EchoActor, "echo")
        assert await echo_a.ask(Ping(1), timeout=5) == Pong(1)
        await echo_a.tell(Ping(2))
        data = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float16)
        out = await echo_a.ask(Echo("t", data[:, ::2]))  # non-contiguous, 512 KiB
        assert np.array_equal(out.data, data[:, ::2])
        assert [c.i async for c in echo_a.stream(Count(30), window=4)] == list(range(30))
        with pytest.raises(RemoteError) as info:
            await echo_b.ask(Fail("remote"))
        assert info.value.type_name == "RuntimeError" and "echo.py" in info.value.traceback_text
        rtt = await echo_b.ask(PingPeer(echo_a, 20), timeout=10)  # node process to node process
        assert rtt.n == 20 and rtt.p50_us > 0
        stats = await echo_a.ask(GetStats())
        assert stats.handled == 2 + 1 + 1 + 20  # the tell arrived too


async def test_cancellation_propagates_across_processes() -> None:
    async with Graph(CONFIG) as graph:
        alpha = await graph.start_node("echo", process=True)
        echo = graph.ref(alpha.actors["echo"])
        with pytest.raises(TimeoutError):
            await echo.ask(Sleep(30), timeout=0.1)
        task = asyncio.ensure_future(echo.ask(Sleep(30)))
        await asyncio.sleep(0.1)
        task.cancel()
        async with aclosing(echo.stream(Count(10_000, delay=0.001))) as items:
            async for item in items:
                if item.i == 5:
                    break
        async with asyncio.timeout(5):
            while (await echo.ask(GetStats())).cancelled < 3:
                await asyncio.sleep(0.02)


async def test_slow_consumer_bounds_the_remote_producer() -> None:
    async with Graph(CONFIG) as graph:
        alpha = await graph.start_node("echo", process=True)
        echo = graph.ref(alpha.actors["echo"])
        window, consumed = 4, 0
        async with aclosing(echo.stream(Count(1000, payload=1 << 20), window=window)) as items:
            async for item in items:
                consumed += 1
                assert item.data.nbytes == 1 << 20
                await asyncio.sleep(0.01)
                produced = (await echo.ask(GetStats())).produced
                assert consumed <= produced <= consumed + window  # never more than 4 MiB in flight
                if consumed == 25:
                    break


async def test_sigkilled_watched_peer_gives_terminated_within_the_heartbeat_timeout() -> None:
    async with Graph(CONFIG) as graph:
        alpha = await graph.start_node("echo", process=True)
        echo = graph.ref(alpha.actors["echo"])
        watcher = Watcher()
        await graph.driver.spawn(watcher, "watcher")
        await watcher.watch(echo)
        await echo.ask(Ping(1))
        loop = asyncio.get_running_loop()
        alpha.process.send_signal(signal.SIGKILL)
        start = loop.time()
        notice = await asyncio.wait_for(watcher.terminated.get(), HEARTBEAT_TIMEOUT)
        assert notice.url == echo.url and loop.time() - start < HEARTBEAT_TIMEOUT


async def test_frozen_peer_is_declared_dead_by_heartbeat() -> None:
    async with Graph(CONFIG) as graph:
        alpha = await graph.start_node("echo", process=True)
        echo = graph.ref(alpha.actors["echo"])
        watcher = Watcher()
        await graph.driver.spawn(watcher, "watcher")
        await watcher.watch(echo)
        loop = asyncio.get_running_loop()
        alpha.process.send_signal(signal.SIGSTOP)  # alive but silent: only the heartbeat can tell
        try:
            start = loop.time()
            notice = await asyncio.wait_for(watcher.terminated.get(), HEARTBEAT_TIMEOUT + 2.0)
            assert notice.reason == "heartbeat timeout"
            assert HEARTBEAT_TIMEOUT <= loop.time() - start <= HEARTBEAT_TIMEOUT + 1.0  # checked every 0.2 s
        finally:
            alpha.process.send_signal(signal.SIGCONT)


async def test_peer_without_the_secret_is_refused_across_processes() -> None:
    async with Graph(CONFIG) as graph:
        alpha = await graph.start_node("echo", process=True)
        intruder = Node(NodeConfig(secret=b"not-the-cluster-secret"))
        await intruder.start()
        try:
            with pytest.raises(AuthenticationFailed):
                await intruder.ref(alpha.actors["echo"]).ask(Ping(1), timeout=5)
        finally:
            await intruder.stop()
        assert await graph.ref(alpha.actors["echo"]).ask(Ping(2)) == Pong(2)  # members still served


def run_cli(*args: str, secret: Path | None = None) -> subprocess.CompletedProcess:
    extra = ["--secret-file", str(secret)] if secret else []
    return subprocess.run(
        [sys.executable, "-m", "aiollm.node", *args, *extra], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_cli_help_and_one_line_errors(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    open_secret = tmp_path / "open-secret"
    open_secret.write_bytes(SECRET)
    open_secret.chmod(0o644)
    help_text = run_cli("--help").stdout
    assert "roles:" in help_text and "echo" in help_text and "empty" in help_text
    for args, secret_file, text in [
        (["--role", "nope"], secret, "unknown role 'nope'"),
        (["--role", "echo", "--listen", "tcp://127.0.0.1:notaport"], secret, "bad port"),
        (["--role", "echo", "--listen", "carrier-pigeon://x"], secret, "unknown scheme"),
        (["--role", "echo"], None, "required: --secret-file"),
        (["--role", "echo", "--secret-file", str(tmp_path / "missing")], None, "cannot read the secret file"),
        (["--role", "echo", "--secret-file", str(open_secret)], None, "readable by others (mode 644)"),
    ]:
        result = run_cli(*args, secret=secret_file)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0]


def test_cli_node_prints_ready_line_and_stops_on_sigterm(tmp_path: Path) -> None:
    import json

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiollm.node", "--role", "echo", "--secret-file", str(secret), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["addresses"][0].startswith("tcp://127.0.0.1:")
        assert ready["actors"] == {"echo": ready["addresses"][0] + "/echo"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_node_demo_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "two_node_echo.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "remote handler cancelled: True" in result.stdout
    assert "SIGKILLed beta -> Terminated" in result.stdout and "all nodes stopped" in result.stdout
