"""Mutual HMAC challenge-response on the cluster secret, run on every new connection before any message.

Both sides send a `Hello` with 32 random bytes; each answers with HMAC-SHA256(secret, label +
the other's nonce + its own nonce), where the label differs by direction so a proof cannot be
reflected back. Each side checks the other's proof with `hmac.compare_digest`. The secret never
crosses the wire; a peer without it is refused (a `Failure` frame, then close) and logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import NamedTuple

from aiollm.actors.codec import Codec
from aiollm.actors.messages import PROTOCOL_VERSION, Failure, Hello, Proof
from aiollm.errors import AiollmError, AuthenticationFailed, ProtocolError
from aiollm.transports.base import Connection

_CONNECTOR = b"aiollm-auth-connector\x00"
_ACCEPTOR = b"aiollm-auth-acceptor\x00"


class PeerInfo(NamedTuple):
    """What the handshake learnt about the peer."""

    # The address it advertises ("" when it does not listen).
    node: str
    # The largest frame it accepts.
    max_frame: int


def _no_buffers(header: bytes, sizes: list[int]) -> list[memoryview]:
    """Handshake frames carry no buffers: refuse before a single payload byte is allocated."""
    if sizes:
        raise ProtocolError(f"handshake frame with {len(sizes)} buffers refused")
    return []


async def handshake(
    conn: Connection, codec: Codec, secret: bytes, advertise: str, max_frame: int, initiator: bool, timeout: float
) -> PeerInfo:
    """Authenticate both ways; `AuthenticationFailed` (after telling the peer) when either proof is wrong.

    Raises `AuthenticationFailed` for a wrong proof, a malformed exchange or a timeout;
    `NodeUnreachable`/`ClosedError` if the connection drops.
    """
    try:
        return await asyncio.wait_for(_exchange(conn, codec, secret, advertise, max_frame, initiator), timeout)
    except TimeoutError:
        raise AuthenticationFailed(f"{conn.peer_address}: no handshake within {timeout} s") from None
    except ProtocolError as exc:
        raise AuthenticationFailed(f"{conn.peer_address}: bad handshake: {exc}") from None


async def _exchange(
    conn: Connection, codec: Codec, secret: bytes, advertise: str, max_frame: int, initiator: bool
) -> PeerInfo:
    mine = secrets.token_bytes(32)
    await conn.send(codec.encode(Hello(PROTOCOL_VERSION, mine, advertise, max_frame))[0])
    hello = await _expect(conn, codec, Hello)
    own_label, peer_label = (_CONNECTOR, _ACCEPTOR) if initiator else (_ACCEPTOR, _CONNECTOR)
    mac = hmac.new(secret, own_label + hello.nonce + mine, hashlib.sha256).digest()
    await conn.send(codec.encode(Proof(PROTOCOL_VERSION, mac))[0])
    proof = await _expect(conn, codec, Proof)
    expected = hmac.new(secret, peer_label + mine + hello.nonce, hashlib.sha256).digest()
    if not hmac.compare_digest(proof.mac, expected):
        refusal = Failure(PROTOCOL_VERSION, 0, "auth", "AuthenticationFailed", "wrong cluster secret", "")
        try:
            await conn.send(codec.encode(refusal)[0])
        except AiollmError:
            pass  # the peer may already have given up; the refusal is best effort
        raise AuthenticationFailed(f"{conn.peer_address}: peer does not know the cluster secret")
    return PeerInfo(hello.node, hello.max_frame)


async def _expect(conn: Connection, codec: Codec, kind: type) -> Hello | Proof:
    frame = await conn.recv(_no_buffers)
    env = codec.decode_handshake(frame.header)
    if isinstance(env, Failure):
        raise AuthenticationFailed(f"{conn.peer_address}: refused by peer: {env.message}")
    if not isinstance(env, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(env).__name__}")
    return env
