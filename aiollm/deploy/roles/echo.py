"""Role `echo`: one `EchoActor` named `echo` (the runtime's demo, tests and transport benchmarks)."""

from __future__ import annotations

from aiollm.actors.echo import EchoActor
from aiollm.actors.node import Node
from aiollm.deploy.roles import Wiring
from aiollm.deploy.spec import ClusterSpec


def add_arguments(parser) -> None:
    """The echo role has no options of its own."""


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    ref = await node.spawn(EchoActor, "echo")
    return {"echo": ref.url}
