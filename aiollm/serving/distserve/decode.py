"""DistServe's decode instance: continuous batching over sequences whose KV it pulled itself.

Admission first, then the pull: a sequence is admitted only when the blocks for its whole
completion are free (aiollm.sched.decode_admission, FCFS), so nothing is ever preempted; then it
pulls the prompt's KV from the prefill instance as a stream whose credit window is the number of
blocks reserved for it, writes each block straight into its pool, acknowledges (the prefill
instance frees its copy), and joins the next step. Each step sends one `Tokens` message per
controller with every sequence's new token.

Where attention runs is the `DecodeExecutor`'s business: `ColocatedExecutor` keeps the KV in this
process and uses the native kernel; an offloaded executor (S-part here, R-workers that pull their own
sequences' KV from the prefill instance) implements the same calls, so this actor does not change
when the R-part moves to other processes.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from aiollm.actors.actor import Actor, handler
from aiollm.actors.ref import ActorRef
from aiollm.errors import AiollmError, require_positive
from aiollm.log import get_logger
from aiollm.model.llama import LlamaModel
from aiollm.model.sequence import Sequence, open_sequence
from aiollm.sched.decode_admission import DecodeAdmission
from aiollm.serving import runner
from aiollm.serving.distserve.messages import AckKV, Cancel, Decode, Delta, GetLoad, KVBlock, Load, PullKV, Tokens
from aiollm.serving.fastdecode.messages import RWorkerMoved
from aiollm.serving.step_log import StepLog
from aiollm.serving.step_thread import run_step
from aiollm.serving.turns import Turns, taking

_log = get_logger("decode")


@dataclass(frozen=True)
class DecodeConfig:
    """Sizing of one decode instance."""

    # KV pool: blocks, tokens per block, storage type (block_size and dtype must match the prefill instances')
    kv_blocks: int = 2048
    block_size: int = 16
    kv_dtype: str = "fp32"
    # most sequences in one decode step
    max_running: int = 128
    # threads of the native attention kernel (None: its default)
    attn_threads: int | None = None
    # file to record each step's and pull's timing in (aiollm.serving.step_log); empty: none
    step_log: str = ""
    # keep pulled prompts' full KV blocks after their sequences end and pull only the blocks a prompt lacks
    # (colocated attention; an offloaded executor's R-workers pull every block)
    prefix_cache: bool = True
    # take turns on the host's cores with its prefill instances through this lock-file path
    # (aiollm.serving.turns; colocated attention)
    turns: str = ""

    def __post_init__(self) -> None:
        require_positive(self, "kv_blocks", "block_size", "max_running")


class DecodeExecutor(Protocol):
    """Where a decode instance keeps KV and runs steps: `ColocatedExecutor` here; an offloaded variant
    (S-part here, R-workers elsewhere) implements the same calls, its R-workers pulling their own KV."""

    total_blocks: int
    used_blocks: int
    block_size: int

    def bind(self, owner: ActorRef) -> None:
        """The decode instance whose sequences these are (whoever holds KV elsewhere frees it when it dies)."""

    def reserve(self, seq: Sequence) -> None:
        """Hold room for the whole completion (admission already checked that it fits)."""

    async def load_kv(self, seq: Sequence, source: ActorRef) -> None:
        """Pull the prompt's KV from the prefill actor `source` and acknowledge it there."""

    async def step(self, seqs: list[Sequence]) -> list[int]:
        """One decode step: append each sequence's next token (and set its finish) and return them."""

    def free(self, seq: Sequence) -> None:
        """Give back what `seq` holds."""


