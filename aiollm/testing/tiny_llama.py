"""A tiny random-weight Llama written by transformers as an HF directory (and as a GGUF), for fast tests.

The tokenizer is a byte-level BPE trained here on a few sentences with ChatML special tokens, so
the HF directory is complete (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).
"""

import json
from pathlib import Path

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "naïve café — 東京 🙂 1234567890",
    "    indented\ttabs\n\nand blank lines  ",
] * 20


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def write_hf_dir(
    directory: Path, tie: bool = True, n_heads: int = 4, n_kv_heads: int = 2, seed: int = 0, init_std: float = 0.02
):
    """Save a random LlamaForCausalLM + tokenizer in `directory`; return the transformers model (fp32, eval).

    A larger `init_std` spreads the logits, so greedy choices are far from ties (token-exact tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms too, so a wrong norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    return model


def _permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (what GGUF files hold)."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path, hf_model, tokenizer_dir: Path, skip_tensor: str | None = None, q8_1_tensor: str | None = None
) -> None:
    """Write the transformers model as a llama GGUF (F32 tensors, Q/K permuted, tokenizer in metadata).

    `skip_tensor` leaves one tensor out; `q8_1_tensor` stores one as zero bytes of type Q8_1, which
    gguf cannot dequantise."""
    import gguf

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    add_shape(writer, c)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            part = rest.removesuffix(".weight")
            gguf_name = f"blk.{i}.{layer_names[part]}.weight"
            if part == "self_attn.q_proj":
                array = _permute(array, c.num_attention_heads)
            elif part == "self_attn.k_proj":
                array = _permute(array, c.num_key_value_heads)
        else:
            gguf_name = names[name]
        if gguf_name == q8_1_tensor:
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((array.shape[0], array.shape[1] // block_elems * block_bytes), dtype=np.uint8)
            writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        elif gguf_name != skip_tensor:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_shape(writer, c) -> None:
    """The GGUF metadata of a transformers config's shape: layers, context, widths and head counts."""
    writer.add_name("tiny")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
