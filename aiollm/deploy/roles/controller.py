"""Role `controller`: DistServe's dispatcher over the given prefill and decode instances."""

from __future__ import annotations

import argparse

from aiollm.actors.node import Node
from aiollm.deploy.roles.common import actor_arg
from aiollm.serving.distserve.controller import Controller, ControllerConfig


def instances(text: str) -> dict[str, str]:
    """'name=tcp://h:p/actor,...' or bare actor URLs (named by their actor) -> {name: url}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, url = item.partition("=")
        if not sep:
            name, url = item.rsplit("/", 1)[-1], item
        out[name] = url
    if not out:
        raise argparse.ArgumentTypeError("expected name=tcp://host:port/actor[,...]")
    return out


def add_arguments(parser) -> None:
    actor_arg(parser, "controller")
    parser.add_argument(
        "--prefill", type=instances, required=True, help="prefill actors: [name=]tcp://host:port/actor,..."
    )
    parser.add_argument(
        "--decode", type=instances, required=True, help="decode actors: [name=]tcp://host:port/actor,..."
    )
    parser.add_argument(
        "--prefill-queue-limit", type=int, default=4, help="requests sent ahead to one prefill instance"
    )
    parser.add_argument("--max-waiting", type=int, default=4096, help="queued requests before HTTP 429")


async def start(node: Node, args: argparse.Namespace) -> dict[str, str]:
    config = ControllerConfig(prefill_queue_limit=args.prefill_queue_limit, max_waiting=args.max_waiting)
    ref = await node.spawn(Controller(args.prefill, args.decode, config), args.actor)
    return {args.actor: ref.url}