class ColocatedExecutor:
    """KV in this process's paged pool, attention through the native kernel, the step in a thread."""

    def __init__(self, model: LlamaModel, config: DecodeConfig) -> None:
        self.model, self.config = model, config
        self.cache = runner.PagedCache(
            model, config.kv_blocks, config.block_size, config.kv_dtype, prefix_cache=config.prefix_cache
        )
        self.total_blocks, self.block_size = self.cache.total_blocks, config.block_size
        self._turns = Turns(config.turns) if config.turns else None
        # prompt KV blocks pulled from prefill instances, and those mapped from this pool's prefix cache instead
        self.blocks_pulled = 0
        self.blocks_reused = 0

    @property
    def used_blocks(self) -> int:
        return self.cache.used_blocks

    def bind(self, owner: ActorRef) -> None:
        """Nothing to do: the KV lives and dies with this process."""

    def reserve(self, seq: Sequence) -> None:
        """Room for the whole completion; with the prefix cache, the prompt's cached full blocks are mapped."""
        self.cache.reserve(seq, reuse=len(seq.prompt))

    async def load_kv(self, seq: Sequence, source: ActorRef) -> None:
        """A stream of one block per item, credit window = the blocks reserved; each lands in its own block. The
        blocks mapped from the prefix cache are skipped; the pulled full blocks join the cache once all landed."""
        have = seq.cached_tokens // self.block_size
        async for block in source.stream(PullKV(seq.request_id, skip=list(range(have))), window=len(seq.blocks)):
            self._ingest(seq, block)
            self.blocks_pulled += 1
        self.blocks_reused += have
        self.cache.commit(seq, len(seq.prompt))
        await source.tell(AckKV(seq.request_id))

    def _ingest(self, seq: Sequence, block: KVBlock) -> None:
        if not 0 <= block.index < len(seq.blocks):
            raise ValueError(f"KV block {block.index} outside the {len(seq.blocks)} blocks of {seq.request_id}")
        if block.index < seq.cached_tokens // self.block_size:  # a shared block: never written over
            raise ValueError(f"KV block {block.index} of {seq.request_id} is mapped from the prefix cache")
        self.cache.pool.write_blocks(
            None, [seq.blocks[block.index]], block.k, block.v, k_scale=block.k_scale, v_scale=block.v_scale
        )

    async def step(self, seqs: list[Sequence]) -> list[int]:
        return await run_step(
            taking(self._turns and self._turns.decode, runner.decode_step),
            self.model,
            self.cache,
            seqs,
            self.config.attn_threads,
        )

    def free(self, seq: Sequence) -> None:
        self.cache.free(seq)


@dataclass
class _Entry:
    seq: Sequence
    source: ActorRef
    reply_to: ActorRef
    pull: asyncio.Task | None = None


