"""Tiny random-weight models of each supported family (Llama 3 with RoPE scaling, Qwen2 with q/k/v biases,
Qwen3 with q/k norms, Mistral with a sliding window), saved by transformers as sharded HF directories, and
their GGUF form (any gguf tensor type) for the loader tests.

Each has 2 layers, a small hidden width and a real-looking config (GQA, its family's head width, untied
embeddings); the tokenizer is tiny_llama's byte-level BPE with ChatML specials.
"""

import json
from pathlib import Path

import numpy as np
import torch

from aiollm.testing.tiny_llama import CHATML, SPECIALS, _permute, add_shape, make_tokenizer

# family -> (transformers config class name, its keyword arguments beyond the shared ones)
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        {
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("Qwen2Config", {"hidden_size": 160, "num_attention_heads": 2, "num_key_value_heads": 1}),
    "qwen3": (
        "Qwen3Config",
        {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 96},
    ),
    "mistral": (
        "MistralConfig",
        {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 12},
    ),
}
# transformers class of each config
_MODELS = {
    "LlamaConfig": "LlamaForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "MistralConfig": "MistralForCausalLM",
}


def write_family_dir(
    directory: Path, family: str, seed: int = 0, init_std: float = 0.2, max_shard_size: str | None = "200KB", **extra
):
    """Save a random model of `family` (FAMILIES) with the tiny tokenizer in `directory`, sharded at
    `max_shard_size`; return the transformers model (fp32, eval). `extra` overrides config fields."""
    import transformers

    config_name, kwargs = FAMILIES[family]
    tokenizer = make_tokenizer()
    kwargs = {**kwargs, **extra}
    if "rope_scaling" in kwargs:  # transformers 5 spells RoPE settings as rope_parameters
        kwargs["rope_parameters"] = {"rope_theta": kwargs.pop("rope_theta", 10000.0), **kwargs.pop("rope_scaling")}
    shared = {
        "vocab_size": tokenizer.get_vocab_size(),
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": init_std,
    }
    config = getattr(transformers, config_name)(**{**shared, **kwargs})
    torch.manual_seed(seed)
    model = getattr(transformers, _MODELS[config_name])(config).eval()
    with torch.no_grad():  # random norms and biases too, so a wrong one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0, init_std)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    return model


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_family_gguf(
    path: Path, hf_model, tokenizer_dir: Path, arch: str, matrix_type=None, raw_matrices=None, rope_freqs=None
):
    """Write the transformers model as a GGUF of architecture `arch` (llama, qwen2, qwen3): Q/K rows permuted
    for llama as llama.cpp does, norms and biases F32, every 2-D matrix quantised to `matrix_type`
    (a gguf.GGMLQuantizationType; None: F32) with gguf.quants.quantize. `raw_matrices(name, array)` may instead
    return (raw bytes array, type) for a matrix, for types gguf cannot quantise. `rope_freqs`: llama.cpp's
    per-pair RoPE frequency divisors, stored as the `rope_freqs.weight` tensor. Returns {hf name: the fp32
    tensor the file holds, as dequantised}, the weights a reference model should carry."""
    import gguf
    from gguf.quants import dequantize, quantize

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    if rope_freqs is not None:  # llama.cpp's form of Llama 3.1's RoPE scaling
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    held = {}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gguf_name = f"blk.{i}.{_LAYER_NAMES[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                array = _permute(array, c.num_attention_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                array = _permute(array, c.num_key_value_heads)
        else:
            gguf_name = _GLOBAL_NAMES[name]
        stored = array
        if array.ndim == 2 and raw_matrices is not None and (raw := raw_matrices(gguf_name, array)) is not None:
            data, qtype = raw
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
            stored = dequantize(data, qtype).reshape(array.shape)
        elif array.ndim == 2 and matrix_type not in (None, gguf.GGMLQuantizationType.F32):
            data = quantize(array, matrix_type)
            writer.add_tensor(gguf_name, data, raw_dtype=matrix_type)
            stored = dequantize(data, matrix_type).reshape(array.shape)
        else:
            writer.add_tensor(gguf_name, array)
        held[name] = torch.from_numpy(np.ascontiguousarray(stored, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if arch == "llama":  # the file holds permuted rows; the reference holds HF's order
        for name in list(held):
            if "q_proj" in name:
                held[name] = torch.from_numpy(_unpermute(held[name].numpy(), c.num_attention_heads))
            elif "k_proj" in name:
                held[name] = torch.from_numpy(_unpermute(held[name].numpy(), c.num_key_value_heads))
    return held


def _unpermute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    half = weight.shape[0] // n_heads // 2
    return np.ascontiguousarray(
        weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )
