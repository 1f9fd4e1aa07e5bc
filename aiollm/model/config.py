"""The shape of a Llama-family model, read once from a GGUF's metadata or a HF `config.json`.

Everything downstream (the forward, the KV cache sizing, the planners) reads these numbers from
one frozen object instead of from a dict, so a typo is an error at load time, not at step 10,000.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension scaling of the RoPE frequencies ("linear" or Llama 3's "llama3")."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling.kind: unsupported RoPE scaling type {self.kind!r} (linear, llama3)")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: must be > 0, got {self.factor}")


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
        """Parameter count (the embedding counted once when tied)."""
        per_layer = 2 * self.hidden + self.hidden * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden
        per_layer += 3 * self.hidden * self.ffn
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.n_layers * per_layer + self.vocab * self.hidden + self.hidden + head
