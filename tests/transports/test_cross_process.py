"""Frames between two OS processes: a child echo peer (tests/transports/echo_peer.py) on 127.0.0.1."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiollm.errors import NodeUnreachable
from aiollm.transports import connect
from tests.transports.conftest import STEP, UCX_MISSING

ROOT = Path(__file__).resolve().parents[2]
SCHEMES = [
    "tcp",
    pytest.param(
        "ucx",
        marks=[
            pytest.mark.ucx,
            pytest.mark.skipif(UCX_MISSING, reason="UCX binding absent: pip install 'aiollm[ucx]'"),
        ],
    ),
]


@pytest.fixture(params=SCHEMES)
def echo_peer(request):
    """Start the echo child; yields (its address, the process); always killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.transports.echo_peer", f"{request.param}://127.0.0.1:0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
        text=True,
    )
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith(f"{request.param}://"), f"echo peer did not start (printed {address!r})"
        yield address, proc
    finally:
        proc.kill()
        proc.wait()


async def test_echo_across_processes(echo_peer):
    address, _ = echo_peer
    conn = await connect(address)
    try:
        for size in (0, 1, 65_536, 1 << 20, 64 << 20):
            payload = np.frombuffer(np.random.default_rng(size).bytes(size), np.uint8)
            await asyncio.wait_for(conn.send(b"echo", [payload, b"", b"x"]), STEP)
            frame = await asyncio.wait_for(conn.recv(), STEP)
            assert frame.header == b"echo"
            assert np.array_equal(np.frombuffer(frame.buffers[0], np.uint8), payload)
            assert [bytes(b) for b in frame.buffers[1:]] == [b"", b"x"]
    finally:
        await conn.close()


async def test_killed_peer_gives_node_unreachable(echo_peer):
    address, proc = echo_peer
    conn = await connect(address)
    try:
        await conn.send(b"ping")
        assert (await asyncio.wait_for(conn.recv(), STEP)).header == b"ping"
        pending = asyncio.create_task(conn.recv())
        await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(NodeUnreachable):
            await asyncio.wait_for(pending, STEP)
        with pytest.raises(NodeUnreachable):
            await conn.send(b"late")
    finally:
        await conn.close()
