"""The conformance suite every transport must pass unchanged (see conftest: per transport, per event loop)."""

import asyncio
import functools

import numpy as np
import pytest

from aiollm.errors import ChannelBroken, ClosedError, NodeUnreachable
from aiollm.transports import TransportConfig, connect
from tests.transports.conftest import STEP

MiB = 1024 * 1024


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    """Random bytes that differ from frame to frame, so misplaced or stale data shows (read-only)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)


# The small payloads recur across tests and loops; caching them keeps the suite fast.
pattern = functools.lru_cache(maxsize=512)(random_bytes)


def as_bytes(view) -> bytes:
    return bytes(view)


async def within(awaitable, seconds: float = STEP):
    return await asyncio.wait_for(awaitable, seconds)


async def transfer(sender, receiver, header, buffers, allocate=None):
    """Send and receive one frame concurrently: a transport may finish `send` only once the peer receives
    (UCX rendezvous does; TCP returns once the kernel took the bytes)."""
    _, frame = await within(asyncio.gather(sender.send(header, buffers), receiver.recv(allocate)))
    return frame


@pytest.mark.parametrize(
    "buffers",
    [
        [],
        [b""],
        [b"", b"", b""],
        [b"a", b"", b"bc" * 1000],
        [pattern(3), pattern(70_000, 1), pattern(1, 2), pattern(300_000, 3)],
    ],
    ids=["no-buffers", "one-empty", "three-empty", "mixed", "sizes"],
)
@pytest.mark.parametrize(
    "header", [b"", b"hdr", bytes(range(256)) * 400], ids=["empty-header", "header", "100KB-header"]
)
async def test_round_trip_header_and_buffers(pair, header, buffers):
    p = await pair()
    frame = await transfer(p.client, p.server, header, buffers)
    assert frame.header == header
    assert [as_bytes(b) for b in frame.buffers] == [as_bytes(memoryview(b).cast("B")) for b in buffers]


async def test_typed_and_multidimensional_arrays_arrive_as_bytes(pair):
    p = await pair()
    arrays = [np.arange(12, dtype=np.float16).reshape(3, 4), np.zeros((0, 5), np.float32), np.array(7, np.int64)]
    frame = await transfer(p.client, p.server, b"t", arrays)
    assert [as_bytes(b) for b in frame.buffers] == [a.tobytes() for a in arrays]


async def test_non_contiguous_buffer_is_refused(pair):
    p = await pair()
    with pytest.raises(ValueError, match="contiguous"):
        await p.client.send(b"x", [np.arange(10)[::2]])


async def test_256_mib_payload(pair):
    p = await pair()
    payload = random_bytes(256 * MiB, 5)
    sender = asyncio.create_task(p.client.send(b"big", [payload, b"tail"]))
    frame = await within(p.server.recv(), 60)
    await within(sender, 60)
    received = np.frombuffer(frame.buffers[0], np.uint8)
    assert received.size == payload.size and np.array_equal(received, payload)
    assert as_bytes(frame.buffers[1]) == b"tail"


async def test_many_frames_arrive_in_order(pair):
    p = await pair()
    count = 2000

    async def produce():
        for i in range(count):
            await p.client.send(i.to_bytes(4, "little"), [pattern(i % 97, i)])

    producer = asyncio.create_task(produce())
    for i in range(count):
        frame = await within(p.server.recv())
        assert int.from_bytes(frame.header, "little") == i
        assert as_bytes(frame.buffers[0]) == pattern(i % 97, i).tobytes()
    await within(producer)


async def test_concurrent_senders_frames_stay_whole(pair):
    p = await pair()
    senders, per_sender, size = 6, 20, 200_000

    async def produce(sender: int):
        for i in range(per_sender):
            await p.client.send(bytes([sender, i]), [pattern(size, sender * 1000 + i), pattern(17, i)])

    tasks = [asyncio.create_task(produce(s)) for s in range(senders)]
    seen = dict.fromkeys(range(senders), 0)
    for _ in range(senders * per_sender):
        frame = await within(p.server.recv())
        sender, i = frame.header
        assert i == seen[sender], "frames of one sender must keep their order"
        seen[sender] += 1
        assert as_bytes(frame.buffers[0]) == pattern(size, sender * 1000 + i).tobytes()
        assert as_bytes(frame.buffers[1]) == pattern(17, i).tobytes()
    await within(asyncio.gather(*tasks))


# Receiver-side bounds used by the clogged test: inproc's queue is set small; TCP buffers what the
# kernel allows (tcp_rmem max + tcp_wmem max, up to 32 + 4 MiB) plus the transport's scratch.
CLOG_CONFIG = TransportConfig(options={"inproc.queue_bytes": str(4 * MiB), "inproc.queue_frames": "8"})
CLOG_BOUND = {"inproc": 5 * MiB, "tcp": 48 * MiB, "tls": 48 * MiB, "ucx": 48 * MiB}


async def wait_until_stalled(counter: list[int], task: asyncio.Task, quiet: float = 0.3) -> None:
    """Return once `counter[0]` stopped growing for `quiet` seconds; fail if `task` finished instead."""
    last, still_since = -1, asyncio.get_running_loop().time()
    async with asyncio.timeout(STEP):
        while True:
            await asyncio.sleep(0.05)
            assert not task.done(), "the sender never blocked although nobody reads"
            now = asyncio.get_running_loop().time()
            if counter[0] != last:
                last, still_since = counter[0], now
            elif now - still_since >= quiet:
                return


async def test_clogged_receiver_blocks_sender_with_bounded_memory(pair, scheme):
    p = await pair(server_config=CLOG_CONFIG)
    frame_size, frames = 1 * MiB, 96
    sent = [0]
    payload = pattern(frame_size)

    async def produce():
        for i in range(frames):
            await p.client.send(i.to_bytes(4, "little"), [payload])
            sent[0] += 1

    producer = asyncio.create_task(produce())
    await wait_until_stalled(sent, producer)
    assert sent[0] * frame_size <= CLOG_BOUND[scheme], f"{sent[0]} MiB accepted while the receiver read nothing"
    for i in range(frames):
        frame = await within(p.server.recv())
        assert int.from_bytes(frame.header, "little") == i
    assert np.array_equal(np.frombuffer(frame.buffers[0], np.uint8), payload)
    await within(producer)


async def test_blocked_sender_gets_node_unreachable_when_peer_closes(pair):
    p = await pair(server_config=CLOG_CONFIG)
    sent = [0]

    async def produce():
        while True:
            await p.client.send(b"x", [pattern(MiB)])
            sent[0] += 1

    producer = asyncio.create_task(produce())
    await wait_until_stalled(sent, producer)
    await p.server.close()
    with pytest.raises(NodeUnreachable):
        await within(producer)


async def test_peer_close_gives_node_unreachable_after_delivering_what_was_sent(pair):
    p = await pair()
    for i in range(3):
        await p.server.send(bytes([i]), [pattern(1000, i)])
    await p.server.close()
    for i in range(3):
        frame = await within(p.client.recv())
        assert frame.header == bytes([i])
    with pytest.raises(NodeUnreachable):
        await within(p.client.recv())
    with pytest.raises(NodeUnreachable):
        await within(p.client.send(b"late"))
    assert p.client.closed


async def test_pending_recv_gets_node_unreachable_when_peer_closes(pair):
    p = await pair()
    pending = asyncio.create_task(p.client.recv())
    await asyncio.sleep(0.05)
    await p.server.close()
    with pytest.raises(NodeUnreachable):
        await within(pending)


async def test_local_close_gives_closed_error(pair):
    p = await pair()
    pending = asyncio.create_task(p.client.recv())
    await asyncio.sleep(0.05)
    await p.client.close()
    await p.client.close()  # idempotent
    assert p.client.closed
    with pytest.raises(ClosedError):
        await within(pending)
    with pytest.raises(ClosedError):
        await p.client.send(b"x")
    with pytest.raises(ClosedError):
        await p.client.recv()
    with pytest.raises(NodeUnreachable):
        await within(p.server.recv())


@pytest.mark.parametrize(
    "limits, header, buffers, fragment",
    [
        ({"max_frame_bytes": 4096}, b"h", [bytes(5000)], "max_frame_bytes"),
        ({"max_buffers": 2}, b"h", [b"a", b"b", b"c"], "max_buffers"),
        ({"max_header_bytes": 16}, bytes(17), [], "max_header_bytes"),
        ({"max_frame_bytes": 64}, bytes(100), [], "max_frame_bytes"),
    ],
    ids=["frame-too-big", "too-many-buffers", "header-too-big", "header-over-frame-limit"],
)
async def test_over_limit_frame_breaks_channel_and_listener_keeps_accepting(pair, limits, header, buffers, fragment):
    p = await pair(server_config=TransportConfig(**limits))
    await within(p.client.send(header, buffers))
    with pytest.raises(ChannelBroken, match=fragment):
        await within(p.server.recv())
    assert p.server.closed
    with pytest.raises(NodeUnreachable):
        await within(p.client.recv())
    again = await connect(p.listener.address)
    try:
        server2 = await within(p.accepted.get())
        await again.send(b"ok", [b"small"])
        frame = await within(server2.recv())
        assert (frame.header, as_bytes(frame.buffers[0])) == (b"ok", b"small")
        await server2.close()
    finally:
        await again.close()


async def test_sender_refuses_frames_over_its_own_limits(pair):
    p = await pair(client_config=TransportConfig(max_frame_bytes=100, max_buffers=1))
    with pytest.raises(ValueError, match="max_frame_bytes"):
        await p.client.send(b"h", [bytes(200)])
    with pytest.raises(ValueError, match="max_buffers"):
        await p.client.send(b"h", [b"a", b"b"])
    await p.client.send(b"h", [b"fits"])
    assert as_bytes((await within(p.server.recv())).buffers[0]) == b"fits"


async def test_allocate_callback_receives_into_caller_memory(pair):
    p = await pair()
    pool = np.zeros(4 * MiB, np.uint8)
    calls = []

    def allocate(header, sizes):
        calls.append((header, list(sizes)))
        views, offset = [], 0
        for size in sizes:
            views.append(memoryview(pool[offset : offset + size]))
            offset += size
        return views

    buffers = [pattern(3 * MiB, 9), pattern(10, 1), b""]
    frame = await transfer(p.client, p.server, b"kv", buffers, allocate)
    assert calls == [(b"kv", [3 * MiB, 10, 0])]
    assert np.shares_memory(np.frombuffer(frame.buffers[0], np.uint8), pool)
    assert np.array_equal(pool[: 3 * MiB], buffers[0])
    assert pool[3 * MiB : 3 * MiB + 10].tobytes() == buffers[1].tobytes()


async def test_allocate_returning_wrong_sizes_is_a_value_error(pair):
    p = await pair()
    await within(p.client.send(b"h", [bytes(100)]))
    with pytest.raises(ValueError, match="allocate returned"):
        await within(p.server.recv(lambda header, sizes: [memoryview(bytearray(1))]))


async def test_connect_to_nothing_is_node_unreachable(scheme):
    url = "inproc://nobody-listens-here" if scheme == "inproc" else f"{scheme}://127.0.0.1:1"
    with pytest.raises(NodeUnreachable):
        await within(connect(url, TransportConfig(connect_timeout=2.0)))


async def test_unknown_option_for_the_transport_is_refused(pair, scheme):
    with pytest.raises(ValueError, match="unknown"):
        await pair(server_config=TransportConfig(options={f"{scheme}.no_such_option": "1"}))
