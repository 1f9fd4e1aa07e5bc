"""The frontend's side of the cluster: a `Backend` that is also an actor receiving `Tokens`.

Why an actor: the controller pushes each request's tokens with tells (it never waits on a
frontend), so the frontend needs a mailbox; this actor routes each delta to the queue of the
HTTP request waiting for it. Errors from the controller become the frontend's exceptions
(overloaded -> `Overloaded` -> HTTP 429; unavailable -> `Unavailable` -> HTTP 503).

Why it holds each request: the controller's state is in one process, and that process can die. The client
keeps every request it streams (its prompt, sampling and the tokens already delivered) and watches the
controller; when the controller is lost it submits each request again, to the controller's address (where the
launcher restarts it), as its prompt plus the tokens so far, asking only for the rest, with its draws keyed from
the next token's index. The HTTP client sees one uninterrupted stream with the tokens an undisturbed run gives.
Each submission has its own wire id (`request_id~attempt`), so a late delta of an earlier attempt is never
mixed into the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from aiollm.actors.actor import Actor, handler
from aiollm.actors.messages import Terminated
from aiollm.actors.ref import ActorRef
from aiollm.errors import AiollmError
from aiollm.log import get_logger
from aiollm.serving.backend import BackendStats, GenerateRequest, Overloaded, TokenDelta, Unavailable
from aiollm.serving.distserve.messages import Cancel, Delta, Generate, GetLoad, Load, Sampling, Tokens

_log = get_logger("cluster_client")

# put in a request's queue when the controller is lost: submit it again
_LOST = object()


@dataclass
class _Flight:
    """A request being streamed: what to submit again if the controller is lost."""

    request: GenerateRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    delivered: list[int] = field(default_factory=list)
    attempt: int = 0

    @property
    def wire_id(self) -> str:
        return f"{self.request.request_id}~{self.attempt}"


class ClusterClient(Actor):
    """Submits requests to the controller at `controller_url` and streams their tokens back; submits them again
    when the controller is lost (waiting up to `resume_timeout_s` for it to answer again)."""

    def __init__(self, controller_url: str, resume_timeout_s: float = 30.0) -> None:
        if resume_timeout_s <= 0:
            raise ValueError(f"resume_timeout_s must be > 0, got {resume_timeout_s}")
        self.controller_url = controller_url
        self.resume_timeout_s = resume_timeout_s
        self.controller: ActorRef | None = None
        # wire id -> the request it carries
        self._flights: dict[str, _Flight] = {}
        self._watching = False
        # requests submitted again after a lost controller (for /metrics and tests)
        self.resubmitted = 0

    async def on_start(self) -> None:
        self.controller = self.node.ref(self.controller_url)

    @handler(Tokens)
    async def on_tokens(self, msg: Tokens) -> None:
        for delta in msg.deltas:
            flight = self._flights.get(delta.request_id)
            if flight is not None:
                flight.queue.put_nowait(delta)

    @handler(Terminated)
    async def on_terminated(self, msg: Terminated) -> None:
        if msg.url != self.controller.url:
            return
        self._watching = False
        _log.warning("controller lost: submitting its requests again", reason=msg.reason, requests=len(self._flights))
        for flight in self._flights.values():
            flight.queue.put_nowait(_LOST)

    async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        flight = _Flight(request)
        finished = False
        try:
            await self._send(flight)
            while True:
                item = await flight.queue.get()
                if item is _LOST:
                    await self._send_again(flight)
                    continue
                delta: Delta = item
                if delta.error is not None:
                    finished = True
                    if delta.error == "overloaded":
                        raise Overloaded("the cluster's queue is full")
                    raise Unavailable(f"request {request.request_id}: {delta.error}")
                finished = delta.finish is not None
                flight.delivered += delta.token_ids
                yield TokenDelta(tuple(delta.token_ids), delta.finish, delta.logprobs)
                if finished:
                    return
        finally:
            self._flights.pop(flight.wire_id, None)
            if not finished:
                await self._cancel_wire(flight.wire_id)

    async def _send(self, flight: _Flight) -> None:
        """Submit `flight` (from its tokens so far), retrying while the controller is unreachable."""
        request, done = flight.request, len(flight.delivered)
        params = replace(
            request.sampling,
            max_tokens=request.sampling.max_tokens - done,
            first_index=request.sampling.first_index + done,
        )
        prompt = [*request.prompt_ids, *flight.delivered]
        self._flights[flight.wire_id] = flight
        deadline = time.monotonic() + self.resume_timeout_s
        while True:
            try:
                await self.controller.tell(Generate(flight.wire_id, prompt, Sampling.of(params), self.ref))
                if not self._watching:
                    self._watching = True
                    await self.watch(self.controller)
                return
            except AiollmError as exc:
                if time.monotonic() > deadline:
                    raise Unavailable(f"controller unreachable: {exc}") from exc
                await asyncio.sleep(0.25)

    async def _send_again(self, flight: _Flight) -> None:
        self._flights.pop(flight.wire_id, None)
        await self._cancel_wire(flight.wire_id)  # in case the controller was only unreachable for a while
        flight.attempt += 1
        self.resubmitted += 1
        await self._send(flight)

    async def cancel(self, request_id: str) -> None:
        flight = next((f for f in self._flights.values() if f.request.request_id == request_id), None)
        if flight is None:
            return
        self._flights.pop(flight.wire_id, None)
        await self._cancel_wire(flight.wire_id)
        flight.queue.put_nowait(Delta(flight.wire_id, [], error="cancelled"))

    async def _cancel_wire(self, wire_id: str) -> None:
        try:
            await self.controller.tell(Cancel(wire_id))
        except AiollmError:
            pass  # the controller is gone: nothing holds the request any more

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
            alive=dict(load.alive),
            instance_kv_blocks_used=dict(load.instance_kv_blocks_used),
            resumed=dict(load.resumed) | {"resubmitted": self.resubmitted},
            replans=load.replans,
            last_replan=load.last_replan,
            prompt_tokens=load.prompt_tokens,
            prefix_hit_tokens=load.prefix_hit_tokens,
            kv_blocks_pulled=load.kv_blocks_pulled,
            kv_blocks_reused=load.kv_blocks_reused,
        )
