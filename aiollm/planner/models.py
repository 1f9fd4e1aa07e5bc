"""Model shapes the planner needs: parameter bytes, KV bytes per token, FLOPs per token.

Why configs and not checkpoints: placement only needs how big a model is and how much memory and
compute each token costs, so a handful of published architecture numbers stands in for the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiollm.errors import require_positive


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of one decoder-only transformer (from its published config.json)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_context: int
    # Llama-style SwiGLU MLP has three ffn matrices, OPT's has two.
    gated_mlp: bool
    # Input embedding and output projection share one matrix (SmolLM2, OPT) or not (Llama-2).
    tied_embeddings: bool
    # fp16/bf16 weights and KV cache.
    bytes_per_param: int = 2

    def __post_init__(self) -> None:
        require_positive(
            self, "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_context", "bytes_per_param"
        )
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec {self.name}: hidden/heads/kv_heads do not divide")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Weights of one transformer layer (biases and norms ignored: < 0.1 %)."""
        kv_width = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv_width
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attention + mlp

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embeddings

    @property
    def param_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def gemm_flops_per_token(self) -> float:
        """Dense FLOPs for one token through every layer and the logits (2 per multiply-add)."""
        return 2.0 * (self.layers * self.layer_params + self.vocab * self.hidden)

    @property
    def attention_flops_per_token_sq(self) -> float:
        """Causal attention FLOPs per squared prompt length: QK^T and AV, 2*h*len^2/2 each per layer."""
        return 2.0 * self.layers * self.hidden


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("opt-13b", 40, 5120, 40, 40, 20480, 50272, 2048, gated_mlp=False, tied_embeddings=True),
        ModelSpec("opt-66b", 64, 9216, 72, 72, 36864, 50272, 2048, gated_mlp=False, tied_embeddings=True),
        ModelSpec("opt-175b", 96, 12288, 96, 96, 49152, 50272, 2048, gated_mlp=False, tied_embeddings=True),
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, gated_mlp=True, tied_embeddings=False),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, gated_mlp=True, tied_embeddings=False),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, gated_mlp=True, tied_embeddings=False),
        ModelSpec("smollm2", 30, 576, 9, 3, 1536, 49152, 8192, gated_mlp=True, tied_embeddings=True),
    )
}

# The names DistServe's profiles use for the same models.
HF_NAMES = {"facebook/opt-13b": "opt-13b", "facebook/opt-66b": "opt-66b", "facebook/opt-175b": "opt-175b"}


def get_model(name: str) -> ModelSpec:
    """The spec for `name` (case-insensitive; Hugging Face ids of the OPT models also work)."""
    key = HF_NAMES.get(name.lower(), name.lower())
    if key == "smollm2-135m":
        key = "smollm2"
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
