"""Python side of native/fused_ops.c: the decode step's RMSNorm, RoPE, SiLU(gate)*up and greedy argmax.

Through PyTorch these small ops cost several ATen calls each (fp32 RMSNorm is six), every one with its
dispatch, a temporary and an OpenMP fork/join: measured in a SmolLM2 decode step, fp32 batch 64, norms
+ RoPE + SiLU*up + argmax took ~15 ms of a ~170 ms step. Natively each is one call on the calling
thread (argmax on the library's pool), writing into a buffer the caller may reuse.

`layer_pre` / `layer_post` run a whole half-layer (norm, GEMMs, RoPE or SiLU, residuals) as one call: through
Python a layer was ~12 calls with their checks and allocations (~0.1 ms a layer, a few ms a 30-layer step).

`native(x)` says whether a tensor can take this path (CPU, fp32 or bf16); callers keep PyTorch otherwise
(CUDA, fp16). Every argument is checked here before the C call (ValueError naming it); C checks sizes
and positions again and returns a status code.
"""
import torch

from aiollm._native import ffi, lib
from aiollm.kv.attention import get_num_threads
from aiollm.model.gemm import PackedWeight

_DT = {torch.float32: lib.AIOLLM_DT_F32, torch.bfloat16: lib.AIOLLM_DT_BF16}


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) per row of x [n, dim]; weight [dim] of x's dtype. `out` may be x."""
    xs = _rows(x, "x")
    n, dim = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dtype != x.dtype or weight.shape != (dim,) or \
            not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(f"weight: expected a contiguous CPU tensor ({dim},) of {x.dtype}, got "
                         f"{getattr(weight, 'shape', None)} of {getattr(weight, 'dtype', type(weight).__name__)}")
    out = _out(out, n, dim, x.dtype)
    os = out.stride(0) if n > 1 else dim
    _ensure(lib.aiollm_rms_norm(_ptr(x), xs, _ptr(weight), _ptr(out), os, n, dim, float(eps), _DT[x.dtype]),
            "rms_norm")
    return out


def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int,
            n_kv_heads: int, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the q and k heads of qkv rows [n, (n_q_heads + n_kv_heads + ...) * head_dim] at `positions`
    (int64 [n]): k in place, q into `q_out` [n, n_q_heads * head_dim] (fp32 or qkv's dtype; None: in place
    in qkv). cos and the sign-folded sin [n_positions, head_dim] (aiollm.model.rope.RotaryTable) of qkv's
    dtype. Returns q_out (or qkv)."""
    rs = _rows(qkv, "qkv")
    n = qkv.shape[0]
    if not isinstance(cos, torch.Tensor) or cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != qkv.dtype \
            or sin.dtype != qkv.dtype or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos, sin: expected two contiguous tables (n_positions, head_dim) of {qkv.dtype}")
    n_positions, head_dim = cos.shape
    if n_q_heads < 0 or n_kv_heads < 0 or (n_q_heads + n_kv_heads) * head_dim > qkv.shape[1]:
        raise ValueError(f"n_q_heads, n_kv_heads: {n_q_heads} + {n_kv_heads} heads of {head_dim} do not fit "
                         f"rows of {qkv.shape[1]}")
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.shape != (n,) or \
            not positions.is_contiguous():
        raise ValueError(f"positions: expected a contiguous int64 tensor ({n},), got "
                         f"{getattr(positions, 'shape', type(positions).__name__)}")
    if q_out is None:
        q_out, qs = qkv, rs
    else:
        if q_out.dtype not in (torch.float32, qkv.dtype):
            raise ValueError(f"q_out: expected float32 or {qkv.dtype}, got {q_out.dtype}")
        _out(q_out, n, n_q_heads * head_dim, q_out.dtype, "q_out")
        qs = q_out.stride(0) if n > 1 else n_q_heads * head_dim
    status = lib.aiollm_rope_qk(_ptr(qkv), rs, n, n_q_heads, n_kv_heads, head_dim,
                                ffi.cast("int64_t *", positions.data_ptr()), _ptr(cos), _ptr(sin), n_positions,
                                _ptr(q_out), qs, _DT[q_out.dtype], _DT[qkv.dtype])
    if status == lib.AIOLLM_ERR_ARG and n and (int(positions.min()) < 0 or int(positions.max()) >= n_positions):
        raise ValueError(f"positions: expected positions in [0, {n_positions}) (the model context), got "
                         f"{int(positions.min())}..{int(positions.max())}")
    _ensure(status, "rope_qk")
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
    _ensure(lib.aiollm_argmax_rows(ffi.cast("float *", logits.data_ptr()), ls, n, width,
                                   ffi.cast("int64_t *", out.data_ptr()), n_threads or get_num_threads()), "argmax")
    return out


def _whole(x, dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """A contiguous CPU tensor of exactly this dtype and shape (checked with few attribute reads: these
    calls run 60 times a decode step)."""
    return isinstance(x, torch.Tensor) and x.dtype is dtype and tuple(x.shape) == shape and x.is_contiguous() \
        and x.device.type == "cpu"


def _check_whole(x, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if not _whole(x, dtype, shape):
        raise ValueError(f"{name}: expected a contiguous CPU tensor {shape} of {dtype}, got "
                         f"{getattr(x, 'shape', type(x).__name__)} of {getattr(x, 'dtype', None)}")


def _packed(w, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if not isinstance(w, PackedWeight) or w.dtype != dtype or tuple(w.shape) != shape:
        raise ValueError(f"{name}: expected a PackedWeight {shape} of {dtype}, got {w!r}")


def layer_pre(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, w_qkv: PackedWeight, n_q_heads: int,
              n_kv_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_out: torch.Tensor | None = None, n_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's S-part before attention in one native call: qkv = RMSNorm(h) @ w_qkv.T, then `rope_qk` on it.

    h [n, hidden] contiguous, of the weights' dtype; positions int64 [n]; cos, sin as for `rope_qk`; q_out
    [n, n_q_heads * head_dim] contiguous (fp32 or h's dtype) receives q (None: q stays in place in qkv).
    Returns (qkv [n, n_qkv], q_out or None). Bits equal rms_norm, gemm and rope_qk called one by one."""
    n, hidden = h.shape if isinstance(h, torch.Tensor) and h.dim() == 2 else (-1, -1)
    dtype = w_qkv.dtype if isinstance(w_qkv, PackedWeight) else None
    _check_whole(h, "h", dtype, (n, hidden))
    n_qkv = w_qkv.shape[0]
    _packed(w_qkv, "w_qkv", dtype, (n_qkv, hidden))
    _check_whole(norm_weight.view(1, -1) if isinstance(norm_weight, torch.Tensor) else norm_weight, "norm_weight",
                 dtype, (1, hidden))
    _check_whole(positions.view(1, -1) if isinstance(positions, torch.Tensor) else positions, "positions",
                 torch.int64, (1, n))
    if not isinstance(cos, torch.Tensor) or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos: expected a table (n_positions, {head_dim}), got {getattr(cos, 'shape', cos)}")
    _check_whole(cos, "cos", dtype, tuple(cos.shape))
    _check_whole(sin, "sin", dtype, tuple(cos.shape))
    q_size = n_q_heads * head_dim
    qkv = torch.empty((n, n_qkv), dtype=dtype)
    if q_out is not None:
        if not (isinstance(q_out, torch.Tensor) and q_out.dtype in (torch.float32, dtype)):
            raise ValueError(f"q_out: expected float32 or {dtype}, got {getattr(q_out, 'dtype', type(q_out).__name__)}")
        _check_whole(q_out, "q_out", q_out.dtype, (n, q_size))
    target, stride = (qkv, n_qkv) if q_out is None else (q_out, q_size)
    xn = torch.empty((n, hidden), dtype=dtype)
    status = lib.aiollm_layer_pre(_ptr(h), n, hidden, _ptr(norm_weight), float(eps), w_qkv._ptr, n_qkv, _ptr(xn),
                                  _ptr(qkv), n_q_heads, n_kv_heads, head_dim,
                                  ffi.cast("int64_t *", positions.data_ptr()), _ptr(cos), _ptr(sin), cos.shape[0],
                                  _ptr(target), stride, _DT[target.dtype], _DT[dtype],
                                  n_threads or torch.get_num_threads())
    if status == lib.AIOLLM_ERR_ARG and n and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"positions: expected positions in [0, {cos.shape[0]}) (the model context), got "
                         f"{int(positions.min())}..{int(positions.max())}")
    _ensure(status, "layer_pre")
    return qkv, q_out


