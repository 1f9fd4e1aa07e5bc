"""The serving roles a node can host: `prefill`, `decode`, `controller`, `frontend`.

Each role adds its flags to the node's argument parser and, given a started node and the parsed
flags, spawns its actors (and, for the frontend, the HTTP server). `aiollm.node` looks roles up
here; `python -m aiollm serve` starts one node per role instance as a subprocess.
"""
from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from aiollm.actors.node import Node
from aiollm.log import get_logger
from aiollm.model.config import ModelConfig
from aiollm.model.loader import resolve
from aiollm.model.tokenizer import Tokenizer

log = get_logger("roles")

# running HTTP server tasks (held so they are not garbage-collected)
_servers: set[asyncio.Task] = set()


@dataclass(frozen=True)
class Role:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    # spawn the role's actors on a started node; returns once they serve
    start: Callable[[Node, argparse.Namespace], Awaitable[None]]


def served_name(model: str) -> str:
    """The id clients pass as `model`: the bundled name, or the file/directory stem."""
    return model if "/" not in model and not model.endswith(".gguf") else Path(model).stem


def load_tokenizer(model: str) -> tuple[Tokenizer, ModelConfig]:
    """Tokenizer and config of a model without dequantising its weights (the frontend needs no weights)."""
    path = resolve(model)
    if path.is_dir():
        from aiollm.model.hf_dir import HFDirectory
        source = HFDirectory(path)
        return Tokenizer.from_hf_dir(path, source.config.eos_ids), source.config
    from aiollm.model.gguf_file import GGUFFile
    source = GGUFFile(path)
    return Tokenizer.from_gguf_fields(source.field, source.path, source.config.eos_ids), source.config


def _actor_arg(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--actor", default=default, help=f"name of the actor on this node (default {default})")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF directory")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weight dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch and attention threads of this instance")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (same on every instance)")
    parser.add_argument("--kv-dtype", default="fp32", choices=["fp32", "fp16", "int8"], help="KV storage type")


def _load_model(args: argparse.Namespace):
    from aiollm.model.loader import load
    torch.set_num_threads(args.threads)
    return load(args.model, dtype=args.dtype)


def _prefill_args(parser: argparse.ArgumentParser) -> None:
    _actor_arg(parser, "prefill")
    _model_args(parser)
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV buffer of prefilled sequences, in blocks")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="L_m: prompt tokens per prefill batch")
    parser.add_argument("--lease", type=float, default=60.0, help="seconds a prefilled KV waits for its pull")


async def _start_prefill(node: Node, args: argparse.Namespace) -> None:
    from aiollm.workers.prefill import PrefillConfig, PrefillInstance
    model = await asyncio.to_thread(_load_model, args)
    config = PrefillConfig(kv_blocks=args.kv_blocks, block_size=args.block_size, kv_dtype=args.kv_dtype,
                           max_batch_tokens=args.max_batch_tokens, lease_s=args.lease)
    _ready("prefill", await node.spawn(PrefillInstance(model, config), args.actor))


def _decode_args(parser: argparse.ArgumentParser) -> None:
    _actor_arg(parser, "decode")
    _model_args(parser)
    parser.add_argument("--kv-blocks", type=int, default=2048, help="KV pool of decoding sequences, in blocks")
    parser.add_argument("--max-running", type=int, default=128, help="most sequences per decode step")


async def _start_decode(node: Node, args: argparse.Namespace) -> None:
    from aiollm.workers.decode import DecodeConfig, DecodeInstance
    model = await asyncio.to_thread(_load_model, args)
    config = DecodeConfig(kv_blocks=args.kv_blocks, block_size=args.block_size, kv_dtype=args.kv_dtype,
                          max_running=args.max_running, attn_threads=args.threads)
    _ready("decode", await node.spawn(DecodeInstance(model, config), args.actor))


def _instances(text: str) -> dict[str, str]:
    """'name=url,name=url' (or bare URLs, named by their actor) -> {name: url}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, url = item.rpartition("=") if "=" in item else (item.rsplit("/", 1)[-1], "", item)
        out[name] = url
    if not out:
        raise argparse.ArgumentTypeError("expected name=tcp://host:port/actor[,...]")
    return out


def _controller_args(parser: argparse.ArgumentParser) -> None:
    _actor_arg(parser, "controller")
    parser.add_argument("--prefill", type=_instances, required=True, help="prefill actors: tcp://host:port/name,...")
    parser.add_argument("--decode", type=_instances, required=True, help="decode actors: tcp://host:port/name,...")
    parser.add_argument("--prefill-queue-limit", type=int, default=4, help="requests sent ahead to one prefill instance")
    parser.add_argument("--max-waiting", type=int, default=4096, help="queued requests before HTTP 429")


async def _start_controller(node: Node, args: argparse.Namespace) -> None:
    from aiollm.workers.controller import Controller, ControllerConfig
    config = ControllerConfig(prefill_queue_limit=args.prefill_queue_limit, max_waiting=args.max_waiting)
    _ready("controller", await node.spawn(Controller(args.prefill, args.decode, config), args.actor))


def _frontend_args(parser: argparse.ArgumentParser) -> None:
    _actor_arg(parser, "frontend")
    parser.add_argument("--controller", required=True, help="the controller actor: tcp://host:port/controller")
    parser.add_argument("--model", default="smollm2", help="model whose tokenizer and chat template to use")
    parser.add_argument("--http-host", default="127.0.0.1", help="HTTP interface")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: any free one)")
    parser.add_argument("--max-in-flight", type=int, default=512, help="HTTP requests served at once")


async def _start_frontend(node: Node, args: argparse.Namespace) -> None:
    from aiollm.workers.backend import ModelInfo
    from aiollm.workers.cluster_client import ClusterClient
    from aiollm.workers.frontend import Frontend, FrontendConfig, start_server
    tokenizer, config = load_tokenizer(args.model)
    client = ClusterClient(args.controller)
    ref = await node.spawn(client, args.actor)
    frontend = Frontend(client, tokenizer, ModelInfo(served_name(args.model), config.max_context),
                        FrontendConfig(host=args.http_host, port=args.http_port, max_in_flight=args.max_in_flight,
                                       vocab_size=config.vocab))
    _, task, port = await start_server(frontend.app, args.http_host, args.http_port)
    _servers.add(task)
    _ready("frontend", ref, f"http://{args.http_host}:{port}/v1")


def _ready(role: str, ref, http: str = "") -> None:
    """One parseable stdout line per started role: `python -m aiollm serve` waits for it."""
    print(f"ready role={role} actor={ref.url}" + (f" http={http}" if http else ""), flush=True)


ROLES: dict[str, Role] = {
    "prefill": Role("DistServe prefill instance (FCFS, batches to L_m, holds KV until pulled)", _prefill_args,
                    _start_prefill),
    "decode": Role("DistServe decode instance (continuous batching, pulls KV)", _decode_args, _start_decode),
    "controller": Role("DistServe controller (dispatch, failover, timings)", _controller_args, _start_controller),
    "frontend": Role("OpenAI-compatible HTTP frontend over a controller", _frontend_args, _start_frontend),
}
