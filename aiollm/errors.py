"""The error hierarchy: every error aiollm raises on purpose derives from `AiollmError`.

Bad arguments raise the builtin `ValueError`/`TypeError`; these classes are for what happens
between parts of the system (a channel, a peer, a remote handler).
"""


class AiollmError(Exception):
    """Base of every aiollm-specific error."""


class ClosedError(AiollmError):
    """This side closed the resource (connection, actor, node) and then tried to use it."""


class ChannelBroken(AiollmError):
    """The channel failed mid-use: a truncated or malformed frame, a reset connection."""


class NodeUnreachable(AiollmError):
    """The peer node cannot be reached or went away (connect refused, connection dropped, heartbeat lost)."""


class AuthenticationFailed(AiollmError):
    """The peer did not prove knowledge of the cluster secret."""


class ProtocolError(AiollmError):
    """A frame or message broke the wire protocol (unknown type, bad version, wrong fields, too large)."""


class ActorDied(AiollmError):
    """The target actor stopped (or was never there) before answering."""


class RemoteError(AiollmError):
    """A remote handler raised; carries the remote exception's type name, message and traceback text."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text


class ModelFormatError(AiollmError):
    """A model file is unusable: corrupt or truncated, an unsupported architecture or tensor type, a missing
    or misshapen tensor. The message names the file and, where it applies, the tensor and the type."""


class KVCacheFull(AiollmError):
    """The KV block pool has fewer free blocks than a request asked for; nothing was allocated."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(f"KV cache full: asked for {requested} blocks, {free} free of {total}")
        self.requested = requested
        self.free = free
        self.total = total


def require_positive(config: object, *names: str) -> None:
    """A config's `__post_init__` check: ValueError naming the first of `names` whose value is not > 0."""
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be > 0, got {value}")
