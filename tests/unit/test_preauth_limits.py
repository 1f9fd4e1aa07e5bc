"""Before a peer authenticates, a node reads only handshake-sized frames and lets only so many connections
authenticate at once: a stranger announcing a 16 MiB header is cut off before the header is allocated, and a
flood of silent connections is refused beyond the cap, while members are served throughout."""

import asyncio

from aiollm.actors import Node, NodeConfig
from aiollm.actors.echo import EchoActor, Ping, Pong
from aiollm.actors.node import MAX_PENDING_HANDSHAKES
from aiollm.transports.framing import MAGIC, PREFIX, VERSION

SECRET = b"preauth-limits-secret-0123456789"


async def _drain_until_eof(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        try:
            data = await asyncio.wait_for(reader.read(1 << 16), 0.5)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
        if not data:
            return True
    return False


async def test_a_huge_header_before_authentication_closes_only_that_connection():
    config = NodeConfig(secret=SECRET)
    async with Node(config) as node, Node(config) as member:
        await node.start(["tcp://127.0.0.1:0"])
        await member.start()
        await node.spawn(EchoActor, "echo")
        host, port = node.url.removeprefix("tcp://").split(":")
        conns = []
        for _ in range(20):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(PREFIX.pack(MAGIC, VERSION, 0, 16 * 2**20, 0) + b"x" * 1024)
            await writer.drain()
            conns.append((reader, writer))
        for reader, writer in conns:
            assert await _drain_until_eof(reader), "the node kept a connection announcing a 16 MiB header"
            writer.close()
        assert await member.ref(f"{node.url}/echo").ask(Ping(7), timeout=5) == Pong(7)
        assert node._authenticating == 0


async def test_silent_connections_beyond_the_cap_are_refused_and_members_still_served():
    config = NodeConfig(secret=SECRET, handshake_timeout=3.0)
    async with Node(config) as node, Node(config) as member:
        await node.start(["tcp://127.0.0.1:0"])
        await member.start()
        await node.spawn(EchoActor, "echo")
        host, port = node.url.removeprefix("tcp://").split(":")
        silent = [await asyncio.open_connection(host, int(port)) for _ in range(MAX_PENDING_HANDSHAKES + 10)]
        await asyncio.sleep(0.3)
        assert node._authenticating == MAX_PENDING_HANDSHAKES
        refused = [await _drain_until_eof(r, timeout=1.0) for r, _ in silent[MAX_PENDING_HANDSHAKES:]]
        assert all(refused)
        for _, writer in silent:
            writer.close()
        await asyncio.sleep(0.3)
        assert await member.ref(f"{node.url}/echo").ask(Ping(8), timeout=5) == Pong(8)
