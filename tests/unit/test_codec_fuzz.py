"""Fuzzing the frame codec and the wire prefix (hypothesis, a bounded budget): whatever bytes arrive, decoding
either yields a frame or raises the one error the receiver handles (ProtocolError, ChannelBroken), never
anything else, and never allocates what a prefix merely announces."""

import struct

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiollm.actors.codec import Codec
from aiollm.actors.echo import Echo, Ping
from aiollm.actors.messages import ASK, PROTOCOL_VERSION, Request
from aiollm.errors import ChannelBroken, ProtocolError
from aiollm.transports.base import TransportConfig
from aiollm.transports.framing import MAGIC, PREFIX, VERSION, decode_prefix, decode_sizes

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODEC = Codec(lambda url: None)
CONFIG = TransportConfig(max_header_bytes=4096, max_frame_bytes=1 << 20, max_buffers=8)


def _valid_frames() -> list[tuple[bytes, list[memoryview]]]:
    frames = []
    for msg in (Ping(3), Echo("hello", np.arange(6, dtype=np.float32))):
        header, buffers = CODEC.encode(Request(PROTOCOL_VERSION, 1, ASK, "echo", 0, msg))
        frames.append((bytes(header), [memoryview(bytes(b)) for b in buffers]))
    return frames


VALID = _valid_frames()


def _decode(header: bytes, buffers: list[memoryview]) -> None:
    try:
        env = CODEC.decode_frame(header, buffers)
    except ProtocolError:
        return
    body = getattr(env, "body", None)
    assert body is None or isinstance(body, msgspec.Struct | ProtocolError)


@FUZZ
@given(st.binary(max_size=512), st.lists(st.binary(max_size=64), max_size=3))
def test_random_frames_decode_or_raise_protocol_error(header, buffers):
    _decode(header, [memoryview(b) for b in buffers])


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.data())
def test_mutated_valid_frames_decode_or_raise_protocol_error(which, data):
    header, buffers = VALID[which]
    mutated = bytearray(header)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(mutated) - 1))
        mutated[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
    cut = [b[: data.draw(st.integers(0, len(b)))] for b in buffers]
    _decode(bytes(mutated), cut)


@FUZZ
@given(st.binary(min_size=PREFIX.size, max_size=PREFIX.size), st.binary(max_size=64))
def test_random_prefixes_are_refused_before_any_allocation(prefix, rest):
    try:
        header_len, count = decode_prefix(prefix, CONFIG)
    except ChannelBroken:
        return
    assert header_len <= CONFIG.max_header_bytes and count <= CONFIG.max_buffers
    table = (rest + bytes(8 * count))[: 8 * count]
    try:
        sizes = decode_sizes(table, count, header_len, CONFIG)
    except ChannelBroken:
        return
    assert header_len + sum(sizes) <= CONFIG.max_frame_bytes


@FUZZ
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_a_prefix_announcing_too_much_is_refused(header_len, count):
    prefix = PREFIX.pack(MAGIC, VERSION, 0, header_len, count)
    try:
        decode_prefix(prefix, CONFIG)
    except ChannelBroken:
        assert header_len > CONFIG.max_header_bytes or count > CONFIG.max_buffers
        return
    assert header_len <= CONFIG.max_header_bytes and count <= CONFIG.max_buffers
    huge = struct.pack(f"<{count}Q", *([2**62] * count)) if count else b""
    if count:
        try:
            decode_sizes(huge, count, header_len, CONFIG)
        except ChannelBroken:
            return
        raise AssertionError("a size table of 2**62-byte buffers was accepted")
