"""Python side of native/fused_ops.c: the decode step's RMSNorm, RoPE, SiLU(gate)*up and greedy argmax.

Through PyTorch these small ops cost several ATen calls each (fp32 RMSNorm is six), every one with its
dispatch, a temporary and an OpenMP fork/join: in a SmolLM2 decode step, fp32 batch 64, norms + RoPE +
SiLU*up + argmax take ~15 ms of a ~170 ms step that way. Natively each is one call on the calling
thread (argmax on the GEMMs' OpenMP team), writing into a buffer the caller may reuse.

`layer_pre` / `layer_post` run a whole half-layer (norm, GEMMs, RoPE or SiLU, residuals) as one call: through
Python a layer would be ~12 calls with their checks and allocations (~0.1 ms a layer, a few ms a 30-layer step).

`native(x)` says whether a tensor can take this path (CPU, fp32 or bf16); callers keep PyTorch otherwise
(CUDA, fp16). Every argument is checked here before the C call (ValueError naming it); C checks sizes
and positions again and returns a status code. The half-layer calls check their weights and RoPE tables
once per combination (fixed after load) and only the activations on every call: generic checks of every argument
would be ~50 us of Python a layer, about what a small-batch layer's GEMMs take.
"""

import math
import threading

import torch

from aiollm._native import ffi, lib
from aiollm.native.attention import get_num_threads
from aiollm.native.gemm import PackedWeight

_DT = {torch.float32: lib.AIOLLM_DT_F32, torch.bfloat16: lib.AIOLLM_DT_BF16}
_NULL = ffi.NULL


def native(x: torch.Tensor) -> bool:
    """Whether `x` can go through these kernels: a CPU tensor of fp32 or bf16."""
    return x.device.type == "cpu" and x.dtype in _DT


def _rows(x: torch.Tensor, name: str, width: int | None = None) -> int:
    """Check a 2-D CPU fp32/bf16 tensor whose rows are contiguous; returns its row stride in elements."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if not native(x):
        raise ValueError(f"{name}: expected a CPU tensor of float32 or bfloat16, got {x.dtype} on {x.device}")
    if x.dim() != 2 or (width is not None and x.shape[1] != width):
        raise ValueError(f"{name}: expected shape (n, {width if width is not None else 'dim'}), got {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name}: expected contiguous rows, got strides {x.stride()}")
    return x.stride(0) if x.shape[0] > 1 else x.shape[1]


def _out(out: torch.Tensor | None, n: int, dim: int, dtype: torch.dtype, name: str = "out") -> torch.Tensor:
    if out is None:
        return torch.empty((n, dim), dtype=dtype)
    _rows(out, name, dim)
    if out.shape[0] != n or out.dtype != dtype:
        raise ValueError(f"{name}: expected ({n}, {dim}) of {dtype}, got {tuple(out.shape)} of {out.dtype}")
    return out


def _ptr(x: torch.Tensor):
    return ffi.cast("void *", x.data_ptr())


def _ensure(status: int, what: str) -> None:
    if status != lib.AIOLLM_OK:
        raise ValueError(f"{what}: the native kernel refused the call (status {status})")


def _ensure_positions(status: int, what: str, positions: torch.Tensor, n: int, n_positions: int) -> None:
    """`_ensure`, naming the positions when the kernel refused some outside the model context."""
    if status == lib.AIOLLM_ERR_ARG and n and (int(positions.min()) < 0 or int(positions.max()) >= n_positions):
        raise ValueError(
            f"positions: expected positions in [0, {n_positions}) (the model context), got "
            f"{int(positions.min())}..{int(positions.max())}"
        )
    _ensure(status, what)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) per row of x [n, dim]; weight [dim] of x's dtype. `out` may be x."""
    xs = _rows(x, "x")
    n, dim = x.shape
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dtype != x.dtype
        or weight.shape != (dim,)
        or not weight.is_contiguous()
        or weight.device.type != "cpu"
    ):
        raise ValueError(
            f"weight: expected a contiguous CPU tensor ({dim},) of {x.dtype}, got "
            f"{getattr(weight, 'shape', None)} of {getattr(weight, 'dtype', type(weight).__name__)}"
        )
    out = _out(out, n, dim, x.dtype)
    os = out.stride(0) if n > 1 else dim
    _ensure(lib.aiollm_rms_norm(_ptr(x), xs, _ptr(weight), _ptr(out), os, n, dim, float(eps), _DT[x.dtype]), "rms_norm")
    return out


