"""Reading a Hugging Face Llama-family directory: `config.json` + `*.safetensors` (+ tokenizer files).

This is how most users hold models. Tensors already have the HF names and layout the forward
expects, so the only work is checking the config and opening every shard lazily.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from aiollm.errors import ModelFormatError
from aiollm.model.config import ModelConfig, RopeScaling

# config.json model_type values whose forward is exactly Llama's (no biases, SiLU MLP, RMSNorm)
LLAMA_MODEL_TYPES = ("llama", "mistral")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON ({exc})") from exc


def _eos_ids(*values) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


def config_from_hf(raw: dict, path: Path, generation: dict | None = None) -> ModelConfig:
    """A ModelConfig from the dict of a HF `config.json` (transformers 4 and 5 spellings)."""
    model_type = raw.get("model_type")
    if model_type not in LLAMA_MODEL_TYPES:
        raise ModelFormatError(f"{path}: model_type {model_type!r} is not supported ({LLAMA_MODEL_TYPES})")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelFormatError(f"{path}: attention_bias/mlp_bias are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
    rope = dict(raw.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling together here
    scaling_raw = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    scaling = None
    if scaling_raw:
        kind = scaling_raw.get("rope_type", scaling_raw.get("type"))
        scaling = RopeScaling(
            kind=kind,
            factor=float(scaling_raw["factor"]),
            low_freq_factor=float(scaling_raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling_raw.get("high_freq_factor", 4.0)),
            original_max_position=int(scaling_raw.get("original_max_position_embeddings", 8192)),
        )
    n_heads = raw["num_attention_heads"]
    generation = generation or {}
    try:
        return ModelConfig(
            n_layers=raw["num_hidden_layers"],
            hidden=raw["hidden_size"],
            n_heads=n_heads,
            n_kv_heads=raw.get("num_key_value_heads") or n_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
            ffn=raw["intermediate_size"],
            vocab=raw["vocab_size"],
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_context=raw.get("max_position_embeddings", 2048),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            bos_id=raw.get("bos_token_id"),
            eos_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            name=Path(path).parent.name,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelFormatError(f"{path}: invalid or incomplete config ({type(exc).__name__}: {exc})") from exc


class HFDirectory:
    """An HF model directory opened for reading: `config` and the TensorSource protocol (`names`, `get`)."""

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        self.path = str(path)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model directory has no config.json: {config_path}")
        generation_path = self.dir / "generation_config.json"
        generation = _read_json(generation_path) if generation_path.is_file() else None
        self.config = config_from_hf(_read_json(config_path), config_path, generation)
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"model directory has no *.safetensors file: {self.dir}")
        self._where: dict[str, Path] = {}
        self._open = {}
        for shard in shards:
            try:
                handle = safe_open(str(shard), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError on bad headers
                raise ModelFormatError(f"{shard}: not a readable safetensors file ({exc})") from exc
            self._open[shard] = handle
            for name in handle.keys():
                self._where[name] = shard

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        shard = self._where[name]
        try:
            return self._open[shard].get_tensor(name)
        except Exception as exc:
            raise ModelFormatError(f"{shard}: tensor {name!r} cannot be read ({exc})") from exc
