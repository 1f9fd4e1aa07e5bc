"""The model families' loaders and pieces: RoPE scalings equal transformers' tables, GGUF files of each
architecture and tensor type give the logits of transformers carrying the file's own dequantised weights,
sharded HF directories are memory-mapped, and unsupported architectures, window layouts and tensor types are
refused naming them."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import aiollm.model
from aiollm.errors import ModelFormatError
from aiollm.model.hf_dir import HFDirectory, config_from_hf
from aiollm.model.loader import load_config, load_tokenizer
from aiollm.model.rope import RotaryTable
from aiollm.testing.tiny_families import write_family_dir, write_family_gguf

Q = gguf.GGMLQuantizationType
# logits of our forward against transformers carrying the same (dequantised) fp32 weights: fp32 rounding only
LOGITS_ATOL = 2e-3
PROMPTS = [[5, 17, 42, 99, 3, 200, 7], list(range(20, 57)), [33]]


def _transformers_logits(hf, held: dict) -> torch.Tensor:
    hf.load_state_dict({**hf.state_dict(), **held})
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])


def _our_logits(path) -> torch.Tensor:
    model = aiollm.model.load(path)
    with torch.inference_mode():
        return torch.cat([model.prefill([p]) for p in PROMPTS])


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("linear", {"factor": 4.0}),
        (
            "llama3",
            {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64}),
        ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "attention_factor": 1.3}),
        ("dynamic", {"factor": 2.0}),
    ],
)
def test_rope_scaling_tables_equal_transformers(kind, extra):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=256,
        rope_parameters={"rope_type": kind, "rope_theta": 10000.0, **extra},
    )
    config = config_from_hf(hf_config.to_dict(), Path("x/config.json"))
    assert config.rope_scaling.kind == kind
    n = 400 if kind == "dynamic" else 256  # dynamic: past max_position_embeddings the base grows with the length
    table = RotaryTable(config, torch.float32, max_positions=n)
    rotary = LlamaRotaryEmbedding(hf_config)
    positions = torch.arange(n)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    # transformers' dynamic rotates a whole batch at its longest length: compare at that last position only
    rows = slice(n - 1, n) if kind == "dynamic" else slice(0, n)
    torch.testing.assert_close(table.cos[rows], cos[0, rows], rtol=0, atol=2e-6)
    torch.testing.assert_close(table.sin[rows].abs(), sin[0, rows].abs(), rtol=0, atol=2e-6)
    if kind == "dynamic":  # and within the original context, the plain table
        plain = RotaryTable(
            config_from_hf({**hf_config.to_dict(), "rope_parameters": None}, Path("x/c")), torch.float32
        )
        torch.testing.assert_close(table.cos[:256], plain.cos[:256], rtol=0, atol=0)


@pytest.mark.parametrize(
    "family,arch", [("llama3", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("mistral", "llama")]
)
def test_gguf_of_each_architecture_gives_transformers_logits(tmp_path, family, arch):
    hf = write_family_dir(tmp_path, family)
    rope_freqs = _llama3_divisors(hf) if family == "llama3" else None
    held = write_family_gguf(tmp_path / "m.gguf", hf, tmp_path, arch, rope_freqs=rope_freqs)
    if family == "mistral":  # GGUF carries the window as metadata; this writer leaves it out: compare unwindowed
        hf.config.sliding_window = None
        for layer in hf.model.layers:
            layer.self_attn.sliding_window = None
        hf.config.layer_types = ["full_attention"] * hf.config.num_hidden_layers
    ours = _our_logits(tmp_path / "m.gguf")
    torch.testing.assert_close(ours, _transformers_logits(hf, held), rtol=0, atol=LOGITS_ATOL)
    config = load_config(tmp_path / "m.gguf")
    assert (config.qkv_bias, config.qk_norm) == (family == "qwen2", family == "qwen3")


def _llama3_divisors(hf) -> np.ndarray:
    """llama.cpp's form of Llama 3.1's RoPE scaling: per-pair divisors of the plain frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    d = hf.config.head_dim
    plain = 1.0 / (hf.config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    return (plain / scaled).numpy()


def _random_k_blocks(qtype, shape, rng) -> np.ndarray:
    """Random bytes of a K-quant tensor with small fp16 super-block scales (weights of a few tenths)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    small = np.float16(3e-5 if qtype == Q.Q6_K else 1e-4)
    at = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for offset in at:
        raw[..., offset : offset + 2] = (
            (small * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)[..., None].view(np.uint8)
        )
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_gguf_tensor_types_give_the_logits_of_their_dequantised_weights(tmp_path, qtype):
    # K-quants need rows of a multiple of 256 elements
    hf = write_family_dir(tmp_path, "llama3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    rng = np.random.default_rng(int(qtype))
    k_quant = qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
    raw = (lambda name, array: (_random_k_blocks(qtype, array.shape, rng), qtype)) if k_quant else None
    held = write_family_gguf(
        tmp_path / "m.gguf", hf, tmp_path, "llama", None if k_quant else qtype, raw, rope_freqs=_llama3_divisors(hf)
    )
    ours = _our_logits(tmp_path / "m.gguf")
    torch.testing.assert_close(ours, _transformers_logits(hf, held), rtol=0, atol=LOGITS_ATOL)
    tok, _ = load_tokenizer(tmp_path / "m.gguf")
    hf_tok, _ = load_tokenizer(tmp_path)
    text = "Paris is the capital of France. def add(a, b): 1234"
    assert tok.encode(text) == hf_tok.encode(text)


def test_sharded_directory_is_memory_mapped_not_copied(tmp_path):
    write_family_dir(tmp_path, "qwen2", max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    source = HFDirectory(tmp_path)
    assert len(source.shard_paths) == len(set(index["weight_map"].values())) > 2
    name = "model.embed_tokens.weight"
    tensor = source.get(name)
    mapped = source._where[name]._map
    start = mapped.ctypes.data
    assert start <= tensor.data_ptr() < start + mapped.nbytes  # a view of the mapping
    (tmp_path / Path(index["weight_map"][name])).rename(tmp_path / "gone.bin")
    with pytest.raises(FileNotFoundError, match="missing"):
        HFDirectory(tmp_path)


def test_unsupported_architectures_and_window_layouts_are_refused(tmp_path):
    write_family_dir(tmp_path, "mistral")
    config = json.loads((tmp_path / "config.json").read_text())
    for change, message in (
        ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1, "layer_types": None},
            "some layers",
        ),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"attention_bias": True}, "attention_bias"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ModelFormatError, match=message):
            load_config(tmp_path)


def test_unsupported_gguf_architecture_and_type_are_refused(tmp_path):
    hf = write_family_dir(tmp_path, "qwen2")
    write_family_gguf(tmp_path / "phi.gguf", hf, tmp_path, "phi3")
    with pytest.raises(ModelFormatError, match="architecture 'phi3' is not supported"):
        aiollm.model.load(tmp_path / "phi.gguf")

    def iq2(name, array):
        if name != "blk.1.ffn_up.weight":
            return None
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
        return np.zeros((array.shape[0], array.shape[1] // block_elems * block_bytes), np.uint8), Q.IQ2_XXS

    hf = write_family_dir(tmp_path, "qwen2", hidden_size=256, num_attention_heads=4)
    write_family_gguf(tmp_path / "iq2.gguf", hf, tmp_path, "qwen2", raw_matrices=iq2)
    with pytest.raises(
        ModelFormatError, match=r"tensor 'blk\.1\.ffn_up\.weight' has type IQ2_XXS, which aiollm does not"
    ):
        aiollm.model.load(tmp_path / "iq2.gguf")
