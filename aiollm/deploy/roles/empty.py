"""Role `empty`: no actor of its own; the system actor every node runs takes remote `Spawn` requests."""

from __future__ import annotations

from aiollm.actors.node import Node
from aiollm.deploy.roles import Wiring
from aiollm.deploy.spec import ClusterSpec


def add_arguments(parser) -> None:
    """The empty role has no options."""


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    return {}
