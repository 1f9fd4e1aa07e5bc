"""Push mode (`Connection.deliver`), part of the conformance suite: per transport, per event loop (see conftest)."""

import asyncio

import numpy as np
import pytest

from aiollm.errors import ChannelBroken, ClosedError, NodeUnreachable
from tests.transports.conftest import STEP
from tests.transports.test_conformance import (
    CLOG_BOUND,
    CLOG_CONFIG,
    MiB,
    pattern,
    wait_until_stalled,
    within,
)


class Collector:
    """Records delivered frames (header, buffer bytes) and the end; `held` futures hold frames back."""

    def __init__(self, hold_first: bool = False) -> None:
        self.frames: list[tuple[bytes, list[bytes]]] = []
        self.views: list[list[memoryview]] = []
        self.ends: list[Exception] = []
        self.ended = asyncio.get_running_loop().create_future()
        self.release = asyncio.get_running_loop().create_future() if hold_first else None

    def on_frame(self, header, buffers):
        self.frames.append((bytes(header), [bytes(b) for b in buffers]))
        self.views.append(buffers)
        if self.release is not None and len(self.frames) == 1:
            return self.release
        return None

    def on_end(self, error):
        self.ends.append(error)
        self.ended.set_result(error)

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(STEP):
            while len(self.frames) < count:
                await asyncio.sleep(0.005)


async def test_frames_arrive_in_order_then_peer_close_ends_once(pair):
    p = await pair()
    early = [(bytes([i]), [pattern(100 + i, i)]) for i in range(2)]
    for header, buffers in early:  # sent before deliver: read ahead, handed over first
        await within(p.client.send(header, buffers))
    await asyncio.sleep(0.05)
    got = Collector()
    p.server.deliver(got.on_frame, got.on_end)
    late = [(b"h" * i, [pattern(i * 1000, i), b""]) for i in range(2, 5)] + [(b"big", [pattern(3 * MiB, 7)])]
    for header, buffers in late:
        await within(p.client.send(header, buffers))
    await got.wait_for(6)
    await p.client.close()
    assert isinstance(await within(got.ended), NodeUnreachable)
    expected = [(h, [bytes(memoryview(b).cast("B")) for b in bufs]) for h, bufs in early + late]
    assert got.frames == expected
    assert len(got.ends) == 1


async def test_held_frame_holds_back_the_rest_and_stalls_the_sender(pair, scheme):
    p = await pair(server_config=CLOG_CONFIG)
    got = Collector(hold_first=True)
    p.server.deliver(got.on_frame, got.on_end)
    sent, frames = [0], 64

    async def produce():
        for i in range(frames):
            await p.client.send(i.to_bytes(4, "little"), [pattern(MiB)])
            sent[0] += 1

    producer = asyncio.create_task(produce())
    await wait_until_stalled(sent, producer)
    assert len(got.frames) == 1, "frames were handed over while the first was held back"
    assert sent[0] * MiB <= CLOG_BOUND[scheme], f"{sent[0]} MiB accepted while the receiver held a frame"
    got.release.set_result(None)
    await within(producer)
    await got.wait_for(frames)
    assert [int.from_bytes(h, "little") for h, _ in got.frames] == list(range(frames))
    assert not got.ends


async def test_local_close_ends_delivery_with_closed_error(pair):
    p = await pair()
    got = Collector()
    p.server.deliver(got.on_frame, got.on_end)
    await within(p.client.send(b"one"))
    await got.wait_for(1)
    await p.server.close()
    assert isinstance(await within(got.ended), ClosedError)
    with pytest.raises(NodeUnreachable):
        await within(p.client.recv())


async def test_raising_frame_handler_breaks_the_channel(pair):
    p = await pair()
    ended = asyncio.get_running_loop().create_future()

    def on_frame(header, buffers):
        raise RuntimeError("receiver bug")

    p.server.deliver(on_frame, ended.set_result)
    await within(p.client.send(b"x"))
    error = await within(ended)
    assert isinstance(error, ChannelBroken) and "receiver bug" in str(error)
    with pytest.raises(NodeUnreachable):
        await within(p.client.recv())


async def test_deliver_receives_into_allocated_memory(pair):
    p = await pair()
    pool = np.zeros(2 * MiB, np.uint8)
    calls = []

    def allocate(header, sizes):
        calls.append((bytes(header), list(sizes)))
        return [memoryview(pool[: sizes[0]])]

    got = Collector()
    p.server.deliver(got.on_frame, got.on_end, allocate)
    await within(p.client.send(b"kv", [pattern(MiB, 3)]))
    await within(p.client.send(b"ctl"))  # no buffers: allocate is not needed
    await got.wait_for(2)
    assert calls == [(b"kv", [MiB])]
    assert np.shares_memory(np.frombuffer(got.views[0][0], np.uint8), pool)
    assert np.array_equal(pool[:MiB], pattern(MiB, 3))
    assert got.frames[1] == (b"ctl", [])


async def test_send_nowait_takes_whole_frames_or_nothing(pair):
    p = await pair(server_config=CLOG_CONFIG)
    taken = 0
    while taken < 2000 and p.client.send_nowait(taken.to_bytes(4, "little") + bytes(60_000)):
        taken += 1
    assert taken < 2000, "send_nowait kept taking frames although nobody reads"
    for i in range(taken):  # each frame taken arrives whole, in order
        frame = await within(p.server.recv())
        assert int.from_bytes(frame.header[:4], "little") == i and len(frame.header) == 60_004
    await within(p.client.send(b"after"))  # what send_nowait refused, send delivers
    assert (await within(p.server.recv())).header == b"after"
    await p.client.close()
    assert not p.client.send_nowait(b"closed")
