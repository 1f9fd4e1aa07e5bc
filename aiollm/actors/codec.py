"""The wire codec: envelopes and messages to (header, buffers) and back, tensors out of band.

A `numpy.ndarray` or `torch.Tensor` anywhere in a message is encoded as a msgpack extension
holding a small descriptor (buffer index, framework, dtype name, shape, byte count); its bytes
go, uncopied, into the frame's buffer list. On receipt the descriptor is checked against the
buffer and the array is rebuilt as a view of the received memory — no copy. A field annotated
`numpy.ndarray` gets a numpy array and one annotated `torch.Tensor` gets a tensor (zero-copy
either way); elsewhere (e.g. `Any`) the sender's framework is kept.

bfloat16 (and the other torch dtypes numpy lacks) travels as raw bytes with the torch dtype name
and is rebuilt as a torch tensor on receipt; a numpy-annotated field refuses it. `ActorRef`
fields travel as their URL and come back bound to the receiving node. Nothing is pickled.
"""

from __future__ import annotations

import math
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from aiollm.actors import messages
from aiollm.actors.messages import (
    PROTOCOL_VERSION,
    AnyEnvelope,
    Envelope,
    HandshakeEnvelope,
    Message,
    TensorMeta,
    message_types,
    registry_generation,
)
from aiollm.actors.ref import ActorRef
from aiollm.errors import ProtocolError

# msgpack extension codes.
_EXT_TENSOR = 1
_EXT_REF = 2

# numpy dtypes allowed on the wire (by name); everything else (object, structured, strings) is refused.
NUMPY_DTYPES = frozenset(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 complex64 complex128".split()
)
# torch dtypes without a numpy equivalent, carried as raw bytes under their torch name.
TORCH_ONLY_DTYPES = frozenset("bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz complex32".split())


# The envelopes that carry a message in `body`.
_WITH_BODY = (messages.Request, messages.Reply, messages.Item)

_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(TensorMeta)


def _torch() -> Any:
    """The torch module if this process imported it (the codec never imports torch itself)."""
    return sys.modules.get("torch")


