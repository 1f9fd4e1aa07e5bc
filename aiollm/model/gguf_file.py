"""Reading a llama.cpp GGUF file: the config from its metadata, its tensors dequantised, its tokenizer.

llama.cpp's converter permutes the rows of the Q and K projections so that its RoPE can rotate
adjacent pairs; Hugging Face Llama rotates the two halves of each head instead. We undo the
permutation here (as transformers does when it loads a GGUF), so the rest of aiollm sees HF
weights and HF RoPE, and q/k equal transformers' bit for bit.
"""

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from aiollm.errors import ModelFormatError
from aiollm.model.config import ModelConfig, RopeScaling

# architectures whose tensors and forward are exactly Llama's
LLAMA_ARCHITECTURES = ("llama",)

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
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                raise ModelFormatError(f"{self.path}: tensor {tensor.name!r} is not part of a supported Llama model")
            self._tensors[name] = tensor
        self.config = self._read_config()

    def field(self, key: str, default=None):
        """A metadata value (scalar, string or list), or `default` when absent."""
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def _require(self, key: str):
        value = self.field(key)
        if value is None:
            raise ModelFormatError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def _read_config(self) -> ModelConfig:
        arch = self._require("general.architecture")
        if arch not in LLAMA_ARCHITECTURES:
            raise ModelFormatError(f"{self.path}: architecture {arch!r} is not supported ({LLAMA_ARCHITECTURES})")
        hidden = int(self._require(f"{arch}.embedding_length"))
        n_heads = int(self._require(f"{arch}.attention.head_count"))
        tokens = self.field("tokenizer.ggml.tokens") or []
        scaling = None
        kind = self.field(f"{arch}.rope.scaling.type", "none")
        if kind not in ("none", None):
            scaling = RopeScaling(
                kind=kind,
                factor=float(self._require(f"{arch}.rope.scaling.factor")),
                original_max_position=int(self.field(f"{arch}.rope.scaling.original_context_length", 8192)),
            )
        eos = self.field("tokenizer.ggml.eos_token_id")
        try:
            return ModelConfig(
                n_layers=int(self._require(f"{arch}.block_count")),
                hidden=hidden,
                n_heads=n_heads,
                n_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", n_heads)),
                head_dim=int(self.field(f"{arch}.attention.key_length", hidden // n_heads)),
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
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, self.config.n_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, self.config.n_kv_heads)
        return weight
