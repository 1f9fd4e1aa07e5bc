"""The decode instance's offloaded executor: S-part in the decode instance, attention on FastDecode R-workers.

Why: a DistServe decode instance's KV and attention scale with context, its weights do not; with
this executor the instance keeps only the weights and the batched S-part, and each sequence's KV
lives on one R-worker (its own process, its own RAM). The R-worker pulls that KV itself, straight
from the prefill instance (`Admit(source=<prefill>)` -> `PullKV` stream -> `AckKV`), so the
prompt's KV never passes through the decode instance.

It implements aiollm.serving.distserve.decode.DecodeExecutor: `reserve` places the sequence on the R-worker
with the least expected total length among those with room (aiollm.serving.fastdecode.pipeline.place, the
S-worker's rule) and books its blocks there; `load_kv` admits it on that R-worker; `step` runs
aiollm.serving.fastdecode.pipeline.decode_step and samples here; `free` releases it on its R-worker. The
block count the instance's admission sees is the sum over R-workers; a sequence that fits that sum
but no single R-worker fails its pull with KVCacheFull (blocks of one sequence cannot span workers).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

from aiollm.actors.node import Node
from aiollm.actors.ref import ActorRef
from aiollm.errors import AiollmError, KVCacheFull, NodeUnreachable, require_positive
from aiollm.log import get_logger
from aiollm.model.llama import LlamaModel
from aiollm.model.sequence import Sequence, sample_next
from aiollm.serving.fastdecode.messages import Admit, GetRLoad, Release, RLoad
from aiollm.serving.fastdecode.pipeline import RWorkerLost, StepRow, decode_step, place

_log = get_logger("offloaded_executor")

# seconds between probes of a lost R-worker
REVIVE_PROBE_S = 1.0
# how long a request waits for an R-worker when every one is lost (restarted by the launcher meanwhile)
ALL_LOST_WAIT_S = 60.0


@dataclass(frozen=True)
class OffloadedConfig:
    """How the offloaded executor runs steps."""

    # split steps into two mini-batches so the S-part here overlaps the R-workers' attention
    pipeline: bool = True
    # ...only from this batch size on (below it the S-part is weight-bound and two halves read the weights twice)
    pipeline_min_batch: int = 64

    def __post_init__(self) -> None:
        require_positive(self, "pipeline_min_batch")


@dataclass
class _Placed:
    """A sequence's id on its R-worker, the worker's index (-1: none had room), and the blocks booked there."""

    sid: int
    worker: int
    blocks: int


class OffloadedExecutor:
    """Places sequences on R-workers, has them pull their KV from the prefill instance, decodes through them."""

    def __init__(
        self,
        model: LlamaModel,
        workers: list[ActorRef],
        loads: list[RLoad],
        config: OffloadedConfig = OffloadedConfig(),
    ) -> None:
        kinds = {(load.block_size, load.dtype) for load in loads}
        if len(kinds) != 1:
            raise ValueError(f"R-workers disagree on KV block size / dtype: {sorted(kinds)}")
        self.model, self.workers, self.config = model, workers, config
        self.block_size, self.kv_dtype = kinds.pop()
        # blocks each R-worker can hold, what this executor booked there, and the expected total length placed there
        self.capacity = [load.blocks_total - load.blocks_used for load in loads]
        self.booked = [0] * len(workers)
        self.expected = [0] * len(workers)
        self.total_blocks = sum(self.capacity)
        # R-workers taking sequences; one lost (a failed step or admission) is probed until it answers again
        self.alive = [True] * len(workers)
        self._revivals: dict[int, asyncio.Task] = {}
        self._placed: dict[str, _Placed] = {}
        # sequence ids start at a random offset: an instance restarted at the same address never reuses the ids
        # its earlier life left on an R-worker that has not yet noticed that life ended
        self._ids = itertools.count(random.getrandbits(40) << 20)
        # the actor whose sequences these are (set by the decode instance); R-workers free them when it dies
        self.owner: ActorRef | None = None
        self._releases: set[asyncio.Task] = set()
        # the node refs are bound to, when connected by address (an R-worker that moves gets a new ref)
        self._node: Node | None = None

    @classmethod
    async def connect(
        cls,
        node: Node,
        urls: list[str],
        model: LlamaModel,
        block_size: int,
        kv_dtype: str,
        config: OffloadedConfig = OffloadedConfig(),
    ) -> OffloadedExecutor:
        """Refs to the R-workers at `urls` (bound to `node`), checked to store KV as the prefill instances do."""
        if not urls:
            raise ValueError("r_workers: need at least one R-worker URL")
        workers = [node.ref(url) for url in urls]
        loads: list[RLoad] = await asyncio.gather(*(w.ask(GetRLoad(), timeout=30.0) for w in workers))
        for url, load in zip(urls, loads):
            if (load.block_size, load.dtype) != (block_size, kv_dtype):
                raise ValueError(
                    f"R-worker {url} stores {load.dtype} KV in blocks of {load.block_size}; the "
                    f"prefill instances' KV is {kv_dtype} in blocks of {block_size} (must match)"
                )
        executor = cls(model, workers, loads, config)
        executor._node = node
        return executor

    @property
    def used_blocks(self) -> int:
        return sum(self.booked)

    def bind(self, owner: ActorRef) -> None:
        """Admit sequences as `owner`'s, so an R-worker frees them when the decode instance dies."""
        self.owner = owner

    def reserve(self, seq: Sequence) -> None:
        need = -(-seq.max_length // self.block_size)
        full = frozenset(i for i, cap in enumerate(self.capacity) if not self.alive[i] or self.booked[i] + need > cap)
        if len(full) == len(self.workers):
            self._placed[seq.request_id] = _Placed(-1, -1, need)
            return
        worker = place(self.expected, seq.max_length, full)
        self.booked[worker] += need
        self.expected[worker] += seq.max_length
        self._placed[seq.request_id] = _Placed(next(self._ids), worker, need)

    async def load_kv(self, seq: Sequence, source: ActorRef) -> None:
        """The sequence's R-worker pulls the prompt's KV from `source` and acknowledges it there."""
        placed = self._placed[seq.request_id]
        if placed.worker < 0 and not any(self.alive):  # every R-worker lost: wait for one to answer again
            await self._wait_for_a_worker()
            self._placed.pop(seq.request_id)
            self.reserve(seq)
            placed = self._placed[seq.request_id]
        if placed.worker < 0:
            free = max(c - b for c, b in zip(self.capacity, self.booked))
            raise KVCacheFull(placed.blocks, free, max(self.capacity))
        # KV entries before the first decode step: the prompt (the first token is fed, not cached yet)
        admit = Admit(placed.sid, seq.request_id, seq.length - 1, seq.max_length, source, owner=self.owner)
        try:
            await self.workers[placed.worker].ask(admit, timeout=60.0)
        except NodeUnreachable:
            self._lost(placed.worker)
            raise

    async def step(self, seqs: list[Sequence]) -> list[int]:
        placed = [self._placed[s.request_id] for s in seqs]
        rows = [StepRow(p.sid, p.worker, s.output[-1], s.length - 1) for p, s in zip(placed, seqs)]
        pipeline = self.config.pipeline and len(rows) >= self.config.pipeline_min_batch
        try:
            return await decode_step(
                self.model,
                self.workers,
                rows,
                pipeline,
                lambda indices, logits: sample_next([seqs[i] for i in indices], logits),
            )
        except RWorkerLost as exc:
            self._lost(exc.worker)
            raise

    def _lost(self, worker: int) -> None:
        """Place nothing more on `worker` until it answers again (the launcher restarts it at its address)."""
        if not self.alive[worker]:
            return
        self.alive[worker] = False
        _log.warning("R-worker lost: placing on the others until it answers", worker=self.workers[worker].url)
        self._revivals[worker] = asyncio.get_running_loop().create_task(self._revive(worker))

    async def _wait_for_a_worker(self) -> None:
        """Return once an R-worker answers again; RuntimeError after `ALL_LOST_WAIT_S` (the request then fails
        over, and the controller places it again)."""
        deadline = time.monotonic() + ALL_LOST_WAIT_S
        while not any(self.alive):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no R-worker answers (all {len(self.workers)} lost for {ALL_LOST_WAIT_S:g} s)")
            await asyncio.sleep(REVIVE_PROBE_S)

    def move(self, worker: int, url: str) -> None:
        """R-worker `worker` now listens at `url` (started again elsewhere): what it held is lost with its old
        process, so it is lost here until it answers at the new address."""
        if not 0 <= worker < len(self.workers):
            raise ValueError(f"R-worker index {worker}: this decode instance has {len(self.workers)}")
        if self._node is None:
            raise ValueError("this executor was not connected by address (OffloadedExecutor.connect)")
        old = self.workers[worker].url
        self.workers[worker] = self._node.ref(url)
        _log.warning("R-worker moved", worker=worker, old=old, new=url)
        self._lost(worker)

    async def _revive(self, worker: int) -> None:
        while True:
            await asyncio.sleep(REVIVE_PROBE_S)
            ref = self.workers[worker]  # read each time: the R-worker may move while it is probed
            try:
                load: RLoad = await ref.ask(GetRLoad(), timeout=5.0)
            except (AiollmError, TimeoutError):
                continue
            if (load.block_size, load.dtype) != (self.block_size, self.kv_dtype):
                _log.error("R-worker came back with another KV layout; left out", worker=ref.url)
                return
            # what it holds now is what is left of this executor's own bookings there (freed as they end)
            self.capacity[worker] = load.blocks_total - max(0, load.blocks_used - self.booked[worker])
            self.total_blocks = sum(self.capacity)
            self.alive[worker] = True
            self._revivals.pop(worker, None)
            _log.warning("R-worker answers again", worker=ref.url)
            return

    def free(self, seq: Sequence) -> None:
        """Give back the booking and release the sequence on its R-worker (a tell sent in the background: a
        Release that overtakes nothing is harmless, the R-worker drops unknown ids)."""
        placed = self._placed.pop(seq.request_id, None)
        if placed is None or placed.worker < 0:
            return
        self.booked[placed.worker] -= placed.blocks
        self.expected[placed.worker] -= seq.max_length
        task = asyncio.get_running_loop().create_task(self._release(placed))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, placed: _Placed) -> None:
        try:
            await self.workers[placed.worker].tell(Release([placed.sid]))
        except AiollmError as exc:  # the R-worker is gone: nothing left to free there
            _log.warning("release failed", worker=self.workers[placed.worker].url, error=str(exc))
