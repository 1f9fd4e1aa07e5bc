"""`ActorRef`: the address of an actor (`tcp://127.0.0.1:7001/echo`) and the three ways to message it.

A ref is bound to the node that made it (its *router*), which decides on each call whether the
target is local (the message object goes straight into the mailbox, nothing is serialised) or
on a peer (encoded, sent over the one connection to that node, opened lazily). Refs can be
message fields: they travel as their URL and are re-bound to the receiving node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING

from aiollm.actors.messages import Message
from aiollm.transports.base import Buffer, parse_address

if TYPE_CHECKING:
    from aiollm.actors.node import Node
    from aiollm.actors.peer import Peer


class ActorRef:
    """A handle on an actor, local or remote; compare and hash by URL."""

    __slots__ = ("url", "name", "node_url", "_router", "_peer")

    def __init__(self, url: str, router: Node) -> None:
        address = parse_address(url)
        if not address.path or "/" in address.path:
            raise ValueError(f"actor ref {url!r}: expected scheme://host:port/actor-name")
        # Full URL, e.g. tcp://127.0.0.1:7001/echo.
        self.url = url
        # Actor name on its node.
        self.name = address.path
        # The node part, e.g. tcp://127.0.0.1:7001.
        self.node_url = address.node_url
        self._router = router
        # The connection the router last sent this ref's asks over (asks then go straight to it while it is open).
        self._peer: Peer | None = None

    async def tell(self, msg: Message) -> None:
        """Send without waiting for a result; waits only while the target's mailbox (or the link) is full.

        Raises `ActorDied` (local target gone), `NodeUnreachable`, `ProtocolError` (frame too large).
        A remote target that is gone is logged there, not reported here.
        """
        await self._router.tell(self, msg)

    def ask(
        self, msg: Message, timeout: float | None = None, into: Sequence[Buffer] | None = None
    ) -> Awaitable[Message | None]:
        """Send and wait for the handler's return value.

        `into`: writable, contiguous buffers (e.g. numpy arrays) for the reply's tensors, in the order
        they appear in it. When a remote actor's reply carries tensors of exactly these byte sizes,
        they are received straight into this memory (the reply's arrays view it); otherwise they land
        in fresh memory. Ignored for an actor in this process (its reply is passed as-is). If the
        ask times out or is cancelled, a reply already arriving may still be written there.

        Raises `TimeoutError` (asyncio.TimeoutError) after `timeout` s, `ActorDied`, `NodeUnreachable`,
        `RemoteError` (the handler raised: type, message, traceback text), `ProtocolError` (the
        message was rejected: unknown type, no handler, invalid fields). Cancelling the awaiting task
        or timing out cancels the remote handler. (A plain method returning the peer's or the router's
        coroutine: no frame of its own on the hottest path.)
        """
        peer = self._peer
        if peer is not None and not peer.closed and isinstance(msg, Message):
            return peer.ask(self.name, msg, timeout, into)
        return self._router.ask(self, msg, timeout, into)

    def stream(self, msg: Message, window: int | None = None) -> AsyncIterator[Message]:
        """Iterate the items yielded by the target's async-generator handler for `msg`.

        At most `window` items (default `NodeConfig.stream_window`) are queued or in flight.
        Leaving the iteration early, or cancelling the iterating task, cancels the remote generator.
        Errors as for `ask`, raised from the iteration.
        """
        return self._router.stream(self, msg, window)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __repr__(self) -> str:
        return f"ActorRef({self.url!r})"
