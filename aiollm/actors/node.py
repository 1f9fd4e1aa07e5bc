"""`Node`: hosts actors, listens on addresses, authenticates peers, routes refs; and its `NodeConfig`.

Every node also listens on a private `inproc://` address, so actors on a node that opens no
socket still have a URL, and two nodes in one process can talk through the full codec. A ref
whose node part is one of this node's addresses is local: the message object is put in the
mailbox as-is. Otherwise the node opens one connection to that node on first use (connect, then
the HMAC handshake) and reuses it; an accepted connection is also reused for the other direction.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from aiollm.actors.actor import Actor
from aiollm.actors.auth import PeerInfo, handshake
from aiollm.actors.cell import ActorCell
from aiollm.actors.codec import Codec
from aiollm.actors.messages import PROTOCOL_VERSION, Message, Unwatch, Watch
from aiollm.actors.peer import Peer
from aiollm.actors.ref import ActorRef
from aiollm.actors.system import SYSTEM_ACTOR, NodeActor
from aiollm.actors.watch import Watches
from aiollm.errors import (
    ActorDied,
    AuthenticationFailed,
    ChannelBroken,
    ClosedError,
    NodeUnreachable,
    require_positive,
)
from aiollm.log import get_logger
from aiollm.transports.base import Buffer, Connection, Listener, TransportConfig, parse_address
from aiollm.transports.base import connect as transport_connect
from aiollm.transports.base import listen as transport_listen

_log = get_logger("actors.node")


_node_ids = itertools.count()
# Before a peer authenticates it may send frames of at most this size (a Hello or a Proof is ~100 bytes), and at
# most this many connections may be authenticating at once: a stranger costs a node little memory, and no more.
PREAUTH_FRAME_BYTES = 4096
MAX_PENDING_HANDSHAKES = 64


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs; validated here so a bad value fails at start-up, naming the field."""

    # Cluster secret shared by every node (at least 16 bytes); proves membership in the handshake.
    secret: bytes
    # Seconds between heartbeats sent on every connection.
    heartbeat_interval: float = 1.0
    # Seconds of silence after which a peer counts as dead (its watchers get Terminated).
    heartbeat_timeout: float = 5.0
    # Messages an actor's mailbox holds before senders wait.
    mailbox_size: int = 256
    # Largest frame (header plus tensors) this node accepts or sends, in bytes.
    max_frame_bytes: int = 2 * 1024**3
    # Seconds a new connection has to complete the handshake.
    handshake_timeout: float = 5.0
    # Seconds `stop` lets each actor drain its mailbox before cancelling it.
    drain_timeout: float = 5.0
    # Default stream window: items queued or in flight per stream.
    stream_window: int = 8
    # Name of the node's inproc address (default: unique per process).
    name: str = ""
    # Transport options by scheme (e.g. {"tls.cert": PATH, "tls.key": PATH, "tls.ca": PATH} for tls://).
    transport_options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise ValueError("NodeConfig.secret must be at least 16 bytes")
        require_positive(self, "heartbeat_interval", "heartbeat_timeout", "handshake_timeout", "drain_timeout")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"NodeConfig.heartbeat_timeout ({self.heartbeat_timeout}) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        require_positive(self, "mailbox_size", "max_frame_bytes", "stream_window")
        if "/" in self.name or ":" in self.name:
            raise ValueError(f"NodeConfig.name must not contain '/' or ':', got {self.name!r}")

    def transport_config(self) -> TransportConfig:
        return TransportConfig(
            max_frame_bytes=self.max_frame_bytes,
            max_header_bytes=min(self.max_frame_bytes, 16 * 1024 * 1024),
            options=dict(self.transport_options),
        )


