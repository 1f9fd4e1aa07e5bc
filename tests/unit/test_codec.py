"""The wire codec: tensors of every dtype and shape round-trip out of band without copies; bad input is refused."""

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from aiollm.actors.codec import NUMPY_DTYPES, Codec
from aiollm.actors.messages import ASK, PROTOCOL_VERSION, Message, Request, TensorMeta
from aiollm.actors.ref import ActorRef
from aiollm.errors import ProtocolError


class Arrays(Message, tag="test.codec.arrays"):
    """A numpy field, a torch field, an optional one and a list, as workers will declare them."""

    # numpy in, numpy out
    a: np.ndarray
    # torch in, torch out (numpy arrives as a tensor)
    t: torch.Tensor
    # absent or an array
    maybe: np.ndarray | None = None
    # KV blocks travel as lists of tensors
    blocks: list[torch.Tensor] = []


class Plain(Message, tag="test.codec.plain"):
    """A message without tensors, to test field validation."""

    # an integer
    n: int
    # a ref to another actor
    peer: ActorRef | None = None


class _Router:
    """Stands in for the node a decoded ref is bound to."""


ROUTER = _Router()


def make_codec() -> Codec:
    return Codec(lambda url: ActorRef(url, ROUTER))


def roundtrip(msg: Message, copy_buffers: bool = False) -> tuple[Message, list[memoryview]]:
    """Encode a request carrying `msg`, then decode it as a receiver would (optionally from fresh memory)."""
    codec = make_codec()
    header, buffers = codec.encode(Request(PROTOCOL_VERSION, 7, ASK, "x", 0, msg))
    received = [memoryview(bytearray(b)) if copy_buffers else memoryview(b) for b in buffers]
    env = codec.decode_envelope(header)
    assert isinstance(env, Request) and env.id == 7 and env.to == "x"
    return codec.decode_body(env.body, received), received


def base_address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_numpy_roundtrip_every_dtype_and_shape(dtype: str, shape: tuple) -> None:
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.random(shape) * 100).astype(dtype)
    out, received = roundtrip(Arrays(a=arr, t=torch.zeros(1)), copy_buffers=True)
    assert out.a.dtype == arr.dtype and out.a.shape == arr.shape
    np.testing.assert_array_equal(out.a, arr)
    if arr.size:  # arrives as a view of the received memory: no extra copy
        assert base_address(out.a) == base_address(np.frombuffer(received[0], np.uint8))


TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (4, 0), (3,), (2, 5)])
def test_torch_roundtrip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple) -> None:
    src = (torch.rand(shape, dtype=torch.float32) * 10).to(dtype)
    out, received = roundtrip(Arrays(a=np.zeros(1), t=src), copy_buffers=True)
    assert out.t.dtype == dtype and tuple(out.t.shape) == shape
    assert torch.equal(
        out.t.view(torch.uint8) if dtype.itemsize == 1 else out.t, src.view(torch.uint8) if dtype.itemsize == 1 else src
    )
    if src.numel():
        assert out.t.data_ptr() == base_address(np.frombuffer(received[1], np.uint8))


def test_bfloat16_is_rebuilt_as_torch_even_in_an_any_field() -> None:
    class Loose(Message, tag="test.codec.loose"):
        # anything
        x: Any

    src = torch.randn(3, 4).to(torch.bfloat16)
    out, _ = roundtrip(Loose(x=src))
    assert isinstance(out.x, torch.Tensor) and out.x.dtype == torch.bfloat16 and torch.equal(out.x, src)


def test_numpy_into_torch_field_and_lists_of_tensors() -> None:
    blocks = [torch.full((2, 2), float(i), dtype=torch.float16) for i in range(3)]
    out, received = roundtrip(Arrays(a=np.arange(3), t=np.ones(4, np.float32), maybe=np.eye(2), blocks=blocks))
    assert isinstance(out.t, torch.Tensor) and out.t.dtype == torch.float32
    assert isinstance(out.maybe, np.ndarray) and out.maybe.shape == (2, 2)
    assert [b.tolist() for b in out.blocks] == [b.tolist() for b in blocks]
    assert len(received) == 6


def test_non_contiguous_inputs_are_made_contiguous() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tbase = torch.arange(24, dtype=torch.float16).reshape(4, 6)
    out, _ = roundtrip(Arrays(a=base.T[::2], t=tbase.t()[1::2]))
    np.testing.assert_array_equal(out.a, base.T[::2])
    assert torch.equal(out.t, tbase.t()[1::2])


def test_big_endian_input_arrives_native() -> None:
    arr = np.arange(5, dtype=">i4")
    out, _ = roundtrip(Arrays(a=arr, t=torch.zeros(1)))
    assert out.a.dtype == np.dtype("int32") and out.a.tolist() == [0, 1, 2, 3, 4]


def test_256_mib_tensor_travels_without_copy() -> None:
    big = np.empty(256 * 1024 * 1024, dtype=np.uint8)
    big[::4096] = 7
    codec = make_codec()
    header, buffers = codec.encode(Request(PROTOCOL_VERSION, 1, ASK, "x", 0, Arrays(a=big, t=torch.zeros(1))))
    assert len(header) < 200 and buffers[0].nbytes == big.nbytes
    assert base_address(np.frombuffer(buffers[0], np.uint8)) == base_address(big)  # sent uncopied
    env = codec.decode_envelope(header)
    out = codec.decode_body(env.body, list(buffers))
    assert base_address(out.a) == base_address(big)  # received as a view
    assert out.a[4096] == 7


