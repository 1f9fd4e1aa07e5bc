"""One authenticated connection to another node: sending requests, reading and routing frames, heartbeats.

Frames arrive by push (`Connection.deliver`): over tcp `_on_frame` runs inside the transport's
receive callback, so a reply settles the asker's future and a request lands in its actor's
mailbox with no reader task in between (one task wake-up less per frame, the
largest avoidable cost of an ask). Asks, stream items and requests are handled there directly;
when a mailbox is full `_on_frame` returns the wait, the transport delivers nothing more until
it is done and stops reading, and the sender's transport backs up — backpressure across the
network. Time spent so blocked does not count against the peer's heartbeat. When the connection drops or stays silent past the heartbeat timeout, every
ask and stream waiting on it fails with `NodeUnreachable` and the node fires `Terminated` for
the actors watched over it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from aiollm.actors.messages import (
    ASK,
    STREAM,
    TELL,
    Cancel,
    Credit,
    End,
    Envelope,
    Failure,
    Heartbeat,
    Item,
    Message,
    Reply,
    Request,
    Stopped,
    Unwatch,
    Watch,
)
from aiollm.actors.messages import (
    PROTOCOL_VERSION as V,
)
from aiollm.actors.reply import Reply as ReplySlot
from aiollm.actors.reply import Sink, expire
from aiollm.actors.stream import StreamReceiver, consume
from aiollm.errors import (
    ActorDied,
    AiollmError,
    ChannelBroken,
    ClosedError,
    NodeUnreachable,
    ProtocolError,
    RemoteError,
)
from aiollm.log import get_logger
from aiollm.transports.base import Buffer, Connection
from aiollm.transports.framing import byte_view

if TYPE_CHECKING:
    from aiollm.actors.cell import ActorCell
    from aiollm.actors.node import Node


_log = get_logger("actors.peer")


class Peer:
    """The node's side of one connection to a peer node."""

    def __init__(self, node: Node, conn: Connection, url: str, max_frame: int) -> None:
        self.node = node
        self.conn = conn
        # The peer node's address (what it advertised, or the connection's far end).
        self.url = url
        # The largest frame the peer accepts (from its Hello).
        self.max_frame = max_frame
        self.closed = False
        self._codec = node.codec
        self._loop = asyncio.get_running_loop()
        # The id of our last request (asks and streams count up from 1).
        self._last_id = 0
        # Our asks waiting for a reply, by request id.
        self._pending: dict[int, asyncio.Future] = {}
        # Where the tensors of our asks' replies should land (ask's `into`), by request id.
        self._into: dict[int, list[memoryview]] = {}
        # Our streams receiving items, by request id.
        self._streams: dict[int, StreamReceiver] = {}
        # The peer's asks and streams being served here, by its request id.
        self._inflight: dict[int, tuple[ActorCell, ReplySlot | Sink]] = {}
        # Frames received so far: the heartbeat checks that it grows (cheaper per frame than reading a clock).
        self._received = 0
        self._blocked = False
        # Last error the peer reported about a frame of ours (shown when the connection then drops).
        self._peer_error = ""
        self._tasks: set[asyncio.Task] = set()
        # Resolved once the connection is lost (the node's accept handler waits on it).
        self.finished = self._loop.create_future()
        self._heartbeat = self._loop.create_task(self._beat(), name=f"peer-heartbeat:{url}")
        conn.deliver(self._on_frame, self._on_end, self._allocate)  # last: frames read ahead go at once

    # --- sending -------------------------------------------------------------------------

    def post(self, env: Envelope | tuple) -> tuple[bytes, Sequence[memoryview]] | None:
        """Encode and send at once if the transport can take the frame now (None); else the encoded
        frame, for `send_frame`. The fast path of every reply: no coroutine. Raises what `encode` raises.
        """
        header, buffers = frame = self._codec.encode(env)
        if not buffers and len(header) <= self.max_frame and not self.closed and self.conn.send_nowait(header):
            return None
        return frame

    async def send(self, env: Envelope) -> None:
        """Encode and send one frame; `ProtocolError` if over the peer's limit, `NodeUnreachable` if gone."""
        await self.send_frame(*self._codec.encode(env))

    async def send_frame(self, header: bytes, buffers: Sequence[memoryview]) -> None:
        """Send an encoded frame; `ProtocolError` if over the peer's limit, `NodeUnreachable` if gone."""
        size = len(header) + (sum(b.nbytes for b in buffers) if buffers else 0)
        if size > self.max_frame:
            raise ProtocolError(f"frame of {size} bytes exceeds the peer's max_frame_bytes={self.max_frame}")
        if self.closed:
            raise NodeUnreachable(f"{self.url}: connection lost{self._why()}")
        try:
            await self.conn.send(header, buffers)
        except (NodeUnreachable, ClosedError, ChannelBroken) as exc:
            self.lose(f"send failed: {exc}")
            raise NodeUnreachable(f"{self.url}: {exc}{self._why()}") from None

    def notify(self, env: Envelope) -> None:
        """Send in the background (from `_on_frame`, which must not block on its own link)."""
        if not self.closed:
            self._spawn(self.send_quiet(env))

    async def send_quiet(self, env: Envelope) -> None:
        """Send, logging instead of raising: for answers whose loss the other side learns about anyway."""
        try:
            await self.send(env)
        except (AiollmError, TypeError, ValueError) as exc:
            _log.warning("frame not sent", peer=self.url, kind=type(env).__name__, error=str(exc))

    async def tell(self, name: str, msg: Message) -> None:
        await self.send(Request(V, 0, TELL, name, 0, msg))

    async def ask(
        self, name: str, msg: Message, timeout: float | None, into: Sequence[Buffer] | None = None
    ) -> Message | None:
        # The hottest coroutine of the runtime: on success it costs an id, a future, one encode and
        # one write; the reply's receive callback removes the future from `_pending`.
        self._last_id = rid = self._last_id + 1
        fut = self._loop.create_future()
        self._pending[rid] = fut
        timer = None
        try:
            if into is not None:
                self._into[rid] = _destinations(into)
            if timeout is not None:
                timer = self._loop.call_later(timeout, expire, fut, timeout)
            header, buffers = self._codec.encode(
                (_REQUEST, V, rid, ASK, name, 0, msg)
            )  # = Request(V, rid, ASK, name, 0, msg)
            if buffers or self.closed or len(header) > self.max_frame or not self.conn.send_nowait(header):
                await self.send_frame(header, buffers)
            return await fut
        except (asyncio.CancelledError, TimeoutError):
            self._abandon(rid)
            raise
        except BaseException:
            self._pending.pop(rid, None)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if into is not None:
                self._into.pop(rid, None)

    def stream(self, name: str, msg: Message, window: int) -> AsyncIterator[Message]:
        self._last_id = rid = self._last_id + 1
        rx = StreamReceiver(window)
        rx.grant = lambda n: None if self.closed else self.send(Credit(V, rid, n))

        async def start() -> None:
            self._streams[rid] = rx
            await self.send(Request(V, rid, STREAM, name, window, msg))

        def cancel() -> None:
            if self._streams.pop(rid, None) is not None:
                self._abandon(rid)

        return consume(rx, start, cancel)

    def _abandon(self, rid: int) -> None:
        """We stopped waiting for request `rid`: cancel its handler on the peer."""
        self._pending.pop(rid, None)
        self.notify(Cancel(V, rid))

    # --- receiving -----------------------------------------------------------------------

    def _on_frame(self, header: bytes, buffers: list[memoryview]) -> Coroutine[Any, Any, None] | None:
        """Route one frame (called by the transport); returns the wait when a full mailbox must hold the link."""
        self._received += 1
        try:
            env = self._codec.decode_frame(header, buffers)  # (a Request's, Reply's or Item's message included)
        except ProtocolError as exc:
            _log.warning("bad frame refused", peer=self.url, error=str(exc))
            self.notify(Failure(V, 0, "protocol", "ProtocolError", str(exc), ""))
            return None
        if isinstance(env, Reply):  # inline: the hottest branch
            fut = self._pending.pop(env.id, None)
            if fut is None or fut.done():
                return None  # the asker gave up (timeout or cancel)
            body = env.body
            if body.__class__ is ProtocolError:
                fut.set_exception(body)
            else:
                fut.set_result(body)
        elif isinstance(env, Request):
            blocked = self._on_request(env)
            if blocked is not None:
                return self._put_waiting(*blocked)
        elif isinstance(env, Item):
            self._on_item(env)
        else:
            self._on_control(env)
        return None

    def _allocate(self, header: bytes, sizes: list[int]) -> list[memoryview] | None:
        """Where a frame's tensors land (called by the transport before they arrive): the memory an
        ask passed as `into` for its reply, when the sizes match; None lets the transport choose."""
        if not self._into:
            return None
        try:
            env = self._codec.decode_envelope(header)
        except ProtocolError:
            return None  # reported when the frame is handed over
        into = self._into.get(env.id) if env.__class__ is Reply else None
        if into is not None and [view.nbytes for view in into] == sizes:
            return into
        return None

    def _on_end(self, error: Exception) -> None:
        """The transport says the connection ended (after every frame it delivered)."""
        if isinstance(error, ChannelBroken):
            _log.warning("bad frame: closing connection", peer=self.url, error=str(error))
            self.lose(f"channel broken ({error})")
        else:
            self.lose(f"connection lost ({error})")

    def _on_request(self, env: Request) -> tuple[ActorCell, tuple] | None:
        """Run or queue a request; returns (actor, item) when the mailbox is full and delivery must wait."""
        actor = self.node.actors.get(env.to)
        if actor is None or actor.mailbox.closed:
            text = f"no actor {env.to!r} on {self.node.url}"
            if env.kind == TELL:
                _log.warning("tell to a missing actor dropped", peer=self.url, actor=env.to)
            self.notify(Failure(V, env.id, "died", "ActorDied", text, ""))
            return None
        msg = env.body
        if msg is None or msg.__class__ is ProtocolError or env.kind not in (TELL, ASK, STREAM):
            error = (
                msg
                if msg is not None and msg.__class__ is ProtocolError
                else f"request of kind {env.kind} without a message"
            )
            _log.warning("bad message refused", peer=self.url, actor=env.to, error=str(error))
            self.notify(Failure(V, env.id, "protocol", "ProtocolError", str(error), ""))
            return None
        if env.kind == TELL:
            reply = None
        else:
            reply = _RemoteReply(self, env.id) if env.kind == ASK else _RemoteSink(self, env.id, env.credits)
        if actor.run_now(msg, reply):  # done, or registered through `Reply.pending` if it suspended
            return None
        if reply is not None:  # queued: a Cancel must find it
            self._inflight[env.id] = (actor, reply)
        item = (msg, reply)
        if actor.mailbox.put_nowait(item):
            return None
        return actor, item

    async def _put_waiting(self, actor: ActorCell, item: tuple) -> None:
        self._blocked = True
        try:
            await actor.mailbox.put(item)
        except ActorDied as exc:
            if item[1] is not None:
                await item[1].fail(exc)
        finally:
            self._blocked = False
            self._received += 1  # the wait is over: the peer's silence counts from now

    def _on_item(self, env: Item) -> None:
        rx = self._streams.get(env.id)
        if rx is None:
            return
        if env.body.__class__ is ProtocolError:
            rx.fail(env.body)
            self._streams.pop(env.id, None)
            self.notify(Cancel(V, env.id))
        else:
            rx.push(env.body)

    def _on_control(self, env: Envelope) -> None:
        kind = env.__class__
        if kind is Credit:
            entry = self._inflight.get(env.id)
            if entry is not None and isinstance(entry[1], Sink):
                entry[1].grant(env.n)
        elif kind is End:
            rx = self._streams.pop(env.id, None)
            if rx is not None:
                rx.finish()
        elif kind is Failure:
            self._on_failure(env)
        elif kind is Cancel:
            entry = self._inflight.pop(env.id, None)
            if entry is not None:
                entry[0].cancel(entry[1])
        elif kind is Watch:
            self.node.watches.add_remote_watcher(env.target, self)
        elif kind is Unwatch:
            self.node.watches.remove_remote_watcher(env.target, self)
        elif kind is Stopped:
            self.node.watches.remote_stopped(self.url, env.target, env.reason)
        elif kind is not Heartbeat:
            _log.warning("unexpected frame", peer=self.url, kind=kind.__name__)

    def _on_failure(self, env: Failure) -> None:
        error = _error_from(env)
        fut = self._pending.pop(env.id, None) if env.id else None
        if fut is not None:
            if not fut.done():
                fut.set_exception(error)
            return
        rx = self._streams.pop(env.id, None) if env.id else None
        if rx is not None:
            rx.fail(error)
            return
        if env.id == 0:
            self._peer_error = env.message
            _log.warning("peer refused a frame", peer=self.url, error=env.message)

    # --- liveness and teardown -----------------------------------------------------------

    async def _beat(self) -> None:
        config = self.node.config
        check = min(config.heartbeat_interval, config.heartbeat_timeout / 4)
        last_sent = 0.0
        sending: asyncio.Task | None = None
        # When a frame was last seen (to within one check), and the frame count then.
        last_recv, seen = self._loop.time(), self._received
        while not self.closed:
            await asyncio.sleep(check)
            now = self._loop.time()
            if self._blocked or self._received != seen:  # (blocked: we are not reading, not the peer's fault)
                last_recv, seen = now, self._received
            elif now - last_recv > config.heartbeat_timeout:
                _log.warning("heartbeat timeout", peer=self.url, silent_s=round(now - last_recv, 3))
                self.lose("heartbeat timeout")
                return
            if now - last_sent >= config.heartbeat_interval and (sending is None or sending.done()):
                last_sent = now
                sending = self._spawn(self.send_quiet(Heartbeat(V)))

    def lose(self, reason: str) -> None:
        """The connection is gone: fail everything waiting on it, cancel what it asked of us, tell the node."""
        if self.closed:
            return
        self.closed = True
        error = NodeUnreachable(f"{self.url}: {reason}{self._why()}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        for rx in self._streams.values():
            rx.fail(error)
        self._streams.clear()
        for actor, reply in self._inflight.values():
            actor.cancel(reply)
        self._inflight.clear()
        self._heartbeat.cancel()
        self._spawn(self.conn.close())
        if not self.finished.done():
            self.finished.set_result(None)
        self.node.peer_lost(self, reason)

    async def close(self) -> None:
        """Close the connection and wait for the tasks serving it to finish."""
        self.lose("closed by this node")
        await self.conn.close()
        await asyncio.gather(self._heartbeat, *self._tasks, return_exceptions=True)

    def _why(self) -> str:
        return f" (peer said: {self._peer_error})" if self._peer_error else ""

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def inflight_done(self, rid: int) -> None:
        self._inflight.pop(rid, None)


class _RemoteReply(ReplySlot):
    """An ask from a peer: the answer goes back as a Reply or Failure frame."""

    __slots__ = ("peer", "rid")

    def __init__(self, peer: Peer, rid: int) -> None:
        self.cancelled = self.cancel_requested = False  # Reply's fields, set here: one call less per ask
        self.peer = peer
        self.rid = rid

    def answer(self, value: Message | None) -> Coroutine[Any, Any, None] | None:
        peer = self.peer
        peer._inflight.pop(self.rid, None)
        try:
            frame = peer.post((_REPLY, V, self.rid, value))  # = Reply(V, self.rid, value)
        except (TypeError, ValueError, ProtocolError) as exc:  # the value could not be encoded
            return self._unsendable(exc)
        return None if frame is None else self._send(frame)

    def pending(self, cell: ActorCell) -> None:
        self.peer._inflight[self.rid] = (cell, self)

    async def _send(self, frame: tuple[bytes, Sequence[memoryview]]) -> None:
        try:
            await self.peer.send_frame(*frame)
        except (ValueError, ProtocolError) as exc:  # too large for the peer or the transport
            await self._unsendable(exc)
        except NodeUnreachable:
            pass  # the asker's side already failed with NodeUnreachable

    async def _unsendable(self, exc: Exception) -> None:
        _log.error("reply not sendable", peer=self.peer.url, error=str(exc))
        await self.peer.send_quiet(_failure(self.rid, RemoteError(type(exc).__name__, str(exc))))

    async def fail(self, error: AiollmError) -> None:
        self.peer.inflight_done(self.rid)
        await self.peer.send_quiet(_failure(self.rid, error))


class _RemoteSink(Sink):
    """A stream consumed by a peer: items go as Item frames; the peer's Credit frames call `grant`."""

    __slots__ = ("peer", "rid")

    def __init__(self, peer: Peer, rid: int, credits: int) -> None:
        super().__init__(credits)
        self.peer = peer
        self.rid = rid

    async def item(self, value: Message) -> None:
        try:
            await self.peer.send(Item(V, self.rid, value))
        except (TypeError, ValueError, ProtocolError) as exc:
            _log.error("stream item not sendable", peer=self.peer.url, error=str(exc))
            self.cancelled = True
            await self.fail(RemoteError(type(exc).__name__, str(exc)))
        except NodeUnreachable:
            self.cancelled = True  # the consumer is gone: close the generator at its next step

    async def end(self) -> None:
        self.peer.inflight_done(self.rid)
        await self.peer.send_quiet(End(V, self.rid))

    async def fail(self, error: AiollmError) -> None:
        self.peer.inflight_done(self.rid)
        await self.peer.send_quiet(_failure(self.rid, error))


# The tags of Request and Reply. The two hottest frames are encoded from tuples holding the tag and the
# fields in order: msgpack arrays identical to what the array-like structs encode to, at a fraction of
# the cost of creating the struct (tests/unit/test_codec.py checks that the bytes are the same).
_REQUEST = Request.__struct_config__.tag
_REPLY = Reply.__struct_config__.tag


def _destinations(into: Sequence[Buffer]) -> list[memoryview]:
    """Flat byte views of an ask's `into` buffers; `ValueError` for read-only or non-contiguous ones."""
    views = [byte_view(buf) for buf in into]
    if any(view.readonly for view in views):
        raise ValueError("ask(into=...) needs writable buffers")
    return views


def _failure(rid: int, error: AiollmError) -> Failure:
    if isinstance(error, RemoteError):
        return Failure(V, rid, "remote", error.type_name, error.message, error.traceback_text)
    kind = "protocol" if isinstance(error, ProtocolError) else "died" if isinstance(error, ActorDied) else "remote"
    return Failure(V, rid, kind, type(error).__name__, str(error), "")


def _error_from(env: Failure) -> AiollmError:
    if env.kind == "protocol":
        return ProtocolError(env.message)
    if env.kind == "died":
        return ActorDied(env.message)
    return RemoteError(env.type_name, env.message, env.traceback)
