"""Reading a Hugging Face directory (Llama, Mistral, Qwen2/2.5, Qwen3): `config.json` + `*.safetensors`, sharded
with `model.safetensors.index.json` or not (+ tokenizer files).

This is how most users hold models. Tensors already have the HF names and layout the forward
expects, so the only work is checking the config and mapping every shard lazily.
"""

import json
from pathlib import Path

import numpy as np
import torch

from aiollm.errors import ModelFormatError
from aiollm.model.config import ModelConfig, RopeScaling

# config.json model_type -> what its forward adds to Llama's (one model definition, differences as config)
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}


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


def _sliding_window(raw: dict, path: Path, n_layers: int) -> int | None:
    """The attention window every layer shares, or None; a window on only some layers is refused."""
    window = raw.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None  # Qwen's config carries a window that only use_sliding_window turns on
    types = raw.get("layer_types")
    if types is None and window is not None and raw.get("max_window_layers") is not None:
        start = raw["max_window_layers"]
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
    if types is not None:
        kinds = set(types)
        if kinds - {"sliding_attention", "full_attention"}:
            raise ModelFormatError(f"{path}: layer_types {sorted(kinds)} are not supported")
        if kinds == {"full_attention"}:
            return None
        if len(kinds) > 1:
            raise ModelFormatError(
                f"{path}: a sliding window on some layers only is not supported (layer_types {types})"
            )
    return None if window is None else int(window)


def _rope_scaling(raw: dict, rope: dict, path: Path) -> RopeScaling | None:
    scaling_raw = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if not scaling_raw:
        return None
    kind = scaling_raw.get("rope_type", scaling_raw.get("type"))
    if kind == "default":
        return None
    max_position = raw.get("max_position_embeddings", 2048)
    original = scaling_raw.get("original_max_position_embeddings")
    if kind == "dynamic":
        original = max_position  # transformers' dynamic NTK grows the base past max_position_embeddings
    if kind == "yarn" and scaling_raw.get("mscale") and scaling_raw.get("mscale_all_dim"):
        raise ModelFormatError(f"{path}: yarn with mscale/mscale_all_dim (DeepSeek's form) is not supported")
    try:
        return RopeScaling(
            kind=kind,
            factor=float(scaling_raw["factor"]),
            low_freq_factor=float(scaling_raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling_raw.get("high_freq_factor", 4.0)),
            original_max_position=int(original or 8192),
            beta_fast=float(scaling_raw.get("beta_fast") or 32.0),
            beta_slow=float(scaling_raw.get("beta_slow") or 1.0),
            attention_factor=scaling_raw.get("attention_factor"),
            truncate=bool(scaling_raw.get("truncate", True)),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelFormatError(f"{path}: rope scaling {scaling_raw} is not supported ({exc})") from exc


def config_from_hf(raw: dict, path: Path, generation: dict | None = None) -> ModelConfig:
    """A ModelConfig from the dict of a HF `config.json` (transformers 4 and 5 spellings)."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ModelFormatError(f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    if raw.get("attention_bias") and model_type != "qwen2":
        raise ModelFormatError(f"{path}: attention_bias (biases on q/k/v and o_proj) is not supported")
    if raw.get("mlp_bias"):
        raise ModelFormatError(f"{path}: mlp_bias is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFormatError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
    rope = dict(raw.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling together here
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelFormatError(f"{path}: partial_rotary_factor is not supported (RoPE over whole heads)")
    scaling = _rope_scaling(raw, rope, path)
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
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_context=raw.get("max_position_embeddings", 2048),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            bos_id=raw.get("bos_token_id"),
            eos_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            name=Path(path).parent.name,
            family=model_type,
            sliding_window=_sliding_window(raw, path, raw["num_hidden_layers"]),
            **FAMILIES[model_type],
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelFormatError(f"{path}: invalid or incomplete config ({type(exc).__name__}: {exc})") from exc


# safetensors dtype -> (numpy dtype of the mapped bytes, torch dtype of the tensor); bf16 is mapped as uint16
_DTYPES = {
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),
    "F64": (np.float64, torch.float64),
}
INDEX = "model.safetensors.index.json"


class _Shard:
    """One safetensors file, memory-mapped copy-on-write: its tensors are views of the page cache, read on first
    touch and never copied into this process's heap (np.memmap keeps the mapping alive with the views)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 2 <= n <= 100_000_000:
                    raise ValueError(f"header size {n}")
                header = json.loads(f.read(n))
            self.size = path.stat().st_size
        except (OSError, ValueError) as exc:
            raise ModelFormatError(f"{path}: not a readable safetensors file ({exc})") from exc
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self._base = 8 + n
        self._map: np.memmap | None = None

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = entry.get("dtype")
        if dtype not in _DTYPES:
            raise ModelFormatError(f"{self.path}: tensor {name!r} has dtype {dtype}, not a float type aiollm reads")
        np_dtype, torch_dtype = _DTYPES[dtype]
        start, end = (self._base + int(x) for x in entry["data_offsets"])
        shape = tuple(int(d) for d in entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end > self.size or end - start != count * np.dtype(np_dtype).itemsize:
            raise ModelFormatError(f"{self.path}: tensor {name!r} lies outside the file or has the wrong size")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        array = self._map[start:end].view(np_dtype).reshape(shape)
        return torch.from_numpy(array).view(torch_dtype)


class HFDirectory:
    """An HF model directory opened for reading: `config` and the TensorSource protocol (`names`, `get`).

    Sharded checkpoints are read through `model.safetensors.index.json` (every shard it names must exist);
    otherwise every `*.safetensors` file is a shard. Shards are memory-mapped, so `get` returns a view of the
    file: the weights are paged in as the loader converts and packs them, and never copied whole."""

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        self.path = str(path)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model directory has no config.json: {config_path}")
        generation_path = self.dir / "generation_config.json"
        generation = _read_json(generation_path) if generation_path.is_file() else None
        self.config = config_from_hf(_read_json(config_path), config_path, generation)
        index_path = self.dir / INDEX
        if index_path.is_file():
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFormatError(f"{index_path}: no weight_map")
            files = sorted({self.dir / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"{index_path} names a shard that is missing: {f}")
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"model directory has no *.safetensors file: {self.dir}")
        self._where: dict[str, _Shard] = {}
        for f in files:
            shard = _Shard(f)
            for name in shard.entries:
                self._where[name] = shard

    @property
    def shard_paths(self) -> list[Path]:
        """The safetensors files the weights come from."""
        return sorted({shard.path for shard in self._where.values()})

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get(name)
