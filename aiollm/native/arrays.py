"""Zero-copy views of numpy arrays and torch CPU tensors for the native kernels, and the checks made on
them before any C call.

The kernels take raw pointers, so everything they could misread is checked here: dtype, shape, strides
(elements, not bytes) and device. Every failure is a `ValueError` (or `TypeError` for a wrong kind of
object) naming the argument and the expected vs actual value. torch is never imported here: a tensor can
only arrive if the caller already imported it.
"""

import sys
from typing import NamedTuple

import numpy as np

_NUMPY_DTYPES = {
    np.dtype(np.float32): "fp32",
    np.dtype(np.float16): "fp16",
    np.dtype(np.int8): "int8",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
}
_TORCH_DTYPE_NAMES = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
    "torch.int32": "int32",
    "torch.int64": "int64",
}
NUMPY_OF = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8, "int32": np.int32, "int64": np.int64}


CACHE_LINE = 64


def aligned_full(shape: tuple[int, ...], fill, dtype) -> np.ndarray:
    """An array whose data starts on a cache line. numpy's large allocations start 16 bytes past one, so every
    64-byte load of the AVX-512 kernels (and every other 32-byte AVX2 load) would span two lines; aligned, the
    kernels read ~4-8 % faster with the KV in L2 (1 thread, fp16: SmolLM2 47.6 against 45 GB/s, Llama 118 against 108
    on a Zen 5 core).
    Zero-filled arrays stay lazily zero-paged, as np.zeros is."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    out = raw[start : start + nbytes].view(dtype).reshape(shape)
    if fill != 0:
        out.fill(fill)
    return out


class Arr(NamedTuple):
    """One array as the kernels see it; `obj` keeps the memory alive for the duration of the call. (A NamedTuple:
    immutable like a frozen dataclass, at a third of its construction cost, and there are ~10 per kernel call.)"""

    ptr: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    obj: object

    def is_contiguous(self, from_dim: int = 0) -> bool:
        """C-contiguous over dims >= from_dim (dims of size 1 may have any stride; an empty array always is)."""
        if from_dim == 0 and isinstance(self.obj, np.ndarray):
            return self.obj.flags.c_contiguous  # the same rule (NumPy's relaxed strides), without a Python loop
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape[from_dim:]), reversed(self.strides[from_dim:])):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def numpy(self) -> np.ndarray:
        """A numpy view (for the small integer arrays the wrapper inspects); no copy."""
        if isinstance(self.obj, np.ndarray):
            return self.obj
        return self.obj.detach().numpy()


def is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def describe(x, name: str) -> Arr:
    """View `x` (numpy array or torch CPU tensor) without copying; TypeError/ValueError naming `name`.
    Callers follow with `check_dtype`: the dtype of an unsupported array is its own name (e.g. 'float64')."""
    if isinstance(x, np.ndarray):
        dtype = _NUMPY_DTYPES.get(x.dtype) or str(x.dtype)  # an unsupported dtype fails check_dtype by name
        itemsize, strides = x.itemsize, x.strides
        if itemsize != 1:  # (this runs on every kernel call: ~10 arrays each, so no generator per array)
            elements = tuple([s // itemsize for s in strides])
            if [e * itemsize for e in elements] != list(strides):
                raise ValueError(f"{name}: expected strides that are multiples of the item size, got {strides} bytes")
            strides = elements
        return Arr(x.ctypes.data, dtype, x.shape, strides, x)
    if is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {x.device}")
        name_of = str(x.dtype)
        dtype = _TORCH_DTYPE_NAMES.get(name_of, name_of)
        return Arr(x.data_ptr(), dtype, tuple(x.shape), tuple(x.stride()), x)
    raise TypeError(f"{name}: expected a numpy array or a torch CPU tensor, got {type(x).__name__}")


def check_dtype(a: Arr, name: str, allowed: tuple[str, ...]) -> None:
    if a.dtype not in allowed:
        raise ValueError(f"{name}: expected dtype {' or '.join(allowed)}, got {a.dtype}")


def check_shape(a: Arr, name: str, expected: tuple) -> None:
    """`expected` may hold None for a free dimension; the message shows the expected shape with names."""
    ok = len(a.shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, a.shape))
    if not ok:
        shown = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name}: expected shape {shown}, got {a.shape}")


def check_contiguous(a: Arr, name: str, from_dim: int = 0) -> None:
    if not a.is_contiguous(from_dim):
        what = "contiguous" if from_dim == 0 else f"contiguous from dim {from_dim} on"
        raise ValueError(f"{name}: expected a {what} array, got strides {a.strides} (elements) for shape {a.shape}")