def _is_torch_tensor(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def _numpy_bytes(arr: np.ndarray) -> tuple[str, np.ndarray]:
    """(dtype name, a C-contiguous native-order array) for a numpy array; copies only when needed."""
    name = arr.dtype.name
    if name not in NUMPY_DTYPES:
        raise TypeError(f"numpy dtype {arr.dtype} cannot be sent; supported: {sorted(NUMPY_DTYPES)}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    # (np.ascontiguousarray would turn a 0-d array into a 1-d one.)
    return name, arr if arr.flags.c_contiguous else arr.copy(order="C")


def _torch_bytes(tensor: Any) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype name, shape, flat uint8 numpy view) of a CPU tensor; copies only if not contiguous."""
    if tensor.device.type != "cpu":
        raise TypeError(f"only CPU tensors can be sent, got one on {tensor.device} (call .cpu() first)")
    if tensor.layout is not _torch().strided:
        raise TypeError(f"only dense (strided) tensors can be sent, got layout {tensor.layout}")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in NUMPY_DTYPES and name not in TORCH_ONLY_DTYPES:
        raise TypeError(f"torch dtype {tensor.dtype} cannot be sent")
    tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
    flat = tensor.reshape(-1).view(_torch().uint8).numpy()
    return name, tuple(tensor.shape), flat


def _rebuild(meta: TensorMeta, buffers: Sequence[memoryview]) -> Any:
    """Check a descriptor against its buffer and return an array viewing it (a tensor for torch-only dtypes)."""
    if not 0 <= meta.index < len(buffers):
        raise ProtocolError(f"tensor refers to buffer {meta.index}, the frame has {len(buffers)}")
    if any(d < 0 for d in meta.shape):
        raise ProtocolError(f"tensor shape {meta.shape} has a negative dimension")
    buf = buffers[meta.index]
    if meta.dtype in NUMPY_DTYPES:
        itemsize = np.dtype(meta.dtype).itemsize
    elif meta.dtype in TORCH_ONLY_DTYPES:
        torch = _torch()
        if torch is None:
            import torch  # a torch-only dtype arrived: the receiver needs torch to hold it
        itemsize = getattr(torch, meta.dtype).itemsize
    else:
        raise ProtocolError(f"tensor dtype {meta.dtype!r} is not allowed on the wire")
    expected = math.prod(meta.shape) * itemsize
    if expected != meta.nbytes or buf.nbytes != meta.nbytes:
        raise ProtocolError(
            f"tensor {meta.dtype}{list(meta.shape)} needs {expected} bytes; "
            f"header says {meta.nbytes}, buffer {meta.index} has {buf.nbytes}"
        )
    if meta.dtype in NUMPY_DTYPES:
        arr = np.frombuffer(buf, dtype=meta.dtype).reshape(meta.shape)
        return _as_torch(arr) if meta.fw == "torch" and _torch() is not None else arr
    torch = _torch()
    raw = torch.from_numpy(_writable(np.frombuffer(buf, dtype=np.uint8)))
    return raw.view(getattr(torch, meta.dtype)).reshape(meta.shape)


def _writable(arr: np.ndarray) -> np.ndarray:
    """torch.from_numpy warns on read-only arrays; received buffers are writable except inproc bytes."""
    return arr if arr.flags.writeable else arr.copy()


def _as_torch(arr: np.ndarray) -> Any:
    return _torch().from_numpy(_writable(arr))


class Codec:
    """Encodes envelopes to (header, buffers) and decodes frames; one per node (not re-entrant).

    `make_ref(url)` turns a received ActorRef URL into a ref bound to the receiving node.
    """

    def __init__(self, make_ref: Callable[[str], ActorRef]) -> None:
        self._make_ref = make_ref
        # Out-of-band buffers collected by the encoder during one encode() call.
        self._out: list[memoryview] | None = None
        # Buffers of the frame being decoded, read by the extension hook.
        self._rx: Sequence[memoryview] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._envelope_decoder = msgspec.msgpack.Decoder(AnyEnvelope)
        self._decode_envelope = self._envelope_decoder.decode
        self._handshake_decoder = msgspec.msgpack.Decoder(HandshakeEnvelope)
        self._body_decoder: msgspec.msgpack.Decoder | None = None
        self._frame_decoder: msgspec.msgpack.Decoder | None = None
        self._registry_generation = -1

    # --- encoding -------------------------------------------------------------------------

    def encode(self, envelope: Envelope) -> tuple[bytes, Sequence[memoryview]]:
        """The header bytes and the out-of-band buffers of one envelope (its body included)."""
        self._out = None  # (reset here, not in a finally: one block less on every frame)
        header = self._encoder.encode(envelope)
        return header, self._out or ()

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            name, arr = _numpy_bytes(obj)
            return self._tensor_ext("np", name, arr.shape, arr.reshape(-1).view(np.uint8), arr.nbytes)
        if isinstance(obj, ActorRef):
            return msgspec.msgpack.Ext(_EXT_REF, obj.url.encode())
        if _is_torch_tensor(obj):
            name, shape, flat = _torch_bytes(obj)
            return self._tensor_ext("torch", name, shape, flat, flat.nbytes)
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(
            f"cannot send a {type(obj).__name__}: message fields hold msgpack values, structs, "
            "numpy arrays, torch tensors and ActorRefs"
        )

    def _tensor_ext(self, fw: str, dtype: str, shape: tuple[int, ...], flat: np.ndarray, nbytes: int) -> Any:
        if self._out is None:
            self._out = []
        meta = TensorMeta(len(self._out), fw, dtype, tuple(shape), nbytes)
        self._out.append(memoryview(flat))
        return msgspec.msgpack.Ext(_EXT_TENSOR, _meta_encoder.encode(meta))

    # --- decoding -------------------------------------------------------------------------

    def decode_envelope(self, header: bytes | memoryview) -> AnyEnvelope:
        """The envelope of a frame; `ProtocolError` for garbage, an unknown kind or another version."""
        try:  # the fast path, inline: a well-formed envelope of our version
            env = self._decode_envelope(header)
            if env.v == PROTOCOL_VERSION:
                return env
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        return _decode_versioned(self._envelope_decoder, header, "frame header")

    def decode_frame(self, header: bytes | memoryview, buffers: Sequence[memoryview]) -> AnyEnvelope:
        """A frame's envelope with its message, if it carries one, already decoded into `body` (tensors viewing `buffers`).

        One msgspec call for a well-formed frame: the frame decoder types the body of Request,
        Reply and Item with every registered message (as subclasses of those envelopes). When that
        fails, the envelope is decoded alone (`ProtocolError` if it is bad) and then its body, which
        is replaced by the `ProtocolError` saying what is wrong with it, so that the receiver can
        answer the request the frame came with.
        """
        if self._registry_generation != messages._generation:
            self._rebuild_decoder()
        self._rx = buffers
        try:
            env = self._frame_decoder.decode(header)
            if env.v == PROTOCOL_VERSION:
                return env
        except Exception:
            pass
        finally:
            self._rx = ()
        env = self.decode_envelope(header)
        if env.__class__ in _WITH_BODY:
            try:
                env.body = self.decode_body(env.body, buffers)
            except ProtocolError as exc:
                env.body = exc
        return env

    def decode_handshake(self, header: bytes | memoryview) -> Any:
        """A handshake envelope (Hello, Proof, or the peer's Failure); `ProtocolError` otherwise."""
        return _decode_versioned(self._handshake_decoder, header, "handshake frame")

    def decode_body(self, raw: msgspec.Raw, buffers: Sequence[memoryview]) -> Message | None:
        """The Message inside an envelope, tensors viewing `buffers`; `ProtocolError` when invalid."""
        self._rx = buffers
        try:
            decoder = self._body_decoder
            if decoder is None or self._registry_generation != messages._generation:
                decoder = self._rebuild_decoder()
            return decoder.decode(raw)
        except ProtocolError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(_unknown_tag_hint(raw) or f"invalid message: {exc}") from None
        except Exception as exc:  # a hook refused a value (e.g. bfloat16 into a numpy field), or a tag clash
            raise ProtocolError(f"invalid message: {exc}") from None
        finally:
            self._rx = ()

    def _rebuild_decoder(self) -> msgspec.msgpack.Decoder:
        body = typing.Optional[typing.Union[tuple(message_types().values())]]  # noqa: UP007, UP045 (built at run time)
        self._registry_generation = registry_generation()
        self._body_decoder = msgspec.msgpack.Decoder(body, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        typed = [
            msgspec.defstruct(
                kind.__name__,
                [("body", body)],
                bases=(kind,),
                module=__name__,
                tag=kind.__struct_config__.tag,
                array_like=True,
            )
            for kind in _WITH_BODY
        ]
        rest = [kind for kind in typing.get_args(AnyEnvelope) if kind not in _WITH_BODY]
        self._frame_decoder = msgspec.msgpack.Decoder(
            typing.Union[(*typed, *rest)], ext_hook=self._ext_hook, dec_hook=_dec_hook
        )
        return self._body_decoder

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_TENSOR:
            try:
                meta = _meta_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProtocolError(f"malformed tensor descriptor: {exc}") from None
            return _rebuild(meta, self._rx)
        if code == _EXT_REF:
            return self._make_ref(bytes(data).decode())
        raise ProtocolError(f"unknown msgpack extension code {code}")


def _dec_hook(kind: type, obj: Any) -> Any:
    """Convert a decoded extension value to the field's annotated type (zero-copy)."""
    if kind is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        if _is_torch_tensor(obj):
            name = str(obj.dtype).removeprefix("torch.")
            if name in TORCH_ONLY_DTYPES:
                raise TypeError(f"a {name} tensor cannot be a numpy array; annotate the field torch.Tensor")
            return obj.numpy()
    elif kind is ActorRef:
        if isinstance(obj, ActorRef):
            return obj
    elif _is_torch_tensor_type(kind):
        if isinstance(obj, np.ndarray):
            return _as_torch(obj)
        if _is_torch_tensor(obj):
            return obj
    else:
        raise TypeError(f"fields of type {kind!r} are not supported on the wire")
    raise TypeError(f"expected {kind.__name__}, got {type(obj).__name__}")


def _is_torch_tensor_type(kind: type) -> bool:
    torch = _torch()
    return torch is not None and kind is torch.Tensor


def _version_hint(header: bytes | memoryview) -> str | None:
    """For a header that failed to decode: a clear message if it comes from another protocol version."""
    try:
        generic = msgspec.msgpack.decode(header)
    except msgspec.DecodeError:
        return None
    if isinstance(generic, list) and len(generic) >= 2 and isinstance(generic[1], int):
        if generic[1] != PROTOCOL_VERSION:
            return f"protocol version {generic[1]} from peer, this node speaks {PROTOCOL_VERSION}"
        if isinstance(generic[0], str):
            return f"unknown or malformed frame kind {generic[0]!r}"
    return None


def _unknown_tag_hint(raw: msgspec.Raw) -> str | None:
    """For a body that failed to decode: name the tag if no message class is registered for it."""
    try:
        generic = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(generic, dict):
        tag = generic.get("type")
        if tag is not None and tag not in message_types():
            return f"unknown message type {tag!r} (no Message class with that tag on this node)"
    return None


def _decode_versioned(decoder: msgspec.msgpack.Decoder, header: bytes | memoryview, what: str) -> Any:
    """Decode an envelope and check its protocol version; `ProtocolError` naming `what` otherwise."""
    try:
        env = decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(_version_hint(header) or f"malformed {what}: {exc}") from None
    if env.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {env.v} from peer, this node speaks {PROTOCOL_VERSION}")
    return env
