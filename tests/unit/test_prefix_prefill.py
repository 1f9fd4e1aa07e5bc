"""Prefill after a cached prefix equals a whole prefill: same first tokens, same logits, same K/V bits (fp32
KV), for prompts that map 1..n cached blocks, mixed with prompts that map none; the paged cache maps the longest
cached prefix, always leaves a token to compute, and counts blocks as the allocator sees them."""

import numpy as np
import pytest
import torch

import aiollm.model
from aiollm.model.prefix_prefill import prefill_after
from aiollm.model.sampling import SamplingParams
from aiollm.model.sequence import new_sequence
from aiollm.serving import runner
from aiollm.testing.tiny_llama import write_hf_dir

BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_prefix")
    write_hf_dir(directory, init_std=0.2)
    return aiollm.model.load(directory)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _seq(model, rid, prompt):
    return new_sequence(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True), model)


def _kv(cache, seq, n):
    """Every layer's K and V of the first n tokens of seq, as the pool holds them."""
    return [cache.pool.read_tokens(layer, seq.blocks)[0][:n] for layer in range(cache.pool.config.n_layers)], [
        cache.pool.read_tokens(layer, seq.blocks)[1][:n] for layer in range(cache.pool.config.n_layers)
    ]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_cached_prefix_gives_the_tokens_and_kv_of_a_whole_prefill(tiny, dtype):
    vocab = tiny.config.vocab
    system = _prompt(1, 3 * BS + 5, vocab)
    prompts = [system + _prompt(2, 9, vocab), system[: 2 * BS] + _prompt(3, 30, vocab), _prompt(4, 21, vocab)]
    plain = runner.PagedCache(tiny, 64, BS, dtype)
    plain_seqs = [_seq(tiny, f"p{i}", p) for i, p in enumerate(prompts)]
    for s in plain_seqs:
        plain.reserve(s, len(s.prompt))
    plain_tokens = runner.prefill_into(tiny, plain, plain_seqs)

    cached = runner.PagedCache(tiny, 64, BS, dtype, prefix_cache=True)
    first = _seq(tiny, "sys", system)
    cached.reserve(first, len(system), reuse=len(system) - runner.MIN_COMPUTED)
    runner.prefill_into(tiny, cached, [first])
    cached.commit(first, len(system))
    cached.free(first)
    seqs = [_seq(tiny, f"c{i}", p) for i, p in enumerate(prompts)]
    for s in seqs:
        cached.reserve(s, len(s.prompt), reuse=len(s.prompt) - runner.MIN_COMPUTED)
    assert [s.cached_tokens for s in seqs] == [3 * BS, 2 * BS, 0]
    assert cached.blocks.hits == 5
    tokens = runner.prefill_into(tiny, cached, seqs)
    if dtype == "fp32":
        assert tokens == plain_tokens
        for s, p in zip(seqs, plain_seqs):
            for got, want in zip(_kv(cached, s, len(s.prompt)), _kv(plain, p, len(p.prompt))):
                assert all(np.array_equal(g, w) for g, w in zip(got, want))
    else:  # the prefix is read back rounded, as decode reads it
        assert sum(a == b for a, b in zip(tokens, plain_tokens)) >= 2


def test_prefill_after_with_the_prefix_of_a_whole_prefill_gives_its_logits(tiny):
    prompt = _prompt(7, 70, tiny.config.vocab)
    kv = {}
    with torch.inference_mode():
        whole = tiny.prefill([prompt], kv_sink=lambda layer, k, v: kv.__setitem__(layer, (k.clone(), v.clone())))
        for start in (1, 16, 48, 70 - runner.MIN_COMPUTED):
            part = prefill_after(
                tiny, [prompt[start:]], [start], lambda layer, i, s=start: (kv[layer][0][:s], kv[layer][1][:s])
            )
            assert torch.equal(part, whole), start


@pytest.mark.parametrize("tail", [0, 3])
def test_a_few_prompt_tokens_are_always_computed(tiny, tail):
    cache = runner.PagedCache(tiny, 8, BS, prefix_cache=True)
    prompt = _prompt(5, 2 * BS + tail, tiny.config.vocab)
    a = _seq(tiny, "a", prompt)
    cache.reserve(a, len(prompt), reuse=len(prompt) - runner.MIN_COMPUTED)
    runner.prefill_into(tiny, cache, [a])
    cache.commit(a, len(prompt))
    b = _seq(tiny, "b", prompt)
    cache.reserve(b, len(prompt), reuse=len(prompt) - runner.MIN_COMPUTED)
    assert b.cached_tokens == BS  # the second block is computed again: its tokens give the first output
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert cache.used_blocks == 2 * cache.blocks_for(len(prompt)) - 1
    cache.free(a)
    cache.free(b)
    assert cache.used_blocks == 0 and cache.free_blocks == 8 and cache.blocks.n_evictable == 2


def test_a_reservation_that_does_not_fit_changes_nothing(tiny):
    cache = runner.PagedCache(tiny, 3, BS, prefix_cache=True)
    prompt = _prompt(6, 2 * BS + 1, tiny.config.vocab)
    a = _seq(tiny, "a", prompt)
    cache.reserve(a, len(prompt))
    cache.commit(a, len(prompt))
    cache.free(a)  # two cached blocks, evictable, one plain free
    b = _seq(tiny, "b", prompt + [1] * BS)  # maps 2, needs 2 more: only 1 is left once the 2 are revived
    with pytest.raises(Exception, match="KV"):
        cache.reserve(b, len(b.prompt), reuse=len(b.prompt) - 1)
    assert b.blocks == [] and b.cached_tokens == 0 and cache.blocks.n_evictable == 2 and cache.free_blocks == 3


def test_prefill_after_keeps_a_sliding_window(tmp_path):
    """Mistral's window: the new tokens see only the last `window` positions of [prefix | new], as a whole
    prefill masks them (the window is smaller than the prefix, so the mask decides the logits)."""
    from aiollm.testing.tiny_families import write_family_dir

    write_family_dir(tmp_path, "mistral")
    model = aiollm.model.load(tmp_path)
    window = model.config.sliding_window
    assert window is not None and window < 40
    prompt = _prompt(9, 60, model.config.vocab)
    kv = {}
    with torch.inference_mode():
        whole = model.prefill([prompt], kv_sink=lambda layer, k, v: kv.__setitem__(layer, (k.clone(), v.clone())))
        for start in (16, 48):
            part = prefill_after(
                model, [prompt[start:]], [start], lambda layer, i, s=start: (kv[layer][0][:s], kv[layer][1][:s])
            )
            torch.testing.assert_close(part, whole, rtol=0, atol=1e-5)
