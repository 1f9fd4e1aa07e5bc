"""What the model-holding roles share: loading the model and the name clients pass as `model`."""

from __future__ import annotations

from pathlib import Path

from aiollm.deploy.spec import ClusterSpec


def served_name(model: str) -> str:
    """The id clients pass as `model`: the bundled name, or the file/directory stem."""
    return model if "/" not in model and not model.endswith(".gguf") else Path(model).stem


def served_model(spec: ClusterSpec) -> str:
    """The id this deployment answers to: the spec's `model.served_name`, else the model's own name."""
    return spec.model.served_name or served_name(spec.model.name)


def load_model(spec: ClusterSpec, threads: int):
    """The spec's model in its weight dtype, with torch using `threads` threads in this process."""
    import torch

    from aiollm.model.loader import load

    torch.set_num_threads(threads)
    return load(spec.model.name, dtype=spec.model.dtype)
