"""A model's memory from its config alone, without reading its weights: the bytes its weights take in a
process in a given dtype, and the bytes of KV one token takes.

    weights_bytes(load_config("smollm2"), "fp32")    # what a prefill / decode instance or S-worker holds
    kv_bytes_per_token(config, "fp16")                # K and V of every layer, the int8/int4 scales included
"""

from __future__ import annotations

from aiollm.kv.pool import DEFAULT_BLOCK_SIZE, KVConfig
from aiollm.model.config import ModelConfig

# bytes of one weight in each dtype the loader converts to
WEIGHT_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def param_count(config: ModelConfig) -> int:
    """Parameters in the model's files: embedding (once when tied), q/k/v/o (GQA's narrower k and v, q/k/v biases,
    q/k norms), the gated MLP, two RMSNorms per layer, the final norm and an untied output projection."""
    c = config
    attention = c.hidden * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden
    attention += (c.q_size + 2 * c.kv_size) * c.qkv_bias + 2 * c.head_dim * c.qk_norm
    layer = attention + 3 * c.hidden * c.ffn + 2 * c.hidden
    output = 0 if c.tie_embeddings else c.vocab * c.hidden
    return c.n_layers * layer + c.vocab * c.hidden + c.hidden + output


def held_params(config: ModelConfig) -> int:
    """Parameters a process holds once loaded: `param_count`, plus lm_head's packed copy of a tied embedding (the
    loader packs the output projection for the GEMM kernel and keeps the embedding for the lookups)."""
    return param_count(config) + (config.vocab * config.hidden if config.tie_embeddings else 0)


def weights_bytes(config: ModelConfig, dtype: str) -> int:
    """Bytes of the weights a process holds with `dtype` weights (every tensor is converted to it)."""
    if dtype not in WEIGHT_DTYPE_BYTES:
        raise ValueError(f"dtype: unknown weight dtype {dtype!r} ({', '.join(WEIGHT_DTYPE_BYTES)})")
    return held_params(config) * WEIGHT_DTYPE_BYTES[dtype]


def kv_bytes_per_block(config: ModelConfig, kv_dtype: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one KV block of `block_size` tokens over all layers (KVConfig's layout)."""
    return KVConfig.for_model(config, 1, block_size, kv_dtype).bytes_per_block


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Bytes of KV one token takes (a block's bytes over its tokens)."""
    return kv_bytes_per_block(config, kv_dtype, block_size) / block_size
