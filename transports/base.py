"""The transport interface every implementation follows, and the registry keyed by URL scheme.

A *frame* is a control header (bytes, encoded by the actor layer) and a list of raw buffers
(tensor payloads) that travel beside it without serialisation. A transport only moves frames;
it knows nothing about messages, actors or models.
"""

from __future__ import annotations

import asyncio
import importlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

from aiollm.errors import AiollmError, ChannelBroken, require_positive
from aiollm.log import get_logger

_log = get_logger("transports")

# Anything exposing the buffer protocol: bytes, bytearray, memoryview, a contiguous numpy array.
Buffer = bytes | bytearray | memoryview

# Called by `recv` once the header and the buffer sizes are known, before the payload is read, for
# frames with at least one buffer: returns one writable buffer per size (e.g. slots of a KV pool) so
# the payload lands there directly, or None to let the transport choose (as without `allocate`).
Allocator = Callable[[bytes, list[int]], list[memoryview]]


# Push mode (`Connection.deliver`): called with each frame's header and buffers as soon as it is complete;
# returning an awaitable holds every later frame back until it completes (the receiver's backpressure).
FrameHandler = Callable[[bytes, list[memoryview]], Awaitable[object] | None]
# Push mode: called once, with the error that ended the connection (after every frame received before it).
EndHandler = Callable[[Exception], None]


class Frame(NamedTuple):
    """One received frame: the header, and each buffer as a writable memoryview the caller owns."""

    header: bytes
    buffers: list[memoryview]


@dataclass(frozen=True)
class TransportConfig:
    """Limits and timeouts shared by every transport."""

    # Largest control header accepted, in bytes.
    max_header_bytes: int = 16 * 1024 * 1024
    # Largest frame (header plus all buffers) accepted, in bytes.
    max_frame_bytes: int = 2 * 1024**3
    # Most out-of-band buffers in one frame.
    max_buffers: int = 4096
    # Seconds to wait for a connection to be established.
    connect_timeout: float = 10.0
    # Extra per-scheme options (e.g. UCX progress mode), validated by that transport.
    options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require_positive(self, "max_header_bytes", "max_frame_bytes", "max_buffers", "connect_timeout")


class Address(NamedTuple):
    """A parsed `scheme://host:port/path` address; `path` names an actor on the node, if any."""

    scheme: str
    host: str
    port: int
    path: str

    @property
    def node_url(self) -> str:
        """The node part of the address (no actor path)."""
        if self.scheme == "inproc":
            return f"inproc://{self.host}"
        return f"{self.scheme}://{self.host}:{self.port}"


def parse_address(url: str) -> Address:
    """Parse and validate an address; raises `ValueError` naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"address {url!r}: unknown scheme {parts.scheme!r}, expected one of {sorted(_SCHEMES)}")
    path = parts.path.lstrip("/")
    if parts.scheme == "inproc":
        if not parts.netloc:
            raise ValueError(f"address {url!r}: inproc addresses need a name, e.g. inproc://node0")
        return Address("inproc", parts.netloc, 0, path)
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"address {url!r}: bad port ({exc})") from None
    if not parts.hostname or port is None:
        raise ValueError(f"address {url!r}: expected {parts.scheme}://host:port")
    return Address(parts.scheme, parts.hostname, port, path)


class Connection(ABC):
    """A bidirectional, ordered, reliable channel of frames."""

    local_address: str
    peer_address: str

    @abstractmethod
    async def send(self, header: Buffer, buffers: Sequence[Buffer] = ()) -> None:
        """Send one frame; returns once the transport has taken the data (buffers may then be reused).

        Raises `ClosedError` if this side closed, `NodeUnreachable` if the peer is gone,
        `ValueError` if the frame exceeds the configured limits.
        """

    def send_nowait(self, header: bytes) -> bool:
        """Send a frame without buffers if the transport can take it right now: True; else False and
        nothing was sent (then `send` waits, or raises what went wrong). Saves a coroutine on hot paths.

        This default always says False.
        """
        return False

    @abstractmethod
    async def recv(self, allocate: Allocator | None = None) -> Frame:
        """Receive the next frame; buffers are received straight into `allocate`'s memory (or fresh memory).

        Raises `ClosedError` if this side closed, `NodeUnreachable` when the peer closed or dropped,
        `ChannelBroken` for a malformed or over-limit frame (the connection is then unusable).
        """

    def deliver(self, on_frame: FrameHandler, on_end: EndHandler, allocate: Allocator | None = None) -> None:
        """Switch to push mode: every later frame goes to `on_frame(header, buffers)`, in order, once complete.

        Buffers land in `allocate`'s memory (or fresh memory), as with `recv`, which must not be called
        afterwards. When `on_frame` returns an awaitable, no further frame is handed over until it
        completes: the connection is then read only into the transport's bounded read-ahead, so a
        receiver that cannot keep up stalls the sender. `on_end(error)` is called once when the
        connection ends, with the error `recv` would raise: `NodeUnreachable` (after every frame the
        peer sent), `ClosedError` (closed here) or `ChannelBroken` (bad data, an `allocate` that failed,
        or `on_frame` raising — a receiver bug, logged). Call it at most once, from the event loop.

        This default runs a task that loops over `recv`; a transport with a receive callback (tcp)
        overrides it to call `on_frame` from there, which saves a task wake-up per frame.
        """
        loop = asyncio.get_running_loop()
        self._delivery = loop.create_task(_deliver_loop(self, on_frame, on_end, allocate))

    def set_limits(self, config: TransportConfig) -> None:
        """Apply `config`'s frame limits from the next frame received on. A node accepts only small frames until
        the peer has authenticated, then raises them. Transports that never read an announced size into
        memory before checking it (inproc) have nothing to change."""
        return

    @abstractmethod
    async def close(self) -> None:
        """Close the connection; idempotent."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once either side closed the connection."""


