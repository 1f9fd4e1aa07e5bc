"""prefill_attention batches runs of equal-length prompts into one SDPA call; each prompt must still see only
its own tokens, causally, exactly as one call per prompt does."""

import pytest
import torch
import torch.nn.functional as F

from aiollm.model.attention import prefill_attention


def one_call_per_prompt(q, k, v, lens):
    out, start = torch.empty_like(q), 0
    for n in lens:
        o = F.scaled_dot_product_attention(
            *(x[start : start + n].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
        )
        out[start : start + n] = o[0].transpose(0, 1)
        start += n
    return out


@pytest.mark.parametrize("lens", [[43] * 8, [5, 5, 5, 3, 7, 7, 1], [1], [16, 17, 17, 16]])
def test_runs_of_equal_lengths_give_the_per_prompt_result(lens):
    qkv = torch.randn(sum(lens), 9 + 3 + 3, 64, generator=torch.Generator().manual_seed(len(lens)))
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]  # strided views, as pre_attention returns them
    assert torch.equal(prefill_attention(q, k, v, lens), one_call_per_prompt(q, k, v, lens))


def test_lengths_must_cover_the_batch():
    x = torch.zeros(5, 2, 8)
    with pytest.raises(ValueError, match="seq_lens"):
        prefill_attention(x, x, x, [2, 2])
