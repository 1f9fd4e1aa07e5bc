"""Python side of native/fused_ops.c: the decode step's RMSNorm, RoPE, SiLU(gate)*up and greedy argmax.

Through PyTorch these small ops cost several ATen calls each (fp32 RMSNorm is six), every one with its
dispatch, a temporary and an OpenMP fork/join: measured in a SmolLM2 decode step, fp32 batch 64, norms
+ RoPE + SiLU*up + argmax took ~15 ms of a ~170 ms step. Natively each is one call on the calling
thread (argmax on the library's pool), writing into a buffer the caller may reuse.

`native(x)` says whether a tensor can take this path (CPU, fp32 or bf16); callers keep PyTorch otherwise
(CUDA, fp16). Every argument is checked here before the C call (ValueError naming it); C checks sizes
and positions again and returns a status code.
"""
import torch

from aiollm._native import ffi, lib
from aiollm.kv.attention import get_num_threads

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
