"""Binding of the native skinny GEMM (native/gemm*.c): weights packed once, then y = x @ W.T (+ residual).

The kernel streams each weight panel from memory once per call and reuses it from L2 across all rows of
the batch, prefetching the next panel while it computes; that is what decode batches (1 to a few hundred
rows) need and what oneDNN's packed GEMMs do not reach (see aiollm.model.linear). fp32 runs fp32
math on AVX-512; bf16 runs bf16 products with fp32 accumulation (AVX512_BF16), y rounded once.

Every argument is checked here (TypeError for a wrong dtype or type, ValueError for a wrong shape or
layout) before the C call; the C side checks again and returns a status code.
"""

import ctypes
import sys
import threading

import torch

from aiollm._native import ffi, lib

_DT = {torch.float32: lib.AIOLLM_DT_F32, torch.bfloat16: lib.AIOLLM_DT_BF16}
_cast, _NULL = ffi.cast, ffi.NULL


def supported(dtype: torch.dtype) -> bool:
    """Whether this CPU runs the kernel for weights of `dtype` (else callers keep another path)."""
    return dtype in _DT and bool(lib.aiollm_gemm_supported(_DT[dtype]))


def _aligned_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes starting on a 64-byte boundary (the kernel loads whole cache lines); large
    ones are carved out of huge-page slabs (`_Slabs`)."""
    if nbytes >= _Slabs.MIN_BYTES and _madvise is not None:
        return _SLABS.take(nbytes)
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    skip = -raw.data_ptr() % 64
    return raw[skip : skip + nbytes]


def _find_madvise():
    """libc's madvise on Linux (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _find_madvise()
_MADV_HUGEPAGE = 14


