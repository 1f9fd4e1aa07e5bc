"""The colocated serving engine: one process, one KV pool, prefill and decode batched together.

It is the frontend's in-process backend (tests, `python -m aiollm serve --colocated`) and the
baseline the serving benchmark compares disaggregation against: each iteration either prefills a
batch of waiting prompts (FCFS, up to L_m tokens, only as many as the KV pool can hold to their
end) or runs one decode step for every running sequence, with prefill first — so a burst of
prompts stalls every running decode, the interference DistServe removes.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiollm.errors import KVCacheFull, require_positive
from aiollm.model.llama import LlamaModel
from aiollm.model.sequence import Sequence, open_sequence
from aiollm.sched.prefill_batching import take_batch
from aiollm.serving import runner
from aiollm.serving.backend import BackendStats, GenerateRequest, Overloaded, TokenDelta
from aiollm.serving.step_thread import run_step


@dataclass(frozen=True)
class EngineConfig:
    """Sizing of one colocated instance."""

    # KV pool size in blocks, and tokens per block
    kv_blocks: int = 2048
    block_size: int = 16
    # KV storage type: fp32, fp16 or int8
    kv_dtype: str = "fp32"
    # L_m: most prompt tokens prefilled in one batch (a longer prompt runs alone)
    max_batch_tokens: int = 512
    # most sequences decoding at once
    max_running: int = 64
    # most requests waiting for prefill; one more is refused (HTTP 429)
    max_waiting: int = 1024
    # threads of the native attention kernel (None: its default)
    attn_threads: int | None = None
    # keep prompts' full KV blocks after their requests end and compute only what a new prompt's cached prefix
    # lacks (aiollm.kv.prefix_cache)
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        require_positive(self, "kv_blocks", "block_size", "max_batch_tokens", "max_running", "max_waiting")


class ColocatedEngine:
    """A `Backend` that runs the whole model in this process."""

    def __init__(self, model: LlamaModel, config: EngineConfig = EngineConfig()) -> None:
        self.model, self.config = model, config
        self.cache = runner.PagedCache(
            model, config.kv_blocks, config.block_size, config.kv_dtype, prefix_cache=config.prefix_cache
        )
        # prompt tokens prefilled, and those mapped from the prefix cache
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self._waiting: OrderedDict[str, Sequence] = OrderedDict()
        self._running: dict[str, Sequence] = {}
        # per request: its deltas, then None once it was cancelled
        self._outputs: dict[str, asyncio.Queue[TokenDelta | None]] = {}
        self._cancelled: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="colocated-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if len(self._waiting) >= self.config.max_waiting:
            raise Overloaded(f"{len(self._waiting)} requests already wait for prefill")
        seq = await open_sequence(request.request_id, list(request.prompt_ids), request.sampling, self.model)
        if self.cache.blocks_for(seq.max_length) > self.cache.total_blocks:
            raise ValueError(f"request {request.request_id} needs more KV than the whole pool holds")
        queue: asyncio.Queue[TokenDelta | None] = asyncio.Queue()
        self._outputs[request.request_id] = queue
        self._waiting[request.request_id] = seq
        self._wake.set()
        try:
            while True:
                delta = await queue.get()
                if delta is None:
                    return
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._outputs.pop(request.request_id, None)
            if request.request_id in self._waiting or request.request_id in self._running:
                await self.cancel(request.request_id)

    async def cancel(self, request_id: str) -> None:
        """Drop a request; its KV is freed by the loop between two steps (never under a running step)."""
        if request_id in self._waiting or request_id in self._running:
            self._cancelled.add(request_id)
            self._wake.set()
        queue = self._outputs.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(None)

    async def stats(self) -> BackendStats:
        return BackendStats(
            waiting=len(self._waiting),
            running=len(self._running),
            prefill_queues={"colocated": len(self._waiting)},
            decode_queues={"colocated": 0},
            kv_blocks_used=self.cache.used_blocks,
            kv_blocks_total=self.cache.total_blocks,
            prompt_tokens=self.prompt_tokens,
            prefix_hit_tokens=self.hit_tokens,
        )

    @property
    def kv_blocks_used(self) -> int:
        return self.cache.used_blocks

    async def _loop(self) -> None:
        while True:
            self._drop_cancelled()
            batch = self._admit()
            if batch:
                tokens = await run_step(runner.prefill_into, self.model, self.cache, batch)
                for seq in batch:
                    self.cache.commit(seq, len(seq.prompt))
                self._emit(batch, tokens)
            elif self._running:
                seqs = list(self._running.values())
                tokens = await run_step(runner.decode_step, self.model, self.cache, seqs, self.config.attn_threads)
                self._emit(seqs, tokens)
            else:
                self._wake.clear()
                await self._wake.wait()

    def _admit(self) -> list[Sequence]:
        """FCFS prompts up to L_m tokens to compute (a cached prefix is not computed) whose whole completion fits
        in the free KV blocks."""
        c = self.config
        room = c.max_running - len(self._running)
        waiting = list(self._waiting.values())
        reuse = [len(s.prompt) - runner.MIN_COMPUTED for s in waiting]
        to_compute = [len(s.prompt) - self.cache.cached_prefix(s, n) for s, n in zip(waiting, reuse)]
        count = take_batch(to_compute, c.max_batch_tokens, max(room, 0)) if room else 0
        batch = []
        for seq, n in zip(waiting[:count], reuse):
            try:
                self.cache.reserve(seq, reuse=n)
            except KVCacheFull:
                break
            self.prompt_tokens += len(seq.prompt)
            self.hit_tokens += seq.cached_tokens
            del self._waiting[seq.request_id]
            self._running[seq.request_id] = seq
            batch.append(seq)
        return batch

    def _emit(self, seqs: list[Sequence], tokens: list[int]) -> None:
        for seq, token in zip(seqs, tokens):
            queue = self._outputs.get(seq.request_id)
            if queue is not None:
                queue.put_nowait(TokenDelta((token,), seq.finish, seq.last_logprobs(1)))
            if seq.finish is not None:
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self._running.pop(seq.request_id, None)
        self._waiting.pop(seq.request_id, None)
        self.cache.free(seq)

    def _drop_cancelled(self) -> None:
        for request_id in self._cancelled:
            seq = self._running.get(request_id) or self._waiting.get(request_id)
            if seq is not None:
                self._finish(seq)
        self._cancelled.clear()