def test_refs_travel_as_urls_and_rebind() -> None:
    out, _ = roundtrip(Plain(n=1, peer=ActorRef("tcp://127.0.0.1:7001/echo", ROUTER)))
    assert out.peer == ActorRef("tcp://127.0.0.1:7001/echo", ROUTER)


def test_refuses_to_encode_unsupported_values() -> None:
    codec = make_codec()
    with pytest.raises(TypeError, match="numpy dtype object"):
        codec.encode(Request(PROTOCOL_VERSION, 1, ASK, "x", 0, Arrays(a=np.array([object()]), t=torch.zeros(1))))
    with pytest.raises(TypeError):
        codec.encode(Request(PROTOCOL_VERSION, 1, ASK, "x", 0, Plain(n=object())))


# --- bad frames --------------------------------------------------------------------------------


def encode_raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_hot_path_tuples_encode_exactly_as_the_envelopes() -> None:
    """The peer encodes asks and replies from tuples (cheaper than the structs): the bytes must not differ."""
    from aiollm.actors.messages import Reply
    from aiollm.actors.peer import _REPLY, _REQUEST

    codec = Codec(lambda url: None)
    msg = Plain(7)
    assert codec.encode((_REQUEST, PROTOCOL_VERSION, 9, ASK, "echo", 0, msg)) == codec.encode(
        Request(PROTOCOL_VERSION, 9, ASK, "echo", 0, msg)
    )
    for value in (msg, None):
        header, buffers = codec.encode((_REPLY, PROTOCOL_VERSION, 9, value))
        assert (header, buffers) == codec.encode(Reply(PROTOCOL_VERSION, 9, value))
        assert codec.decode_body(codec.decode_envelope(header).body, buffers) == value


def test_garbage_header() -> None:
    with pytest.raises(ProtocolError, match="malformed frame header"):
        make_codec().decode_envelope(b"\xc1\x00garbage")


def test_version_mismatch_is_named() -> None:
    header = encode_raw(["req", PROTOCOL_VERSION + 1, 1, ASK, "x", 0, {"type": "test.codec.plain", "n": 1}])
    with pytest.raises(ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
        make_codec().decode_envelope(header)
    # a future version whose envelope no longer parses is still reported as a version mismatch
    with pytest.raises(ProtocolError, match="protocol version 99"):
        make_codec().decode_envelope(encode_raw(["req", 99, "new", "layout"]))


def test_unknown_envelope_kind() -> None:
    with pytest.raises(ProtocolError, match="unknown or malformed frame kind 'bogus'"):
        make_codec().decode_envelope(encode_raw(["bogus", PROTOCOL_VERSION]))


def decode_request_body(body: object, buffers: list[memoryview] = ()) -> Message:
    codec = make_codec()
    env = codec.decode_envelope(encode_raw(["req", PROTOCOL_VERSION, 1, ASK, "x", 0, body]))
    return codec.decode_body(env.body, list(buffers))


def test_unknown_message_tag() -> None:
    with pytest.raises(ProtocolError, match="unknown message type 'no.such.type'"):
        decode_request_body({"type": "no.such.type", "n": 1})


def test_wrong_field_type() -> None:
    with pytest.raises(ProtocolError, match=r"Expected `int`, got `str` - at `\$.n`"):
        decode_request_body({"type": "test.codec.plain", "n": "one"})
    with pytest.raises(ProtocolError, match="expected ndarray, got int"):
        decode_request_body({"type": "test.codec.arrays", "a": 5, "t": 5})


def tensor_ext(meta: TensorMeta) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(1, msgspec.msgpack.encode(meta))


@pytest.mark.parametrize(
    ("meta", "nbytes", "error"),
    [
        (TensorMeta(0, "np", "float32", (4,), 12), 12, "needs 16 bytes; header says 12"),
        (TensorMeta(0, "np", "float32", (4,), 16), 12, "buffer 0 has 12"),
        (TensorMeta(0, "np", "float16", (2, 3), 12), 10, "buffer 0 has 10"),
        (TensorMeta(1, "np", "float32", (1,), 4), 4, "refers to buffer 1, the frame has 1"),
        (TensorMeta(0, "np", "object", (1,), 8), 8, "dtype 'object' is not allowed"),
        (TensorMeta(0, "np", "float32", (-1,), 4), 4, "negative dimension"),
    ],
)
def test_tensor_descriptor_must_match_the_buffer(meta: TensorMeta, nbytes: int, error: str) -> None:
    body = {"type": "test.codec.arrays", "a": tensor_ext(meta), "t": tensor_ext(meta)}
    with pytest.raises(ProtocolError, match=error):
        decode_request_body(body, [memoryview(bytearray(nbytes))])


def test_bfloat16_cannot_land_in_a_numpy_field() -> None:
    meta = TensorMeta(0, "torch", "bfloat16", (2,), 4)
    body = {"type": "test.codec.arrays", "a": tensor_ext(meta), "t": tensor_ext(meta)}
    with pytest.raises(ProtocolError, match="annotate the field torch.Tensor"):
        decode_request_body(body, [memoryview(bytearray(4))])


def test_duplicate_tags_are_refused() -> None:
    class First(Message, tag="test.codec.dup"):
        pass

    class Second(Message, tag="test.codec.dup"):
        pass

    with pytest.raises(ProtocolError, match="already used by"):
        decode_request_body({"type": "test.codec.plain", "n": 1})
    assert decode_request_body({"type": "test.codec.plain", "n": 1}) == Plain(n=1)  # the registry recovers
