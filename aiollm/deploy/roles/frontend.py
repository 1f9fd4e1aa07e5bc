"""Role `frontend`: the OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of a controller."""

from __future__ import annotations

import asyncio
import os

from aiollm.actors.node import Node
from aiollm.deploy.roles import Wiring, add_actor, spec_flag
from aiollm.deploy.roles.common import served_model
from aiollm.deploy.spec import ClusterSpec
from aiollm.frontend.app import Frontend, FrontendConfig, start_server
from aiollm.model.loader import load_tokenizer
from aiollm.serving.backend import ModelInfo
from aiollm.serving.distserve.client import ClusterClient

# running HTTP server tasks (held so they are not garbage-collected)
_servers: set[asyncio.Task] = set()


def add_arguments(parser) -> None:
    add_actor(parser, "frontend")
    parser.add_argument(
        "--controller", required=True, metavar="URL", help="the controller actor: tcp://host:port/controller"
    )
    spec_flag(parser, "--model", "model.name", "model whose tokenizer and chat template to use")
    spec_flag(
        parser, "--served-model-name", "model.served_name", "the name clients send as `model` (default: the model's)"
    )
    spec_flag(parser, "--http-host", "frontend.host", "HTTP interface")
    spec_flag(parser, "--http-port", "frontend.port", "HTTP port")
    spec_flag(parser, "--max-in-flight", "frontend.max_in_flight", "HTTP requests served at once")
    spec_flag(parser, "--max-body-bytes", "frontend.max_body_bytes", "largest request body (413 beyond)")
    spec_flag(parser, "--api-key", "frontend.api_key", "clients must send it as a Bearer token (or AIOLLM_API_KEY)")


def frontend_config(spec: ClusterSpec, vocab_size: int) -> FrontendConfig:
    f = spec.frontend
    return FrontendConfig(
        host=f.host,
        port=f.port,
        max_in_flight=f.max_in_flight,
        vocab_size=vocab_size,
        max_body_bytes=f.max_body_bytes,
        api_key=f.api_key or os.environ.get("AIOLLM_API_KEY", ""),
    )


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    actor = wiring.actor or "frontend"
    tokenizer, config = load_tokenizer(spec.model.name)
    client = ClusterClient(wiring.controller, spec.controller.resume_timeout_s)
    ref = await node.spawn(client, actor)
    f = spec.frontend
    info = ModelInfo(served_model(spec), config.max_context)
    frontend = Frontend(client, tokenizer, info, frontend_config(spec, config.vocab))
    _, task, _ = await start_server(frontend.app, f.host, f.port)
    _servers.add(task)
    return {actor: ref.url}
