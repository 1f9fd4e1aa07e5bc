"""The Llama forward as explicit per-layer operations, split where FastDecode and DistServe split it.

One definition serves Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3: the config switches on q/k/v biases (added
after the QKV projection), per-head q/k RMSNorm (before RoPE) and a sliding attention window (prefill's mask
here; decode's in the KV pool, `KVConfig.window`).

S-part (dense, weight-bound, batched over every token of every sequence, packed without padding):
    h = model.embed(token_ids)                          # [n, hidden]
    q, k, v = model.pre_attention(layer, h, positions)  # RMSNorm, fused QKV projection, RoPE
    h = model.post_attention(layer, h, attn_out)        # o-proj + residual, RMSNorm, SiLU MLP + residual
    logits = model.logits(h)                            # final RMSNorm + lm_head, fp32
R-part (attention, no weights; see aiollm.model.attention): prefill over the prompt with SDPA, decode
over the paged KV cache. `prefill` runs both for whole prompts and hands each layer's K/V to a sink.

The arithmetic follows transformers' LlamaForCausalLM (RMSNorm in fp32, RoPE half-split, SDPA), so fp32
greedy tokens equal transformers'. On CPU in fp32/bf16 the small ops between the matrix products (RMSNorm,
RoPE, SiLU*up) run as single native calls (aiollm.native.fused_ops): through PyTorch they cost several
ATen ops each, every one with its OpenMP fork/join; when every matrix is on the native GEMM, each half-layer
(pre_attention, post_attention) is one native call (fused_ops.layer_pre / layer_post, same bits). RoPE is then bit-identical to transformers' formula;
RMSNorm sums the squares in another order (a few fp32 ulps).
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from aiollm.model.attention import prefill_attention
from aiollm.model.config import ModelConfig
from aiollm.model.linear import linear, linear_add
from aiollm.model.rope import RotaryTable, Rotation
from aiollm.model.tokenizer import Tokenizer
from aiollm.model.weights import LlamaWeights
from aiollm.native import fused_ops
from aiollm.native.gemm import PackedWeight

# called once per layer during prefill with (layer, k, v), k/v [n_tokens, n_kv_heads, head_dim]
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [n, dim] as one op, rounded once in bf16: the native kernel on CPU (fp32/bf16),
    else torch's (which in fp32 gives transformers' bits)."""
    if fused_ops.native(x) and x.dim() == 2 and x.stride(-1) == 1 and weight.dtype == x.dtype:
        return fused_ops.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows gate_up [n, 2 * ffn] = [gate | up] (native on CPU fp32/bf16)."""
    if fused_ops.native(gate_up) and gate_up.stride(-1) == 1:
        return fused_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class LlamaModel:
    """A loaded Llama-family model: `config`, `tokenizer`, `weights`, and the split forward."""

    def __init__(
        self,
        config: ModelConfig,
        weights: LlamaWeights,
        tokenizer: Tokenizer | None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        self.rotary = RotaryTable(config, dtype, device)
        # every layer's S-part halves as one native call each (fused_ops.layer_pre / layer_post) when all the
        # layers' matrices are on the native GEMM in the model dtype and the RoPE table is in that dtype
        self._fused_post = (
            self.device.type == "cpu"
            and self.rotary.cos.dtype == dtype
            and all(
                isinstance(m, PackedWeight) and m.dtype == dtype and w.attn_norm.dtype == w.mlp_norm.dtype == dtype
                for w in weights.layers
                for m in (w.qkv, w.o, w.gate_up, w.down)
            )
        )
        # pre_attention's native half-layer is plain Llama's: q/k/v biases or q/k norms take the per-op path
        self._fused_layers = self._fused_post and not (config.qkv_bias or config.qk_norm)
        self._qkv_heads = (config.n_heads, config.n_kv_heads, config.n_kv_heads)
        self._decode_layer_weights: list | None = None  # decode_layers' per-layer weights, gathered on first use

    # ---- S-part -------------------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Hidden states [n, hidden] of a packed 1-D batch of token ids."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab):
            raise ValueError(f"token_ids: ids must lie in [0, {self.config.vocab}), got {ids.min()}..{ids.max()}")
        return F.embedding(ids, self.weights.embed)

    def rope(self, positions: torch.Tensor | Sequence[int]) -> Rotation:
        """These positions' RoPE, checked once; compute once per step and pass to every pre_attention."""
        return Rotation(self.rotary, torch.as_tensor(positions, dtype=torch.long, device=self.device))

    def pre_attention(
        self,
        layer: int,
        h: torch.Tensor,
        positions,
        rope: Rotation | None = None,
        q_out: torch.Tensor | None = None,
        kv_step=None,
    ):
        """RMSNorm, QKV projection and RoPE of layer `layer` for packed hidden states h [n, hidden].

        `positions` are the tokens' positions in their own sequences (1-D, length n); pass `rope` from
        `self.rope(positions)` to check them once per step. Returns q [n, n_heads, d], k and v [n, n_kv_heads, d]:
        views whose heads and dims are contiguous (each token's row has a stride; `.contiguous()` if needed).
        `q_out` [n, n_heads, d] (fp32 or the model dtype, e.g. the buffer decode attention reads) receives q
        instead, and is returned as q. `kv_step` (a decode step over these n tokens, `KVPool.prepare_decode`)
        also stores this layer's k and v in its pool, as `kv_step.write(layer, k, v)` does (the fused path
        does it inside its native call).
        """
        w = self.weights.layers[layer]
        c = self.config
        rope = rope if rope is not None else self.rope(positions)
        n = h.shape[0]
        if self._fused_layers and h.dtype == self.dtype and (q_out is None or q_out.is_contiguous()):
            flat_q = None if q_out is None else q_out.view(n, c.q_size)
            qkv, _ = fused_ops.layer_pre(
                h.contiguous(),
                w.attn_norm,
                c.rms_eps,
                w.qkv,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                rope.positions,
                rope.table.cos,
                rope.table.sin,
                flat_q,
                kv_target=None if kv_step is None else kv_step.native_write_target(layer),
            )
            # one split_with_sizes makes the three views in one ATen call (three slices cost ~8 us a layer)
            q, k, v = qkv.view(n, c.n_heads + 2 * c.n_kv_heads, c.head_dim).split_with_sizes(self._qkv_heads, 1)
            return (q if q_out is None else q_out), k, v
        qkv = linear(rms_norm(h, w.attn_norm, c.rms_eps), w.qkv)
        if w.qkv_bias is not None:
            qkv.add_(w.qkv_bias)
        qkv = qkv.view(n, c.n_heads + 2 * c.n_kv_heads, c.head_dim)
        if w.q_norm is not None:  # per-head RMSNorm of q and k before RoPE, in place (torch's: transformers' bits)
            q_heads, k_heads = qkv[:, : c.n_heads], qkv[:, c.n_heads : c.n_heads + c.n_kv_heads]
            q_heads.copy_(F.rms_norm(q_heads, (c.head_dim,), w.q_norm, c.rms_eps))
            k_heads.copy_(F.rms_norm(k_heads, (c.head_dim,), w.k_norm, c.rms_eps))
        q = rope.rotate_qk(qkv, c.n_heads, c.n_kv_heads, q_out)  # k rotated in place
        k, v = qkv[:, c.n_heads : c.n_heads + c.n_kv_heads], qkv[:, c.n_heads + c.n_kv_heads :]
        if kv_step is not None:
            kv_step.write(layer, k, v)
        return q, k, v

    def post_attention(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection + residual, RMSNorm, SiLU-gated MLP + residual. attn_out [n, n_heads, d] (any float)."""
        w = self.weights.layers[layer]
        attn = attn_out.reshape(h.shape[0], self.config.q_size)
        if attn.dtype != self.dtype:
            attn = attn.to(self.dtype)
        if self._fused_post and h.dtype == self.dtype:
            return fused_ops.layer_post(
                h.contiguous(), attn.contiguous(), w.o, w.mlp_norm, self.config.rms_eps, w.gate_up, w.down
            )
        h = linear_add(attn, w.o, h)
        gate_up = linear(rms_norm(h, w.mlp_norm, self.config.rms_eps), w.gate_up)
        return linear_add(silu_mul(gate_up), w.down, h)

    def decode_layers(
        self,
        h: torch.Tensor,
        rope: Rotation,
        kv_step,
        q_out: torch.Tensor,
        attn_out: torch.Tensor,
        n_threads: int | None = None,
        seconds=None,
    ) -> torch.Tensor | None:
        """Every layer of a decode step (pre_attention, decode attention over kv_step, post_attention) in one
        native call (`fused_ops.decode_layers`, same bits as the per-layer calls); h is updated in place and
        returned. None (nothing done) where the layers are not on the fused path or the buffers do not fit it:
        the caller then runs the layers one by one. q_out fp32 and attn_out of the model dtype, both
        [n, n_heads, head_dim]; n_threads: attention threads; seconds as for `fused_ops.decode_layers`."""
        if not (
            self._fused_layers
            and h.dtype == self.dtype
            and attn_out.dtype == self.dtype
            and q_out.dtype == torch.float32
            and h.is_contiguous()
        ):
            return None
        c = self.config
        layers = self._decode_layer_weights
        if layers is None:
            layers = self._decode_layer_weights = [
                (w.attn_norm, w.qkv, w.o, w.mlp_norm, w.gate_up, w.down) for w in self.weights.layers
            ]
        return fused_ops.decode_layers(
            h,
            layers,
            c.rms_eps,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            rope.positions,
            rope.table.cos,
            rope.table.sin,
            kv_step,
            q_out,
            attn_out,
            attn_threads=n_threads,
            seconds=seconds,
        )

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and output projection: fp32 logits [n, vocab]."""
        return linear(rms_norm(h, self.weights.norm, self.config.rms_eps), self.weights.lm_head).float()

    # ---- whole prompts ------------------------------------------------------------------------------

    def prefill(
        self,
        token_ids: Sequence[Sequence[int]],
        kv_sink: KVSink | None = None,
        start_positions: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run prompts (packed into one batch) through every layer; fp32 logits [n_seqs, vocab] of each last token.

        Attention is causal within each prompt (torch SDPA); each layer's K/V of all tokens (packed, in
        prompt order) is handed to `kv_sink` so the caller can keep it (a paged pool, a message to a
        decode instance). `start_positions` offsets RoPE positions (default 0 for every prompt).
        """
        if not token_ids or any(len(ids) == 0 for ids in token_ids):
            raise ValueError("token_ids: need at least one prompt, each with at least one token")
        lens = [len(ids) for ids in token_ids]
        starts = start_positions or [0] * len(lens)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        rope = self.rope(positions)
        h = self.embed([t for ids in token_ids for t in ids])
        for layer in range(self.config.n_layers):
            q, k, v = self.pre_attention(layer, h, positions, rope)
            if kv_sink is not None:
                kv_sink(layer, k, v)
            h = self.post_attention(layer, h, prefill_attention(q, k, v, lens, window=self.config.sliding_window))
        last = torch.tensor(lens).cumsum(0) - 1
        return self.logits(h[last.to(self.device)])
