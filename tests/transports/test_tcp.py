"""TCP-specific behaviour: malformed byte streams, socket options, listener lifetime."""

import asyncio
import socket
import struct

import pytest

from aiollm.errors import ChannelBroken, NodeUnreachable
from aiollm.transports import TransportConfig, connect, listen
from aiollm.transports.framing import MAGIC, PREFIX, VERSION
from tests.transports.conftest import STEP

LIMITS = TransportConfig(max_header_bytes=1024, max_frame_bytes=1 << 20, max_buffers=8)


def prefix(magic=MAGIC, version=VERSION, header_len=0, sizes=()) -> bytes:
    return PREFIX.pack(magic, version, 0, header_len, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)


@pytest.fixture
async def tcp_listener():
    accepted: asyncio.Queue = asyncio.Queue()
    listener = await listen("tcp://127.0.0.1:0", accepted.put, LIMITS)
    yield listener, accepted
    await listener.close()


async def raw_connect(address: str) -> socket.socket:
    host, port = address.removeprefix("tcp://").split(":")
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return sock


async def peer_dropped(sock: socket.socket) -> bool:
    """True once the other side closed or reset `sock`."""
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), STEP) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "data, fragment",
    [
        (prefix(magic=0xDEADBEEF), "bad frame magic"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad frame magic"),
        (prefix(version=VERSION + 1), "unsupported frame version"),
        (prefix(header_len=1025), "max_header_bytes"),
        (prefix(sizes=[1] * 9), "max_buffers"),
        (prefix(sizes=[1 << 19, 1 << 19, 1]), "max_frame_bytes"),
        (prefix(header_len=10, sizes=[2**64 - 1]), "max_frame_bytes"),
    ],
    ids=["magic", "http", "version", "header", "buffers", "frame", "huge-size"],
)
async def test_malformed_stream_breaks_only_that_connection(tcp_listener, data, fragment):
    listener, accepted = tcp_listener
    sock = await raw_connect(listener.address)
    try:
        server = await asyncio.wait_for(accepted.get(), STEP)
        await asyncio.get_running_loop().sock_sendall(sock, data)
        with pytest.raises(ChannelBroken, match=fragment):
            await asyncio.wait_for(server.recv(), STEP)
        assert await peer_dropped(sock)
        with pytest.raises(ChannelBroken):
            await server.recv()
    finally:
        sock.close()
    client = await connect(listener.address)
    try:
        server2 = await asyncio.wait_for(accepted.get(), STEP)
        await client.send(b"still", [b"serving"])
        frame = await asyncio.wait_for(server2.recv(), STEP)
        assert (frame.header, bytes(frame.buffers[0])) == (b"still", b"serving")
        await server2.close()
    finally:
        await client.close()


@pytest.mark.parametrize("cut", [3, PREFIX.size + 8, PREFIX.size + 8 + 5, PREFIX.size + 8 + 10 + 100_000])
async def test_peer_dropping_mid_frame_is_node_unreachable(tcp_listener, cut):
    listener, accepted = tcp_listener
    sock = await raw_connect(listener.address)
    server = await asyncio.wait_for(accepted.get(), STEP)
    frame = prefix(header_len=10, sizes=[500_000]) + b"h" * 10 + bytes(500_000)
    pending = asyncio.create_task(server.recv())
    await asyncio.get_running_loop().sock_sendall(sock, frame[:cut])
    await asyncio.sleep(0.05)
    sock.close()
    with pytest.raises(NodeUnreachable):
        await asyncio.wait_for(pending, STEP)


async def test_port_zero_reports_real_port_and_nodelay_is_on(tcp_listener):
    listener, accepted = tcp_listener
    port = int(listener.address.rsplit(":", 1)[1])
    assert port > 0
    client = await connect(listener.address)
    try:
        server = await asyncio.wait_for(accepted.get(), STEP)
        for conn in (client, server):
            sock = conn._p.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert client.peer_address == listener.address
        await server.close()
    finally:
        await client.close()


async def test_closed_listener_refuses_new_but_keeps_established_connections(tcp_listener):
    listener, accepted = tcp_listener
    client = await connect(listener.address)
    try:
        server = await asyncio.wait_for(accepted.get(), STEP)
        await listener.close()
        with pytest.raises(NodeUnreachable):
            await connect(listener.address, TransportConfig(connect_timeout=2.0))
        await client.send(b"after")
        assert (await asyncio.wait_for(server.recv(), STEP)).header == b"after"
        await server.close()
    finally:
        await client.close()
