"""Python entry points of the native attention library: `kv_write`, `decode_attention`, `read_sum`, the
thread count and the ISA in use.

These functions work on the raw arrays of ONE layer of a paged KV pool (KVPool hands them its views):

    k_cache  [n_blocks, n_kv_heads, head_dim, block_size]   K transposed inside a block
    v_cache  [n_blocks, n_kv_heads, block_size, head_dim]
    k_scale, v_scale  fp16 [n_blocks, n_kv_heads, block_size]   int8 and int4 storage only

all C-contiguous, fp32, fp16 or int8 (numpy arrays or torch CPU tensors, never copied). int4 storage is uint8
with two codes a byte and the last dim halved: k_cache [n_blocks, n_kv_heads, head_dim, block_size / 2], v_cache
[n_blocks, n_kv_heads, block_size, head_dim / 2]; it needs head_dim % 32 == 0 and block_size % 4 == 0. Every argument is
checked here before the C call (ValueError naming it, expected vs actual); C checks lengths, block-table
entries and slots again and returns a status code, turned into the same exception.

Threads: the library has its own persistent pthread pool (not OpenMP). `n_threads` (or the process-wide
default from `set_num_threads`, initially the CPUs this process may run on) sets how many threads one call
uses; the pool's workers sleep between calls. PyTorch's libgomp team spin-waits after each parallel region
instead, which slows attention running next to torch GEMMs ~2x unless OMP_WAIT_POLICY=PASSIVE. The rule
(README, "Native attention kernels"): never run both concurrently on the same cores, and in a process that
runs both set OMP_WAIT_POLICY=PASSIVE before importing torch. A thread that interleaves attention with its
own torch ops (the colocated decode step) instead runs it on its OpenMP team inside `on_gemm_team()`.

ISA: probed once (AVX-512 > AVX2+FMA+F16C > portable C); the environment variable AIOLLM_ATTN_ISA=ref|avx2|
avx512, read once at the first call, overrides it; `force_isa` switches at run time (tests). int8 KV runs as
fp32 math or int8 dot products, VNNI on AVX-512 and vpmaddubsw/vpmaddwd on AVX2 (`int8_path`;
AIOLLM_ATTN_INT8=fp32|vnni|madd or `force_int8_path`); int4 KV always runs int8 dot products (VNNI, else MADD) on
the SIMD kernels, and in fp32 math on the reference path, which the fp32 int8 path also selects for it. The far (L2) software prefetch level is on or off per
CPU and storage class (`far_prefetch(storage)`; off on Zen 5 and on CPUs without AVX-512 other than a Zen 4 core
whose AVX-512 a hypervisor hides, and for int8 / int4 on Intel and on that Zen 4 core only the line form on items of
many heads, where the kernels read faster without it; AIOLLM_ATTN_FAR_PREFETCH=0-7, the AIOLLM_FAR_* mask of
native/aiollm_native.h, or `force_far_prefetch`).
"""

import contextlib
import math
import os
import time

import numpy as np

from aiollm._native import ffi, lib
from aiollm.native.arrays import NUMPY_OF, check_contiguous, check_dtype, check_shape, describe

ISAS = {"ref": lib.AIOLLM_ISA_REF, "avx2": lib.AIOLLM_ISA_AVX2, "avx512": lib.AIOLLM_ISA_AVX512}
_ISA_NAMES = {code: name for name, code in ISAS.items()}
_DT = {
    "fp32": lib.AIOLLM_DT_F32,
    "fp16": lib.AIOLLM_DT_F16,
    "bf16": lib.AIOLLM_DT_BF16,
    "int8": lib.AIOLLM_DT_I8,
    "uint8": lib.AIOLLM_DT_I4,
}  # a uint8 cache holds int4 codes, two a byte
_STATUS = {
    lib.AIOLLM_ERR_ARG: "an argument is out of range",
    lib.AIOLLM_ERR_BLOCK: "block_tables: an entry in use lies outside the pool",
    lib.AIOLLM_ERR_LEN: "seq_lens: a length is negative or needs more blocks than block_tables has columns",
    lib.AIOLLM_ERR_SLOT: "slot_mapping: an entry lies outside the pool",
    lib.AIOLLM_ERR_UNSUPPORTED: "unsupported dtype combination",
}
MAX_HEAD_DIM = lib.AIOLLM_MAX_HEAD_DIM
MAX_GROUP = lib.AIOLLM_MAX_GROUP

