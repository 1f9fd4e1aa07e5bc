"""DistServe's prefill instance: an FCFS queue, batches up to L_m tokens, a bounded KV buffer.

Why the buffer is the queue: a prefilled sequence's KV stays here until a decode instance has
room, pulls it (the `PullKV` stream, one block per item) and acknowledges it (`AckKV`). The buffer
is a paged pool of fixed size; the loop only starts a batch whose prompts fit in its free blocks,
so when decode falls behind, prefill stops, its queue grows, and the controller (which sends each
instance at most a few requests ahead) keeps the rest in its own queue. Each held sequence has a
lease: if nobody pulls and acks it in time (the puller died, the request was forgotten), the KV
is freed and the controller is told (`KVLost`), which fails the request over.

Handlers only change state and wake the loop; the model runs in a thread, so KV pulls are served
while the next batch computes.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiollm.actors.actor import Actor, handler
from aiollm.actors.ref import ActorRef
from aiollm.errors import AiollmError, KVCacheFull, require_positive
from aiollm.log import get_logger
from aiollm.model.llama import LlamaModel
from aiollm.model.sequence import Sequence, open_sequence
from aiollm.sched.prefill_batching import take_batch
from aiollm.serving import runner
from aiollm.serving.distserve.messages import AckKV, Cancel, GetLoad, KVBlock, KVLost, Load, Prefill, Prefilled, PullKV
from aiollm.serving.step_log import StepLog
from aiollm.serving.step_thread import run_step
from aiollm.serving.turns import Turns, taking

_log = get_logger("prefill")


@dataclass(frozen=True)
class PrefillConfig:
    """Sizing of one prefill instance."""

    # the KV buffer: blocks, tokens per block, storage type (must match the decode instances')
    kv_blocks: int = 1024
    block_size: int = 16
    kv_dtype: str = "fp32"
    # L_m: most prompt tokens in one prefill batch (a longer prompt runs alone)
    max_batch_tokens: int = 512
    # seconds a prefilled sequence's KV is kept waiting for its pull and ack
    lease_s: float = 60.0
    # file to record each batch's timing in (aiollm.serving.step_log); empty: none
    step_log: str = ""
    # keep prompts' full KV blocks after their pull and compute only what a new prompt's cached prefix lacks
    prefix_cache: bool = True
    # take turns on the host's cores with its decode instances through this lock-file path (aiollm.serving.turns)
    turns: str = ""

    def __post_init__(self) -> None:
        require_positive(self, "kv_blocks", "block_size", "max_batch_tokens", "lease_s")


@dataclass
class _Held:
    seq: Sequence
    reply_to: ActorRef
    deadline: float
    pulling: bool = False
    # cancelled while a pull was streaming it: freed when the stream ends
    cancelled: bool = False


class PrefillInstance(Actor):
    """Prefills prompts and holds their KV until a decode instance pulled it."""

    def __init__(self, model: LlamaModel, config: PrefillConfig = PrefillConfig()) -> None:
        self.model, self.config = model, config
        self.cache = runner.PagedCache(
            model, config.kv_blocks, config.block_size, config.kv_dtype, prefix_cache=config.prefix_cache
        )
        self._queue: OrderedDict[str, tuple[Sequence, ActorRef]] = OrderedDict()
        self._computing: set[str] = set()
        self._cancelled: set[str] = set()
        self._held: dict[str, _Held] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # sequences prefilled so far (for load checks and logs)
        self.prefilled = 0
        self._steps = StepLog(config.step_log) if config.step_log else None
        self._turns = Turns(config.turns) if config.turns else None
        # when each queued request arrived (only with a step log)
        self._received: dict[str, float] = {}
        # prompt tokens prefilled, those mapped from the prefix cache, and KV blocks streamed to pullers
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.blocks_sent = 0

    async def on_start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(), name=f"{self.name}-loop"),
            asyncio.create_task(self._expire_leases(), name=f"{self.name}-leases"),
        ]

    async def on_stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._steps is not None:
            self._steps.close()

    @handler(Prefill)
    async def on_prefill(self, msg: Prefill) -> None:
        try:
            seq = await open_sequence(msg.request_id, msg.prompt_ids, msg.sampling.params(), self.model)
        except ValueError as exc:
            await msg.reply_to.tell(Prefilled(msg.request_id, -1, None, self.name, error=str(exc)))
            return
        if self.cache.blocks_for(len(seq.prompt)) > self.cache.total_blocks:
            await msg.reply_to.tell(
                Prefilled(
                    msg.request_id,
                    -1,
                    None,
                    self.name,
                    error=f"prompt of {len(seq.prompt)} tokens exceeds the KV buffer",
                )
            )
            return
        self._queue[msg.request_id] = (seq, msg.reply_to)
        if self._steps is not None:
            self._received[msg.request_id] = time.time()
        self._wake.set()

    @handler(Cancel)
    async def on_cancel(self, msg: Cancel) -> None:
        rid = msg.request_id
        self._received.pop(rid, None)
        if self._queue.pop(rid, None) is None and rid in self._computing:
            self._cancelled.add(rid)
        held = self._held.get(rid)
        if held is not None:
            if held.pulling:
                held.cancelled = True
            else:
                self._release(rid)

    @handler(PullKV)
    async def on_pull(self, msg: PullKV):
        held = self._held.get(msg.request_id)
        if held is None:
            raise KeyError(f"no KV held for request {msg.request_id!r} on {self.name} (lease expired or cancelled)")
        held.pulling = True
        skip = set(msg.skip)
        wanted = [(i, b) for i, b in enumerate(held.seq.blocks) if i not in skip]
        sent = 0
        try:
            for index, block in wanted:
                kv = self.cache.pool.read(None, [block])
                yield KVBlock(index, kv.k, kv.v, kv.k_scale, kv.v_scale)
                sent += 1
                self.blocks_sent += 1
        finally:
            held.pulling = False
            # a puller that went away mid-stream will not ack; the KV stays until the controller either has
            # another decode instance pull it again (cheaper than prefilling it again) or cancels it, or the
            # lease ends
            if held.cancelled:
                self._release(msg.request_id)
            elif sent < len(wanted):
                _log.info("KV pull broke off; held for another", instance=self.name, request_id=msg.request_id)

    @handler(AckKV)
    async def on_ack(self, msg: AckKV) -> None:
        self._release(msg.request_id)

    @handler(GetLoad)
    async def on_get_load(self, msg: GetLoad) -> Load:
        return Load(
            waiting=len(self._queue) + len(self._computing),
            running=len(self._held),
            kv_blocks_used=self.cache.used_blocks,
            kv_blocks_total=self.cache.total_blocks,
            kv_block_size=self.cache.block_size,
            prompt_tokens=self.prompt_tokens,
            prefix_hit_tokens=self.hit_tokens,
        )

    def _release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.cache.free(held.seq)
            self._wake.set()

    def _next_batch(self) -> list[tuple[Sequence, ActorRef]]:
        """FCFS prompts up to L_m tokens to compute (a cached prefix is not computed) whose KV fits in the free
        part of the buffer."""
        entries = list(self._queue.values())
        reuse = [len(seq.prompt) - runner.MIN_COMPUTED for seq, _ in entries]
        to_compute = [len(seq.prompt) - self.cache.cached_prefix(seq, n) for (seq, _), n in zip(entries, reuse)]
        count = take_batch(to_compute, self.config.max_batch_tokens)
        batch = []
        for (seq, reply_to), n in zip(entries[:count], reuse):
            try:
                self.cache.reserve(seq, len(seq.prompt), reuse=n)
            except KVCacheFull:
                break
            self.prompt_tokens += len(seq.prompt)
            self.hit_tokens += seq.cached_tokens
            del self._queue[seq.request_id]
            self._computing.add(seq.request_id)
            batch.append((seq, reply_to))
        return batch

    async def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = [seq for seq, _ in batch]
            started = time.time()
            try:
                await run_step(
                    taking(self._turns and self._turns.prefill, runner.prefill_into), self.model, self.cache, seqs
                )
            except Exception as exc:  # a failed batch fails its own requests only
                _log.exception("prefill failed", instance=self.name, batch=len(seqs))
                for seq, reply_to in batch:
                    self._computing.discard(seq.request_id)
                    self.cache.free(seq)
                    await self._tell(
                        reply_to, Prefilled(seq.request_id, -1, None, self.name, error=f"prefill failed: {exc}")
                    )
                continue
            deadline = time.monotonic() + self.config.lease_s
            self.prefilled += len(batch)
            for seq, reply_to in batch:
                self.cache.commit(seq, len(seq.prompt))
                rid = seq.request_id
                self._computing.discard(rid)
                cancelled = rid in self._cancelled
                self._cancelled.discard(rid)
                if cancelled or seq.finish is not None:
                    self.cache.free(seq)
                else:
                    self._held[rid] = _Held(seq, reply_to, deadline)
                if not cancelled:
                    first = seq.last_logprobs(1)
                    logprobs = first[0] if first else None
                    await self._tell(reply_to, Prefilled(rid, seq.output[0], seq.finish, self.name, logprobs=logprobs))
            if self._steps is not None:
                self._steps.record(
                    "prefill",
                    started,
                    time.time(),
                    lengths=[len(s.prompt) for s in seqs],
                    recv=[self._received.pop(s.request_id, started) for s in seqs],
                )

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.lease_s / 4))
            now = time.monotonic()
            for rid, held in list(self._held.items()):
                # a pull still open a whole lease past the deadline has a dead puller whose stream was never closed
                if held.deadline < now and (not held.pulling or held.deadline + self.config.lease_s < now):
                    _log.warning("KV lease expired", instance=self.name, request_id=rid)
                    self._release(rid)
                    await self._tell(held.reply_to, KVLost(rid, self.name))

    async def _tell(self, dest: ActorRef, msg) -> None:
        """Answer a controller; a vanished one is only logged (leases free whatever it left here)."""
        try:
            await dest.tell(msg)
        except AiollmError as exc:
            _log.warning("controller unreachable", controller=dest.url, message=type(msg).__name__, error=str(exc))
