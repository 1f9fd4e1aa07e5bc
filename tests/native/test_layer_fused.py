"""fused_ops.layer_pre / layer_post (one native call per half-layer) against the ops called one by one
(same bits) and against a float64 reference of the whole half-layer."""

import numpy as np
import pytest
import torch

from aiollm.model.config import ModelConfig
from aiollm.model.rope import RotaryTable
from aiollm.native import fused_ops, gemm

DTYPES = [d for d in (torch.float32, torch.bfloat16) if gemm.supported(d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="this CPU has no native GEMM (AVX-512)")

HIDDEN, N_Q, N_KV, HEAD_DIM, FFN, EPS = 96, 3, 1, 32, 160, 1e-5
# rows: one, a tile tail, past the row-split threshold of the norms and SiLU, past the GEMM's 256-row chunk
ROWS = [1, 5, 64, 300]


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _pre_setup(dtype, n):
    config = ModelConfig(
        n_layers=1,
        hidden=HIDDEN,
        n_heads=N_Q,
        n_kv_heads=N_KV,
        head_dim=HEAD_DIM,
        ffn=FFN,
        vocab=8,
        rope_theta=10000.0,
        rms_eps=EPS,
        max_context=512,
    )
    table = RotaryTable(config, dtype)
    n_qkv = (N_Q + 2 * N_KV) * HEAD_DIM
    w = rand(n_qkv, HIDDEN, dtype=dtype, scale=0.2, seed=1)
    return (
        table,
        rand(n, HIDDEN, dtype=dtype, scale=2.0),
        rand(HIDDEN, dtype=dtype, seed=2),
        w,
        gemm.PackedWeight(w),
        torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(3)),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_layer_pre_equals_the_ops_one_by_one(dtype, n, n_threads):
    table, h, norm_w, _, packed, positions = _pre_setup(dtype, n)
    qkv = gemm.gemm(fused_ops.rms_norm(h, norm_w, EPS), packed)
    q32 = fused_ops.rope_qk(qkv, positions, table.cos, table.sin, N_Q, N_KV, torch.empty(n, N_Q * HEAD_DIM))
    got_qkv, got_q32 = fused_ops.layer_pre(
        h,
        norm_w,
        EPS,
        packed,
        N_Q,
        N_KV,
        HEAD_DIM,
        positions,
        table.cos,
        table.sin,
        torch.empty(n, N_Q * HEAD_DIM),
        n_threads=n_threads,
    )
    assert torch.equal(got_q32, q32)
    assert torch.equal(got_qkv[:, N_Q * HEAD_DIM :], qkv[:, N_Q * HEAD_DIM :])  # k rotated in place, v as is
    in_place, none = fused_ops.layer_pre(
        h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin, n_threads=n_threads
    )
    assert none is None
    assert torch.equal(in_place[:, : N_Q * HEAD_DIM], q32.to(dtype))  # q rotated in place in qkv
    assert torch.equal(in_place[:, N_Q * HEAD_DIM :], qkv[:, N_Q * HEAD_DIM :])


def test_layer_pre_matches_float64():
    n = 9
    table, h, norm_w, w, packed, positions = _pre_setup(torch.float32, n)
    hd = h.double()
    xn = norm_w.double() * hd / torch.sqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)
    qkv = (xn @ w.double().T).view(n, N_Q + 2 * N_KV, HEAD_DIM)
    cos, sin = (t.double()[positions].unsqueeze(1) for t in (table.cos, table.sin))  # sin sign-folded
    qk = qkv[:, : N_Q + N_KV]
    rotated = qk * cos + qk.roll(HEAD_DIM // 2, -1) * sin
    got, _ = fused_ops.layer_pre(h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)
    got = got.view(n, N_Q + 2 * N_KV, HEAD_DIM).double()
    scale = rotated.abs().max()
    assert (got[:, : N_Q + N_KV] - rotated).abs().max() <= 2e-5 * scale
    assert (got[:, N_Q + N_KV :] - qkv[:, N_Q + N_KV :]).abs().max() <= 2e-5 * scale


def _post_setup(dtype, n):
    q_size = N_Q * HEAD_DIM
    dense = {
        "o": rand(HIDDEN, q_size, dtype=dtype, scale=0.1, seed=4),
        "gate_up": rand(2 * FFN, HIDDEN, dtype=dtype, scale=0.1, seed=5),
        "down": rand(HIDDEN, FFN, dtype=dtype, scale=0.1, seed=6),
    }
    packed = {name: gemm.PackedWeight(w) for name, w in dense.items()}
    return (
        rand(n, HIDDEN, dtype=dtype, scale=2.0),
        rand(n, q_size, dtype=dtype, seed=7),
        rand(HIDDEN, dtype=dtype, seed=8),
        dense,
        packed,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_layer_post_equals_the_ops_one_by_one(dtype, n, n_threads):
    h, attn, norm_w, _, p = _post_setup(dtype, n)
    h2 = gemm.gemm(attn, p["o"], h)
    act = fused_ops.silu_mul(gemm.gemm(fused_ops.rms_norm(h2, norm_w, EPS), p["gate_up"]))
    expected = gemm.gemm(act, p["down"], h2)
    got = fused_ops.layer_post(h, attn, p["o"], norm_w, EPS, p["gate_up"], p["down"], n_threads=n_threads)
    assert torch.equal(got, expected)
    h_copy = h.clone()
    same = fused_ops.layer_post(
        h_copy, attn, p["o"], norm_w, EPS, p["gate_up"], p["down"], out=h_copy, n_threads=n_threads
    )
    assert same.data_ptr() == h_copy.data_ptr() and torch.equal(h_copy, expected)


def test_layer_post_matches_float64():
    n = 11
    h, attn, norm_w, w, p = _post_setup(torch.float32, n)
    hd = h.double()
    h2 = hd + attn.double() @ w["o"].double().T
    xn = norm_w.double() * h2 / torch.sqrt(h2.pow(2).mean(-1, keepdim=True) + EPS)
    gate, up = (xn @ w["gate_up"].double().T).chunk(2, dim=-1)
    expected = h2 + (gate * torch.sigmoid(gate) * up) @ w["down"].double().T
    got = fused_ops.layer_post(h, attn, p["o"], norm_w, EPS, p["gate_up"], p["down"]).double()
    assert np.abs((got - expected).numpy()).max() <= 2e-5 * expected.abs().max().item()


def test_layer_calls_reject_bad_arguments_naming_them():
    dtype = DTYPES[0]
    table, h, norm_w, _, packed, positions = _pre_setup(dtype, 4)
    with pytest.raises(ValueError, match="positions"):
        fused_ops.layer_pre(h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions + 512, table.cos, table.sin)
    with pytest.raises(ValueError, match="h:"):
        fused_ops.layer_pre(h[:, :-1], norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)
    with pytest.raises(ValueError, match="q_out"):
        fused_ops.layer_pre(
            h,
            norm_w,
            EPS,
            packed,
            N_Q,
            N_KV,
            HEAD_DIM,
            positions,
            table.cos,
            table.sin,
            torch.empty(4, N_Q * HEAD_DIM, dtype=torch.float64),
        )
    h, attn, norm_w, _, p = _post_setup(dtype, 4)
    with pytest.raises(ValueError, match="attn"):
        fused_ops.layer_post(h, attn[:3], p["o"], norm_w, EPS, p["gate_up"], p["down"])
    with pytest.raises(ValueError, match="w_down"):
        fused_ops.layer_post(h, attn, p["o"], norm_w, EPS, p["gate_up"], p["o"])


def test_checked_weights_still_reject_bad_activations_on_later_calls():
    """The weights are checked once and cached; h, positions, q_out, attn and out are checked on every call,
    and the message names the argument with the expected and the actual shape or dtype."""
    dtype = DTYPES[0]
    table, h, norm_w, _, packed, positions = _pre_setup(dtype, 4)
    fused_ops.layer_pre(h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)  # cached
    other = torch.float64
    with pytest.raises(ValueError, match=rf"h: expected .*\(4, {HIDDEN}\) of {dtype}, got .* of {other}"):
        fused_ops.layer_pre(h.to(other), norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)
    wide = torch.cat([h, h], 1)[:, :HIDDEN]
    with pytest.raises(ValueError, match="h: .*not contiguous"):
        fused_ops.layer_pre(wide, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)
    with pytest.raises(ValueError, match="positions: .*torch.int64, got .*torch.int32"):
        fused_ops.layer_pre(h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions.int(), table.cos, table.sin)
    with pytest.raises(ValueError, match=r"positions: expected .*\(1, 4\)"):
        fused_ops.layer_pre(h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions[:3], table.cos, table.sin)
    with pytest.raises(ValueError, match=rf"q_out: expected .*\(4, {N_Q * HEAD_DIM}\)"):
        fused_ops.layer_pre(
            h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin, torch.empty(3, N_Q * HEAD_DIM)
        )
    with pytest.raises(ValueError, match="norm_weight"):  # a new weight object is checked on its first use
        fused_ops.layer_pre(h, norm_w[:-1], EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)
    with pytest.raises(ValueError, match="cos"):
        fused_ops.layer_pre(h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos.double(), table.sin)
    h, attn, norm_w, _, p = _post_setup(dtype, 4)
    fused_ops.layer_post(h, attn, p["o"], norm_w, EPS, p["gate_up"], p["down"])  # cached
    with pytest.raises(ValueError, match=rf"attn: expected .*\(4, {N_Q * HEAD_DIM}\) of {dtype}, got .* of {other}"):
        fused_ops.layer_post(h, attn.to(other), p["o"], norm_w, EPS, p["gate_up"], p["down"])
    with pytest.raises(ValueError, match=rf"out: expected .*\(4, {HIDDEN}\)"):
        fused_ops.layer_post(h, attn, p["o"], norm_w, EPS, p["gate_up"], p["down"], out=torch.empty(4, 3, dtype=dtype))
    with pytest.raises(ValueError, match="h: "):
        fused_ops.layer_post(h.t(), attn, p["o"], norm_w, EPS, p["gate_up"], p["down"])
    with pytest.raises(ValueError, match="norm_weight"):
        fused_ops.layer_post(h, attn, p["o"], norm_w.double(), EPS, p["gate_up"], p["down"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reused_scratch_gives_the_same_bits_at_every_size(dtype):
    """The half-layers' scratch is kept per thread and grown as needed: a big call, then a small one, then a
    big one again give the bits of fresh calls (nothing of the previous call leaks into the next)."""
    h, attn, norm_w, _, p = _post_setup(dtype, 300)
    table, hp, norm_p, _, packed, positions = _pre_setup(dtype, 300)
    expected = {}
    for n in (300, 1, 64, 300, 5):
        post = fused_ops.layer_post(h[:n], attn[:n], p["o"], norm_w, EPS, p["gate_up"], p["down"])
        pre, _ = fused_ops.layer_pre(
            hp[:n], norm_p, EPS, packed, N_Q, N_KV, HEAD_DIM, positions[:n], table.cos, table.sin
        )
        if n in expected:
            assert torch.equal(post, expected[n][0]) and torch.equal(pre, expected[n][1])
        expected[n] = (post, pre)
    assert torch.equal(expected[5][0], expected[300][0][:5]) and torch.equal(expected[1][1], expected[300][1][:1])


def _pools(kv_dtype, n):
    """Two empty pools (2 layers) of the test geometry and one step over n distinct, shuffled slots."""
    from aiollm.kv.pool import KVConfig, KVPool

    config = KVConfig(
        n_layers=2, n_blocks=n // 16 + 3, block_size=16, n_kv_heads=N_KV, head_dim=HEAD_DIM, dtype=kv_dtype
    )
    slots = torch.randperm(config.n_blocks * 16, generator=torch.Generator().manual_seed(9))[:n]
    tables, lens = np.zeros((n, 1), np.int32), np.ones(n, np.int32)
    return [(pool, pool.prepare_decode(slots, tables, lens)) for pool in (KVPool(config), KVPool(config))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_layer_pre_stores_kv_as_a_separate_write_does(dtype, kv_dtype, n, n_threads):
    """With kv_target, layer_pre also stores each row's rotated k and v: the pool's bytes (and int8 scales)
    equal those of the call without it followed by DecodeStep.write, its outputs are unchanged, and no
    other layer is touched."""
    table, h, norm_w, _, packed, positions = _pre_setup(dtype, n)
    (fused, fused_step), (separate, separate_step) = _pools(kv_dtype, n)
    args = (h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)
    qkv, q = fused_ops.layer_pre(
        *args, torch.empty(n, N_Q * HEAD_DIM), n_threads=n_threads, kv_target=fused_step.native_write_target(1)
    )
    ref_qkv, ref_q = fused_ops.layer_pre(*args, torch.empty(n, N_Q * HEAD_DIM), n_threads=n_threads)
    assert torch.equal(qkv, ref_qkv) and torch.equal(q, ref_q)
    kv = ref_qkv.view(n, N_Q + 2 * N_KV, HEAD_DIM)
    separate_step.write(1, kv[:, N_Q : N_Q + N_KV], kv[:, N_Q + N_KV :])
    for name in ("k", "v", "k_scale", "v_scale"):
        got, want = getattr(fused, name), getattr(separate, name)
        if want is not None:
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name
            assert not got[0].any(), f"{name}: layer 0 was written"
    assert fused.k[1].any() and fused.v[1].any()


def test_layer_pre_rejects_a_kv_target_that_does_not_fit():
    dtype = DTYPES[0]
    table, h, norm_w, _, packed, positions = _pre_setup(dtype, 4)
    args = (h, norm_w, EPS, packed, N_Q, N_KV, HEAD_DIM, positions, table.cos, table.sin)
    (_, step), _ = _pools("fp32", 3)
    with pytest.raises(ValueError, match="kv_target: expected 4 slots .* got 3 slots"):
        fused_ops.layer_pre(*args, kv_target=step.native_write_target(0))
    from aiollm.kv.pool import KVConfig, KVPool

    wide = KVPool(KVConfig(n_layers=1, n_blocks=2, block_size=16, n_kv_heads=N_KV, head_dim=2 * HEAD_DIM))
    step = wide.prepare_decode(np.arange(4), np.zeros((4, 1), np.int32), np.ones(4, np.int32))
    with pytest.raises(ValueError, match=f"kv_target: .*got 4 slots, {N_KV} heads of {2 * HEAD_DIM}"):
        fused_ops.layer_pre(*args, kv_target=step.native_write_target(0))
    assert not wide.k.any()
    from aiollm._native import ffi

    (_, step), _ = _pools("fp32", 4)  # kept alive: desc points into its pool
    desc, _, _ = step.native_write_target(0)
    outside = ffi.new("int64_t[]", [0, 1, 2, desc.n_blocks * desc.block_size])  # C checks every slot first
    with pytest.raises(ValueError, match="kv_target: a slot lies outside"):
        fused_ops.layer_pre(*args, kv_target=(desc, outside, 4))
