"""One decode step of the colocated forward over a paged KV pool: the single implementation behind the
colocated engine (`aiollm.model.engine`) and the serving runner (`aiollm.serving.runner`).

Each sequence feeds one token; every layer runs its S-part (`pre_attention`, `post_attention`) and its
R-part (attend with the native kernel, on the same OpenMP team as the GEMMs). On the fused CPU path all the
layers run in one native call (`model.decode_layers`, same bits as the per-layer calls, which remain the path
elsewhere): per layer through Python they cost ~8 % of a SmolLM2 fp32 batch-64 step while the team waits. `pre_attention` also stores the
new K/V: on the fused path inside its native call, each row by the thread that just rotated it. The step's
index arrays are checked once (`KVPool.prepare_decode`), the positions once (`model.rope`), and two buffers
serve all layers: RoPE writes each layer's q straight into the fp32 buffer the attention kernel reads (no
`q.float()` copy in bf16), and the kernel writes its output into the other, in the model dtype.
"""

from collections.abc import Sequence

import torch

from aiollm.kv.pool import KVPool
from aiollm.model.llama import LlamaModel
from aiollm.native.attention import on_gemm_team


def decode_logits(
    model: LlamaModel,
    pool: KVPool,
    token_ids: Sequence[int],
    positions: Sequence[int],
    slot_mapping,
    block_tables,
    seq_lens,
    n_threads: int | None = None,
) -> torch.Tensor:
    """fp32 logits [n_seqs, vocab] of one decode step.

    token_ids: the token each sequence feeds; positions: its position (= tokens already cached);
    slot_mapping int [n_seqs] (where its K/V goes), block_tables int32 [n_seqs, max_blocks], seq_lens int32
    [n_seqs] including the fed token (numpy arrays or torch CPU tensors); n_threads: attention threads.
    """
    c = model.config
    step = pool.prepare_decode(slot_mapping, block_tables, seq_lens)
    with torch.inference_mode(), on_gemm_team():  # attention on the GEMMs' OpenMP team, not the pool
        rope = model.rope(positions)
        h = model.embed(token_ids)
        out_dtype = model.dtype if model.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty((len(token_ids), c.n_heads, c.head_dim), dtype=out_dtype)  # every layer's output
        q32 = torch.empty((len(token_ids), c.n_heads, c.head_dim), dtype=torch.float32)  # every layer's q
        if model.decode_layers(h, rope, step, q32, out, n_threads) is not None:
            return model.logits(h)  # every layer in one native call, h updated in place
        for layer in range(c.n_layers):
            q, _, _ = model.pre_attention(layer, h, positions, rope, q_out=q32, kv_step=step)  # K/V stored too
            h = model.post_attention(layer, h, step.attend(layer, q.float(), out, n_threads=n_threads))
        return model.logits(h)