async def _deliver_loop(
    conn: Connection, on_frame: FrameHandler, on_end: EndHandler, allocate: Allocator | None
) -> None:
    """The default push mode: receive, hand over, wait while the receiver holds the frame back."""
    try:
        while True:
            frame = await conn.recv(allocate)
            held = on_frame(frame.header, frame.buffers)
            if held is not None:
                await held
    except AiollmError as exc:
        on_end(exc)
    except ValueError as exc:  # allocate returned unsuitable buffers: the stream lost its place
        await conn.close()
        on_end(ChannelBroken(f"receive failed: {exc}"))
    except Exception as exc:  # on_frame (or what it returned) raised: a bug on the receiving side
        _log.exception("frame handler failed; closing the connection", peer=conn.peer_address)
        await conn.close()
        on_end(ChannelBroken(f"frame handler failed: {exc!r}"))


class Listener(ABC):
    """Accepts connections on one address."""

    # The bound address (with the real port when port 0 was asked for).
    address: str

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting; established connections stay open. Idempotent."""


ConnectionHandler = Callable[[Connection], Awaitable[None]]


class HandlerTasks:
    """A listener's `handler(conn)` run as one task per accepted connection, each task held until it ends.

    A handler that raises is logged and its connection closed; the listener goes on.
    """

    def __init__(self, listener: Listener, handler: ConnectionHandler) -> None:
        self._listener = listener
        self._handler = handler
        self._tasks: set[asyncio.Task] = set()

    def start(self, conn: Connection) -> None:
        task = asyncio.get_running_loop().create_task(self._run(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: Connection) -> None:
        try:
            await self._handler(conn)
        except Exception:
            _log.exception("connection handler failed", listener=self._listener.address, peer=conn.peer_address)
            await conn.close()


class Transport(ABC):
    """One implementation of the interface, registered under a URL scheme."""

    @abstractmethod
    async def listen(self, address: Address, handler: ConnectionHandler, config: TransportConfig) -> Listener:
        """Listen on `address`; run `handler(conn)` as a task for each accepted connection."""

    @abstractmethod
    async def connect(self, address: Address, config: TransportConfig) -> Connection:
        """Connect to a listener, raising `NodeUnreachable` if it cannot be reached."""


# scheme -> module that defines `TRANSPORT`, a `Transport` instance; imported on first use.
_SCHEMES = {
    "inproc": "aiollm.transports.inproc",
    "tcp": "aiollm.transports.tcp",
    "tls": "aiollm.transports.tls",
    "ucx": "aiollm.transports.ucx",
}


def get_transport(scheme: str) -> Transport:
    """The transport registered for `scheme`, importing its module on first use."""
    if scheme not in _SCHEMES:
        raise ValueError(f"unknown transport scheme {scheme!r}, expected one of {sorted(_SCHEMES)}")
    module = importlib.import_module(_SCHEMES[scheme])
    return module.TRANSPORT


async def listen(url: str, handler: ConnectionHandler, config: TransportConfig | None = None) -> Listener:
    """Listen on `url` with the transport its scheme names."""
    address = parse_address(url)
    return await get_transport(address.scheme).listen(address, handler, config or TransportConfig())


async def connect(url: str, config: TransportConfig | None = None) -> Connection:
    """Connect to `url` with the transport its scheme names."""
    address = parse_address(url)
    return await get_transport(address.scheme).connect(address, config or TransportConfig())
