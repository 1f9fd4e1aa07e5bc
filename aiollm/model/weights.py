"""The weights of a Llama-family model (with Qwen2's q/k/v biases and Qwen3's q/k norms where the config has
them), laid out for fast batched CPU/GPU inference.

Both loaders (GGUF, HF directory) hand over tensors under the Hugging Face names; `assemble`
checks every shape against the config and fuses Q/K/V into one matrix and gate/up into another,
so a decode step does 4 GEMMs per layer instead of 7 (fewer, larger GEMMs: less per-call
overhead, better use of AMX/AVX-512 tiles at small batch).
"""

from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm import tqdm

from aiollm.errors import ModelFormatError
from aiollm.log import get_logger
from aiollm.model.config import ModelConfig
from aiollm.model.linear import pack


class TensorSource(Protocol):
    """A model file opened for reading: tensor names (HF spelling) and their values."""

    path: str

    def names(self) -> set[str]:
        """Every tensor name the file holds."""

    def get(self, name: str) -> torch.Tensor:
        """The tensor, dequantised to a float dtype; raises ModelFormatError naming file, tensor and type."""


@dataclass
class LayerWeights:
    """One decoder layer; matrices are [out_features, in_features], packed by aiollm.model.linear.pack
    (on CPU an opaque oneDNN tensor: use `.to_dense()` to read one)."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2*kv_size, hidden]
    o: torch.Tensor  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2*ffn, hidden]
    down: torch.Tensor  # [hidden, ffn]
    qkv_bias: torch.Tensor | None = None  # [q_size + 2*kv_size] (Qwen2)
    q_norm: torch.Tensor | None = None  # [head_dim], RMSNorm of each q head (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim], RMSNorm of each k head (Qwen3)


@dataclass
class LlamaWeights:
    """All weights of the model; lm_head is packed like the layers' matrices (a packed copy of the embedding
    when they are tied)."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


def _layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "attn_norm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "mlp_norm": p + "post_attention_layernorm.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
        "q_bias": p + "self_attn.q_proj.bias",
        "k_bias": p + "self_attn.k_proj.bias",
        "v_bias": p + "self_attn.v_proj.bias",
        "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
    }


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape, under the HF names."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab, c.hidden), "model.norm.weight": (c.hidden,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab, c.hidden)
    for i in range(c.n_layers):
        n = _layer_names(i)
        shapes.update(
            {
                n["attn_norm"]: (c.hidden,),
                n["mlp_norm"]: (c.hidden,),
                n["q"]: (c.q_size, c.hidden),
                n["k"]: (c.kv_size, c.hidden),
                n["v"]: (c.kv_size, c.hidden),
                n["o"]: (c.hidden, c.q_size),
                n["gate"]: (c.ffn, c.hidden),
                n["up"]: (c.ffn, c.hidden),
                n["down"]: (c.hidden, c.ffn),
            }
        )
        if c.qkv_bias:
            shapes.update({n["q_bias"]: (c.q_size,), n["k_bias"]: (c.kv_size,), n["v_bias"]: (c.kv_size,)})
        if c.qk_norm:
            shapes.update({n["q_norm"]: (c.head_dim,), n["k_norm"]: (c.head_dim,)})
    return shapes


def assemble(config: ModelConfig, source: TensorSource, dtype: torch.dtype, device: str = "cpu") -> LlamaWeights:
    """Read, check, convert and fuse every tensor of `source`, showing progress."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - source.names())
    if missing:
        raise ModelFormatError(f"{source.path}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    log = get_logger("model.weights")  # bound at call time, so the process's log level set later applies
    progress = tqdm(total=len(shapes), desc=f"loading {config.name}", unit="tensor", disable=None, leave=False)

    def take(name: str) -> torch.Tensor:
        tensor = source.get(name)
        if tuple(tensor.shape) != shapes[name]:
            raise ModelFormatError(
                f"{source.path}: tensor {name!r} has shape {tuple(tensor.shape)}, the config needs {shapes[name]}"
            )
        progress.update(1)
        return tensor.to(device=device, dtype=dtype)

    try:
        embed = take("model.embed_tokens.weight").contiguous()
        layers = []
        for i in range(config.n_layers):
            n = _layer_names(i)
            layers.append(
                LayerWeights(
                    attn_norm=take(n["attn_norm"]),
                    qkv=pack(torch.cat([take(n["q"]), take(n["k"]), take(n["v"])])),
                    o=pack(take(n["o"])),
                    mlp_norm=take(n["mlp_norm"]),
                    gate_up=pack(torch.cat([take(n["gate"]), take(n["up"])])),
                    down=pack(take(n["down"])),
                    qkv_bias=(
                        torch.cat([take(n["q_bias"]), take(n["k_bias"]), take(n["v_bias"])])
                        if config.qkv_bias
                        else None
                    ),
                    q_norm=take(n["q_norm"]) if config.qk_norm else None,
                    k_norm=take(n["k_norm"]) if config.qk_norm else None,
                )
            )
            if (i + 1) % 10 == 0 or i + 1 == config.n_layers:
                log.info("loaded layers", done=i + 1, total=config.n_layers, path=source.path)
        norm = take("model.norm.weight")
        lm_head = pack(embed if config.tie_embeddings else take("lm_head.weight"))
    finally:
        progress.close()
    return LlamaWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
