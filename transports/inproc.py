"""In-process transport (`inproc://name`): frames passed between tasks of one event loop, no copy.

Why it exists: most actor tests (and colocated workers) need the full connection semantics —
ordering, backpressure, close and peer-gone errors — without sockets or serialisation cost.

Zero copy: a buffer reaches the receiver as a memoryview of the *sender's own object*. So, unlike
the socket transports, the sender must not mutate a buffer after `send` returns (the receiver
sees the same memory; it is read-only when the sender passed `bytes`). With an `allocate`
callback the receiver asked for its own memory, so the payload is copied into it once.

Each direction is a bounded queue sized by the receiver's config: at most `inproc.queue_frames`
frames and `inproc.queue_bytes` bytes wait in it (a frame larger than the byte bound is still
admitted into an empty queue), so a receiver that does not read makes the sender wait.
All endpoints of one name must live on one event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from aiollm.errors import ChannelBroken, ClosedError, NodeUnreachable
from aiollm.transports.base import (
    Address,
    Allocator,
    Buffer,
    Connection,
    ConnectionHandler,
    Frame,
    HandlerTasks,
    Listener,
    Transport,
    TransportConfig,
)
from aiollm.transports.framing import allocate_buffers, byte_view, check_limits, options_for

# Options this transport reads from TransportConfig.options, with their defaults.
DEFAULT_OPTIONS: dict[str, int | str] = {"inproc.queue_frames": 64, "inproc.queue_bytes": 64 * 1024 * 1024}


class _Pipe:
    """One direction of a connection: a bounded FIFO of frames and both ends' close flags."""

    def __init__(self, receiver_config: TransportConfig) -> None:
        opts = options_for(receiver_config, "inproc", DEFAULT_OPTIONS)
        self.max_frames = int(opts["inproc.queue_frames"])
        self.max_bytes = int(opts["inproc.queue_bytes"])
        self.frames: deque[tuple[bytes, list[memoryview], int]] = deque()
        self.queued_bytes = 0
        self.writer_closed = False
        self.reader_closed = False
        self._waiters: list[asyncio.Future] = []

    def has_room(self, size: int) -> bool:
        if not self.frames:
            return True
        return len(self.frames) < self.max_frames and self.queued_bytes + size <= self.max_bytes

    def wake(self) -> None:
        """Wake every task waiting on this pipe so it re-checks its condition."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)


class InprocConnection(Connection):
    """One end of an in-process connection: sends into `tx`, receives from `rx`."""

    def __init__(self, tx: _Pipe, rx: _Pipe, config: TransportConfig, local_address: str, peer_address: str) -> None:
        self._tx = tx
        self._rx = rx
        self._config = config
        self.local_address = local_address
        self.peer_address = peer_address

    async def send(self, header: Buffer, buffers: Sequence[Buffer] = ()) -> None:
        """Queue one frame for the peer, waiting while the peer's queue is full.

        The buffers are not copied: do not mutate them afterwards.
        Raises `ClosedError` if this side closed, `NodeUnreachable` if the peer closed,
        `ValueError` if the frame exceeds this side's limits or a buffer is not contiguous.
        """
        views = [byte_view(b) for b in buffers]
        head = bytes(header)
        sizes = [v.nbytes for v in views]
        check_limits(self._config, len(head), sizes, ValueError)
        size = len(head) + sum(sizes)
        pipe = self._tx
        while True:
            if pipe.writer_closed:
                raise ClosedError(f"{self.local_address}: connection closed locally")
            if pipe.reader_closed:
                raise NodeUnreachable(f"{self.peer_address}: peer closed the connection")
            if pipe.has_room(size):
                break
            await pipe.wait()
        pipe.frames.append((head, views, size))
        pipe.queued_bytes += size
        pipe.wake()

    def send_nowait(self, header: bytes) -> bool:
        """Queue a control-only frame if the peer's queue has room (see `Connection`)."""
        pipe = self._tx
        size = len(header)
        if (
            pipe.writer_closed
            or pipe.reader_closed
            or size > self._config.max_header_bytes
            or size > self._config.max_frame_bytes
            or not pipe.has_room(size)
        ):
            return False
        pipe.frames.append((bytes(header), [], size))
        pipe.queued_bytes += size
        pipe.wake()
        return True

    async def recv(self, allocate: Allocator | None = None) -> Frame:
        """Take the next frame, waiting for one; frames queued before the peer closed are still delivered.

        Raises `ClosedError` if this side closed, `NodeUnreachable` when the peer closed and nothing
        is left, `ChannelBroken` for a frame over this side's limits (the connection is then closed),
        `ValueError` if `allocate` returns unsuitable buffers.
        """
        pipe = self._rx
        while not pipe.frames:
            if pipe.reader_closed:
                raise ClosedError(f"{self.local_address}: connection closed locally")
            if pipe.writer_closed:
                raise NodeUnreachable(f"{self.peer_address}: peer closed the connection")
            await pipe.wait()
        head, views, size = pipe.frames.popleft()
        pipe.queued_bytes -= size
        pipe.wake()
        sizes = [v.nbytes for v in views]
        try:
            check_limits(self._config, len(head), sizes, ChannelBroken)
        except ChannelBroken:
            await self.close()
            raise
        dests = allocate_buffers(allocate, head, sizes)
        if dests is None:  # nobody chose: the sender's memory, no copy
            return Frame(head, views)
        for dest, src in zip(dests, views):
            dest[:] = src
        return Frame(head, dests)

    async def close(self) -> None:
        """Close both directions; frames not yet received are dropped and the peer sees `NodeUnreachable`."""
        self._tx.writer_closed = True
        self._tx.wake()
        self._rx.reader_closed = True
        self._rx.frames.clear()
        self._rx.queued_bytes = 0
        self._rx.wake()

    @property
    def closed(self) -> bool:
        return self._tx.writer_closed or self._tx.reader_closed


