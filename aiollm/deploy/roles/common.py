"""What the serving roles share: model loading, the served model name, and the flags every model-holding role takes.

The roles themselves are the sibling modules `prefill`, `decode`, `controller`, `frontend`; each has
`add_arguments(parser)` and `async start(node, args) -> {actor name: url}`, as `aiollm.cli.node`'s role
registry expects.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from aiollm.kv.pool import KV_DTYPES


def served_name(model: str) -> str:
    """The id clients pass as `model`: the bundled name, or the file/directory stem."""
    return model if "/" not in model and not model.endswith(".gguf") else Path(model).stem


def actor_arg(parser, default: str) -> None:
    parser.add_argument("--actor", default=default, help=f"name of the actor on this node (default {default})")


def model_args(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF directory")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weight dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch and attention threads of this instance")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (same on every instance)")
    parser.add_argument("--kv-dtype", default="fp32", choices=KV_DTYPES, help="KV storage type")


def load_model(args: argparse.Namespace):
    from aiollm.model.loader import load

    torch.set_num_threads(args.threads)
    return load(args.model, dtype=args.dtype)