_num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_num_threads(n: int) -> None:
    """Default number of pool threads per call (an `n_threads` argument overrides it)."""
    global _num_threads
    if not isinstance(n, int) or not 1 <= n <= lib.AIOLLM_MAX_THREADS:
        raise ValueError(f"n_threads: expected an int in [1, {lib.AIOLLM_MAX_THREADS}], got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    return _num_threads


@contextlib.contextmanager
def on_gemm_team():
    """Within the block, this thread's attention calls run on its OpenMP team (the threads its GEMMs and torch
    ops run on) instead of the library's pool: in a step that interleaves them, torch's workers spin after each
    op and attention on the pool would share the cores with them (SmolLM2 fp32 batch 32: ~13 vs ~7 ms of
    attention per step). Where there is no team the pool runs them anyway; AIOLLM_ATTN_POOL=1 keeps them on the pool."""
    prev = lib.aiollm_set_attn_team(1)
    try:
        yield
    finally:
        lib.aiollm_set_attn_team(prev)


def isa() -> str:
    """The kernel variant in use: 'ref', 'avx2' or 'avx512' (on Zen 5, unforced 'avx512' runs int8 calls with one q
    head per kv head in the AVX2 kernel: see `int8_path`)."""
    return _ISA_NAMES[lib.aiollm_isa()]


def supported_isas() -> list[str]:
    return [name for name, code in ISAS.items() if lib.aiollm_isa_supported(code)]


def force_isa(name: str | None) -> None:
    """Use this variant from now on (None: back to the probed/env choice). ValueError if the CPU lacks it."""
    _force("isa", name, ISAS, lib.aiollm_set_isa, supported_isas)


INT8_PATHS = {"fp32": lib.AIOLLM_INT8_FP32, "vnni": lib.AIOLLM_INT8_VNNI, "madd": lib.AIOLLM_INT8_MADD}
_INT8_NAMES = {code: name for name, code in INT8_PATHS.items()}


def int8_path() -> str:
    """How int8 KV attention is computed: 'fp32' math, or int8 dot products: 'vnni' (AVX-512) or 'madd' (AVX2).

    On Zen 5 the probed 'vnni' leaves calls with one q head per kv head (Llama's GQA 1) to the AVX2 kernel's
    'madd', which reads faster from DRAM there (native/dispatch.c); an ISA forced by `force_isa` or
    AIOLLM_ATTN_ISA, or a path forced by `force_int8_path` or AIOLLM_ATTN_INT8, serves every call."""
    return _INT8_NAMES[lib.aiollm_int8_path()]


def supported_int8_paths() -> list[str]:
    return [name for name, code in INT8_PATHS.items() if lib.aiollm_int8_path_supported(code)]


def force_int8_path(name: str | None) -> None:
    """Use this int8 path from now on (None: back to the probed/env choice). ValueError if the CPU lacks it."""
    _force("int8 path", name, INT8_PATHS, lib.aiollm_set_int8_path, supported_int8_paths)


def _force(what: str, name: str | None, codes: dict[str, int], set_code, supported) -> None:
    """`force_isa` and `force_int8_path`: set `codes[name]` (-1 for None) through `set_code`, naming the choices on error."""
    code = -1 if name is None else codes.get(name)
    if code is None:
        raise ValueError(f"{what}: expected one of {sorted(codes)} or None, got {name!r}")
    if set_code(code) != lib.AIOLLM_OK:
        raise ValueError(f"{what}: this CPU does not support {name!r} (supported: {supported()})")


_QUANTISED_FAR = lib.AIOLLM_FAR_QUANTISED | lib.AIOLLM_FAR_QUANTISED_LINES
_FAR_CLASS = {
    "fp32": lib.AIOLLM_FAR_FLOAT,
    "fp16": lib.AIOLLM_FAR_FLOAT,
    "int8": _QUANTISED_FAR,
    "int4": _QUANTISED_FAR,
}


def _far_class(storage: str | None) -> int:
    """The AIOLLM_FAR_* bits of one storage dtype's far levels (None: every storage)."""
    if storage is None:
        return lib.AIOLLM_FAR_ALL
    if storage not in _FAR_CLASS:
        raise ValueError(f"far prefetch: storage expected one of {sorted(_FAR_CLASS)} or None, got {storage!r}")
    return _FAR_CLASS[storage]


def far_prefetch(storage: str = "fp16") -> bool:
    """Whether the SIMD kernels issue a far (L2) software prefetch level over KV of this storage dtype (fp32 and fp16
    share one setting, int8 and int4 another; probed per CPU, see native/cpu.c). The results are identical either
    way; only the speed differs."""
    return bool(lib.aiollm_far_prefetch() & _far_class(storage))


def force_far_prefetch(on: bool | None, storage: str | None = None) -> None:
    """Turn the far prefetch level on or off from now on, for `storage`'s setting (None: every storage); on=None puts
    every setting back to the probed/env choice. On, int8 / int4 take this CPU's own form of the level where it has
    one (AIOLLM_FAR_QUANTISED_LINES on Intel), else the whole-tile form."""
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"far prefetch: expected True, False or None, got {on!r}")
    bits = _far_class(storage)
    current = lib.aiollm_far_prefetch()
    if on is None:
        mask = -1
    elif not on:
        mask = current & ~bits
    else:
        quantised = lib.aiollm_cpu_far_prefetch_default() & _QUANTISED_FAR or lib.AIOLLM_FAR_QUANTISED
        mask = current & ~bits | bits & (lib.AIOLLM_FAR_FLOAT | quantised)
    _ensure(lib.aiollm_set_far_prefetch(mask))


