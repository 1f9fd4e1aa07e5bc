"""A decode instance that takes requests and never pulls or decodes them: one that dies before it would (the KV
re-pull test and the faults benchmark kill it to time recovery paths)."""

from aiollm.actors import Actor, handler
from aiollm.serving.distserve.messages import Decode, GetLoad, Load


class SilentDecode(Actor):
    """Answers its load (a large, empty pool, so the controller prefers it) and records the requests sent."""

    def __init__(self) -> None:
        self.got: list[str] = []

    @handler(GetLoad)
    async def load(self, msg: GetLoad) -> Load:
        return Load(waiting=0, running=0, kv_blocks_used=0, kv_blocks_total=1 << 20, kv_block_size=16)

    @handler(Decode)
    async def decode(self, msg: Decode) -> None:
        self.got.append(msg.request_id)
