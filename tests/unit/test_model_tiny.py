"""The split Llama forward, both loaders and the tokenizer, on a tiny random Llama saved by transformers."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import aiollm.model
from aiollm.errors import ModelFormatError
from aiollm.model.config import ModelConfig
from aiollm.testing.tiny_llama import write_gguf, write_hf_dir

LOGIT_ATOL = 1e-4  # fp32, same op order as transformers: differences are GEMM summation order only
PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200], [33]]
TEXTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b",
    "naïve café — 東京 🙂 2024!",
    "  leading and trailing spaces  ",
    "tabs\tand\n\nnewlines\r\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "unseen wörds ÆØÅ ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]


@pytest.fixture(scope="module", params=[(True, 2), (False, 4)], ids=["tied-gqa", "untied-mha"])
def tiny(request, tmp_path_factory):
    tie, n_kv = request.param
    directory = tmp_path_factory.mktemp("tiny_llama")
    hf_model = write_hf_dir(directory, tie=tie, n_kv_heads=n_kv)
    return directory, hf_model


def hf_last_logits(hf_model, prompts):
    with torch.no_grad():
        return torch.stack([hf_model(torch.tensor([p])).logits[0, -1] for p in prompts])


def test_hf_directory_prefill_matches_transformers(tiny):
    directory, hf_model = tiny
    model = aiollm.model.load(directory)
    assert model.config.n_kv_heads == hf_model.config.num_key_value_heads
    assert model.config.tie_embeddings == hf_model.config.tie_word_embeddings
    with torch.inference_mode():
        ours = model.prefill(PROMPTS)  # three prompts packed into one batch
    torch.testing.assert_close(ours, hf_last_logits(hf_model, PROMPTS), atol=LOGIT_ATOL, rtol=0)


def test_split_decode_step_by_step_matches_transformers(tiny):
    """Drive embed / pre_attention / post_attention / logits by hand, one token at a time, with a plain K/V list."""
    directory, hf_model = tiny
    model = aiollm.model.load(directory)
    c = model.config
    tokens = PROMPTS[1]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    cache = [([], []) for _ in range(c.n_layers)]
    with torch.inference_mode():
        for pos, token in enumerate(tokens):
            h = model.embed([token])
            for layer in range(c.n_layers):
                q, k, v = model.pre_attention(layer, h, [pos])
                assert q.shape == (1, c.n_heads, c.head_dim) and k.shape == v.shape == (1, c.n_kv_heads, c.head_dim)
                cache[layer][0].append(k)
                cache[layer][1].append(v)
                keys, values = (torch.cat(x).transpose(0, 1)[None] for x in cache[layer])
                attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, enable_gqa=True)
                h = model.post_attention(layer, h, attn[0].transpose(0, 1))
            torch.testing.assert_close(model.logits(h)[0], expected[pos], atol=LOGIT_ATOL, rtol=0)


def test_gguf_file_matches_transformers(tiny, tmp_path):
    """A GGUF holds Q/K permuted the llama.cpp way; loading must undo it."""
    directory, hf_model = tiny
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model, directory)
    model = aiollm.model.load(path)
    assert model.config.tie_embeddings == hf_model.config.tie_word_embeddings
    with torch.inference_mode():
        ours = model.prefill(PROMPTS)
    torch.testing.assert_close(ours, hf_last_logits(hf_model, PROMPTS), atol=LOGIT_ATOL, rtol=0)
    from_dir = aiollm.model.load(directory).tokenizer
    for text in TEXTS:  # the BPE rebuilt from GGUF metadata equals the directory's tokenizer.json
        assert model.tokenizer.encode(text) == from_dir.encode(text), text
    messages = [{"role": "user", "content": "hi"}]
    assert model.tokenizer.apply_chat_template(messages) == from_dir.apply_chat_template(messages)
    assert model.tokenizer.stop_ids == (2,)


def test_tokenizer_and_template_match_transformers(tiny):
    from transformers import AutoTokenizer

    directory, _ = tiny
    ours = aiollm.model.load(directory).tokenizer
    theirs = AutoTokenizer.from_pretrained(directory)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_bf16_weights_stay_close_to_fp32(tiny):
    directory, hf_model = tiny
    model = aiollm.model.load(directory, dtype="bf16")
    assert model.weights.layers[0].qkv.dtype == torch.bfloat16
    with torch.inference_mode():
        ours = model.prefill(PROMPTS)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_last_logits(hf_model, PROMPTS), atol=0.1, rtol=0.05)


def test_truncated_or_garbage_gguf_names_the_file(tiny, tmp_path):
    directory, hf_model = tiny
    good = tmp_path / "good.gguf"
    write_gguf(good, hf_model, directory)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 100)
    for bad in (truncated, garbage):
        with pytest.raises(ModelFormatError, match=bad.name):
            aiollm.model.load(bad)


def test_missing_tensor_is_named(tiny, tmp_path):
    directory, hf_model = tiny
    path = tmp_path / "missing.gguf"
    write_gguf(path, hf_model, directory, skip_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ModelFormatError, match=r"missing.gguf: missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        aiollm.model.load(path)


def test_unsupported_tensor_type_is_named(tiny, tmp_path):
    directory, hf_model = tiny
    path = tmp_path / "q8_1.gguf"
    write_gguf(path, hf_model, directory, q8_1_tensor="blk.0.ffn_up.weight")
    with pytest.raises(ModelFormatError, match=r"q8_1.gguf: tensor 'blk\.0\.ffn_up\.weight' has type Q8_1"):
        aiollm.model.load(path)


def test_bad_hf_directories(tiny, tmp_path):
    directory, _ = tiny
    with pytest.raises(FileNotFoundError, match="nowhere"):
        aiollm.model.load(tmp_path / "nowhere")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(directory / "config.json", no_weights / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        aiollm.model.load(no_weights)
    other = tmp_path / "other_arch"
    shutil.copytree(directory, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelFormatError, match="model_type 'gpt2'"):
        aiollm.model.load(other)
    corrupt = tmp_path / "corrupt_weights"
    shutil.copytree(directory, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        aiollm.model.load(corrupt)


@pytest.mark.parametrize("field, value", [("n_layers", 0), ("n_kv_heads", 5), ("head_dim", 7), ("rms_eps", 0.0)])
def test_model_config_rejects_bad_fields(field, value):
    good = dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, vocab=100)
    ModelConfig(**good)
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**good, field: value})
