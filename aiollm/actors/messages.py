"""Every wire type of the actor runtime: the `Message` base users subclass, and the envelopes.

A frame's header is one msgpack-encoded *envelope* (a tagged, array-like struct whose first
field is the protocol version). Envelopes that carry a user message hold it in `body`, which is
decoded in a second step against the registry of `Message` subclasses, so an unknown type tag
or a wrong field is reported against the request it came with. Tensor fields never appear in
the header: the codec (`codec.py`) replaces each one with a small descriptor and sends the raw
bytes as one of the frame's buffers.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Bumped whenever an envelope changes shape; a peer speaking another version is refused.
PROTOCOL_VERSION = 1

# Request kinds, in `Request.kind`.
TELL, ASK, STREAM = 0, 1, 2


class Message(msgspec.Struct, tag=True):
    """Base of every actor message: a msgspec struct tagged with its class name (or `tag="..."`).

    Subclasses are registered when defined, so a receiving node can decode them; two classes with
    one tag are refused when the registry is next read (give one an explicit `tag=`). Fields may
    be `numpy.ndarray` or `torch.Tensor` (sent out of band, see `codec.py`) or `ActorRef`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # msgspec sets the class's tag only after this hook returns, so it is read in message_types().
        global _generation
        _unregistered.append(cls)
        _generation += 1


# Message classes defined since the registry was last read.
_unregistered: list[type[Message]] = []
# tag -> Message class.
_registry: dict[str, type[Message]] = {}
# Incremented whenever a Message class is defined (the codec rebuilds its decoder then).
_generation = 0


def registry_generation() -> int:
    """Changes whenever a Message class is defined."""
    return _generation


def message_types() -> dict[str, type[Message]]:
    """Every Message class by tag; `TypeError` if two classes share a tag."""
    while _unregistered:
        cls = _unregistered.pop(0)
        tag = cls.__struct_config__.tag
        previous = _registry.get(tag)
        if previous is not None and (previous.__module__, previous.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(
                f"message tag {tag!r} of {cls.__module__}.{cls.__qualname__} is already used by "
                f"{previous.__module__}.{previous.__qualname__}; give one an explicit tag=..."
            )
        _registry[tag] = cls
    return _registry


class Terminated(Message):
    """Delivered to a watcher when the watched actor stops, its process dies or its node drops."""

    # URL of the actor that is gone, e.g. tcp://127.0.0.1:7001/echo.
    url: str
    # Why: "stopped", "not found", "connection lost", "heartbeat timeout", "node stopped".
    reason: str


class Envelope(msgspec.Struct, array_like=True, tag=True):
    """Base of the runtime's own frames; never seen by actors."""

    # Protocol version of the sender (PROTOCOL_VERSION).
    v: int


class Hello(Envelope, tag="hello"):
    """First frame of the handshake, sent by both sides."""

    # 32 random bytes the peer must sign with the cluster secret.
    nonce: bytes
    # Address other nodes reach the sender at ("" when it does not listen).
    node: str
    # Largest frame the sender accepts, so the other side refuses bigger ones before sending.
    max_frame: int


class Proof(Envelope, tag="proof"):
    """Second frame of the handshake: HMAC-SHA256 over the peer's nonce and the sender's own."""

    # hmac(secret, direction label + receiver's nonce + sender's nonce).
    mac: bytes


class Request(Envelope, tag="req"):
    """A message for an actor: a tell, an ask (one reply) or a stream (items under credits)."""

    # Sender-chosen id naming this request in replies, items, credits and cancels (0 for tells).
    id: int
    # TELL, ASK or STREAM.
    kind: int
    # Name of the target actor on the receiving node.
    to: str
    # For streams, how many items the producer may send before it needs more credit.
    credits: int
    # The user message (a tagged Message struct), decoded against the registry.
    body: msgspec.Raw


class Reply(Envelope, tag="rep"):
    """The result of an ask."""

    # The request being answered.
    id: int
    # The returned Message, or nil.
    body: msgspec.Raw


class Failure(Envelope, tag="fail"):
    """An ask or stream failed (or, with id 0, a frame could not be processed at all)."""

    # The request that failed; 0 when the frame named none.
    id: int
    # "remote" (handler raised), "protocol" (bad frame), "died" (no such actor / it stopped),
    # "cancelled" (the request was cancelled).
    kind: str
    # Type name of the remote exception.
    type_name: str
    # Its message.
    message: str
    # Formatted remote traceback ("" when there is none).
    traceback: str


class Item(Envelope, tag="item"):
    """One item of a stream, from producer to consumer."""

    # The stream request.
    id: int
    # The yielded Message.
    body: msgspec.Raw


class End(Envelope, tag="end"):
    """The producer's generator finished normally."""

    # The stream request.
    id: int


class Credit(Envelope, tag="credit"):
    """The consumer took items and lets the producer send this many more."""

    # The stream request.
    id: int
    # Number of further items allowed.
    n: int


class Cancel(Envelope, tag="cancel"):
    """The asker or consumer gave up: the remote handler is cancelled."""

    # The request to cancel.
    id: int


class Watch(Envelope, tag="watch"):
    """Tell the sender when the named actor stops (a `Stopped` frame), at once if it is not there."""

    # Name of the watched actor on the receiving node.
    target: str


class Unwatch(Envelope, tag="unwatch"):
    """The sender no longer needs `Stopped` for this actor."""

    # Name of the actor no longer watched.
    target: str


class Stopped(Envelope, tag="stopped"):
    """A watched actor on the sending node stopped."""

    # Its name on the sending node.
    target: str
    # Why (see Terminated.reason).
    reason: str


class Heartbeat(Envelope, tag="hb"):
    """Sent every heartbeat interval so the peer can tell a silent node from a dead one."""


# Every envelope the node accepts after the handshake.
AnyEnvelope = Request | Reply | Failure | Item | End | Credit | Cancel | Watch | Unwatch | Stopped | Heartbeat
# What the handshake accepts.
HandshakeEnvelope = Hello | Proof | Failure


class TensorMeta(msgspec.Struct, array_like=True):
    """Descriptor of one out-of-band tensor, carried in the header as msgpack extension data."""

    # Position of its bytes in the frame's buffer list.
    index: int
    # "np" or "torch": what the sender passed (kept for fields annotated Any).
    fw: str
    # dtype name ("float16", "bfloat16", ...).
    dtype: str
    # Shape; () for 0-d.
    shape: tuple[int, ...]
    # Byte count, checked against the shape, the dtype and the received buffer.
    nbytes: int


# --- the node's built-in system actor ("_node"), used by graph.py and the CLI ----------------


class Spawn(Message, tag="aiollm.spawn"):
    """Ask a node to create an actor; the reply is `Spawned`."""

    # "package.module:ClassName" of an Actor subclass importable on the node.
    cls: str
    # Name to register it under on that node.
    name: str
    # Keyword arguments for the class (msgpack values only).
    kwargs: dict[str, Any] = {}


class Spawned(Message, tag="aiollm.spawned"):
    """Reply to `Spawn`."""

    # Full URL of the new actor.
    url: str


class StopActor(Message, tag="aiollm.stop_actor"):
    """Ask a node to stop one of its actors (after draining its mailbox); the reply is None."""

    # Name of the actor on that node.
    name: str


class Shutdown(Message, tag="aiollm.shutdown"):
    """Ask a node to stop: drain every actor, close connections, and let its process exit."""
