"""The frontend's side of the cluster: a `Backend` that is also an actor receiving `Tokens`.

Why an actor: the controller pushes each request's tokens with tells (it never waits on a
frontend), so the frontend needs a mailbox; this actor routes each delta to the queue of the
HTTP request waiting for it. Errors from the controller become the frontend's exceptions
(overloaded -> `Overloaded` -> HTTP 429; unavailable -> `Unavailable` -> HTTP 503).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiollm.actors.actor import Actor, handler
from aiollm.actors.ref import ActorRef
from aiollm.errors import AiollmError
from aiollm.serving.backend import BackendStats, GenerateRequest, Overloaded, TokenDelta, Unavailable
from aiollm.serving.distserve.messages import Cancel, Delta, Generate, GetLoad, Load, Sampling, Tokens


class ClusterClient(Actor):
    """Submits requests to the controller at `controller_url` and streams their tokens back."""

    def __init__(self, controller_url: str) -> None:
        self.controller_url = controller_url
        self.controller: ActorRef | None = None
        self._queues: dict[str, asyncio.Queue[Delta]] = {}

    async def on_start(self) -> None:
        self.controller = self.node.ref(self.controller_url)

    @handler(Tokens)
    async def on_tokens(self, msg: Tokens) -> None:
        for delta in msg.deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        rid = request.request_id
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            try:
                await self.controller.tell(
                    Generate(rid, list(request.prompt_ids), Sampling.of(request.sampling), self.ref)
                )
            except Exception as exc:
                raise Unavailable(f"controller unreachable: {exc}") from exc
            while True:
                delta = await queue.get()
                if delta.error is not None:
                    finished = True
                    if delta.error == "overloaded":
                        raise Overloaded("the cluster's queue is full")
                    raise Unavailable(f"request {rid}: {delta.error}")
                finished = delta.finish is not None
                yield TokenDelta(tuple(delta.token_ids), delta.finish)
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                await self.cancel(rid)

    async def cancel(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        try:
            await self.controller.tell(Cancel(request_id))
        except AiollmError:
            pass  # the controller is gone: nothing holds the request any more
        if queue is not None:
            queue.put_nowait(Delta(request_id, [], error="cancelled"))

    async def stats(self) -> BackendStats:
        try:
            load: Load = await self.controller.ask(GetLoad(), timeout=5.0)
        except Exception as exc:
            raise Unavailable(f"controller unreachable: {exc}") from exc
        return BackendStats(
            waiting=load.waiting,
            running=load.running,
            prefill_queues=load.prefill_queues,
            decode_queues=load.decode_queues,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
        )