class DecodeInstance(Actor):
    """Admits, pulls KV, and decodes; tokens go to each request's controller."""

    def __init__(
        self, model: LlamaModel, config: DecodeConfig = DecodeConfig(), executor: DecodeExecutor | None = None
    ) -> None:
        self.model, self.config = model, config
        self.executor = executor or ColocatedExecutor(model, config)
        self.admission = DecodeAdmission(self.executor.total_blocks, self.executor.block_size, config.max_running)
        self._entries: dict[str, _Entry] = {}
        self._running: dict[str, _Entry] = {}  # pulled, in the batch
        self._cancelled: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # sequences decoded to their end so far (for load checks and logs)
        self.finished = 0
        self._steps = StepLog(config.step_log) if config.step_log else None

    async def on_start(self) -> None:
        self.executor.bind(self.ref)
        self._task = asyncio.create_task(self._loop(), name=f"{self.name}-loop")

    async def on_stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for entry in self._entries.values():
            if entry.pull is not None:
                entry.pull.cancel()
        if self._steps is not None:
            self._steps.close()

    @handler(Decode)
    async def on_decode(self, msg: Decode) -> None:
        try:
            seq = await open_sequence(
                msg.request_id, msg.prompt_ids, msg.sampling.params(), self.model, first_token=msg.first_token
            )
            self.admission.enqueue(msg.request_id, seq.max_length)
        except ValueError as exc:
            await msg.reply_to.tell(Tokens([Delta(msg.request_id, [], error=f"failed: {exc}")], self.name))
            return
        self._entries[msg.request_id] = _Entry(seq, msg.source, msg.reply_to)
        self._wake.set()

    @handler(RWorkerMoved)
    async def on_r_worker_moved(self, msg: RWorkerMoved) -> None:
        move = getattr(self.executor, "move", None)
        if move is None:
            raise ValueError("this decode instance has no R-workers (its attention runs in its own process)")
        move(msg.index, msg.url)

    @handler(Cancel)
    async def on_cancel(self, msg: Cancel) -> None:
        if msg.request_id in self._entries:
            self._cancelled.add(msg.request_id)
            self._wake.set()

    @handler(GetLoad)
    async def on_get_load(self, msg: GetLoad) -> Load:
        return Load(
            waiting=self.admission.waiting,
            running=self.admission.running,
            kv_blocks_used=self.executor.used_blocks,
            kv_blocks_total=self.executor.total_blocks,
            kv_block_size=self.executor.block_size,
            kv_blocks_pulled=getattr(self.executor, "blocks_pulled", 0),
            kv_blocks_reused=getattr(self.executor, "blocks_reused", 0),
        )

    async def _loop(self) -> None:
        while True:
            self._drop_cancelled()
            for admitted in self.admission.admit():
                entry = self._entries[admitted.seq_id]
                self.executor.reserve(entry.seq)
                entry.pull = asyncio.create_task(self._pull(entry), name=f"pull-{admitted.seq_id}")
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            entries = list(self._running.values())
            seqs = [e.seq for e in entries]
            started = time.time()
            context = sum(len(s.prompt) + len(s.output) for s in seqs)
            try:
                tokens = await self.executor.step(seqs)
            except Exception as exc:
                _log.exception("decode step failed", instance=self.name, batch=len(seqs))
                for entry in entries:
                    await self._fail(entry, f"failed: decode step: {exc}")
                continue
            await self._send(entries, tokens)
            if self._steps is not None:  # the step and the sending of its tokens: what a TPOT sees
                self._steps.record("decode", started, time.time(), batch=len(seqs), context=context)

    async def _pull(self, entry: _Entry) -> None:
        """Have the executor pull the prompt's KV, then join the batch."""
        seq = entry.seq
        started = time.time()
        try:
            await self.executor.load_kv(seq, entry.source)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _log.warning("KV pull failed", instance=self.name, request_id=seq.request_id, error=str(exc))
            await self._fail(entry, f"failed: KV pull: {exc}")
            return
        entry.pull = None
        if self._steps is not None:
            self._steps.record("pull", started, time.time(), tokens=len(seq.prompt))
        if seq.request_id in self._entries:
            self._running[seq.request_id] = entry
            self._wake.set()

    async def _send(self, entries: list[_Entry], tokens: list[int]) -> None:
        by_dest: dict[ActorRef, list[Delta]] = defaultdict(list)
        for entry, token in zip(entries, tokens):
            seq = entry.seq
            if seq.request_id in self._cancelled:
                continue
            by_dest[entry.reply_to].append(Delta(seq.request_id, [token], seq.finish, logprobs=seq.last_logprobs(1)))
            if seq.finish is not None:
                self.finished += 1
                self._forget(entry)
        for dest, deltas in by_dest.items():
            await self._tell(dest, Tokens(deltas, self.name))

    async def _fail(self, entry: _Entry, error: str) -> None:
        self._forget(entry)
        await self._tell(entry.reply_to, Tokens([Delta(entry.seq.request_id, [], error=error)], self.name))

    async def _tell(self, dest: ActorRef, msg: Tokens) -> None:
        """Send to a controller; if it is gone, drop its requests (nobody would read their tokens)."""
        try:
            await dest.tell(msg)
        except AiollmError as exc:
            _log.warning("controller unreachable: dropping its requests", controller=dest.url, error=str(exc))
            for entry in [e for e in self._entries.values() if e.reply_to == dest]:
                if entry.pull is not None:
                    entry.pull.cancel()
                self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        rid = entry.seq.request_id
        self._entries.pop(rid, None)
        self._running.pop(rid, None)
        self.admission.release(rid)
        self.executor.free(entry.seq)

    def _drop_cancelled(self) -> None:
        for rid in self._cancelled:
            entry = self._entries.get(rid)
            if entry is None:
                continue
            if entry.pull is not None:
                entry.pull.cancel()  # cancelling the stream cancels the producer; the controller frees the prefill copy
            self._forget(entry)
        self._cancelled.clear()
