"""native/fused_ops.c against float64 (and PyTorch) references, on every ISA variant, with awkward sizes."""

import pytest
import torch
import torch.nn.functional as F

from aiollm.model.config import ModelConfig
from aiollm.model.rope import RotaryTable, apply_rotary
from aiollm.native import attention, fused_ops

ISAS = [isa for isa in ("ref", "avx512") if isa in attention.supported_isas()]
DIMS = [1, 3, 15, 16, 17, 33, 576, 1023]
# fp32 results are a few fp32 roundings away from the float64 reference (exp: ~2 ulp, then a divide and a
# multiply); bf16 results are rounded once to bf16 (half an ulp, 2^-9 relative) after fp32 math
F32_RTOL, F32_ATOL = 4e-6, 1e-6
BF16_RTOL, BF16_ATOL = 2**-8, 1e-6


@pytest.fixture(params=ISAS)
def isa(request, isa_forced):
    isa_forced(request.param)
    return request.param


def tol(dtype):
    if dtype == torch.float32:
        return {"rtol": F32_RTOL, "atol": F32_ATOL}
    return {"rtol": BF16_RTOL, "atol": BF16_ATOL}


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", DIMS)
def test_rms_norm_matches_float64(isa, dtype, dim):
    wide = rand(5, dim + 7, dtype=dtype, scale=3.0)
    x = wide[:, 3 : 3 + dim]  # rows with a stride
    w = rand(dim, dtype=dtype, seed=1)
    xd = x.double()
    expected = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-5).double(), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_place_and_against_torch(isa, dtype):
    x = rand(7, 576, dtype=dtype, scale=10.0)
    w = rand(576, dtype=dtype, seed=2)
    expected = F.rms_norm(x.float(), (576,), w.float(), 1e-5)
    out = fused_ops.rms_norm(x, w, 1e-5, out=x)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x.float(), expected, **tol(dtype))


def test_rms_norm_of_no_rows_and_zero_rows(isa):
    w = torch.ones(8)
    assert fused_ops.rms_norm(torch.empty(0, 8), w, 1e-5).shape == (0, 8)
    assert torch.equal(fused_ops.rms_norm(torch.zeros(2, 8), w, 1e-5), torch.zeros(2, 8))  # eps keeps it finite


def _rope_setup(dtype, n_q, n_kv, head_dim, n):
    config = ModelConfig(
        n_layers=1,
        hidden=n_q * head_dim,
        n_heads=n_q,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn=8,
        vocab=8,
        rope_theta=10000.0,
        rms_eps=1e-5,
        max_context=300,
    )
    table = RotaryTable(config, dtype)
    qkv = rand(n, (n_q + 2 * n_kv) * head_dim + 5, dtype=dtype, scale=2.0)[:, 5:]
    positions = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(3))
    return table, qkv, positions


@pytest.mark.parametrize("head_dim", [2, 6, 30, 32, 64, 128])
def test_rope_fp32_is_bit_identical_to_apply_rotary(isa, head_dim):
    """apply_rotary computes transformers' x*cos + rotate_half(x)*sin op for op; the kernel must give its bits."""
    n_q, n_kv, n = 3, 1, 9
    table, qkv, positions = _rope_setup(torch.float32, n_q, n_kv, head_dim, n)
    heads = qkv.reshape(n, n_q + 2 * n_kv, head_dim)
    cos, sin = table.gather(positions)
    expected_qk = apply_rotary(heads[:, : n_q + n_kv], cos, sin)
    v_before = heads[:, n_q + n_kv :].clone()
    q = fused_ops.rope_qk(qkv, positions, table.cos, table.sin, n_q, n_kv, q_out=torch.empty(n, n_q * head_dim))
    assert torch.equal(q.reshape(n, n_q, head_dim), expected_qk[:, :n_q])
    assert torch.equal(heads[:, n_q : n_q + n_kv], expected_qk[:, n_q:])  # k rotated in place
    assert torch.equal(heads[:, n_q + n_kv :], v_before)  # v untouched