def _ensure(status: int) -> None:
    if status == lib.AIOLLM_OK:
        return
    if status == lib.AIOLLM_ERR_NOMEM:
        raise MemoryError("native attention: out of memory")
    raise ValueError(f"native kernel refused the call: {_STATUS.get(status, f'status {status}')}")


def _threads(n_threads: int | None) -> int:
    if n_threads is None:
        return _num_threads
    if not isinstance(n_threads, int) or not 1 <= n_threads <= lib.AIOLLM_MAX_THREADS:
        raise ValueError(f"n_threads: expected an int in [1, {lib.AIOLLM_MAX_THREADS}], got {n_threads!r}")
    return n_threads


def _layer(k_cache, v_cache, k_scale, v_scale, window: int = 0):
    """Check one layer's cache arrays and build the C descriptor (the caller's arrays keep the memory alive).
    `window` > 0: a query attends to its sequence's last `window` tokens only (sliding-window attention)."""
    k = describe(k_cache, "k_cache")
    check_dtype(k, "k_cache", ("fp32", "fp16", "int8", "uint8"))
    if len(k.shape) != 4:
        raise ValueError(f"k_cache: expected 4 dims [n_blocks, n_kv_heads, head_dim, block_size], got shape {k.shape}")
    n_blocks, n_kv_heads, head_dim, block_size = k.shape
    int4 = k.dtype == "uint8"
    if int4:
        block_size *= 2
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"k_cache: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if int4 and (head_dim % 32 or block_size % 4):
        raise ValueError(
            f"k_cache: int4 (uint8) storage needs head_dim % 32 == 0 and block_size % 4 == 0, got "
            f"head_dim {head_dim}, block_size {block_size}"
        )
    v = describe(v_cache, "v_cache")
    check_dtype(v, "v_cache", (k.dtype,))
    check_shape(v, "v_cache", (n_blocks, n_kv_heads, block_size, head_dim // 2 if int4 else head_dim))
    check_contiguous(k, "k_cache")
    check_contiguous(v, "v_cache")
    desc = ffi.new("aiollm_kv_layer *")
    desc.k, desc.v = ffi.cast("void *", k.ptr), ffi.cast("void *", v.ptr)
    desc.n_blocks, desc.block_size, desc.n_kv_heads, desc.head_dim = n_blocks, block_size, n_kv_heads, head_dim
    desc.dtype = _DT[k.dtype]
    if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window: expected an int >= 0 (0: no sliding window), got {window!r}")
    desc.window = int(window)
    if k.dtype in ("int8", "uint8"):
        for arr, name, field in ((k_scale, "k_scale", "k_scale"), (v_scale, "v_scale", "v_scale")):
            if arr is None:
                raise ValueError(f"{name}: required for an {'int4' if int4 else 'int8'} cache, got None")
            s = describe(arr, name)
            check_dtype(s, name, ("fp16",))
            check_shape(s, name, (n_blocks, n_kv_heads, block_size))
            check_contiguous(s, name)
            setattr(desc, field, ffi.cast("uint16_t *", s.ptr))
    return desc


def kv_write(k_cache, v_cache, slot_mapping, k, v, *, k_scale=None, v_scale=None) -> None:
    """Write new tokens' k, v [n_tokens, n_kv_heads, head_dim] (fp32, fp16 or bf16; heads and dims contiguous,
    any token stride) into slots `slot_mapping` (int64/int32 [n_tokens], block_id * block_size + offset).
    Converts to the cache dtype; int8 and int4 are quantised per token per head. A repeated slot keeps the last
    token."""
    desc = _layer(k_cache, v_cache, k_scale, v_scale)
    n_slots = desc.n_blocks * desc.block_size
    slots = describe(slot_mapping, "slot_mapping")
    check_dtype(slots, "slot_mapping", ("int64", "int32"))
    if len(slots.shape) != 1:
        raise ValueError(f"slot_mapping: expected 1 dim [n_tokens], got shape {slots.shape}")
    n_tokens = slots.shape[0]
    slots_np = np.ascontiguousarray(slots.numpy(), dtype=np.int64)
    if n_tokens:
        bad = np.flatnonzero((slots_np < 0) | (slots_np >= n_slots))
        if bad.size:
            raise ValueError(
                f"slot_mapping: expected entries in [0, {n_slots}), got {int(slots_np[bad[0]])} at index {int(bad[0])}"
            )
    kv_in = []
    for x, name in ((k, "k"), (v, "v")):
        a = describe(x, name)
        check_dtype(a, name, ("fp32", "fp16", "bf16"))
        check_shape(a, name, (n_tokens, desc.n_kv_heads, desc.head_dim))
        check_contiguous(a, name, from_dim=1)
        kv_in.append(a)
    ka, va = kv_in
    if va.dtype != ka.dtype:
        raise ValueError(f"v: expected the dtype of k ({ka.dtype}), got {va.dtype}")
    row = desc.n_kv_heads * desc.head_dim
    k_stride = ka.strides[0] if n_tokens > 1 else row
    v_stride = va.strides[0] if n_tokens > 1 else row
    _ensure(
        lib.aiollm_kv_write(
            desc,
            ffi.cast("int64_t *", slots_np.ctypes.data),
            n_tokens,
            ffi.cast("void *", ka.ptr),
            k_stride,
            ffi.cast("void *", va.ptr),
            v_stride,
            _DT[ka.dtype],
        )
    )


def _check_tables(bt: np.ndarray, lens: np.ndarray, block_size: int, n_blocks: int) -> None:
    """Lengths fit the tables and every entry in use lies inside the pool (the kernel reads only those)."""
    if lens.size == 0:
        return
    if lens.min() < 0:
        i = int(np.argmin(lens))
        raise ValueError(f"seq_lens: expected lengths >= 0, got {int(lens[i])} for sequence {i}")
    need = (lens.astype(np.int64) + block_size - 1) // block_size
    max_blocks = bt.shape[1]
    if need.max() > max_blocks:
        i = int(np.argmax(need))
        raise ValueError(
            f"seq_lens: sequence {i} has length {int(lens[i])}, needing {int(need[i])} blocks of "
            f"{block_size}, but block_tables has {max_blocks} columns"
        )
    in_use = np.arange(max_blocks) < need[:, None]
    bad = in_use & ((bt < 0) | (bt >= n_blocks))
    if bad.any():
        s, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables: expected entries in use in [0, {n_blocks}), got {int(bt[s, j])} "
            f"at [{s}, {j}] (sequence length {int(lens[s])})"
        )


def decode_attention(
    k_cache,
    v_cache,
    q,
    block_tables,
    seq_lens,
    *,
    k_scale=None,
    v_scale=None,
    scale: float | None = None,
    out=None,
    out_dtype: str | None = None,
    n_threads: int | None = None,
    window: int = 0,
):
    """Attention of one query token per sequence over its cached tokens, grouped-query.

    q fp32 [n_seqs, n_q_heads, head_dim] (heads and dims contiguous); block_tables int32 [n_seqs, max_blocks]
    (only the first ceil(len / block_size) entries of a row are read, padding may be anything);
    seq_lens int32 [n_seqs] including the tokens written this step. Returns out [n_seqs, n_q_heads, head_dim]
    in out_dtype ('fp32' default, 'fp16', 'bf16' -> a torch tensor) or written into `out` (its dtype is the
    default out_dtype). scale defaults to 1/sqrt(head_dim). `window` > 0 attends to each sequence's last `window`
    tokens only (sliding-window attention, Mistral's): [max(0, len - window), len).
    """
    desc = _layer(k_cache, v_cache, k_scale, v_scale, window)
    qa = describe(q, "q")
    check_dtype(qa, "q", ("fp32",))
    if len(qa.shape) != 3 or qa.shape[2] != desc.head_dim:
        raise ValueError(f"q: expected shape (n_seqs, n_q_heads, {desc.head_dim}), got {qa.shape}")
    n_seqs, n_q_heads, head_dim = qa.shape
    if n_q_heads % desc.n_kv_heads or n_q_heads // desc.n_kv_heads > MAX_GROUP:
        raise ValueError(
            f"q: expected n_q_heads a multiple of n_kv_heads={desc.n_kv_heads} with at most "
            f"{MAX_GROUP} per group, got {n_q_heads}"
        )
    check_contiguous(qa, "q", from_dim=1)
    bt = describe(block_tables, "block_tables")
    check_dtype(bt, "block_tables", ("int32",))
    if len(bt.shape) != 2 or bt.shape[0] != n_seqs:
        raise ValueError(f"block_tables: expected shape ({n_seqs}, max_blocks), got {bt.shape}")
    check_contiguous(bt, "block_tables")
    sl = describe(seq_lens, "seq_lens")
    check_dtype(sl, "seq_lens", ("int32",))
    check_shape(sl, "seq_lens", (n_seqs,))
    check_contiguous(sl, "seq_lens")
    out = _output(out, out_dtype, (n_seqs, n_q_heads, head_dim))
    oa = describe(out, "out")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q_stride = qa.strides[0] if n_seqs > 1 else n_q_heads * head_dim
    # Lengths and block-table entries are checked by C before any kernel runs (the same conditions as
    # _check_tables); only a refused call pays for the numpy pass that names the offending entry. Checked here
    # first, they cost ~20 us a call, ~2 % of a SmolLM2 64 x 1024 int8 call.
    status = lib.aiollm_decode_attention(
        desc,
        ffi.cast("float *", qa.ptr),
        q_stride,
        n_seqs,
        n_q_heads,
        ffi.cast("int32_t *", bt.ptr),
        bt.shape[1],
        ffi.cast("int32_t *", sl.ptr),
        scale,
        ffi.cast("void *", oa.ptr),
        _DT[oa.dtype],
        _threads(n_threads),
    )
    if status in (lib.AIOLLM_ERR_LEN, lib.AIOLLM_ERR_BLOCK):
        _check_tables(bt.numpy(), sl.numpy(), desc.block_size, desc.n_blocks)
    _ensure(status)
    return out


class DecodeStep:
    """One decode step's slot_mapping, block_tables and seq_lens, checked once and reused by every layer.

    They are identical across a model's layers; re-checking them in each layer's `kv_write` and
    `decode_attention` would cost ~8 ms per step at batch 8 for a 30-layer model. The step keeps its own
    contiguous copies (a caller changing its arrays later cannot make C read out of bounds) and the
    layers' C descriptors; per layer only q, k, v and out are checked. Build it with
    `KVPool.prepare_decode`; all layers share one geometry (n_blocks, block_size, heads, head_dim).
    `owner` is whatever holds the cache arrays the descriptors point into: the step keeps it alive,
    so a step outliving its pool cannot make C read freed memory.
    """

    def __init__(self, layers: list, slot_mapping, block_tables, seq_lens, *, owner) -> None:
        g = layers[0]
        slots = describe(slot_mapping, "slot_mapping")
        check_dtype(slots, "slot_mapping", ("int64", "int32"))
        if len(slots.shape) != 1:
            raise ValueError(f"slot_mapping: expected 1 dim [n_tokens], got shape {slots.shape}")
        self._slots = np.array(slots.numpy(), dtype=np.int64, order="C", copy=True)
        n_slots = g.n_blocks * g.block_size
        bad = np.flatnonzero((self._slots < 0) | (self._slots >= n_slots))
        if bad.size:
            raise ValueError(
                f"slot_mapping: expected entries in [0, {n_slots}), got {int(self._slots[bad[0]])} "
                f"at index {int(bad[0])}"
            )
        n_seqs = self._slots.shape[0]
        bt = describe(block_tables, "block_tables")
        check_dtype(bt, "block_tables", ("int32",))
        if len(bt.shape) != 2 or bt.shape[0] != n_seqs:
            raise ValueError(f"block_tables: expected shape ({n_seqs}, max_blocks), got {bt.shape}")
        sl = describe(seq_lens, "seq_lens")
        check_dtype(sl, "seq_lens", ("int32",))
        check_shape(sl, "seq_lens", (n_seqs,))
        self._tables = np.array(bt.numpy(), dtype=np.int32, order="C", copy=True)
        self._lens = np.array(sl.numpy(), dtype=np.int32, order="C", copy=True)
        _check_tables(self._tables, self._lens, g.block_size, g.n_blocks)
        self._layers = layers
        self._owner = owner
        self.n_seqs = n_seqs
        self._slots_ptr = ffi.cast("int64_t *", self._slots.ctypes.data)
        self._tables_ptr = ffi.cast("int32_t *", self._tables.ctypes.data)
        self._lens_ptr = ffi.cast("int32_t *", self._lens.ctypes.data)

    def _desc(self, layer: int):
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < len(self._layers):
            raise ValueError(f"layer: expected an int in [0, {len(self._layers)}), got {layer!r}")
        return self._layers[layer]

    def write(self, layer: int, k, v) -> None:
        """`kv_write` of this step's new tokens' k, v [n_seqs, n_kv_heads, head_dim] into layer `layer`."""
        desc = self._desc(layer)
        n = self.n_seqs
        ka, va = describe(k, "k"), describe(v, "v")
        for a, name in ((ka, "k"), (va, "v")):
            check_dtype(a, name, ("fp32", "fp16", "bf16"))
            check_shape(a, name, (n, desc.n_kv_heads, desc.head_dim))
            check_contiguous(a, name, from_dim=1)
        if va.dtype != ka.dtype:
            raise ValueError(f"v: expected the dtype of k ({ka.dtype}), got {va.dtype}")
        row = desc.n_kv_heads * desc.head_dim
        _ensure(
            lib.aiollm_kv_write(
                desc,
                self._slots_ptr,
                n,
                ffi.cast("void *", ka.ptr),
                ka.strides[0] if n > 1 else row,
                ffi.cast("void *", va.ptr),
                va.strides[0] if n > 1 else row,
                _DT[ka.dtype],
            )
        )

    def native_write_target(self, layer: int):
        """(layer `layer`'s C descriptor `aiollm_kv_layer *`, this step's slots `int64_t *`, n_seqs): for a native
        call that stores the step's new K/V itself, as `write` does (the model's fused pre-attention call,
        aiollm_layer_pre_kv). Valid while this step lives; the slots are checked, the descriptor is the pool's."""
        return self._desc(layer), self._slots_ptr, self.n_seqs

    def native_attention_tables(self):
        """(block tables `int32_t *`, max_blocks, sequence lengths `int32_t *`): this step's checked copies, for a
        native call that runs the attention itself (the model's one-call decode step, aiollm_decode_layers).
        Valid while this step lives."""
        return self._tables_ptr, self._tables.shape[1], self._lens_ptr

    def write_attend(self, layer: int, qkv, out, *, scale: float | None = None, n_threads: int | None = None):
        """`write` then `attend` from one packed qkv [n_seqs, n_q_heads + 2 * n_kv_heads, head_dim] (q heads, then
        k, then v; rows may be strided, heads contiguous), the form an R-worker receives; returns out.

        Why: an R-worker's ask is ~0.5 ms of Python around a kernel that takes ~0.1 ms at short contexts, and the
        three views of qkv, their checks and the fp32 `.float()` would be a fifth of it. Here qkv is checked once
        and its k, v and (fp32) q are pointer offsets into it. bf16 / fp16 q heads are converted to fp32 first
        (the kernel takes fp32 queries). Everything is checked before anything is stored."""
        desc = self._desc(layer)
        a = describe(qkv, "qkv")
        check_dtype(a, "qkv", ("fp32", "fp16", "bf16"))
        hk, d, n = desc.n_kv_heads, desc.head_dim, self.n_seqs
        if len(a.shape) != 3 or a.shape[0] != n or a.shape[1] <= 2 * hk or a.shape[2] != d:
            raise ValueError(f"qkv: expected shape ({n}, n_q_heads + 2 x {hk}, {d}), got {a.shape}")
        check_contiguous(a, "qkv", from_dim=1)
        hq = a.shape[1] - 2 * hk
        oa, scale = self._checked_out(desc, hq, out, scale)
        row = a.shape[1] * d if n == 1 else a.strides[0]
        size = 4 if a.dtype == "fp32" else 2
        _ensure(
            lib.aiollm_kv_write(
                desc,
                self._slots_ptr,
                n,
                ffi.cast("void *", a.ptr + hq * d * size),
                row,
                ffi.cast("void *", a.ptr + (hq + hk) * d * size),
                row,
                _DT[a.dtype],
            )
        )
        if a.dtype == "fp32":
            return self._run(desc, a.ptr, row, hq, oa, scale, n_threads, out)
        q = qkv[:, :hq]
        q = q.float().contiguous() if hasattr(q, "float") else np.ascontiguousarray(q, dtype=np.float32)
        return self._run(desc, describe(q, "q").ptr, hq * d, hq, oa, scale, n_threads, out)

    def attend(self, layer: int, q, out, *, scale: float | None = None, n_threads: int | None = None):
        """`decode_attention` of q fp32 [n_seqs, n_q_heads, head_dim] over layer `layer` into `out` (fp32,
        fp16 or bf16, contiguous, q's shape); returns out."""
        desc = self._desc(layer)
        qa = describe(q, "q")
        check_dtype(qa, "q", ("fp32",))
        if len(qa.shape) != 3 or qa.shape[0] != self.n_seqs or qa.shape[2] != desc.head_dim:
            raise ValueError(f"q: expected shape ({self.n_seqs}, n_q_heads, {desc.head_dim}), got {qa.shape}")
        n_q_heads = qa.shape[1]
        oa, scale = self._checked_out(desc, n_q_heads, out, scale)
        check_contiguous(qa, "q", from_dim=1)
        q_stride = qa.strides[0] if self.n_seqs > 1 else n_q_heads * desc.head_dim
        return self._run(desc, qa.ptr, q_stride, n_q_heads, oa, scale, n_threads, out)

    def _checked_out(self, desc, n_q_heads: int, out, scale: float | None):
        """(out described, the softmax scale) once the head count and `out` are checked."""
        if n_q_heads % desc.n_kv_heads or n_q_heads // desc.n_kv_heads > MAX_GROUP:
            raise ValueError(
                f"q: expected n_q_heads a multiple of n_kv_heads={desc.n_kv_heads} with at most "
                f"{MAX_GROUP} per group, got {n_q_heads}"
            )
        oa = describe(out, "out")
        check_dtype(oa, "out", ("fp32", "fp16", "bf16"))
        check_shape(oa, "out", (self.n_seqs, n_q_heads, desc.head_dim))
        check_contiguous(oa, "out")
        return oa, 1.0 / math.sqrt(desc.head_dim) if scale is None else float(scale)

    def _run(self, desc, q_ptr: int, q_stride: int, n_q_heads: int, oa, scale: float, n_threads: int | None, out):
        """The kernel over checked fp32 q rows (at q_ptr, q_stride elements apart) into the checked `oa`."""
        _ensure(
            lib.aiollm_decode_attention(
                desc,
                ffi.cast("float *", q_ptr),
                q_stride,
                self.n_seqs,
                n_q_heads,
                self._tables_ptr,
                self._tables.shape[1],
                self._lens_ptr,
                scale,
                ffi.cast("void *", oa.ptr),
                _DT[oa.dtype],
                _threads(n_threads),
            )
        )
        return out


def _output(out, out_dtype: str | None, shape: tuple[int, int, int]):
    """Allocate the output, or check the one given (its dtype must match out_dtype when both are given)."""
    if out_dtype is not None and out_dtype not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"out_dtype: expected 'fp32', 'fp16' or 'bf16', got {out_dtype!r}")
    if out is None:
        out_dtype = out_dtype or "fp32"
        if out_dtype == "bf16":
            import torch  # bf16 has no numpy dtype

            return torch.empty(shape, dtype=torch.bfloat16)
        return np.empty(shape, dtype=NUMPY_OF[out_dtype])
    oa = describe(out, "out")
    check_dtype(oa, "out", (out_dtype,) if out_dtype else ("fp32", "fp16", "bf16"))
    check_shape(oa, "out", shape)
    check_contiguous(oa, "out")
    return out


