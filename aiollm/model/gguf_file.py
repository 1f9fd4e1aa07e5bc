"""Reading a llama.cpp GGUF file (llama, mistral, qwen2, qwen3): the config from its metadata, its tensors
dequantised with gguf.quants (F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, Q2_K-Q6_K), its tokenizer.

llama.cpp's converter permutes the rows of Llama's (and Mistral's) Q and K projections so that its RoPE can
rotate adjacent pairs; Hugging Face Llama rotates the two halves of each head instead. We undo the
permutation here (as transformers does when it loads a GGUF), so the rest of aiollm sees HF
weights and HF RoPE, and q/k equal transformers' bit for bit. Qwen files keep HF's order.
"""

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from aiollm.errors import ModelFormatError
from aiollm.model.config import ModelConfig, RopeScaling

# GGUF general.architecture -> what its forward adds to Llama's (ModelConfig fields); Mistral files say "llama"
ARCHITECTURES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}
# architectures whose Q and K rows llama.cpp permuted for its adjacent-pair RoPE (Qwen's use the half split)
_PERMUTED = ("llama", "mistral")
# tensor types dequantised at load (with gguf.quants); any other type is refused when the file is opened
SUPPORTED_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
# llama.cpp's per-pair RoPE frequency divisors (Llama 3.1's scaling, baked into a tensor)
ROPE_FREQS = "rope_freqs.weight"

# GGUF tensor name (layer part stripped) -> HF name
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None when the tensor is not part of a Llama."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Q or K projection ([n_heads*head_dim, hidden])."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFFile:
    """An open GGUF file: `config`, `tokenizer_fields`, and the TensorSource protocol (`names`, `get`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if not Path(path).is_file():
            raise FileNotFoundError(f"GGUF model file not found: {self.path}")
        try:
            self._reader = GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError, IndexError, struct/numpy errors on bad bytes
            raise ModelFormatError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self._fields = self._reader.fields
        self._tensors = {}
        rope_freqs = None
        for tensor in self._reader.tensors:
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise ModelFormatError(
                    f"{self.path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which aiollm does not "
                    f"dequantise (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
                )
            if tensor.name == ROPE_FREQS:
                rope_freqs = tensor
                continue
            name = hf_name(tensor.name)
            if name is None:
                raise ModelFormatError(f"{self.path}: tensor {tensor.name!r} is not part of a supported Llama model")
            self._tensors[name] = tensor
        self.config = self._read_config(rope_freqs)

    def field(self, key: str, default=None):
        """A metadata value (scalar, string or list), or `default` when absent."""
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def _require(self, key: str):
        value = self.field(key)
        if value is None:
            raise ModelFormatError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def _rope_scaling(self, arch: str, rope_freqs, head_dim: int) -> RopeScaling | None:
        kind = self.field(f"{arch}.rope.scaling.type", "none")
        if rope_freqs is not None:
            factors = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type), np.float32).reshape(-1)
            if factors.size != head_dim // 2:
                raise ModelFormatError(f"{self.path}: {ROPE_FREQS} has {factors.size} factors, need {head_dim // 2}")
            return RopeScaling(kind="freq_factors", factor=1.0, freq_factors=tuple(float(f) for f in factors))
        if kind in ("none", None):
            return None
        if kind not in ("linear", "yarn"):
            raise ModelFormatError(f"{self.path}: RoPE scaling type {kind!r} is not supported (linear, yarn)")
        factor = float(self._require(f"{arch}.rope.scaling.factor"))
        attn = self.field(f"{arch}.rope.scaling.attn_factor")
        return RopeScaling(
            kind=kind,
            factor=factor,
            original_max_position=int(self.field(f"{arch}.rope.scaling.original_context_length", 8192)),
            beta_fast=float(self.field(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(self.field(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=None if attn is None else float(attn),
        )

    def _read_config(self, rope_freqs) -> ModelConfig:
        arch = self._require("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelFormatError(
                f"{self.path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        self._arch = arch
        hidden = int(self._require(f"{arch}.embedding_length"))
        n_heads = int(self._require(f"{arch}.attention.head_count"))
        head_dim = int(self.field(f"{arch}.attention.key_length", hidden // n_heads))
        tokens = self.field("tokenizer.ggml.tokens") or []
        eos = self.field("tokenizer.ggml.eos_token_id")
        window = self.field(f"{arch}.attention.sliding_window")
        try:
            scaling = self._rope_scaling(arch, rope_freqs, head_dim)
            return ModelConfig(
                n_layers=int(self._require(f"{arch}.block_count")),
                hidden=hidden,
                n_heads=n_heads,
                n_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", n_heads)),
                head_dim=head_dim,
                ffn=int(self._require(f"{arch}.feed_forward_length")),
                vocab=int(self.field(f"{arch}.vocab_size", len(tokens))),
                rope_theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
                rms_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                max_context=int(self.field(f"{arch}.context_length", 2048)),
                tie_embeddings="lm_head.weight" not in self._tensors,
                rope_scaling=scaling,
                bos_id=self.field("tokenizer.ggml.bos_token_id"),
                eos_ids=() if eos is None else (int(eos),),
                name=self.field("general.name", Path(self.path).stem),
                family=arch,
                sliding_window=int(window) if window else None,
                **ARCHITECTURES[arch],
            )
        except ValueError as exc:
            raise ModelFormatError(f"{self.path}: metadata gives an invalid config: {exc}") from exc

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelFormatError(
                f"{self.path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be dequantised"
            ) from exc
        except (ValueError, IndexError) as exc:
            raise ModelFormatError(
                f"{self.path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) is corrupt: {exc}"
            ) from exc
        weight = torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: never a view of the mapped file
        if self._arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_qk(weight, self.config.n_heads)
        elif self._arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_qk(weight, self.config.n_kv_heads)
        return weight