class Node:
    """Hosts actors and connects them to other nodes. Use `async with Node(config) as node:` or start/stop."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.codec = Codec(self.ref)
        # name -> the running actor's cell (its mailbox and loop; `.actor` is the instance)
        self.actors: dict[str, ActorCell] = {}
        self.watches = Watches()
        # Bound addresses, the first being the one this node advertises.
        self.addresses: list[str] = []
        self._local_urls: set[str] = set()
        self._listeners: list[Listener] = []
        # node url -> the connection used to send to that node
        self._peers: dict[str, Peer] = {}
        self._all_peers: set[Peer] = set()
        self._connecting: dict[str, asyncio.Future] = {}
        self._transport = config.transport_config()
        # what a connection may send before it authenticated: a handshake frame, nothing near the real limits
        self._preauth = replace(
            self._transport,
            max_header_bytes=min(PREAUTH_FRAME_BYTES, self._transport.max_header_bytes),
            max_frame_bytes=min(PREAUTH_FRAME_BYTES, self._transport.max_frame_bytes),
        )
        self._authenticating = 0
        self._stopping = False
        self._stopped: asyncio.Event | None = None

    @property
    def url(self) -> str:
        """The address this node advertises (its first listen address)."""
        if not self.addresses:
            raise ClosedError("node not started")
        return self.addresses[0]

    async def start(self, listen: Sequence[str] = (), advertise: str = "") -> None:
        """Bind `listen` (e.g. tcp://127.0.0.1:0 for any free port) plus a private inproc address.

        `advertise` is the address other nodes reach this one at when it differs from the bound one (a node
        behind NAT, or bound to 0.0.0.0): it becomes `url`, and refs to it count as local. Port 0
        (`tcp://host-a:0`) takes the first listener's bound port.
        """
        self._stopped = asyncio.Event()
        name = self.config.name or f"node-{os.getpid()}-{next(_node_ids)}"
        for url in [*listen, f"inproc://{name}"]:
            listener = await transport_listen(url, self._accept, self._transport)
            self._listeners.append(listener)
            self.addresses.append(listener.address)
            self._local_urls.add(listener.address)
        if advertise:
            address = parse_address(advertise)
            if not address.port and listen:
                advertise = f"{address.scheme}://{address.host}:{parse_address(self.addresses[0]).port}"
            self.addresses.insert(0, advertise)
            self._local_urls.add(advertise)
        await self.spawn(NodeActor, SYSTEM_ACTOR)
        _log.info("node started", addresses=self.addresses)

    async def __aenter__(self) -> Node:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- actors ----------------------------------------------------------------------------

    async def spawn(self, actor: type[Actor] | Actor, name: str | None = None, /, **kwargs: object) -> ActorRef:
        """Create (from a class and kwargs) or adopt an actor, run its `on_start`, return its ref."""
        if self._stopping:
            raise ClosedError("node is stopping")
        if isinstance(actor, type):
            if not issubclass(actor, Actor):
                raise TypeError(f"spawn needs an Actor subclass, got {actor!r}")
            actor = actor(**kwargs)
        elif not isinstance(actor, Actor) or kwargs:
            raise TypeError("spawn takes an Actor subclass with kwargs, or an Actor instance without")
        name = name or f"{type(actor).__name__.lower()}-{next(_node_ids)}"
        if "/" in name or not name:
            raise ValueError(f"actor name {name!r}: must be non-empty without '/'")
        if name in self.actors:
            raise ValueError(f"actor name {name!r} is already taken on {self.url}")
        ref = ActorRef(f"{self.url}/{name}", self)
        cell = ActorCell(actor, self, name, ref, self.config.mailbox_size)
        await cell.start()
        self.actors[name] = cell
        return ref

    def ref(self, url: str) -> ActorRef:
        """A ref from a full URL, or from a bare name for an actor on this node."""
        return ActorRef(url if "://" in url else f"{self.url}/{url}", self)

    async def stop_actor(self, name: str, timeout: float | None = None, reason: str = "stopped") -> None:
        """Drain and stop one actor, then tell its watchers."""
        actor = self.actors.get(name)
        if actor is None:
            return
        if actor.mailbox.closed:
            await actor.stopped
            return
        await actor.shutdown(self.config.drain_timeout if timeout is None else timeout)
        self.actors.pop(name, None)
        for node_url, url in await self.watches.local_stopped(actor, reason):
            peer = self._peers.get(node_url)
            if peer is not None:
                await peer.send_quiet(Unwatch(PROTOCOL_VERSION, url.rsplit("/", 1)[1]))

    async def watch(self, watcher: ActorCell, ref: ActorRef) -> None:
        if ref.node_url in self._local_urls:
            if ref.name in self.actors:
                self.watches.add_local(ref.name, watcher)
            else:
                watcher.deliver_terminated(ref.url, "not found")
            return
        if not self.watches.add_remote(ref.node_url, ref.url, watcher):
            return
        try:
            await (await self.peer(ref.node_url)).send(Watch(PROTOCOL_VERSION, ref.name))
        except (NodeUnreachable, AuthenticationFailed) as exc:
            self.watches.remote_stopped(ref.node_url, ref.name, f"unreachable: {exc}")

    async def unwatch(self, watcher: ActorCell, ref: ActorRef) -> None:
        local = ref.node_url in self._local_urls
        if self.watches.remove(watcher, ref.url, ref.name, None if local else ref.node_url):
            peer = self._peers.get(ref.node_url)
            if peer is not None:
                await peer.send_quiet(Unwatch(PROTOCOL_VERSION, ref.name))

    # --- routing (called by ActorRef) ------------------------------------------------------

    async def tell(self, ref: ActorRef, msg: Message) -> None:
        _check(msg)
        if ref.node_url in self._local_urls:
            await self._local(ref).tell_local(msg)
        else:
            await (await self.peer(ref.node_url)).tell(ref.name, msg)

    def ask(
        self, ref: ActorRef, msg: Message, timeout: float | None, into: Sequence[Buffer] | None = None
    ) -> Awaitable[Message | None]:
        if not isinstance(msg, Message):
            _check(msg)
        peer = self._peers.get(ref.node_url)
        if peer is not None and not peer.closed:  # the hot path: a connected peer, no extra coroutine
            ref._peer = peer  # the ref's next asks skip this lookup while the connection lasts
            return peer.ask(ref.name, msg, timeout, into)
        return self._ask(ref, msg, timeout, into)

    async def _ask(
        self, ref: ActorRef, msg: Message, timeout: float | None, into: Sequence[Buffer] | None
    ) -> Message | None:
        if ref.node_url in self._local_urls:
            return await self._local(ref).ask_local(msg, timeout)
        peer = await self.peer(ref.node_url)
        return await peer.ask(ref.name, msg, timeout, into)

    def stream(self, ref: ActorRef, msg: Message, window: int | None) -> AsyncIterator[Message]:
        _check(msg)
        return self._stream(ref, msg, window or self.config.stream_window)

    async def _stream(self, ref: ActorRef, msg: Message, window: int) -> AsyncIterator[Message]:
        if ref.node_url in self._local_urls:
            source = self._local(ref).stream_local(msg, window)
        else:
            source = (await self.peer(ref.node_url)).stream(ref.name, msg, window)
        async with aclosing(source):
            async for item in source:
                yield item

    def _local(self, ref: ActorRef) -> ActorCell:
        actor = self.actors.get(ref.name)
        if actor is None:
            raise ActorDied(f"no actor {ref.name!r} on {ref.node_url}")
        return actor

    # --- peers -----------------------------------------------------------------------------

    async def peer(self, node_url: str) -> Peer:
        """The connection to `node_url`, opened and authenticated on first use.

        Raises `NodeUnreachable` (cannot connect), `AuthenticationFailed` (refused), `ClosedError` (stopping).
        """
        peer = self._peers.get(node_url)
        if peer is not None and not peer.closed:
            return peer
        if self._stopping:
            raise ClosedError("node is stopping")
        pending = self._connecting.get(node_url)
        if pending is not None:
            return await asyncio.shield(pending)
        fut = asyncio.get_running_loop().create_future()
        self._connecting[node_url] = fut
        try:
            conn = await transport_connect(node_url, self._transport)
            try:
                info = await self._handshake(conn, initiator=True)
            except AuthenticationFailed as exc:  # said here too: the refusing side logs its own line
                _log.warning("refused by peer", peer=node_url, reason=str(exc))
                raise
            peer = self._add_peer(conn, node_url, info)
            fut.set_result(peer)
            return peer
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved here: concurrent waiters re-raise it, no "never retrieved" warning
            raise
        finally:
            del self._connecting[node_url]

    async def _handshake(self, conn: Connection, initiator: bool) -> PeerInfo:
        """Authenticate `conn` under small frame limits (nothing larger than a handshake frame is read into memory
        before the peer proves it knows the secret), then raise them to this node's."""
        config = self.config
        conn.set_limits(self._preauth)
        try:
            info = await handshake(
                conn, self.codec, config.secret, self.url, config.max_frame_bytes, initiator, config.handshake_timeout
            )
        except BaseException:
            await conn.close()
            raise
        conn.set_limits(self._transport)
        return info

    async def _accept(self, conn: Connection) -> None:
        """Serve one incoming connection: authenticate, then read it until it closes."""
        if self._stopping:
            await conn.close()
            return
        if self._authenticating >= MAX_PENDING_HANDSHAKES:
            _log.warning("too many unauthenticated connections: refused", peer=conn.peer_address)
            await conn.close()
            return
        self._authenticating += 1
        try:
            info = await self._handshake(conn, initiator=False)
        except AuthenticationFailed as exc:
            _log.warning("peer refused", peer=conn.peer_address, reason=str(exc))
            return
        except (NodeUnreachable, ClosedError, ChannelBroken) as exc:
            _log.info("connection dropped during handshake", peer=conn.peer_address, reason=str(exc))
            return
        finally:
            self._authenticating -= 1
        peer = self._add_peer(conn, info.node or conn.peer_address, info)
        await peer.finished

    def _add_peer(self, conn: Connection, url: str, info: PeerInfo) -> Peer:
        peer = Peer(self, conn, url, info.max_frame)
        self._all_peers.add(peer)
        existing = self._peers.get(url)
        if existing is None or existing.closed:
            self._peers[url] = peer
        _log.info("peer connected", peer=url, via=conn.peer_address)
        return peer

    def peer_lost(self, peer: Peer, reason: str) -> None:
        """Called by a Peer whose connection is gone."""
        self._all_peers.discard(peer)
        registered = self._peers.get(peer.url) is peer
        if registered:
            del self._peers[peer.url]
        self.watches.node_lost(peer.url if registered else None, peer, reason)
        if not self._stopping:
            _log.info("peer lost", peer=peer.url, reason=reason)

    # --- shutdown --------------------------------------------------------------------------

    async def stop(self, timeout: float | None = None) -> None:
        """Stop accepting, drain every mailbox (up to `timeout`, default drain_timeout), close connections."""
        if self._stopping:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._stopping = True
        for listener in self._listeners:
            await listener.close()
        users = [name for name in self.actors if name != SYSTEM_ACTOR]
        await asyncio.gather(*(self.stop_actor(name, timeout, "node stopped") for name in users))
        await self.stop_actor(SYSTEM_ACTOR, timeout, "node stopped")
        await asyncio.gather(*(peer.close() for peer in list(self._all_peers)), return_exceptions=True)
        _log.info("node stopped", addresses=self.addresses)
        if self._stopped is not None:
            self._stopped.set()

    async def wait_stopped(self) -> None:
        """Return once the node has stopped (e.g. after a remote `Shutdown`)."""
        await self._stopped.wait()


def _check(msg: object) -> None:
    if not isinstance(msg, Message):
        raise TypeError(f"actors exchange Message instances, got {type(msg).__name__}")
