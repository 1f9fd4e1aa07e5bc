"""The shape of a Llama-family model, read once from a GGUF's metadata or a HF `config.json`.

One definition covers the families: Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3 differ only in the fields
below (q/k/v biases, per-head q/k RMSNorm, a sliding attention window, RoPE scaling, tied embeddings).

Everything downstream (the forward, the KV cache sizing, the planners) reads these numbers from
one frozen object instead of from a dict, so a typo is an error at load time, not at step 10,000.
"""

import math
from dataclasses import dataclass, field

ROPE_SCALINGS = ("linear", "dynamic", "llama3", "yarn", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension scaling of the RoPE frequencies, as transformers defines each kind: "linear" (positions
    divided by factor), "dynamic" (NTK: the base grows past original_max_position), "llama3" (Llama 3.1's
    wavelength blend), "yarn" (ramped blend between beta_fast and beta_slow rotations, cos/sin times
    attention_factor) and "freq_factors" (each pair's frequency divided by its factor: how a GGUF stores Llama 3.1's
    scaling, a `rope_freqs` tensor)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn: the ramp's ends in rotations, and the cos/sin scale (None: 0.1 ln(factor) + 1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # yarn: round the ramp's ends outwards to whole dims (transformers' default)
    truncate: bool = True
    # freq_factors: one divisor per rotated pair [head_dim / 2]
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling.kind: unsupported RoPE scaling type {self.kind!r} {ROPE_SCALINGS}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: must be > 0, got {self.factor}")
        if self.original_max_position <= 0:
            raise ValueError(f"rope_scaling.original_max_position: must be > 0, got {self.original_max_position}")

    @property
    def cos_sin_scale(self) -> float:
        """The factor on cos and sin (yarn's attention_factor; 1 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (grouped-query attention, SiLU-gated MLP, RMSNorm)."""

    # number of decoder layers
    n_layers: int
    # width of the residual stream
    hidden: int
    # query heads per layer
    n_heads: int
    # key/value heads per layer (n_heads is a multiple of it: grouped-query attention)
    n_kv_heads: int
    # width of one attention head
    head_dim: int
    # inner width of the MLP
    ffn: int
    # number of token ids (rows of the embedding and of the output projection)
    vocab: int
    # RoPE base frequency
    rope_theta: float = 10000.0
    # RMSNorm epsilon
    rms_eps: float = 1e-5
    # longest sequence the model was trained for (prompt + completion)
    max_context: int = 2048
    # lm_head shares the embedding matrix
    tie_embeddings: bool = False
    # optional RoPE context-extension scaling
    rope_scaling: RopeScaling | None = None
    # token prepended when the tokenizer asks for it
    bos_id: int | None = None
    # token ids that end a completion
    eos_ids: tuple[int, ...] = field(default_factory=tuple)
    # human-readable model name, for logs
    name: str = "llama"
    # the family the file declares (llama, mistral, qwen2, qwen3), for logs and reports
    family: str = "llama"
    # q, k and v projections carry biases (Qwen2)
    qkv_bias: bool = False
    # RMSNorm over each head of q and k before RoPE, one weight [head_dim] each (Qwen3)
    qk_norm: bool = False
    # sliding-window attention: each token attends to the last `sliding_window` tokens, itself included (Mistral)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab", "max_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: {self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head width, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError(f"rope_theta/rms_eps: must be > 0, got {self.rope_theta}/{self.rms_eps}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window: must be a positive int or None, got {self.sliding_window!r}")
        for token in (self.bos_id, *self.eos_ids):
            if token is not None and not 0 <= token < self.vocab:
                raise ValueError(f"bos_id/eos_ids: token id {token} outside the vocabulary of {self.vocab}")

    @property
    def q_size(self) -> int:
        """Width of all query heads together."""
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads together."""
        return self.n_kv_heads * self.head_dim

    @property
    def n_params(self) -> int:
        """Parameter count (the embedding counted once when tied): aiollm.model.size.param_count."""
        from aiollm.model.size import param_count

        return param_count(self)