class InprocListener(Listener):
    """A name in this process's inproc registry; `connect` to it starts the handler with the far end."""

    def __init__(self, name: str, handler: ConnectionHandler, config: TransportConfig) -> None:
        self.name = name
        self.address = f"inproc://{name}"
        self.config = config
        self._handlers = HandlerTasks(self, handler)
        self._count = 0

    def accept(self, client_config: TransportConfig) -> InprocConnection:
        """Make a connected pair; the handler runs as a task on the server end, the client end is returned."""
        self._count += 1
        client_name = f"{self.address}#client{self._count}"
        to_server, to_client = _Pipe(self.config), _Pipe(client_config)
        server = InprocConnection(to_client, to_server, self.config, self.address, client_name)
        client = InprocConnection(to_server, to_client, client_config, client_name, self.address)
        self._handlers.start(server)
        return client

    async def close(self) -> None:
        """Remove the name from the registry; established connections and their handlers go on."""
        if _LISTENERS.get(self.name) is self:
            del _LISTENERS[self.name]


# name -> listener, for this process.
_LISTENERS: dict[str, InprocListener] = {}


class InprocTransport(Transport):
    """Registry-backed transport for endpoints in one process."""

    async def listen(self, address: Address, handler: ConnectionHandler, config: TransportConfig) -> Listener:
        """Register `address.host` as a name; `ValueError` if a listener already holds it."""
        options_for(config, "inproc", DEFAULT_OPTIONS)
        if address.host in _LISTENERS:
            raise ValueError(f"inproc://{address.host} already has a listener in this process")
        listener = InprocListener(address.host, handler, config)
        _LISTENERS[address.host] = listener
        return listener

    async def connect(self, address: Address, config: TransportConfig) -> Connection:
        """Connect to a registered name; `NodeUnreachable` if nothing listens on it."""
        listener = _LISTENERS.get(address.host)
        if listener is None:
            raise NodeUnreachable(f"inproc://{address.host}: no listener with that name in this process")
        return listener.accept(config)


TRANSPORT = InprocTransport()
