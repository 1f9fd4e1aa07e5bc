"""UCX-specific behaviour: the message without the binding, idle CPU use, progress modes."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiollm.transports import TransportConfig, connect, listen
from tests.transports.conftest import STEP, UCX_MISSING

ROOT = Path(__file__).resolve().parents[2]


def test_ucx_address_without_binding_says_how_to_install():
    code = (
        "import sys, asyncio; sys.modules['ucxx'] = None\n"
        "from aiollm.transports import connect\n"
        "try:\n    asyncio.run(connect('ucx://127.0.0.1:1'))\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "pip install 'aiollm[ucx]'" in out.stdout, out.stderr


@pytest.mark.ucx
@pytest.mark.skipif(UCX_MISSING, reason="UCX binding absent: pip install 'aiollm[ucx]'")
@pytest.mark.parametrize("mode", ["event", "polling"])
async def test_progress_modes_and_idle_cpu(mode):
    """Both modes move frames; the default `event` mode uses (almost) no CPU while connected and idle."""
    config = TransportConfig(options={"ucx.progress": mode})
    accepted: asyncio.Queue = asyncio.Queue()
    listener = await listen("ucx://127.0.0.1:0", accepted.put, config)
    client = await connect(listener.address, config)
    server = await asyncio.wait_for(accepted.get(), STEP)
    try:
        for i in range(50):
            await client.send(bytes([i]))
            assert (await asyncio.wait_for(server.recv(), STEP)).header == bytes([i])
        pending = asyncio.create_task(server.recv())
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        busy = (time.process_time() - cpu) / (time.monotonic() - wall)
        if mode == "event":
            assert busy < 0.2, f"an idle connection used {busy:.0%} of a CPU"
        await client.send(b"wake")
        assert (await asyncio.wait_for(pending, STEP)).header == b"wake"
    finally:
        await client.close()
        await server.close()
        await listener.close()
