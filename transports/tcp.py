"""TCP transport (`tcp://host:port`): frames over asyncio streams, payloads received in place.

Why it is shaped this way: `asyncio.BufferedProtocol` on uvloop moves 90-98 % of what raw sockets do,
while `StreamReader.readexactly` copies and falls to a fraction of that for large payloads. So:

- Receiving: small data (prefixes, headers, small buffers) is read into one scratch buffer and
  parsed from there; once a frame's sizes and header are known, its buffers are allocated (the
  `allocate` callback of the waiting `recv`, else `np.empty` uint8 arrays) and any large remainder
  is read by the kernel straight into them. Parsing of a frame stops before allocation until a
  `recv` is waiting, so `allocate` always decides where a payload lands; a receiver that does
  not call `recv` stops reading once the scratch buffer is full, and TCP flow control then
  stalls the sender (memory in flight = scratch + kernel socket buffers + one frame).
- Sending: `transport.writelines` with the prefix, header and each buffer as separate pieces (no
  concatenation of big buffers; small frames are joined into one write). The write-buffer high
  mark is 0: whenever the kernel did not take a whole frame, `pause_writing` fires and `send`
  waits for `resume_writing`, i.e. until the kernel has taken every byte. That is what makes the
  interface's promise true (buffers may be reused once `send` returns) even though uvloop keeps
  references to unsent memory instead of copying it, and it bounds memory in flight per sender.
  (On the stdlib loop before Python 3.12 `writelines` concatenates; it is correct, just slower.)

One `recv` runs at a time (others wait their turn). If a `recv` is cancelled after its `allocate`
was called, the frame keeps landing in that memory and is returned by the next `recv`.

Push mode (`deliver`, what nodes use): the same parser hands each complete frame to the receiver's
callback from `buffer_updated`, i.e. inside uvloop's read callback, so a reply reaches its asker's
future and a request its actor without a task wake-up in between. A receiver that returns an
awaitable holds the next frames back: they stay in the scratch buffer, reading pauses once it is
full, and TCP flow control stalls the sender, as with a receiver that does not call `recv`.
`send_nowait` writes a small control-only frame at once when nothing holds writing back (no
coroutine: the fast path of asks and replies).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections import deque
from collections.abc import Awaitable, Sequence

from aiollm.errors import ChannelBroken, ClosedError, NodeUnreachable
from aiollm.log import get_logger
from aiollm.transports.base import (
    Address,
    Allocator,
    Buffer,
    Connection,
    ConnectionHandler,
    EndHandler,
    Frame,
    FrameHandler,
    HandlerTasks,
    Listener,
    Transport,
    TransportConfig,
)
from aiollm.transports.framing import (
    MAGIC,
    PREFIX,
    VERSION,
    allocate_buffers,
    byte_view,
    check_limits,
    decode_prefix,
    decode_sizes,
    encode_prefix,
    fresh_buffers,
    options_for,
)

_log = get_logger("transports.tcp")

# Options this transport reads from TransportConfig.options, with their defaults.
DEFAULT_OPTIONS: dict[str, int | str] = {
    # Bytes of read-ahead for prefixes, headers and small buffers (raised to fit the largest size table).
    "tcp.scratch_bytes": 256 * 1024,
    # A buffer remainder at least this large is read by the kernel straight into its destination.
    "tcp.direct_min_bytes": 32 * 1024,
    # Frames up to this size are joined into one write (fewer syscalls for small messages).
    "tcp.join_max_bytes": 64 * 1024,
}

# The prefix read as two u64 words: magic, version and the reserved field (_CONTROL_WORD), then the header
# length plus the buffer count times 2**32 — the header length itself when the frame has no buffers.
_unpack_words = struct.Struct("<QQ").unpack_from
_PREFIX_SIZE = PREFIX.size
_CONTROL_WORD = MAGIC | VERSION << 32
# `send_nowait` takes headers shorter than this; their prefixes are made once, here.
_SMALL_HEADER = 1024
_CONTROL_PREFIXES = tuple(PREFIX.pack(MAGIC, VERSION, 0, n, 0) for n in range(_SMALL_HEADER))

# Receive stages of one frame.
_PREFIX, _SIZES, _HEADER, _ALLOC, _BODY = range(5)
# Seconds `close` waits for the socket to be released before giving up on it.
_CLOSE_WAIT = 2.0


# Bytes of encrypted data a TLS connection may hold unsent before `send` waits (a write high mark of 0, what
# plain TCP uses, leaves TLS's own buffer never drained enough to resume).
TLS_WRITE_HIGH = 256 * 1024


class _FrameProtocol(asyncio.BufferedProtocol):
    """The asyncio side of one TCP connection: parses incoming frames and tracks write flow control."""

    def __init__(self, config: TransportConfig, scheme: str = "tcp") -> None:
        opts = options_for(config, "tcp", DEFAULT_OPTIONS)
        self.scheme = scheme
        self.direct_min = int(opts["tcp.direct_min_bytes"])
        self.join_max = int(opts["tcp.join_max_bytes"])
        self.set_limits(config)
        scratch = max(int(opts["tcp.scratch_bytes"]), PREFIX.size + 8 * config.max_buffers)
        self.scratch = memoryview(bytearray(scratch))
        self.rpos = self.wpos = 0
        self.transport: asyncio.Transport | None = None
        # Receive state of the frame being parsed.
        self.stage = _PREFIX
        self.header_len = self.count = 0
        self.sizes: list[int] = []
        self.header = b""
        self.dests: list[memoryview] = []
        self.idx = self.pos = 0
        self.direct: memoryview | None = None  # destination the kernel currently reads into
        self.ready: Frame | None = None  # a completed frame whose recv was cancelled
        self.waiter: asyncio.Future | None = None
        self.allocate: Allocator | None = None
        self.reading_paused = False
        # Why the connection ended: ClosedError (here), NodeUnreachable (peer), ChannelBroken (bad data).
        self.ended: Exception | None = None
        self.write_paused = False
        self.drain_waiters: list[asyncio.Future] = []
        self.loop = asyncio.get_running_loop()
        self.lost = self.loop.create_future()
        self.on_connected = None  # set by the listener: called with the protocol once connected
        # Push mode (TcpConnection.deliver): the receiver's callbacks, and the awaitable holding frames back.
        self.on_frame: FrameHandler | None = None
        self.on_end: EndHandler | None = None
        self.hold: asyncio.Future | None = None

    def set_limits(self, config: TransportConfig) -> None:
        self.config = config
        # Largest header a control-only frame may carry (both limits apply to it).
        self.header_max = min(config.max_header_bytes, config.max_frame_bytes, 2**32 - 1)
        # Largest header `send_nowait` writes (a control-only frame small enough to be joined).
        self.nowait_max = min(self.header_max, self.join_max)

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.write = transport.write  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if transport.get_extra_info("sslcontext") is None:
            transport.set_write_buffer_limits(high=0, low=0)  # type: ignore[attr-defined]
        else:  # TLS encrypts a copy at write time (buffers are free to reuse at once); flow control bounds memory
            transport.set_write_buffer_limits(high=TLS_WRITE_HIGH)  # type: ignore[attr-defined]
        if self.on_connected is not None:
            self.on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.rpos == self.wpos and self.direct is None:  # the usual case: everything parsed
            self.rpos = self.wpos = 0
            return self.scratch  # (the whole view: no slice to make)
        if self.direct is not None:
            return self.direct[self.pos :]
        if self.wpos == len(self.scratch):
            n = self.wpos - self.rpos
            self.scratch[:n] = self.scratch[self.rpos : self.wpos]
            self.rpos, self.wpos = 0, n
        return self.scratch[self.wpos :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.direct is not None:
            self.pos += nbytes
            if self.pos < len(self.direct):
                return
            self.direct = None
            self.idx += 1
            self.pos = 0
            if self.on_frame is not None:
                self.push()
            else:
                self._progress()
            return
        self.wpos = wpos = self.wpos + nbytes
        on_frame = self.on_frame
        if on_frame is None:
            self._progress()
            return
        if self.hold is None and self.stage == _PREFIX:
            # Push mode's fast path, inline (the hottest code of every ask): whole control-only
            # frames, each handed over right here; anything else goes on in `push`.
            scratch, rpos = self.scratch, self.rpos
            while wpos - rpos >= _PREFIX_SIZE:
                word, header_len = _unpack_words(scratch, rpos)  # (a buffer count makes header_len huge)
                start = rpos + _PREFIX_SIZE
                end = start + header_len
                if word != _CONTROL_WORD or header_len > self.header_max or end > wpos:
                    break
                self.rpos = end
                try:
                    held = on_frame(bytes(scratch[start:end]), [])
                except Exception as exc:
                    self.handler_failed(exc)
                    return
                if held is not None:
                    self.hold_back(held)
                    break
                if end == wpos and self.ended is None:
                    return  # all parsed, nothing held: done
                if self.ended is not None:
                    break
                rpos = end
        self.push()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ended is None:
            reason = f" ({exc})" if exc else ""
            self.ended = NodeUnreachable(f"peer closed the connection{reason}")
        if not self.lost.done():
            self.lost.set_result(None)
        self._fail_waiters(self.ended)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiters, self.drain_waiters = self.drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- receiving ---------------------------------------------------------------------------

    def _progress(self) -> None:
        """Parse what arrived; hand a completed frame to the waiting recv (or keep it); pause when full."""
        waiter = self.waiter
        waiting = waiter is not None and not waiter.done()
        try:
            frame = self.parse(waiting)
        except Exception as exc:  # a malformed frame or a bad allocate result ends the connection
            self.fail(exc)
            return
        if frame is not None:
            frame = Frame(*frame)
            if waiting:
                waiter.set_result(frame)
            else:  # only a frame whose recv was cancelled mid-body completes without a waiter
                self.ready = frame
        if self.direct is None and self.wpos - self.rpos == len(self.scratch) and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def push(self) -> None:
        """Push mode: hand every complete frame to `on_frame` until one is held back; pause when full."""
        on_frame = self.on_frame
        while self.hold is None and self.on_frame is not None:  # (on_end clears on_frame)
            try:
                frame = self.parse(True)
            except Exception as exc:  # a malformed frame or a bad allocate result ends the connection
                self.fail(exc)
                return
            if frame is None:
                break
            try:
                held = on_frame(*frame)
            except Exception as exc:
                self.handler_failed(exc)
                return
            if held is not None:
                self.hold_back(held)
            elif self.rpos == self.wpos:  # at a frame boundary with nothing buffered: done for now
                break
        if self.hold is None:
            if self.ended is not None:
                self.end_push()
            elif self.reading_paused:
                self.resume()
        elif self.direct is None and self.wpos - self.rpos == len(self.scratch) and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def hold_back(self, held: Awaitable[object]) -> None:
        """The receiver returned an awaitable: deliver nothing more until it completes."""
        self.hold = hold = asyncio.ensure_future(held)
        hold.add_done_callback(self._released)

    def _released(self, hold: asyncio.Future) -> None:
        """The receiver let go of the frame it held back: go on with the next ones."""
        self.hold = None
        if not hold.cancelled() and hold.exception() is not None:
            self.handler_failed(hold.exception())
        elif isinstance(self.ended, (ClosedError, ChannelBroken)):
            self.end_push()
        elif self.on_frame is not None:
            self.push()

    def handler_failed(self, exc: BaseException) -> None:
        _log.error("frame handler failed; closing the connection", peer=self.peername(), exc_info=exc)
        self.fail(ChannelBroken(f"frame handler failed: {exc!r}"))

    def end_push(self) -> None:
        """Tell the receiver, once, why the connection ended (after the frames it held back, if the peer closed)."""
        if self.on_end is not None and (self.hold is None or not isinstance(self.ended, NodeUnreachable)):
            on_end, self.on_end, self.on_frame = self.on_end, None, None
            on_end(self.ended)

    def parse(self, may_allocate: bool) -> tuple[bytes, list[memoryview]] | None:
        """Advance the current frame with the bytes in scratch; returns (header, buffers) once complete.

        Stops before allocating unless `may_allocate` (a recv is waiting) and whenever more bytes
        are needed. Raises `ChannelBroken` for malformed frames, `ValueError` from `allocate`.
        """
        if self.stage == _PREFIX:
            avail = self.wpos - self.rpos
            if avail < PREFIX.size:
                return None
            rpos = self.rpos
            magic, version, _, header_len, count = PREFIX.unpack_from(self.scratch, rpos)
            if (
                count == 0
                and may_allocate
                and magic == MAGIC
                and version == VERSION
                and avail >= PREFIX.size + header_len
                and header_len <= self.header_max
            ):
                # fast path: a whole control-only frame (only for a waiting receiver: a frame completed
                # without one would be parked in `ready`, and a second such frame would overwrite it)
                self.rpos = rpos + PREFIX.size + header_len
                return bytes(self.scratch[rpos + PREFIX.size : self.rpos]), []
            self.header_len, self.count = decode_prefix(self.scratch[self.rpos : self.rpos + PREFIX.size], self.config)
            self.rpos += PREFIX.size
            self.stage = _SIZES
        if self.stage == _SIZES:
            need = 8 * self.count
            if self.wpos - self.rpos < need:
                return None
            self.sizes = decode_sizes(
                self.scratch[self.rpos : self.rpos + need], self.count, self.header_len, self.config
            )
            self.rpos += need
            if self.wpos - self.rpos >= self.header_len:  # the usual case: the whole header is here
                self.header = bytes(self.scratch[self.rpos : self.rpos + self.header_len])
                self.rpos += self.header_len
                self.stage = _ALLOC
            else:
                self.dests, self.idx, self.pos = [memoryview(bytearray(self.header_len))], 0, 0
                self.stage = _HEADER
        if self.stage == _HEADER:
            if not self._fill():
                return None
            self.header = bytes(self.dests[0])
            self.stage = _ALLOC
        if self.stage == _ALLOC:
            if not may_allocate:
                return None
            dests = allocate_buffers(self.allocate, self.header, self.sizes)
            self.dests, self.idx, self.pos = fresh_buffers(self.sizes) if dests is None else dests, 0, 0
            self.stage = _BODY
        if not self._fill():
            return None
        self.stage = _PREFIX
        frame = self.header, self.dests
        self.dests, self.header = [], b""
        return frame

    def _fill(self) -> bool:
        """Copy scratch bytes into `dests` from (idx, pos); True once all are full.

        When scratch runs dry with a large remainder left, the kernel is pointed at the destination.
        """
        while self.idx < len(self.dests):
            dest = self.dests[self.idx]
            take = min(self.wpos - self.rpos, len(dest) - self.pos)
            if take:
                dest[self.pos : self.pos + take] = self.scratch[self.rpos : self.rpos + take]
                self.pos += take
                self.rpos += take
            if self.pos < len(dest):
                if len(dest) - self.pos >= self.direct_min:
                    self.direct = dest
                return False
            self.idx += 1
            self.pos = 0
        return True

    def fail(self, exc: Exception) -> None:
        """End the connection because of `exc`; the waiting recv gets `exc`, later calls `ChannelBroken`."""
        if self.ended is None:
            self.ended = exc if isinstance(exc, ChannelBroken) else ChannelBroken(f"receive failed: {exc}")
            _log.warning("closing connection", reason=str(exc), peer=self.peername())
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self._fail_waiters(self.ended)
        if self.transport is not None:
            self.transport.abort()

    def resume(self) -> None:
        """Read again, unless the scratch buffer is still full (the kernel would get an empty buffer)."""
        if (
            self.reading_paused
            and self.ended is None
            and (self.direct is not None or self.wpos - self.rpos < len(self.scratch))
        ):
            self.reading_paused = False
            self.transport.resume_reading()

    def _fail_waiters(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        waiters, self.drain_waiters = self.drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(exc)
        if self.on_end is not None:
            self.end_push()

    def peername(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{self.scheme}://{peer[0]}:{peer[1]}" if peer else f"{self.scheme}://?"


class TcpConnection(Connection):
    """One end of a TCP connection carrying frames."""

    def __init__(self, protocol: _FrameProtocol) -> None:
        self._p = protocol
        self._receiving = False
        self._turns: deque[asyncio.Future] = deque()
        sock = protocol.transport.get_extra_info("sockname")
        self.local_address = f"{protocol.scheme}://{sock[0]}:{sock[1]}"
        self.peer_address = protocol.peername()

    def set_limits(self, config: TransportConfig) -> None:
        self._p.set_limits(config)

    async def send(self, header: Buffer, buffers: Sequence[Buffer] = ()) -> None:
        """Write one frame; returns once the kernel has taken all of it (buffers may then be reused).

        Raises `ClosedError` if this side closed, `NodeUnreachable` if the peer is gone,
        `ValueError` if the frame exceeds this side's limits or a buffer is not contiguous.
        """
        p = self._p
        head = header if isinstance(header, bytes) else bytes(header)
        if not buffers and len(head) <= p.join_max:  # fast path: a small control-only frame
            if len(head) > p.header_max:
                check_limits(p.config, len(head), (), ValueError)
            while p.ended is not None or p.write_paused:
                if p.ended is not None:
                    raise p.ended
                await self._drained()
            p.transport.write(PREFIX.pack(MAGIC, VERSION, 0, len(head), 0) + head)
            if p.write_paused:
                await self._drained()
            return
        views = [byte_view(b) for b in buffers]
        sizes = [v.nbytes for v in views]
        check_limits(p.config, len(head), sizes, ValueError)
        while p.ended is not None or p.write_paused:
            if p.ended is not None:
                raise p.ended
            await self._drained()
        prefix = encode_prefix(len(head), sizes)
        if len(head) + sum(sizes) <= p.join_max:
            p.transport.write(b"".join((prefix, head, *views)))
        else:
            pieces = [prefix + head] if len(head) <= p.join_max else [prefix, head]
            pieces += [v for v in views if v.nbytes]
            p.transport.writelines(pieces)
        if p.write_paused:
            await self._drained()

    def send_nowait(self, header: bytes) -> bool:
        """Write a small control-only frame at once if nothing holds writing back (see `Connection`).

        One `transport.write` of one bytes object: uvloop sends it with one syscall and, as bytes
        are immutable, keeps no copy if the kernel takes only part of it.
        """
        p = self._p
        size = len(header)
        if p.ended is not None or p.write_paused or size > p.nowait_max:
            return False
        p.write((_CONTROL_PREFIXES[size] if size < _SMALL_HEADER else PREFIX.pack(MAGIC, VERSION, 0, size, 0)) + header)
        return True

    async def _drained(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._p.drain_waiters.append(fut)
        await fut

    async def recv(self, allocate: Allocator | None = None) -> Frame:
        """Receive the next frame, its buffers straight into `allocate`'s memory (or fresh uint8 arrays).

        Raises `ClosedError` if this side closed, `NodeUnreachable` when the peer closed or dropped
        (frames it sent before closing are still delivered), `ChannelBroken` for a malformed or
        over-limit frame (the connection is then closed), `ValueError` if `allocate` returns
        unsuitable buffers (the connection is then closed too: its byte stream lost its place).
        """
        if self._p.on_end is not None or self._p.on_frame is not None:
            raise RuntimeError("recv called on a connection in push mode (deliver)")
        while self._receiving:  # one recv at a time; later callers take turns
            fut = asyncio.get_running_loop().create_future()
            self._turns.append(fut)
            await fut
        self._receiving = True
        p = self._p
        try:  # the body is inline (no inner coroutine): this is the hottest path of every ask
            if isinstance(p.ended, ClosedError):
                raise p.ended
            if p.ready is not None:
                frame, p.ready = p.ready, None
                return frame
            p.allocate = allocate
            try:  # (nothing buffered at a frame boundary, the usual case when waiting: no parse)
                parsable = p.rpos != p.wpos or p.stage != _PREFIX
                frame = (
                    p.parse(True) if parsable and (p.ended is None or isinstance(p.ended, NodeUnreachable)) else None
                )
            except Exception as exc:
                p.fail(exc)
                raise
            if frame is not None:
                p.allocate = None
                if p.reading_paused:
                    p.resume()
                return Frame(*frame)
            if p.ended is not None:
                raise p.ended
            p.waiter = waiter = p.loop.create_future()
            if p.reading_paused:
                p.resume()
            try:
                return await waiter
            finally:
                p.waiter = None
                p.allocate = None
        finally:
            self._receiving = False
            if self._turns:
                turn = self._turns.popleft()
                if not turn.done():
                    turn.set_result(None)

    def deliver(self, on_frame: FrameHandler, on_end: EndHandler, allocate: Allocator | None = None) -> None:
        """Push mode, from the protocol's receive callback: a frame reaches `on_frame` with no task wake-up.

        See `Connection.deliver`. Frames already read ahead (and one a cancelled `recv` left) go first.
        """
        p = self._p
        if p.on_end is not None or self._receiving:
            raise RuntimeError("deliver called twice, or while a recv is waiting")
        p.on_frame, p.on_end, p.allocate = on_frame, on_end, allocate
        if p.ready is not None:
            frame, p.ready = p.ready, None
            try:
                held = on_frame(frame.header, frame.buffers)
            except Exception as exc:
                p.handler_failed(exc)
                return
            if held is not None:
                p.hold_back(held)
                return
        if isinstance(p.ended, (ClosedError, ChannelBroken)):
            p.end_push()
        else:
            p.push()

    async def close(self) -> None:
        """Close the connection (idempotent); pending and later calls here raise `ClosedError`.

        Bytes already handed to the kernel are still delivered; the peer then sees `NodeUnreachable`.
        """
        p = self._p
        if isinstance(p.ended, ClosedError):
            return
        if p.ended is None:
            p.ended = ClosedError(f"{self.local_address}: connection closed locally")
        else:  # already ended by the peer or bad data: later calls still say it was closed here
            p.ended = ClosedError(f"{self.local_address}: connection closed locally (after: {p.ended})")
        p._fail_waiters(p.ended)
        if p.transport.get_write_buffer_size():
            p.transport.abort()  # the peer is not reading; do not wait for it
        else:
            p.transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(p.lost), _CLOSE_WAIT)
        except TimeoutError:
            p.transport.abort()

    @property
    def closed(self) -> bool:
        return self._p.ended is not None


class TcpListener(Listener):
    """A listening socket; each accepted connection runs `handler(conn)` as a task."""

    def __init__(self, handler: ConnectionHandler) -> None:
        self.address = ""
        self.server: asyncio.AbstractServer | None = None
        self._handlers = HandlerTasks(self, handler)

    def accepted(self, protocol: _FrameProtocol) -> None:
        self._handlers.start(TcpConnection(protocol))

    async def close(self) -> None:
        """Stop accepting; established connections stay open."""
        if self.server is not None:
            self.server.close()
            self.server = None


class TcpTransport(Transport):
    """Frames over TCP sockets on whatever asyncio event loop is running (uvloop or stdlib). A subclass that
    returns SSL contexts from `server_ssl` / `client_ssl` carries the same frames inside TLS (tls.py)."""

    scheme = "tcp"

    def server_ssl(self, config: TransportConfig) -> ssl.SSLContext | None:
        """The SSL context of a listener (None: plain TCP)."""
        return None

    def client_ssl(self, config: TransportConfig) -> ssl.SSLContext | None:
        """The SSL context of a connecting side (None: plain TCP)."""
        return None

    async def listen(self, address: Address, handler: ConnectionHandler, config: TransportConfig) -> Listener:
        """Bind and listen; with port 0 the listener's `address` carries the port the kernel chose."""
        options_for(config, "tcp", DEFAULT_OPTIONS)
        context = self.server_ssl(config)
        listener = TcpListener(handler)

        def factory() -> _FrameProtocol:
            protocol = _FrameProtocol(config, self.scheme)
            protocol.on_connected = listener.accepted
            return protocol

        loop = asyncio.get_running_loop()
        listener.server = await loop.create_server(factory, address.host, address.port, reuse_address=True, ssl=context)
        port = listener.server.sockets[0].getsockname()[1]
        listener.address = f"{self.scheme}://{address.host}:{port}"
        return listener

    async def connect(self, address: Address, config: TransportConfig) -> Connection:
        """Connect within `config.connect_timeout`; `NodeUnreachable` if refused, timed out, or (TLS) the
        peer's certificate or ours is refused."""
        loop = asyncio.get_running_loop()
        url = f"{self.scheme}://{address.host}:{address.port}"
        context = self.client_ssl(config)
        tls = {"ssl": context, "server_hostname": address.host} if context is not None else {}
        try:
            async with asyncio.timeout(config.connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: _FrameProtocol(config, self.scheme), address.host, address.port, **tls
                )
        except TimeoutError:
            raise NodeUnreachable(f"{url}: no connection within {config.connect_timeout} s") from None
        except OSError as exc:  # ssl.SSLError included: a refused certificate
            raise NodeUnreachable(f"{url}: {exc.strerror or exc}") from None
        return TcpConnection(protocol)


TRANSPORT = TcpTransport()
