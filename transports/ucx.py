"""UCX transport (`ucx://host:port`): the same frames as `tcp`, moved by UCX (shared memory, tcp, RDMA).

Binding: `ucxx` (RAPIDS, PyPI `ucxx-cu12`, the maintained successor of ucx-py). Only its low-level layer is used (context,
worker, endpoints, tagged messages), so another binding could replace it inside this module.

Design, and why:
- Bootstrap over our own TCP transport: `ucx://host:port` is a TCP listener bound exactly to host
  (ucxx's sockaddr listener can only bind the wildcard address). Peers exchange UCX worker addresses
  and a random per-connection tag over it, then keep it open as a liveness signal: a killed peer is
  seen as a TCP reset at once, instead of after UCX keep-alive timeouts.
- A frame is one control message (the tcp prefix, size table and header) on the connection's control
  tag, then one message per non-empty buffer on its data tag. The receiver learns the sizes from the
  control message, asks `allocate` for memory and posts receives straight into it (rendezvous for
  large buffers: UCX copies once, from the sender's memory into the destination).
- Credits: a sender may have `ucx.window_frames` frames not yet received; the receiver grants more as
  it consumes. UCX would otherwise buffer unexpected small messages without bound.
- Progress: one UCX worker per event loop, progressed from the loop. `ucx.progress=event` (default)
  progresses when the worker's event fd fires or an operation is posted, then re-arms the worker,
  so an idle process sleeps in epoll and never spins — on a machine with more processes than cores
  a spinning peer turns each round trip into a scheduler slice (8 ms with both processes on one
  core). `ucx.spin_us` (50) keeps polling briefly after activity, yielding the core between
  polls, so a prompt reply skips a sleep/wake-up pair without starving a peer on the same core.
  `ucx.progress=polling` progresses on every loop iteration while connections are open: lowest
  latency on dedicated cores, a full core per process otherwise. ucxx's own progress modes are not
  used: without its notifier thread every pending request re-polls with `sleep(0)`, i.e. spins.
- Worker settings (`ucx.tls`, `ucx.progress`) come from the first UCX listener or connection of
  an event loop. `UCX_TLS` in the environment wins over the `ucx.tls` default.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
from collections import deque
from collections.abc import Sequence

from aiollm.errors import AiollmError, ChannelBroken, ClosedError, NodeUnreachable
from aiollm.log import get_logger
from aiollm.transports import tcp
from aiollm.transports.base import (
    Address,
    Allocator,
    Buffer,
    Connection,
    ConnectionHandler,
    Frame,
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
from aiollm.transports.ucx_worker import DEFAULT_OPTIONS, Array, Engine, engine_for, ucx_api

_log = get_logger("transports.ucx")

# Control message kinds, in the prefix's reserved field.
_FRAME, _CREDIT, _BYE, _INLINE = 0, 1, 2, 3
# Seconds to wait, after the bootstrap connection dropped, for a BYE still in flight over UCX.
_GONE_GRACE = 0.25
_HELLO = b"aiollm-ucx/1"
_UINT64 = struct.Struct("<Q")


def _control(kind: int, value: int = 0) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, kind, value, 0)


class UcxConnection(Connection):
    """One end of a UCX connection: an endpoint, two tags each way, and the TCP bootstrap as liveness."""

    def __init__(
        self,
        engine: Engine,
        endpoint,
        bootstrap: Connection,
        config: TransportConfig,
        recv_id: int,
        send_id: int,
        local_address: str,
        peer_address: str,
    ) -> None:
        self._engine = engine
        self._ep = endpoint
        self._bootstrap = bootstrap
        self._config = config
        opts = options_for(config, "ucx", DEFAULT_OPTIONS)
        self._window = int(opts["ucx.window_frames"])
        self._inline_max = int(opts["ucx.inline_bytes"])
        self._credits = self._window
        self._consumed = 0
        self._ctrl_tag = ucx_api.UCXXTag(recv_id << 1)
        self._data_tag = ucx_api.UCXXTag(recv_id << 1 | 1)
        self._peer_ctrl = ucx_api.UCXXTag(send_id << 1)
        self._peer_data = ucx_api.UCXXTag(send_id << 1 | 1)
        self.local_address = local_address
        self.peer_address = peer_address
        self._controls: deque = deque()  # (buffer, request) of control messages being received, in order
        self._frames: deque = deque()  # (header, sizes, inline payload or None) announced, not yet received
        self._partial: tuple | None = None  # a frame whose recv was cancelled while its data arrived
        self._ended: AiollmError | None = None  # closed here, or broken
        self._peer_gone: NodeUnreachable | None = None
        self._waiters: list[asyncio.Future] = []
        self._recv_lock = asyncio.Lock()
        engine.connections.add(self)
        engine.acquire()
        endpoint.set_close_callback(self._endpoint_failed)
        self._monitor = engine.loop.create_task(self._watch_bootstrap())

    # -- sending -------------------------------------------------------------------------------

    def set_limits(self, config: TransportConfig) -> None:
        self._config = config

    async def send(self, header: Buffer, buffers: Sequence[Buffer] = ()) -> None:
        """Send one frame; returns once UCX completed every message (buffers may then be reused).

        Raises `ClosedError` if this side closed, `NodeUnreachable` if the peer is gone,
        `ValueError` if the frame exceeds this side's limits or a buffer is not contiguous.
        """
        views = [byte_view(b) for b in buffers]
        head = bytes(header)
        sizes = [v.nbytes for v in views]
        check_limits(self._config, len(head), sizes, ValueError)
        while True:
            self._raise_if_unusable()
            if self._credits > 0:
                break
            await self._wait()
        self._credits -= 1
        if sum(sizes) <= self._inline_max:  # one message: fewer wake-ups beat one small copy
            message = b"".join((encode_prefix(len(head), sizes, _INLINE), head, *views))
            await self._complete([self._post_send(message, self._peer_ctrl)])
            return
        futures = [self._post_send(encode_prefix(len(head), sizes) + head, self._peer_ctrl)]
        futures += [self._post_send(v, self._peer_data) for v in views if v.nbytes]
        await self._complete(futures)

    def _post_send(self, data, tag) -> asyncio.Future:
        if self._ep is None:
            self._raise_if_unusable()
        array = Array(data)
        return self._engine.submit(self._ep.tag_send(array, tag), (array, data))

    async def _complete(self, futures: list[asyncio.Future]) -> None:
        try:
            await (futures[0] if len(futures) == 1 else asyncio.gather(*futures))
        except AiollmError:
            raise
        except Exception as exc:  # a UCX error: the endpoint failed or was closed
            self._raise_if_unusable()
            raise NodeUnreachable(f"{self.peer_address}: {exc}") from None

    # -- receiving -----------------------------------------------------------------------------

    def poll_control(self) -> bool:
        """Take every control message that arrived (called by the engine after each progress); True if any."""
        worker = self._engine.worker
        arrived = False
        while True:
            probe = worker.tag_probe(self._ctrl_tag, remove=True)
            if not probe.matched:
                break
            buf = bytearray(probe.length)
            request = worker.tag_recv_with_handle(Array(buf), probe)
            self._controls.append((buf, request))
        while self._controls and self._controls[0][1].completed:
            buf, request = self._controls.popleft()
            arrived = True
            try:
                request.check_error()
                self._on_control(buf)
            except Exception as exc:
                self._break(exc if isinstance(exc, ChannelBroken) else ChannelBroken(f"control message: {exc}"))
                break
        return arrived

    def _on_control(self, buf: bytearray) -> None:
        if len(buf) < PREFIX.size:
            raise ChannelBroken(f"control message of {len(buf)} bytes is shorter than the frame prefix")
        magic, version, kind, value, _count = PREFIX.unpack_from(buf)
        if magic != MAGIC or version != VERSION:
            decode_prefix(buf[: PREFIX.size], self._config)  # raises ChannelBroken naming the problem
        if kind == _CREDIT:
            self._credits += value
        elif kind == _BYE:
            self._peer_gone = NodeUnreachable(f"{self.peer_address}: peer closed the connection")
        elif kind in (_FRAME, _INLINE):
            header_len, count = decode_prefix(buf[: PREFIX.size], self._config)
            end = PREFIX.size + 8 * count
            sizes = decode_sizes(buf[PREFIX.size : end], count, header_len, self._config)
            expected = end + header_len + (sum(sizes) if kind == _INLINE else 0)
            if len(buf) != expected:
                raise ChannelBroken(f"control message of {len(buf)} bytes, its prefix announces {expected}")
            payload = memoryview(buf)[end + header_len :] if kind == _INLINE else None
            self._frames.append((bytes(buf[end : end + header_len]), sizes, payload))
        else:
            raise ChannelBroken(f"unknown control message kind {kind}")
        self._wake()

    async def recv(self, allocate: Allocator | None = None) -> Frame:
        """Receive the next frame, its buffers straight into `allocate`'s memory (or fresh uint8 arrays).

        Raises `ClosedError` if this side closed, `NodeUnreachable` when the peer closed or died
        (frames it announced before are still delivered), `ChannelBroken` for a malformed or
        over-limit frame (the connection is then closed), `ValueError` if `allocate` returns
        unsuitable buffers (the connection is then closed too).
        """
        async with self._recv_lock:
            if self._partial is None:
                while not self._frames:
                    if self._ended is not None:
                        raise self._ended
                    if self._peer_gone is not None:
                        raise self._peer_gone
                    await self._wait()
                if isinstance(self._ended, ClosedError):
                    raise self._ended
                header, sizes, payload = self._frames.popleft()
                if payload is not None:
                    return self._consume(header, self._unpack_inline(allocate, header, sizes, payload))
                dests = self._allocate(allocate, header, sizes)
                if dests is None:
                    dests = fresh_buffers(sizes)
                futures = [self._post_recv(d) for d in dests if d.nbytes]
                self._partial = (header, dests, asyncio.gather(*futures))
            header, dests, done = self._partial
            try:
                await self._complete([asyncio.shield(done)])
            except AiollmError:
                self._partial = None
                raise
            self._partial = None
            return self._consume(header, dests)

    def _allocate(self, allocate: Allocator | None, header: bytes, sizes: list[int]) -> list[memoryview] | None:
        """`allocate`'s destination buffers (None: the transport chooses); a bad answer breaks the channel."""
        try:
            return allocate_buffers(allocate, header, sizes)
        except ValueError as exc:
            self._break(ChannelBroken(f"receive failed: {exc}"))
            raise

    def _unpack_inline(
        self, allocate: Allocator | None, header: bytes, sizes: list[int], payload: memoryview
    ) -> list[memoryview]:
        """An inline frame's buffers: views of the received message, or copies into `allocate`'s memory."""
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        views = [payload[a:b] for a, b in zip(offsets, offsets[1:])]
        dests = self._allocate(allocate, header, sizes)
        if dests is None:
            return views
        for dest, view in zip(dests, views):
            dest[:] = view
        return dests

    def _consume(self, header: bytes, dests: list[memoryview]) -> Frame:
        """Count a delivered frame, granting the peer more credits every half window."""
        self._consumed += 1
        if self._consumed % (self._window // 2) == 0 and self._ended is None and self._peer_gone is None:
            self._post_send(_control(_CREDIT, self._window // 2), self._peer_ctrl)
        return Frame(header, dests)

    def _post_recv(self, dest: memoryview) -> asyncio.Future:
        if self._ep is None:
            self._raise_if_unusable()
        array = Array(dest)
        return self._engine.submit(self._ep.tag_recv(array, self._data_tag, ucx_api.UCXXTagMaskFull), (array, dest))

    # -- lifetime ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the connection (idempotent): tell the peer (BYE), then drop the endpoint and the bootstrap."""
        if isinstance(self._ended, ClosedError):
            return
        was_usable = self._ended is None and self._peer_gone is None
        self._ended = ClosedError(f"{self.local_address}: connection closed locally")
        self._wake()
        if was_usable:
            try:
                bye = self._post_send(_control(_BYE), self._peer_ctrl)
                await asyncio.wait_for(bye, 1.0)
            except Exception:  # the peer is already unreachable; nothing to tell it
                pass
        self._teardown()
        await self._bootstrap.close()

    def _teardown(self) -> None:
        """Release UCX resources; posted operations are cancelled and their waiters fail."""
        if self._ep is not None:
            self._engine.connections.discard(self)
            self._ep.remove_close_callback()
            self._ep.close_blocking(period=0, max_attempts=1)
            self._ep = None
            self._engine.kick()
            self._engine.release()
        if self._monitor is not asyncio.current_task():
            self._monitor.cancel()

    def _break(self, exc: ChannelBroken) -> None:
        if self._ended is None:
            self._ended = exc
            _log.warning("closing connection", reason=str(exc), peer=self.peer_address)
        self._wake()
        self._teardown()
        self._engine.loop.create_task(self._bootstrap.close())

    def _endpoint_failed(self, *args) -> None:
        self._engine.loop.call_soon(self._declare_gone, "UCX endpoint failed")

    async def _watch_bootstrap(self) -> None:
        try:
            await self._bootstrap.recv()
        except AiollmError:
            pass
        if self._peer_gone is None and self._ended is None:
            await asyncio.sleep(_GONE_GRACE)  # a BYE may still be on its way over UCX
        self._declare_gone("peer dropped the connection")

    def _declare_gone(self, reason: str) -> None:
        if self._peer_gone is None:
            self._peer_gone = NodeUnreachable(f"{self.peer_address}: {reason}")
        if not self._frames:
            self._teardown()  # cancels posted operations: their waiters get NodeUnreachable
        else:  # announced frames may still be received from UCX's buffers; then give up on them
            self._engine.loop.call_later(4 * _GONE_GRACE, self._teardown)
        self._wake()

    def _raise_if_unusable(self) -> None:
        if self._ended is not None:
            raise self._ended
        if self._peer_gone is not None:
            raise self._peer_gone

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait(self) -> None:
        fut = self._engine.loop.create_future()
        self._waiters.append(fut)
        await fut

    @property
    def closed(self) -> bool:
        return self._ended is not None or self._peer_gone is not None


async def _handshake(bootstrap: Connection, engine: Engine, timeout: float) -> tuple[object, int, int]:
    """Exchange worker addresses and receive ids over the bootstrap; returns (endpoint, recv id, send id)."""
    recv_id = secrets.randbits(62)
    engine.acquire()  # held across the awaits, so the worker is not released under the handshake
    try:
        await bootstrap.send(_HELLO, [engine.address, _UINT64.pack(recv_id)])
        frame = await asyncio.wait_for(bootstrap.recv(), timeout)
        if frame.header != _HELLO or len(frame.buffers) != 2 or frame.buffers[1].nbytes != 8:
            raise ChannelBroken("ucx handshake: the peer is not an aiollm ucx endpoint")
        address = ucx_api.UCXAddress.create_from_buffer(bytes(frame.buffers[0]))
        endpoint = ucx_api.UCXEndpoint.create_from_worker_address(engine.worker, address, True)
        engine.kick()
        return endpoint, recv_id, _UINT64.unpack(frame.buffers[1])[0]
    finally:
        engine.release()


def _bootstrap_config(config: TransportConfig) -> TransportConfig:
    """The bootstrap carries only the handshake: default limits (the frame limits apply to UCX frames)."""
    return TransportConfig(connect_timeout=config.connect_timeout)


class UcxListener(Listener):
    """The TCP bootstrap listener; each accepted connection is upgraded to UCX, then handed to the handler."""

    def __init__(self, bootstrap: Listener, engine: Engine) -> None:
        self._bootstrap = bootstrap
        self._engine = engine
        engine.acquire()
        self.address = bootstrap.address.replace("tcp://", "ucx://", 1)

    async def close(self) -> None:
        """Stop accepting; established connections stay open."""
        if self._engine is not None:
            await self._bootstrap.close()
            self._engine.release()
            self._engine = None


class UcxTransport(Transport):
    """Frames over UCX, bootstrapped over TCP on the same host:port."""

    async def listen(self, address: Address, handler: ConnectionHandler, config: TransportConfig) -> Listener:
        engine = engine_for(config)

        async def upgrade(bootstrap: Connection) -> None:
            try:
                endpoint, recv_id, send_id = await _handshake(bootstrap, engine, config.connect_timeout)
            except (AiollmError, TimeoutError) as exc:
                _log.warning("ucx handshake failed", peer=bootstrap.peer_address, reason=str(exc) or type(exc).__name__)
                await bootstrap.close()
                return
            local = bootstrap.local_address.replace("tcp://", "ucx://", 1)
            peer = bootstrap.peer_address.replace("tcp://", "ucx://", 1)
            await handler(UcxConnection(engine, endpoint, bootstrap, config, recv_id, send_id, local, peer))

        bootstrap = await tcp.TRANSPORT.listen(address._replace(scheme="tcp"), upgrade, _bootstrap_config(config))
        return UcxListener(bootstrap, engine)

    async def connect(self, address: Address, config: TransportConfig) -> Connection:
        """Connect within `config.connect_timeout`; `NodeUnreachable` if the peer cannot be reached."""
        engine = engine_for(config)
        bootstrap = await tcp.TRANSPORT.connect(address._replace(scheme="tcp"), _bootstrap_config(config))
        try:
            endpoint, recv_id, send_id = await _handshake(bootstrap, engine, config.connect_timeout)
        except TimeoutError:
            await bootstrap.close()
            raise NodeUnreachable(f"{address.node_url}: no ucx handshake within {config.connect_timeout} s") from None
        except BaseException:
            await bootstrap.close()
            raise
        local = bootstrap.local_address.replace("tcp://", "ucx://", 1)
        return UcxConnection(engine, endpoint, bootstrap, config, recv_id, send_id, local, address.node_url)


TRANSPORT = UcxTransport()
