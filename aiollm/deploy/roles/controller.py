"""Role `controller`: DistServe's dispatcher over the given prefill and decode instances."""

from __future__ import annotations

from aiollm.actors.node import Node
from aiollm.deploy.roles import Wiring, add_actor, add_prefix_cache_flag, instances, spec_flag
from aiollm.deploy.spec import ClusterSpec
from aiollm.serving.distserve.controller import Controller, ControllerConfig


def add_arguments(parser) -> None:
    add_actor(parser, "controller")
    parser.add_argument(
        "--prefill", type=instances, required=True, help="prefill actors: [name=]tcp://host:port/actor,..."
    )
    parser.add_argument(
        "--decode", type=instances, required=True, help="decode actors: [name=]tcp://host:port/actor,..."
    )
    spec_flag(
        parser, "--prefill-queue-limit", "controller.prefill_queue_limit", "requests sent ahead to one prefill instance"
    )
    spec_flag(parser, "--max-waiting", "controller.max_waiting", "queued requests before HTTP 429")
    spec_flag(parser, "--resume-timeout", "controller.resume_timeout_s", "seconds a request waits for a live instance")
    add_prefix_cache_flag(parser)


def controller_config(spec: ClusterSpec) -> ControllerConfig:
    c = spec.controller
    return ControllerConfig(
        prefill_queue_limit=c.prefill_queue_limit,
        max_waiting=c.max_waiting,
        resume_timeout_s=c.resume_timeout_s,
        repull=c.repull,
        prefix_routing=spec.kv.prefix_cache,
    )


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    actor = wiring.actor or "controller"
    controller = Controller(wiring.prefill, wiring.decode, controller_config(spec))
    ref = await node.spawn(controller, actor)
    return {actor: ref.url}