def test_rope_bf16_into_fp32_q_and_in_place(isa):
    n_q, n_kv, head_dim, n = 9, 3, 64, 11
    table, qkv, positions = _rope_setup(torch.bfloat16, n_q, n_kv, head_dim, n)
    heads = qkv.reshape(n, -1, head_dim).double()
    cos, sin = (t[positions].double().unsqueeze(1) for t in (table.cos, table.sin))
    expected = heads[:, : n_q + n_kv] * cos + heads[:, : n_q + n_kv].roll(head_dim // 2, -1) * sin
    q32 = fused_ops.rope_qk(qkv.clone(), positions, table.cos, table.sin, n_q, n_kv, q_out=torch.empty(n, 576))
    fused_ops.rope_qk(qkv, positions, table.cos, table.sin, n_q, n_kv)  # q in place, in bf16
    torch.testing.assert_close(qkv.reshape(n, -1, head_dim)[:, : n_q + n_kv].double(), expected, **tol(torch.bfloat16))
    # the fp32 q is the bf16 q widened (what an R-worker makes of a bf16 q), not a more precise one
    assert torch.equal(q32, qkv[:, : n_q * head_dim].float())


def test_rope_rejects_positions_beyond_the_table():
    table, qkv, _ = _rope_setup(torch.float32, 2, 1, 8, 2)
    with pytest.raises(ValueError, match="positions: expected positions in \\[0, 300\\)"):
        fused_ops.rope_qk(qkv, torch.tensor([0, 300]), table.cos, table.sin, 2, 1)
    with pytest.raises(ValueError, match="positions"):
        fused_ops.rope_qk(qkv, torch.tensor([0, 1], dtype=torch.int32), table.cos, table.sin, 2, 1)
    with pytest.raises(ValueError, match="n_q_heads, n_kv_heads"):
        fused_ops.rope_qk(qkv, torch.tensor([0, 1]), table.cos, table.sin, 4, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", DIMS + [1536])
def test_silu_mul_matches_float64(isa, dtype, dim):
    gate_up = rand(4, 2 * dim, dtype=dtype, scale=4.0)
    gate_up[0, : min(dim, 4)] = torch.tensor([-100.0, 100.0, 0.0, -20.0], dtype=dtype)[: min(dim, 4)]  # exp limits
    g, u = gate_up.double().chunk(2, dim=-1)
    expected = g * torch.sigmoid(g) * u
    torch.testing.assert_close(fused_ops.silu_mul(gate_up).double(), expected, **tol(dtype))


def test_silu_mul_into_a_strided_out(isa):
    gate_up = rand(3, 34)
    out = torch.full((3, 20), 7.0)
    fused_ops.silu_mul(gate_up, out=out[:, 2:19])
    torch.testing.assert_close(out[:, 2:19], F.silu(gate_up[:, :17]) * gate_up[:, 17:], rtol=F32_RTOL, atol=F32_ATOL)
    assert torch.equal(out[:, :2], torch.full((3, 2), 7.0)) and torch.equal(out[:, 19:], torch.full((3, 1), 7.0))


@pytest.mark.parametrize("width", [1, 3, 15, 16, 17, 33, 1023, 49152])
def test_argmax_matches_torch(isa, width):
    logits = rand(6, width, scale=3.0)
    logits[1] = 0.5  # all tied: the first index
    logits[2, width // 2 :] = logits[2].max() + 1  # ties at the maximum: the first of them
    logits[3] = float("-inf")
    logits[4, width - 1] = 1e9  # the maximum in the tail
    logits[5, width // 3] = float("nan")  # NaN wins, as in torch
    got = fused_ops.argmax(logits, n_threads=2)
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_argmax_of_strided_rows():
    logits = rand(5, 40)
    assert fused_ops.argmax(logits[:, 3:37]).tolist() == logits[:, 3:37].argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fused_ops.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-5), "x: expected a CPU"),
        (lambda: fused_ops.rms_norm(torch.ones(4, 2).t(), torch.ones(4), 1e-5), "x: expected contiguous rows"),
        (lambda: fused_ops.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-5), "weight"),
        (lambda: fused_ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-5, out=torch.ones(3, 4)), "out"),
        (lambda: fused_ops.rms_norm(torch.ones(2, 4), torch.ones(4), -1.0), "rms_norm"),
        (lambda: fused_ops.rms_norm([[1.0]], torch.ones(1), 1e-5), "x: expected a torch tensor"),
        (lambda: fused_ops.silu_mul(torch.ones(2, 5)), "gate_up: expected an even"),
        (lambda: fused_ops.silu_mul(torch.ones(2, 4), out=torch.ones(2, 2, dtype=torch.bfloat16)), "out"),
        (lambda: fused_ops.argmax(torch.ones(2, 4, dtype=torch.bfloat16)), "logits: expected float32"),
        (lambda: fused_ops.argmax(torch.ones(2, 3, 4)), "logits: expected shape"),
    ],
)
def test_bad_arguments_raise_naming_them(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