def rope_qk(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the q and k heads of qkv rows [n, (n_q_heads + n_kv_heads + ...) * head_dim] at `positions`
    (int64 [n]): k in place, q into `q_out` [n, n_q_heads * head_dim] (fp32 or qkv's dtype; None: in place
    in qkv). cos and the sign-folded sin [n_positions, head_dim] (aiollm.model.rope.RotaryTable) of qkv's
    dtype. Returns q_out (or qkv)."""
    rs = _rows(qkv, "qkv")
    n = qkv.shape[0]
    if (
        not isinstance(cos, torch.Tensor)
        or cos.dim() != 2
        or cos.shape != sin.shape
        or cos.dtype != qkv.dtype
        or sin.dtype != qkv.dtype
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        raise ValueError(f"cos, sin: expected two contiguous tables (n_positions, head_dim) of {qkv.dtype}")
    n_positions, head_dim = cos.shape
    if n_q_heads < 0 or n_kv_heads < 0 or (n_q_heads + n_kv_heads) * head_dim > qkv.shape[1]:
        raise ValueError(
            f"n_q_heads, n_kv_heads: {n_q_heads} + {n_kv_heads} heads of {head_dim} do not fit rows of {qkv.shape[1]}"
        )
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dtype != torch.int64
        or positions.shape != (n,)
        or not positions.is_contiguous()
    ):
        raise ValueError(
            f"positions: expected a contiguous int64 tensor ({n},), got "
            f"{getattr(positions, 'shape', type(positions).__name__)}"
        )
    if q_out is None:
        q_out, qs = qkv, rs
    else:
        if q_out.dtype not in (torch.float32, qkv.dtype):
            raise ValueError(f"q_out: expected float32 or {qkv.dtype}, got {q_out.dtype}")
        _out(q_out, n, n_q_heads * head_dim, q_out.dtype, "q_out")
        qs = q_out.stride(0) if n > 1 else n_q_heads * head_dim
    status = lib.aiollm_rope_qk(
        _ptr(qkv),
        rs,
        n,
        n_q_heads,
        n_kv_heads,
        head_dim,
        ffi.cast("int64_t *", positions.data_ptr()),
        _ptr(cos),
        _ptr(sin),
        n_positions,
        _ptr(q_out),
        qs,
        _DT[q_out.dtype],
        _DT[qkv.dtype],
    )
    _ensure_positions(status, "rope_qk", positions, n, n_positions)
    return q_out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for rows gate_up [n, 2 * dim] = [gate | up]; returns (or fills) out [n, dim]."""
    gs = _rows(gate_up, "gate_up")
    n, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up: expected an even row length [gate | up], got {width}")
    out = _out(out, n, width // 2, gate_up.dtype)
    os = out.stride(0) if n > 1 else width // 2
    _ensure(lib.aiollm_silu_mul(_ptr(gate_up), gs, _ptr(out), os, n, width // 2, _DT[gate_up.dtype]), "silu_mul")
    return out


def argmax(logits: torch.Tensor, n_threads: int | None = None) -> torch.Tensor:
    """int64 [n]: each fp32 row's first maximal index (the first NaN's if it has one), as torch.argmax."""
    ls = _rows(logits, "logits")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits: expected float32, got {logits.dtype}")
    n, width = logits.shape
    out = torch.empty(n, dtype=torch.int64)
    if n and not width:
        raise ValueError("logits: expected at least one column")
    _ensure(
        lib.aiollm_argmax_rows(
            ffi.cast("float *", logits.data_ptr()),
            ls,
            n,
            width,
            ffi.cast("int64_t *", out.data_ptr()),
            n_threads or get_num_threads(),
        ),
        "argmax",
    )
    return out


def _whole(x, dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """A contiguous CPU tensor of exactly this dtype and shape."""
    return (
        isinstance(x, torch.Tensor) and x.dtype is dtype and tuple(x.shape) == shape and x.is_contiguous() and x.is_cpu
    )


def _check_whole(x, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if not _whole(x, dtype, shape):
        raise ValueError(
            f"{name}: expected a contiguous CPU tensor {shape} of {dtype}, got "
            f"{getattr(x, 'shape', type(x).__name__)} of {getattr(x, 'dtype', None)}"
            f"{'' if not isinstance(x, torch.Tensor) or x.is_contiguous() else ' (not contiguous)'}"
            f"{'' if not isinstance(x, torch.Tensor) or x.is_cpu else f' on {x.device}'}"
        )


def _packed(w, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if not isinstance(w, PackedWeight) or w.dtype != dtype or tuple(w.shape) != shape:
        raise ValueError(f"{name}: expected a PackedWeight {shape} of {dtype}, got {w!r}")


# The per-layer constants (weights, norm weights, RoPE tables) are fixed after load, so each combination is
# checked once and its pointers kept: the key holds ids, the value holds the objects themselves, so an id
# cannot be reused by another object while its entry lives. Bounded so that callers passing fresh tensors
# every call (tests, one-off use) cannot grow it without limit.
_CHECKED: dict[tuple, tuple] = {}
_CHECKED_MAX = 1024


def _remember(key: tuple, value: tuple) -> tuple:
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[key] = value
    return value


class _Scratch(threading.local):
    """Each thread's reused scratch (the half-layers' xn, gate_up, act never leave the C call): a fresh
    torch.empty of a few hundred KB per call is a fresh mmap whose pages fault in every time."""

    buf: torch.Tensor | None = None


_SCRATCH = _Scratch()


def _scratch(nbytes: int) -> int:
    """Address of at least nbytes of this thread's scratch, 64-byte aligned (valid until its next call here)."""
    buf = _SCRATCH.buf
    if buf is None or buf.numel() < nbytes:
        buf = _SCRATCH.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buf.data_ptr()


def _up64(nbytes: int) -> int:
    return (nbytes + 63) & ~63


def _pre_constants(norm_weight, w_qkv, head_dim: int, cos, sin) -> tuple:
    """(dtype, hidden, n_qkv, norm ptr, w_qkv ptr, cos ptr, sin ptr, n_positions, dtype code), checked once."""
    key = (id(norm_weight), id(w_qkv), id(cos), id(sin), head_dim)
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit[4:]
    if not isinstance(w_qkv, PackedWeight):
        raise ValueError(f"w_qkv: expected a PackedWeight, got {w_qkv!r}")
    dtype, (n_qkv, hidden) = w_qkv.dtype, w_qkv.shape
    _check_whole(
        norm_weight.view(1, -1) if isinstance(norm_weight, torch.Tensor) else norm_weight,
        "norm_weight",
        dtype,
        (1, hidden),
    )
    if not isinstance(cos, torch.Tensor) or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos: expected a table (n_positions, {head_dim}), got {getattr(cos, 'shape', cos)}")
    _check_whole(cos, "cos", dtype, tuple(cos.shape))
    _check_whole(sin, "sin", dtype, tuple(cos.shape))
    return _remember(
        key,
        (
            norm_weight,
            w_qkv,
            cos,
            sin,
            dtype,
            hidden,
            n_qkv,
            _ptr(norm_weight),
            w_qkv._ptr,
            _ptr(cos),
            _ptr(sin),
            cos.shape[0],
            _DT[dtype],
        ),
    )[4:]


def _post_constants(w_o, norm_weight, w_gate_up, w_down) -> tuple:
    """(dtype, hidden, q_size, ffn, w_o ptr, norm ptr, w_gate_up ptr, w_down ptr, dtype code), checked once."""
    key = (id(w_o), id(norm_weight), id(w_gate_up), id(w_down))
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit[4:]
    if not isinstance(w_o, PackedWeight):
        raise ValueError(f"w_o: expected a PackedWeight, got {w_o!r}")
    dtype, (hidden, q_size) = w_o.dtype, w_o.shape
    ffn = w_gate_up.shape[0] // 2 if isinstance(w_gate_up, PackedWeight) else -1
    _packed(w_gate_up, "w_gate_up", dtype, (2 * ffn, hidden))
    _packed(w_down, "w_down", dtype, (hidden, ffn))
    _check_whole(
        norm_weight.view(1, -1) if isinstance(norm_weight, torch.Tensor) else norm_weight,
        "norm_weight",
        dtype,
        (1, hidden),
    )
    return _remember(
        key,
        (
            w_o,
            norm_weight,
            w_gate_up,
            w_down,
            dtype,
            hidden,
            q_size,
            ffn,
            w_o._ptr,
            _ptr(norm_weight),
            w_gate_up._ptr,
            w_down._ptr,
            _DT[dtype],
        ),
    )[4:]


def _activation(x, name: str, dtype: torch.dtype, n: int, width: int) -> None:
    """Check a per-call activation with direct attribute reads (these calls run 60 times a decode step)."""
    if not (
        type(x) is torch.Tensor
        and x.dtype is dtype
        and x.is_cpu
        and x.is_contiguous()
        and x.dim() == 2
        and x.shape[0] == n
        and x.shape[1] == width
    ):
        _check_whole(x, name, dtype, (n, width))


def _positions(positions, n: int) -> None:
    """Check per-call positions (int64 [n], contiguous, on the CPU) as `_activation` checks an activation."""
    if not (
        type(positions) is torch.Tensor
        and positions.dtype is torch.int64
        and positions.is_cpu
        and positions.dim() == 1
        and positions.shape[0] == n
        and positions.is_contiguous()
    ):
        _check_whole(
            positions.view(1, -1) if isinstance(positions, torch.Tensor) else positions,
            "positions",
            torch.int64,
            (1, n),
        )


def _write_target(name: str, target, n: int, n_kv_heads: int, head_dim: int):
    """(cache, slots) of a `native_write_target` (cache, slots, n_slots), checked against the rows it will store."""
    kv, slots, n_slots = target
    if n_slots != n or kv.n_kv_heads != n_kv_heads or kv.head_dim != head_dim:
        raise ValueError(
            f"{name}: expected {n} slots of a cache with {n_kv_heads} heads of {head_dim}, got "
            f"{n_slots} slots, {kv.n_kv_heads} heads of {kv.head_dim}"
        )
    return kv, slots


def layer_pre(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_qkv: PackedWeight,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor | None = None,
    n_threads: int | None = None,
    kv_target=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's S-part before attention in one native call: qkv = RMSNorm(h) @ w_qkv.T, then `rope_qk` on it.

    h [n, hidden] contiguous, of the weights' dtype; positions int64 [n]; cos, sin as for `rope_qk`; q_out
    [n, n_q_heads * head_dim] contiguous (fp32 or h's dtype) receives q (None: q stays in place in qkv).
    kv_target (optional): `DecodeStep.native_write_target(layer)` of a step over these n rows; each row's
    rotated k and its v are then also stored in that cache layer, as `DecodeStep.write` stores them, by the
    thread that rotated the row while it is in cache (a separate write would reach the rows from memory, ~5
    ms of a SmolLM2 fp32 batch-64 step).
    Returns (qkv [n, n_qkv], q_out or None). Bits equal rms_norm, gemm and rope_qk called one by one.
    The weights and tables are checked on their first call (they must not be resized or moved afterwards);
    h, positions and q_out on every call."""
    dtype, hidden, n_qkv, p_norm, p_w, p_cos, p_sin, n_positions, code = _pre_constants(
        norm_weight, w_qkv, head_dim, cos, sin
    )
    n = h.shape[0] if isinstance(h, torch.Tensor) and h.dim() == 2 else -1
    _activation(h, "h", dtype, n, hidden)
    _positions(positions, n)
    q_size = n_q_heads * head_dim
    qkv = torch.empty((n, n_qkv), dtype=dtype)
    if q_out is None:
        target, stride, target_code = qkv, n_qkv, code
    else:
        if not (isinstance(q_out, torch.Tensor) and q_out.dtype in (torch.float32, dtype)):
            raise ValueError(f"q_out: expected float32 or {dtype}, got {getattr(q_out, 'dtype', type(q_out).__name__)}")
        _activation(q_out, "q_out", q_out.dtype, n, q_size)
        target, stride, target_code = q_out, q_size, _DT[q_out.dtype]
    kv, slots = _NULL, _NULL
    if kv_target is not None:
        kv, slots = _write_target("kv_target", kv_target, n, n_kv_heads, head_dim)
    status = lib.aiollm_layer_pre_kv(
        _ptr(h),
        n,
        hidden,
        p_norm,
        eps,
        p_w,
        n_qkv,
        ffi.cast("void *", _scratch(n * hidden * h.element_size())),
        _ptr(qkv),
        n_q_heads,
        n_kv_heads,
        head_dim,
        ffi.cast("int64_t *", positions.data_ptr()),
        p_cos,
        p_sin,
        n_positions,
        _ptr(target),
        stride,
        target_code,
        code,
        kv,
        slots,
        n_threads or torch.get_num_threads(),
    )
    if status != lib.AIOLLM_OK:
        if status == lib.AIOLLM_ERR_SLOT:
            raise ValueError("kv_target: a slot lies outside the cache layer")
        _ensure_positions(status, "layer_pre", positions, n, n_positions)
    return qkv, q_out


def layer_post(
    h: torch.Tensor,
    attn: torch.Tensor,
    w_o: PackedWeight,
    norm_weight: torch.Tensor,
    eps: float,
    w_gate_up: PackedWeight,
    w_down: PackedWeight,
    out: torch.Tensor | None = None,
    n_threads: int | None = None,
) -> torch.Tensor:
    """A layer's S-part after attention in one native call: h2 = h + attn @ w_o.T, then
    h2 + silu_mul(RMSNorm(h2) @ w_gate_up.T) @ w_down.T, into `out` (may be h; None: a new tensor).

    h [n, hidden] and attn [n, q_size] contiguous, of the weights' dtype. Bits equal the ops called one by one.
    The weights are checked on their first call (they must not be resized or moved afterwards); h, attn and
    out on every call."""
    dtype, hidden, q_size, ffn, p_o, p_norm, p_gate_up, p_down, code = _post_constants(
        w_o, norm_weight, w_gate_up, w_down
    )
    n = h.shape[0] if isinstance(h, torch.Tensor) and h.dim() == 2 else -1
    _activation(h, "h", dtype, n, hidden)
    _activation(attn, "attn", dtype, n, q_size)
    if out is None:
        out = torch.empty((n, hidden), dtype=dtype)
    else:
        _activation(out, "out", dtype, n, hidden)
    size = h.element_size()
    xn_bytes, gate_up_bytes = _up64(n * hidden * size), _up64(n * 2 * ffn * size)
    base = _scratch(xn_bytes + gate_up_bytes + n * ffn * size)
    _ensure(
        lib.aiollm_layer_post(
            _ptr(h),
            _ptr(attn),
            _ptr(out),
            n,
            hidden,
            q_size,
            ffn,
            p_o,
            p_norm,
            eps,
            p_gate_up,
            p_down,
            ffi.cast("void *", base),
            ffi.cast("void *", base + xn_bytes),
            ffi.cast("void *", base + xn_bytes + gate_up_bytes),
            code,
            n_threads or torch.get_num_threads(),
        ),
        "layer_post",
    )
    return out


def seconds_buffer():
    """A zeroed cffi double[2] for `decode_layers`' seconds (S-part halves, attention)."""
    return ffi.new("double[2]")


def decode_layers(
    h: torch.Tensor,
    layers,
    eps: float,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_step,
    q: torch.Tensor,
    attn_out: torch.Tensor,
    n_threads: int | None = None,
    attn_threads: int | None = None,
    seconds=None,
) -> torch.Tensor:
    """Every layer of a decode step in one native call: per layer `layer_pre` (q into `q`, k and v stored by
    `kv_step`), decode attention over `kv_step`'s pool into `attn_out`, and `layer_post` updating h in place.

    Per layer through Python these would be three calls with their checks, views and allocations: ~8-11 ms of a
    SmolLM2 fp32 batch-64 step (~8 %), while the OpenMP team waits. Same functions, same order, same bits.
    h [n, hidden] contiguous of the weights' dtype (updated and returned); layers: per layer (attn_norm, w_qkv,
    w_o, mlp_norm, w_gate_up, w_down); positions, cos, sin as for `layer_pre`; kv_step a `KVPool.prepare_decode`
    step over these n rows (its checked block tables and lengths are the attention's); q fp32 [n, n_q_heads, head_dim] and attn_out [n, n_q_heads, head_dim] of h's dtype, contiguous.
    seconds: None, or a cffi double[2] to which the S-part halves' and the attention's wall seconds are added."""
    n = h.shape[0] if isinstance(h, torch.Tensor) and h.dim() == 2 else -1
    arr = ffi.new("aiollm_decode_layer[]", len(layers))
    pre = post = None
    for i, (attn_norm, w_qkv, w_o, mlp_norm, w_gate_up, w_down) in enumerate(layers):
        pre = _pre_constants(attn_norm, w_qkv, head_dim, cos, sin)
        post = _post_constants(w_o, mlp_norm, w_gate_up, w_down)
        if post[0] != pre[0] or post[1] != pre[1]:
            raise ValueError(f"layer {i}: the post-attention weights' dtype or width differ from w_qkv's")
        kv, slots = _write_target("kv_step", kv_step.native_write_target(i), n, n_kv_heads, head_dim)
        a = arr[i]
        a.attn_norm, a.w_qkv, a.w_o, a.mlp_norm, a.w_gate_up, a.w_down, a.kv = (
            pre[3],
            pre[4],
            post[4],
            post[5],
            post[6],
            post[7],
            kv,
        )
    if pre is None:
        return h
    dtype, hidden, n_qkv, _, _, p_cos, p_sin, n_positions, code = pre
    ffn, q_size = post[3], n_q_heads * head_dim
    if post[2] != q_size:
        raise ValueError(f"w_o: expected {q_size} input columns (n_q_heads * head_dim), got {post[2]}")
    _activation(h, "h", dtype, n, hidden)
    _positions(positions, n)
    _activation(
        q.view(n, -1) if isinstance(q, torch.Tensor) and q.is_contiguous() else q, "q", torch.float32, n, q_size
    )
    _activation(
        attn_out.view(n, -1) if isinstance(attn_out, torch.Tensor) and attn_out.is_contiguous() else attn_out,
        "attn_out",
        dtype,
        n,
        q_size,
    )
    tables, max_blocks, lens = kv_step.native_attention_tables()
    size = h.element_size()
    xn_bytes, qkv_bytes, gate_up_bytes = _up64(n * hidden * size), _up64(n * n_qkv * size), _up64(n * 2 * ffn * size)
    base = _scratch(xn_bytes + qkv_bytes + gate_up_bytes + n * ffn * size)
    status = lib.aiollm_decode_layers(
        _ptr(h),
        n,
        len(layers),
        arr,
        hidden,
        n_qkv,
        ffn,
        eps,
        n_q_heads,
        n_kv_heads,
        head_dim,
        ffi.cast("int64_t *", positions.data_ptr()),
        p_cos,
        p_sin,
        n_positions,
        slots,
        tables,
        max_blocks,
        lens,
        1.0 / math.sqrt(head_dim),
        ffi.cast("void *", base),
        ffi.cast("void *", base + xn_bytes),
        ffi.cast("float *", q.data_ptr()),
        _ptr(attn_out),
        ffi.cast("void *", base + xn_bytes + qkv_bytes),
        ffi.cast("void *", base + xn_bytes + qkv_bytes + gate_up_bytes),
        code,
        n_threads or torch.get_num_threads(),
        attn_threads or get_num_threads(),
        _NULL if seconds is None else seconds,
    )
    _ensure_positions(status, "decode_layers", positions, n, n_positions)
    return h
