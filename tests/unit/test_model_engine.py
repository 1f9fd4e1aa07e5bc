"""The colocated engine on a tiny random Llama: greedy tokens equal a plain transformers greedy loop,
a mixed-length batch gives each prompt's solo tokens, stop rules, and every KV block comes back."""

import pytest
import torch

import aiollm.model
from aiollm.cli.generate import main
from aiollm.model.engine import ReferenceEngine, generate
from aiollm.model.sampling import SamplingParams
from aiollm.testing.tiny_llama import write_hf_dir

PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 57)), [33], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200]]
N_NEW = 20  # crosses a 16-token block boundary for every prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_engine")
    hf_model = write_hf_dir(directory, init_std=0.2)
    return aiollm.model.load(directory), hf_model, directory


def hf_greedy(hf_model, prompt, n):
    """Greedy decoding with full re-forwards (no cache): the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_batched_greedy_equals_transformers(tiny):
    model, hf_model, _ = tiny
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    completions = generate(model, PROMPTS, params)
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.token_ids == hf_greedy(hf_model, prompt, N_NEW)
        assert completion.finish_reason == "length"
        assert completion.text == model.tokenizer.decode(completion.token_ids)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "int8"])
def test_mixed_length_batch_gives_solo_tokens(tiny, kv_dtype):
    model, _, _ = tiny
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    engine = ReferenceEngine(model, kv_dtype=kv_dtype, n_blocks=64, block_size=16)
    batched = engine.generate(PROMPTS, params)
    for prompt, completion in zip(PROMPTS, batched):
        assert engine.generate([prompt], params)[0].token_ids == completion.token_ids
    assert engine.allocator.n_free == 64


def test_int4_kv_refuses_a_head_dim_its_layout_cannot_hold(tiny):
    model, _, _ = tiny  # head_dim 16: int4 needs a multiple of 32
    with pytest.raises(ValueError, match="int4 needs head_dim % 32 == 0"):
        ReferenceEngine(model, kv_dtype="int4", n_blocks=8, block_size=16)


def test_seeded_sampling_is_independent_of_the_batch(tiny):
    model, _, _ = tiny
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    solo = generate(model, PROMPTS[:1], params)[0].token_ids
    mixed = generate(model, PROMPTS, [params, SamplingParams(max_tokens=3, temperature=1.0), params, params])
    assert mixed[0].token_ids == solo
    assert len(mixed[1].token_ids) == 3


def test_stop_token_string_and_length(tiny):
    model, _, _ = tiny
    free = generate(model, PROMPTS[:1], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    by_token = generate(
        model, PROMPTS[:1], SamplingParams(max_tokens=N_NEW, stop_token_ids=(stop_at,), ignore_eos=True)
    )[0]
    assert by_token.finish_reason == "stop" and by_token.token_ids == free.token_ids[: first + 1]
    tail = model.tokenizer.decode(free.token_ids[6:9])
    assert tail.strip(), "the fixture's seed should give printable tokens here"
    by_string = generate(model, PROMPTS[:1], SamplingParams(max_tokens=N_NEW, stop=(tail,), ignore_eos=True))[0]
    assert by_string.finish_reason == "stop"
    assert tail not in by_string.text and free.text.startswith(by_string.text)
    short = generate(model, PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:3]


def test_params_count_must_match_prompts(tiny):
    model, _, _ = tiny
    with pytest.raises(ValueError, match="params"):
        generate(model, PROMPTS, [SamplingParams()] * 2)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_generate_command_prints_greedy_completion(tiny, capsys, kv_dtype):
    model, _, directory = tiny
    text = "The quick brown fox"
    expected = generate(model, [model.tokenizer.encode(text)], SamplingParams(max_tokens=6), kv_dtype=kv_dtype)[0]
    assert (
        main(
            [
                "--model",
                str(directory),
                "--prompt",
                text,
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--kv-dtype",
                kv_dtype,
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == expected.text + "\n"
    assert main(["--model", str(directory), "--prompt", text, "--chat", "--max-tokens", "2"]) == 0
    assert main(["--model", str(directory), "--prompt", text, "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, "fp32"), (torch.float32, "int8"), (torch.bfloat16, "fp16")])
def test_one_call_decode_step_equals_the_per_layer_step(tiny, dtype, kv_dtype):
    """decode_logits runs every layer in one native call (model.decode_layers); the per-layer Python path it
    replaced must give the same logits and the same KV cache, bit for bit."""
    import numpy as np

    from aiollm.native import gemm

    if not gemm.supported(dtype):
        pytest.skip(f"the one-call step needs the native {dtype} GEMM (AVX-512), which this CPU lacks")

    from aiollm.kv.blocks import BlockAllocator, BlockTable
    from aiollm.kv.pool import KVConfig, KVPool
    from aiollm.model.decode import decode_logits

    _, _, directory = tiny
    model = aiollm.model.load(directory, dtype=dtype)
    c = model.config
    lengths = [5, 37, 1, 11]  # tokens cached before the step
    results = []
    for fused in (True, False):
        pool = KVPool(
            KVConfig(
                n_layers=c.n_layers,
                n_blocks=16,
                block_size=16,
                n_kv_heads=c.n_kv_heads,
                head_dim=c.head_dim,
                dtype=kv_dtype,
            )
        )
        table = BlockTable(BlockAllocator(16), 16)
        ids = list(range(len(lengths)))
        slots = table.append_batch(ids, lengths)
        gen = torch.Generator().manual_seed(1)
        for layer in range(c.n_layers):
            k, v = (torch.randn(len(slots), c.n_kv_heads, c.head_dim, generator=gen) for _ in range(2))
            pool.write(layer, torch.from_numpy(slots), k, v)
        step_slots = table.append_batch(ids, [1] * len(ids))
        ran = []
        if fused:  # record that the one-call path really ran
            model.decode_layers = lambda *args, real=model.decode_layers, ran=ran, **kwargs: (
                ran.append(real(*args, **kwargs)) or ran[-1]
            )
        else:
            model.decode_layers = lambda *args, **kwargs: None  # the per-layer path
        try:
            with torch.inference_mode():
                logits = decode_logits(
                    model, pool, [3, 50, 7, 99], lengths, step_slots, table.block_tables(ids), table.seq_lens(ids)
                )
        finally:
            del model.decode_layers
        assert not fused or (len(ran) == 1 and ran[0] is not None)
        results.append((logits, [np.array(a, copy=True) for a in (pool.k, pool.v) if a is not None]))
    (fused_logits, fused_kv), (layer_logits, layer_kv) = results
    assert torch.equal(fused_logits, layer_logits)
    assert all(np.array_equal(a, b) for a, b in zip(fused_kv, layer_kv))
