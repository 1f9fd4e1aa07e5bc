"""The actor runtime: typed messages, actors with bounded mailboxes, refs (tell/ask/stream), nodes.

from aiollm.actors import Actor, Message, Node, NodeConfig, handler
"""

from aiollm.actors.actor import Actor, handler
from aiollm.actors.messages import Message, Terminated
from aiollm.actors.node import Node, NodeConfig
from aiollm.actors.ref import ActorRef

__all__ = ["Actor", "ActorRef", "Message", "Node", "NodeConfig", "Terminated", "handler"]