class _Slabs:
    """Packed weights placed in 2 MiB-aligned slabs marked MADV_HUGEPAGE (transparent huge pages are commonly
    on for madvised memory only), so a step's streaming read of every weight is served by 2 MiB pages: with 4 KiB
    pages each of SmolLM2's fp32 step's ~130 k weight pages costs a TLB miss and a page walk. Huge pages make the
    step's products ~1.08x faster at batch 1, ~1.12x at 8, ~1.04x at 32 and 64. A slab lives while any weight in it does; the pages past the last
    weight are never touched, so they take no memory."""

    MIN_BYTES = 256 << 10
    SLAB_BYTES = 64 << 20
    HUGE = 2 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slab: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            start = -(-self._used // 64) * 64
            if self._slab is None or start + nbytes > self._slab.numel():
                size = max(self.SLAB_BYTES, -(-nbytes // self.HUGE) * self.HUGE)
                raw = torch.empty(size + self.HUGE, dtype=torch.uint8)  # not touched yet: no page mapped
                skip = -raw.data_ptr() % self.HUGE
                self._slab, start = raw[skip : skip + size], 0
                _madvise(self._slab.data_ptr(), size, _MADV_HUGEPAGE)  # a refusal only costs the speed-up
            self._used = start + nbytes
            return self._slab[start : start + nbytes]


_SLABS = _Slabs()


class PackedWeight:
    """A weight matrix [n, k] in the kernel's panel layout (16 output columns per panel, k-major).

    `shape`, `dtype` and `device` describe the logical matrix; `to_dense()` gives it back as [n, k].
    """

    def __init__(self, weight: torch.Tensor) -> None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
        if weight.dtype not in _DT:
            raise TypeError(f"weight: expected float32 or bfloat16, got {weight.dtype}")
        if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
            raise ValueError(f"weight: expected a non-empty 2-D [out, in] matrix, got shape {tuple(weight.shape)}")
        if weight.device.type != "cpu":
            raise ValueError(f"weight: expected a CPU tensor, got device {weight.device}")
        if not supported(weight.dtype):
            raise ValueError(f"weight: this CPU has no native GEMM for {weight.dtype}")
        weight = weight.contiguous()
        n, k = weight.shape
        self.shape = torch.Size((n, k))
        self.dtype = weight.dtype
        self.device = weight.device
        self._code = _DT[weight.dtype]
        self.data = _aligned_bytes(lib.aiollm_gemm_packed_bytes(n, k, self._code))
        self._ptr = ffi.cast("void *", self.data.data_ptr())
        _ensure(lib.aiollm_gemm_pack(ffi.cast("void *", weight.data_ptr()), k, n, k, self._code, self._ptr))

    def to_dense(self) -> torch.Tensor:
        """The logical [n, k] matrix (a copy)."""
        n, k = self.shape
        panels = -(-n // 16)
        if self.dtype == torch.float32:
            blocks = self.data.view(torch.float32).view(panels, k, 16).permute(0, 2, 1)
            return blocks.reshape(panels * 16, k)[:n].clone()
        kp = self.data.numel() // (2 * panels * 16)
        blocks = self.data.view(torch.bfloat16).view(panels, kp // 2, 16, 2).permute(0, 2, 1, 3)
        return blocks.reshape(panels * 16, kp)[:n, :k].clone()

    def __repr__(self) -> str:
        return f"PackedWeight(shape={tuple(self.shape)}, dtype={self.dtype})"


def _ensure(status: int) -> None:
    if status:
        raise ValueError(f"native gemm refused the call (status {status})")


def _rows(t: torch.Tensor, name: str, dtype: torch.dtype, cols: int, rows: int | None = None) -> None:
    """t must be a 2-D CPU tensor of dtype with `cols` unit-stride columns (and `rows` rows if given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype} (the weight's dtype), got {t.dtype}")
    if t.dim() != 2 or t.shape[1] != cols or (rows is not None and t.shape[0] != rows):
        want = f"[{rows if rows is not None else 'm'}, {cols}]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
    if t.shape[0] > 1 and t.stride(0) < cols or t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: rows must be unit-stride and not overlap, got strides {t.stride()}")


def _fits(t, dtype: torch.dtype, rows: int | None, cols: int) -> bool:
    """The common case of `_rows`, checked with as few tensor attribute reads as possible (this runs 121
    times per decode step)."""
    shape, stride = t.shape, t.stride()
    return (
        t.dtype is dtype
        and len(shape) == 2
        and shape[1] == cols
        and (rows is None or shape[0] == rows)
        and (stride[1] == 1 or cols == 1)
        and (stride[0] >= cols or shape[0] <= 1)
        and not t.is_cuda
    )


def gemm(
    x: torch.Tensor, weight: PackedWeight, residual: torch.Tensor | None = None, n_threads: int | None = None
) -> torch.Tensor:
    """x [m, k] @ weight.T (+ residual [m, n]) as a new [m, n] tensor of the weight's dtype.

    x and residual must have the weight's dtype and unit-stride rows (a row stride is fine).
    n_threads: threads of the native pool (default: torch's thread count).
    """
    if not isinstance(weight, PackedWeight):
        raise TypeError(f"weight: expected a PackedWeight, got {type(weight).__name__}")
    n, k = weight.shape
    if not isinstance(x, torch.Tensor) or not _fits(x, weight.dtype, None, k):
        _rows(x, "x", weight.dtype, k)
    m = x.shape[0]
    if residual is not None and (not isinstance(residual, torch.Tensor) or not _fits(residual, weight.dtype, m, n)):
        _rows(residual, "residual", weight.dtype, n, m)
    y = torch.empty((m, n), dtype=weight.dtype)
    if m == 0:
        return y
    r_ptr, ldr = (_NULL, 0) if residual is None else (_cast("void *", residual.data_ptr()), residual.stride(0))
    _ensure(
        lib.aiollm_gemm(
            _cast("void *", x.data_ptr()),
            x.stride(0) if m > 1 else k,
            m,
            weight._ptr,
            n,
            k,
            weight._code,
            r_ptr,
            ldr if m > 1 else n,
            _cast("void *", y.data_ptr()),
            n,
            torch.get_num_threads() if n_threads is None else n_threads,
        )
    )
    return y