def read_sum(buf: np.ndarray, n_threads: int | None = None) -> float:
    """Read every byte of `buf` (a contiguous numpy array, its size a multiple of 64 bytes) as fp32 with the
    ISA in use on the library's pool and return the sum: the read-bandwidth probe of `python -m bench attention`."""
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or buf.nbytes % 64:
        raise ValueError("buf: expected a C-contiguous numpy array whose size is a multiple of 64 bytes")
    return lib.aiollm_read_sum(ffi.cast("void *", buf.ctypes.data), buf.nbytes, _threads(n_threads))


def fma_peak(n_threads: int | None = None, reps: int = 5, n_iters: int = 2_000_000) -> float:
    """The cores' fp32 multiply-add peak in multiply-adds (vector lanes) per second on n_threads threads of the pool:
    the best of `reps` calls of 12 independent FMA chains of the ISA in use (native/fma_peak.c), each n_iters rounds
    per thread. GQA attention over fp16 KV needs 2 / group bytes of KV per multiply-add, so this rate bounds the
    kernel's KV bytes per second whatever the memory does (`python -m bench attention`'s fma_bound_*)."""
    for name, value in (("reps", reps), ("n_iters", n_iters)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    threads = _threads(n_threads)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        lanes = lib.aiollm_fma_peak(n_iters, threads)
        best = max(best, lanes / (time.perf_counter() - t0))
    return best


def pool_size() -> int:
    """Threads the native pool has started (it grows on demand)."""
    return lib.aiollm_pool_size()


__all__ = [
    "DecodeStep",
    "decode_attention",
    "on_gemm_team",
    "kv_write",
    "read_sum",
    "set_num_threads",
    "get_num_threads",
    "isa",
    "supported_isas",
    "force_isa",
    "int8_path",
    "supported_int8_paths",
    "force_int8_path",
    "far_prefetch",
    "force_far_prefetch",
    "fma_peak",
    "pool_size",
]