def layer_post(h: torch.Tensor, attn: torch.Tensor, w_o: PackedWeight, norm_weight: torch.Tensor, eps: float,
               w_gate_up: PackedWeight, w_down: PackedWeight, out: torch.Tensor | None = None,
               n_threads: int | None = None) -> torch.Tensor:
    """A layer's S-part after attention in one native call: h2 = h + attn @ w_o.T, then
    h2 + silu_mul(RMSNorm(h2) @ w_gate_up.T) @ w_down.T, into `out` (may be h; None: a new tensor).

    h [n, hidden] and attn [n, q_size] contiguous, of the weights' dtype. Bits equal the ops called one by one."""
    n, hidden = h.shape if isinstance(h, torch.Tensor) and h.dim() == 2 else (-1, -1)
    dtype = w_o.dtype if isinstance(w_o, PackedWeight) else None
    _check_whole(h, "h", dtype, (n, hidden))
    q_size = w_o.shape[1]
    _packed(w_o, "w_o", dtype, (hidden, q_size))
    _check_whole(attn, "attn", dtype, (n, q_size))
    ffn = w_gate_up.shape[0] // 2 if isinstance(w_gate_up, PackedWeight) else -1
    _packed(w_gate_up, "w_gate_up", dtype, (2 * ffn, hidden))
    _packed(w_down, "w_down", dtype, (hidden, ffn))
    _check_whole(norm_weight.view(1, -1) if isinstance(norm_weight, torch.Tensor) else norm_weight, "norm_weight",
                 dtype, (1, hidden))
    if out is None:
        out = torch.empty((n, hidden), dtype=dtype)
    else:
        _check_whole(out, "out", dtype, (n, hidden))
    xn, gate_up, act = (torch.empty((n, width), dtype=dtype) for width in (hidden, 2 * ffn, ffn))
    _ensure(lib.aiollm_layer_post(_ptr(h), _ptr(attn), _ptr(out), n, hidden, q_size, ffn, w_o._ptr, _ptr(norm_weight),
                                  float(eps), w_gate_up._ptr, w_down._ptr, _ptr(xn), _ptr(gate_up), _ptr(act), _DT[dtype],
                                  n_threads or torch.get_num_threads()), "layer_post")
    return out
