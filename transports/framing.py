"""What every transport shares: buffer views, frame limits, allocation checks, options, the wire prefix.

The wire prefix (used by `tcp` and `ucx`) is fixed-size and little-endian:

    magic u32 | version u16 | reserved u16 | header length u32 | buffer count u32 | size u64 * count

followed by the header bytes and then each buffer's bytes. Sizes come first so the receiver can
allocate every destination before a single payload byte arrives.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from aiollm.errors import ChannelBroken
from aiollm.transports.base import Allocator, Buffer, TransportConfig

MAGIC = 0x4C4C4941  # b"AILL" read as little-endian u32
VERSION = 1
PREFIX = struct.Struct("<IHHII")


def byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of `buf` without copying; `ValueError` if it is not contiguous."""
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous (make the array contiguous before sending)")
    if view.format == "B" and view.ndim == 1:
        return view
    if view.nbytes == 0:
        return memoryview(bytearray())
    try:
        return view.cast("B")
    except TypeError:  # formats memoryview cannot cast (e.g. numpy structured dtypes)
        return memoryview(np.frombuffer(view, dtype=np.uint8))


def check_limits(config: TransportConfig, header_len: int, sizes: Sequence[int], error: type[Exception]) -> None:
    """Raise `error` naming the limit a frame with these sizes breaks (none: return)."""
    if header_len > config.max_header_bytes:
        raise error(f"frame header of {header_len} bytes exceeds max_header_bytes={config.max_header_bytes}")
    if len(sizes) > config.max_buffers:
        raise error(f"frame has {len(sizes)} buffers, more than max_buffers={config.max_buffers}")
    total = header_len + sum(sizes)
    if total > config.max_frame_bytes:
        raise error(f"frame of {total} bytes exceeds max_frame_bytes={config.max_frame_bytes}")


def encode_prefix(header_len: int, sizes: Sequence[int], kind: int = 0) -> bytes:
    """The fixed prefix plus the size table for a frame; `kind` fills the reserved field (a ucx message kind)."""
    return PREFIX.pack(MAGIC, VERSION, kind, header_len, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)


def decode_prefix(data: Buffer, config: TransportConfig) -> tuple[int, int]:
    """Validate a received fixed prefix; returns (header length, buffer count) or raises `ChannelBroken`."""
    magic, version, _reserved, header_len, count = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ChannelBroken(f"bad frame magic 0x{magic:08x} (expected 0x{MAGIC:08x}): not an aiollm peer?")
    if version != VERSION:
        raise ChannelBroken(f"unsupported frame version {version} (this side speaks {VERSION})")
    if header_len > config.max_header_bytes:
        raise ChannelBroken(f"frame header of {header_len} bytes exceeds max_header_bytes={config.max_header_bytes}")
    if count > config.max_buffers:
        raise ChannelBroken(f"frame has {count} buffers, more than max_buffers={config.max_buffers}")
    return header_len, count


def decode_sizes(data: Buffer, count: int, header_len: int, config: TransportConfig) -> list[int]:
    """Unpack and validate the size table that follows the prefix."""
    sizes = list(struct.unpack(f"<{count}Q", data))
    check_limits(config, header_len, sizes, ChannelBroken)
    return sizes


def fresh_buffers(sizes: Sequence[int]) -> list[memoryview]:
    """New uninitialised uint8 arrays, one per size: where a frame's buffers land when nobody chose."""
    return [memoryview(np.empty(size, dtype=np.uint8)) for size in sizes]


def allocate_buffers(allocate: Allocator | None, header: bytes, sizes: list[int]) -> list[memoryview] | None:
    """Destinations for a frame's buffers chosen by `allocate` (checked); None when it leaves the choice
    to the transport (no `allocate`, or it returned None): fresh memory, or whatever costs no copy.

    Raises `ValueError` when `allocate` returns the wrong number of buffers, a read-only one,
    or one whose size differs from the frame's.
    """
    if allocate is None:
        return None
    if not sizes:  # nothing to place: allocate is only asked about frames that carry buffers
        return []
    given = allocate(header, list(sizes))
    if given is None:
        return None
    if len(given) != len(sizes):
        raise ValueError(f"allocate returned {len(given)} buffers for a frame with {len(sizes)}")
    views = []
    for i, (buf, size) in enumerate(zip(given, sizes)):
        view = byte_view(buf)
        if view.readonly:
            raise ValueError(f"allocate returned a read-only buffer at index {i}")
        if view.nbytes != size:
            raise ValueError(f"allocate returned {view.nbytes} bytes at index {i}, the frame has {size}")
        views.append(view)
    return views


def options_for(config: TransportConfig, scheme: str, defaults: dict[str, int | str]) -> dict[str, int | str]:
    """This scheme's options (keys `scheme.name`) merged over `defaults`; `ValueError` for unknown keys.

    Values arrive as strings; each is converted to its default's type.
    """
    merged = dict(defaults)
    prefix = scheme + "."
    for key, value in config.options.items():
        if not key.startswith(prefix):
            continue
        if key not in defaults:
            raise ValueError(
                f"TransportConfig.options: unknown {scheme} option {key!r}, expected one of {sorted(defaults)}"
            )
        kind = type(defaults[key])
        try:
            merged[key] = kind(value)
        except ValueError:
            raise ValueError(f"TransportConfig.options[{key!r}]: expected {kind.__name__}, got {value!r}") from None
    return merged
