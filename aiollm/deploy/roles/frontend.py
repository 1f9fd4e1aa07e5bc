"""Role `frontend`: the OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of a controller."""

from __future__ import annotations

import argparse
import asyncio

from aiollm.actors.node import Node
from aiollm.deploy.roles.common import actor_arg, served_name
from aiollm.frontend.app import Frontend, FrontendConfig, start_server
from aiollm.model.loader import load_tokenizer
from aiollm.serving.backend import ModelInfo
from aiollm.serving.distserve.client import ClusterClient

# running HTTP server tasks (held so they are not garbage-collected)
_servers: set[asyncio.Task] = set()


def add_arguments(parser) -> None:
    actor_arg(parser, "frontend")
    parser.add_argument("--controller", required=True, help="the controller actor: tcp://host:port/controller")
    parser.add_argument("--model", default="smollm2", help="model whose tokenizer and chat template to use")
    parser.add_argument("--http-host", default="127.0.0.1", help="HTTP interface")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--max-in-flight", type=int, default=512, help="HTTP requests served at once")


async def start(node: Node, args: argparse.Namespace) -> dict[str, str]:
    tokenizer, config = load_tokenizer(args.model)
    client = ClusterClient(args.controller)
    ref = await node.spawn(client, args.actor)
    frontend = Frontend(
        client,
        tokenizer,
        ModelInfo(served_name(args.model), config.max_context),
        FrontendConfig(
            host=args.http_host, port=args.http_port, max_in_flight=args.max_in_flight, vocab_size=config.vocab
        ),
    )
    _, task, _ = await start_server(frontend.app, args.http_host, args.http_port)
    _servers.add(task)
    return {args.actor: ref.url}
