"""FastDecode's S-worker: the weights and the batched S-part of every decoding sequence; R-workers do the rest.

Requests arrive as DistServe's `Generate` (tokens go back as `Tokens` to `reply_to`, `Cancel`
stops one, `GetLoad` reports), so `aiollm.serving.distserve.client.ClusterClient` pointed at this
actor is the HTTP frontend's `Backend` for it. The loop, a task of its own so handlers (and the
R-workers' KV pulls from here) are served while it waits:

1. pick requests to start: with the load-stabilising schedule (aiollm.sched.sls) a micro-batch of
   M = B*F/S every F steps when W_lim allows; without it, whenever the batch has room;
2. prefill them here as one packed batch into a small staging pool in the R-workers' KV format,
   send the first tokens, place each on the R-worker with the least expected total length that
   has room, and let that R-worker pull the prompt's KV (`Admit` -> `PullKV` stream -> `AckKV`);
3. run one decode step for all of them (aiollm.serving.fastdecode.pipeline, with or without the
   two-minibatch pipeline), sample, send each request's token, release finished sequences.

The S-worker reserves on its side what every R-worker will hold (prompt + max_tokens per
sequence), so it never picks a request no R-worker has room for; an R-worker's own refusal is
still honoured (that request fails with the R-worker's message).

Recovery: the S-worker watches every R-worker. When one is lost (`Terminated`, or a step's ask
failing with `RWorkerLost`), its sequences are re-placed on the survivors: each one's prompt plus the
tokens generated so far (all but the last, which the next step feeds) is prefilled again into
staging and pulled by its new R-worker, then the interrupted step runs again (positions make the
repeat overwrite what survivors already appended). Greedy output is unchanged; a sequence that no
survivor has room for fails with an error that says so.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from aiollm.actors.actor import Actor, handler
from aiollm.actors.messages import Terminated
from aiollm.actors.ref import ActorRef
from aiollm.log import get_logger
from aiollm.model.llama import LlamaModel
from aiollm.model.sampling import SamplingParams
from aiollm.model.sequence import Sequence, new_sequence, open_sequence, sample_next
from aiollm.sched.sls import LoadSchedule, SLSConfig
from aiollm.serving import runner
from aiollm.serving.distserve.messages import AckKV, Cancel, Delta, Generate, GetLoad, KVBlock, Load, PullKV, Tokens
from aiollm.serving.fastdecode.messages import Admit, GetRLoad, GetTrace, Release, RLoad, Synthetic, Trace
from aiollm.serving.fastdecode.pipeline import RWorkerLost, StepRow, decode_step, place
from aiollm.serving.step_thread import run_step

if TYPE_CHECKING:
    pass


_log = get_logger("s_worker")


@dataclass(frozen=True)
class SWorkerConfig:
    """How the S-worker batches and schedules."""

    # B: most sequences decoding at once
    max_batch: int = 256
    # split each step into two mini-batches so S-part and R-part overlap
    pipeline: bool = True
    # ...but only from this batch size on: below it the S-part is bound by reading the weights, which two
    # half-batches do twice (on this CPU T(8) ~ T(16)), so the split costs more than the overlap gains
    pipeline_min_batch: int = 2
    # the load-stabilising schedule (its batch_size must equal max_batch); None: start requests whenever there is room
    schedule: SLSConfig | None = None
    # most prompt tokens prefilled in one batch
    max_prefill_tokens: int = 4096
    # staging pool for prompt KV waiting to be pulled by the R-workers, in tokens
    staging_tokens: int = 16384
    # most requests waiting to start; more are refused as overloaded
    max_waiting: int = 4096
    # per-step trace entries kept (for the benchmark's latency plot)
    trace_len: int = 100_000

    def __post_init__(self) -> None:
        for name in (
            "max_batch",
            "pipeline_min_batch",
            "max_prefill_tokens",
            "staging_tokens",
            "max_waiting",
            "trace_len",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SWorkerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.schedule is not None and self.schedule.batch_size != self.max_batch:
            raise ValueError(
                f"SWorkerConfig.schedule.batch_size ({self.schedule.batch_size}) must equal "
                f"max_batch ({self.max_batch})"
            )


@dataclass
class _Request:
    """A request from `Generate` (or a synthetic load-test sequence) until it finishes."""

    seq: Sequence
    reply_to: ActorRef | None
    # its id on its R-worker, and which R-worker (set when placed)
    sid: int = -1
    worker: int = -1
    # decode step it started at under the schedule (-1: not scheduled)
    start: int = -1
    # KV entries staged here for its R-worker to pull (the prompt; after a loss, everything but the last token)
    staged: int = 0
    # a load-test sequence: its R-worker holds zeros instead of pulling KV, nobody receives its tokens
    synthetic: bool = False
    # tokens of its output already told to its client
    sent: int = 0


class SWorker(Actor):
    """Holds the weights; decodes every active sequence as one batch with attention on the R-workers."""

    def __init__(self, model: LlamaModel, r_workers: list[str], config: SWorkerConfig = SWorkerConfig()) -> None:
        if not r_workers:
            raise ValueError("r_workers: need at least one R-worker URL")
        self.model, self.config, self.r_urls = model, config, list(r_workers)
        self.schedule = LoadSchedule(config.schedule) if config.schedule is not None else None
        self._waiting: deque[_Request] = deque()
        self._live: dict[str, _Request] = {}
        self._cancelled: set[str] = set()
        # sequence ids on the R-workers start at a random offset: a restarted S-worker never reuses ids its earlier
        # life left on an R-worker that has not yet noticed that life ended
        self._ids = itertools.count(random.getrandbits(40) << 20)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.step_no = 0
        # per step: (seconds, batch, KV entries held, sequences started before it, perf_counter at its end, CPU seconds)
        self._trace: deque[tuple[float, int, int, int, float, float]] = deque(maxlen=config.trace_len)
        self._started_now = 0
        # indices of R-workers lost (never used again), and sequences re-placed after a loss
        self._dead: set[int] = set()
        self.recovered = 0

    async def on_start(self) -> None:
        self.workers: list[ActorRef] = [self.node.ref(url) for url in self.r_urls]
        loads: list[RLoad] = await asyncio.gather(*(w.ask(GetRLoad(), timeout=30.0) for w in self.workers))
        kinds = {(load.block_size, load.dtype) for load in loads}
        if len(kinds) != 1:
            raise ValueError(f"R-workers disagree on KV block size / dtype: {sorted(kinds)}")
        self.block_size, self.kv_dtype = kinds.pop()
        # blocks each R-worker can hold, and what this S-worker has reserved there (it is their only client)
        self.capacity = [load.blocks_total - load.blocks_used for load in loads]
        self.reserved = [0] * len(loads)
        # expected total length (prompt + max_tokens) of the sequences on each R-worker: the balancing key
        self.expected = [0] * len(loads)
        self.staging = runner.PagedCache(
            self.model, -(-self.config.staging_tokens // self.block_size), self.block_size, self.kv_dtype
        )
        for worker in self.workers:
            await self.watch(worker)
        self._task = asyncio.create_task(self._loop(), name=f"{self.name}-loop")

    async def on_stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        # what this S-worker admitted would otherwise stay reserved on R-workers that outlive it
        held: dict[int, list[int]] = defaultdict(list)
        for req in self._live.values():
            if req.worker >= 0 and req.worker not in self._dead:
                held[req.worker].append(req.sid)
        for worker, sids in held.items():
            try:
                await self.workers[worker].tell(Release(sids))
            except Exception as exc:  # the R-worker is gone too: nothing left to free there
                _log.warning("release on stop failed", worker=self.r_urls[worker], error=str(exc))

    # --- handlers: they only change state and wake the loop -----------------------------------

    @handler(Generate)
    async def on_generate(self, msg: Generate) -> None:
        if len(self._waiting) >= self.config.max_waiting:
            await msg.reply_to.tell(Tokens([Delta(msg.request_id, [], error="overloaded")], self.name))
            return
        try:
            seq = await open_sequence(msg.request_id, msg.prompt_ids, msg.sampling.params(), self.model)
            self._check_fits(seq)
        except ValueError as exc:
            await msg.reply_to.tell(Tokens([Delta(msg.request_id, [], error=f"failed: {exc}")], self.name))
            return
        self._waiting.append(_Request(seq, msg.reply_to))
        self._wake.set()

    @handler(Synthetic)
    async def on_synthetic(self, msg: Synthetic) -> None:
        # + 1: the placeholder token fed at the first step counts as output, and each must decode max_tokens steps
        params = SamplingParams(max_tokens=msg.max_tokens + 1, ignore_eos=True)
        reqs = [
            _Request(new_sequence(f"synthetic-{next(self._ids)}", [0] * n, params, self.model), None, synthetic=True)
            for n in msg.context_lens
        ]
        for req in reqs:
            req.seq.output.append(0)  # the token fed at the first step
            self._check_fits(req.seq)
            if not self._place(req):
                raise ValueError(f"no R-worker has room for a {req.seq.max_length}-token synthetic sequence")
        await asyncio.gather(*(self._admit(req) for req in reqs))
        self._wake.set()

    @handler(Cancel)
    async def on_cancel(self, msg: Cancel) -> None:
        self._cancelled.add(msg.request_id)
        self._wake.set()

    @handler(GetLoad)
    async def on_get_load(self, msg: GetLoad) -> Load:
        return Load(
            waiting=len(self._waiting),
            running=len(self._live),
            kv_blocks_used=sum(self.reserved),
            kv_blocks_total=sum(self.capacity),
            kv_block_size=self.block_size,
        )

    @handler(GetTrace)
    async def on_get_trace(self, msg: GetTrace) -> Trace:
        steps = list(self._trace)
        if msg.reset:
            self._trace.clear()
        return Trace(
            step_s=[s[0] for s in steps],
            batch=[s[1] for s in steps],
            tokens=[s[2] for s in steps],
            started=[s[3] for s in steps],
            ended=[s[4] for s in steps],
            recovered=self.recovered,
            cpu_s=[s[5] for s in steps],
        )

    @handler(Terminated)
    async def on_terminated(self, msg: Terminated) -> None:
        for i, worker in enumerate(self.workers):
            if worker.url == msg.url:
                self._lose(i, msg.reason)
        self._wake.set()

    @handler(PullKV)
    async def on_pull(self, msg: PullKV):
        req = self._staged(msg.request_id)
        seq = req.seq
        for index in range(self.staging.blocks_for(req.staged)):
            kv = self.staging.pool.read(None, [seq.blocks[index]])
            yield KVBlock(index, kv.k, kv.v, kv.k_scale, kv.v_scale)

    @handler(AckKV)
    async def on_ack(self, msg: AckKV) -> None:
        req = self._live.get(msg.request_id)
        if req is not None:
            self.staging.free(req.seq)

    # --- the loop ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._turn()
            await self._drop_cancelled()
            await self._recover()
            starting = self._pick()
            if starting:
                await self._start(starting)
            if not self._live:
                if not starting:  # nothing to do until a request (or a cancel) arrives
                    self._wake.clear()
                    await self._wake.wait()
                continue
            try:
                await self._step()
            except RWorkerLost as exc:  # re-place its sequences at the top of the loop, then repeat the step
                self._lose(exc.worker, str(exc.__cause__))
                # a mini-batch that sampled before the other one failed (its rows all on survivors): its tokens
                # go out now, the repeated step feeds them
                await self._send(list(self._live.values()))
            except Exception as exc:
                _log.exception("decode step failed", worker=self.name, batch=len(self._live), step=self.step_no)
                for req in list(self._live.values()):
                    await self._finish(req, error=f"failed: decode step: {exc}")

    async def _turn(self) -> None:
        """Awaited before each iteration of the loop (admissions, their prefill, one decode step). A serving
        S-worker's turn is always now; `bench fastdecode` interleaves two S-workers on one core by waiting here, so
        that runs with and without the schedule are measured over the same minutes of a drifting host."""

    def _pick(self) -> list[_Request]:
        """Requests to start before this step: a micro-batch under the schedule, else all that fit."""
        c = self.config
        schedule = self.schedule
        limit = c.max_batch - len(self._live)
        if schedule is not None:
            if self._live and self.step_no % schedule.config.interval:
                return []
            limit = min(limit, schedule.config.micro_batch_size)
        picked: list[_Request] = []
        tokens = 0
        staging_free = self.staging.free_blocks
        while self._waiting and len(picked) < limit:
            req = self._waiting[0]
            need = self.staging.blocks_for(len(req.seq.prompt))
            if picked and (tokens + len(req.seq.prompt) > c.max_prefill_tokens or need > staging_free):
                break
            if need > staging_free or not self._place(req):
                break
            self._waiting.popleft()
            picked.append(req)
            tokens += len(req.seq.prompt)
            staging_free -= need
        if schedule is None or not picked:
            return picked
        profile = schedule.micro_batch_load([len(r.seq.prompt) for r in picked], [r.seq.max_length for r in picked])
        try:
            start = schedule.earliest_step(profile, not_before=self.step_no)
        except ValueError:  # longer than the schedule plans for: start it only into an empty batch
            start = self.step_no if not self._live else -1
        if start != self.step_no and self._live:
            for req in reversed(picked):
                self._unplace(req)
                self._waiting.appendleft(req)
            return []
        self.step_no = start  # an idle S-worker jumps its clock to the micro-batch's slot
        schedule.advance(start)
        schedule.add_micro_batch(profile, start)
        for req in picked:
            req.start = start
        return picked

    def _place(self, req: _Request) -> bool:
        """Choose (and reserve on) the R-worker for `req`; False when none has room."""
        need = self.staging.blocks_for(req.seq.max_length)
        full = frozenset(i for i in range(len(self.workers)) if self.reserved[i] + need > self.capacity[i])
        if len(full) == len(self.workers):
            return False
        req.worker = place(self.expected, req.seq.max_length, full)
        req.sid = next(self._ids)
        self.reserved[req.worker] += need
        self.expected[req.worker] += req.seq.max_length
        return True

    def _unplace(self, req: _Request) -> None:
        if req.worker < 0:
            return
        self.reserved[req.worker] -= self.staging.blocks_for(req.seq.max_length)
        self.expected[req.worker] -= req.seq.max_length
        req.worker = -1

    async def _start(self, reqs: list[_Request]) -> None:
        """Prefill into staging, send first tokens, and have each sequence's R-worker pull its KV."""
        seqs = [r.seq for r in reqs]
        for req in reqs:
            req.staged = len(req.seq.prompt)
            self.staging.reserve(req.seq, req.staged)
        # in a thread, so this node keeps answering (heartbeats, pulls, loads) meanwhile: 4096 prompt tokens take
        # seconds on a slow host, and a loop silent past the heartbeat timeout made the R-workers drop this node
        await run_step(runner.prefill_into, self.model, self.staging, seqs)
        self._started_now += len(reqs)
        for req in reqs:
            self._live[req.seq.request_id] = req
        await self._send(reqs)
        await asyncio.gather(*(self._admit(req) for req in reqs if req.seq.finish is None))

    async def _admit(self, req: _Request) -> None:
        """Have the sequence's R-worker take it (pulling the staged KV from here, or holding zeros for a synthetic
        one); it decodes from the next step on. A real request is already in `_live` (its first token went out);
        a new synthetic one joins only once admitted, so a step never names a sequence its R-worker lacks."""
        seq = req.seq
        n_tokens = seq.length - 1  # KV entries before the next decode step (its fed token is not cached yet)
        source = None if req.synthetic else self.ref
        msg = Admit(req.sid, seq.request_id, n_tokens, seq.max_length, source, owner=self.ref)
        try:
            await self.workers[req.worker].ask(msg, timeout=60.0)
        except Exception as exc:  # RemoteError (e.g. AdmissionRefused), TimeoutError, the R-worker gone
            _log.warning("R-worker refused or failed admission", request_id=seq.request_id, error=str(exc))
            if seq.request_id not in self._live:  # a synthetic sequence being added: its Synthetic ask fails
                self._unplace(req)
                raise
            await self._finish(
                req, error=f"failed: admission on R-worker {self.r_urls[req.worker]}: {exc}", admitted=False
            )
            return
        finally:
            self.staging.free(seq)
        self._live[seq.request_id] = req

    # --- recovery from a lost R-worker --------------------------------------------------------

    def _lose(self, worker: int, reason: str) -> None:
        """Mark an R-worker lost: nothing is placed there again; `_recover` re-places its sequences."""
        if worker in self._dead:
            return
        self._dead.add(worker)
        self.capacity[worker] = 0
        # an orderly stop (the cluster shutting down) is not a fault worth a warning
        (_log.info if reason == "node stopped" else _log.warning)(
            "R-worker lost; re-placing its sequences",
            worker=self.r_urls[worker],
            reason=reason,
            sequences=sum(r.worker == worker for r in self._live.values()),
        )

    async def _recover(self) -> None:
        """Re-place every sequence of a lost R-worker on a survivor with room, re-prefilling its KV (prompt and
        the tokens generated so far) in batches that fit the staging pool and the prefill limit."""
        lost = [r for r in self._live.values() if r.worker in self._dead]
        while lost:
            batch, tokens, free = [], 0, self.staging.free_blocks
            for req in lost:
                n = req.seq.length - 1
                need = 0 if req.synthetic else self.staging.blocks_for(n)
                if batch and (tokens + n > self.config.max_prefill_tokens or need > free):
                    break
                batch.append(req)
                tokens, free = tokens + n, free - need
            lost = lost[len(batch) :]
            placed = []
            for req in batch:
                self._unplace(req)
                if not self._place(req):
                    alive = len(self.workers) - len(self._dead)
                    await self._finish(
                        req,
                        admitted=False,
                        error=f"failed: its R-worker was lost and none of the "
                        f"{alive} surviving R-workers has room for {req.seq.max_length} tokens",
                    )
                elif not req.synthetic and self.staging.blocks_for(req.seq.length - 1) > self.staging.free_blocks:
                    await self._finish(
                        req,
                        admitted=False,
                        error=f"failed: its R-worker was lost and its "
                        f"{req.seq.length - 1} tokens exceed the staging pool "
                        f"({self.config.staging_tokens} tokens)",
                    )
                else:
                    placed.append(req)
            await self._restage(placed)
            self.recovered += len(placed)
            await asyncio.gather(*(self._admit(req) for req in placed))

    async def _restage(self, reqs: list[_Request]) -> None:
        """Prefill prompt + output[:-1] of each real sequence into staging (the next step feeds output[-1]), in a
        thread as `_start` does."""
        real = [r for r in reqs if not r.synthetic]
        for req in real:
            req.staged = req.seq.length - 1
            self.staging.reserve(req.seq, req.staged)
        if not real:
            return
        slots = torch.tensor([slot for r in real for slot in self.staging.slots(r.seq, 0, r.staged)], dtype=torch.int64)
        tokens = [r.seq.prompt + r.seq.output[:-1] for r in real]

        def prefill() -> None:
            with torch.inference_mode():
                self.model.prefill(tokens, kv_sink=lambda layer, k, v: self.staging.pool.write(layer, slots, k, v))

        await run_step(prefill)

    async def _step(self) -> None:
        live = list(self._live.values())
        rows = [StepRow(r.sid, r.worker, r.seq.output[-1], r.seq.length - 1) for r in live]
        held = sum(r.seq.length for r in live)
        started, cpu = time.perf_counter(), time.process_time()
        pipeline = self.config.pipeline and len(rows) >= self.config.pipeline_min_batch
        await decode_step(
            self.model,
            self.workers,
            rows,
            pipeline,
            lambda indices, logits: sample_next([live[i].seq for i in indices], logits),
        )
        ended = time.perf_counter()
        self._trace.append((ended - started, len(live), held, self._started_now, ended, time.process_time() - cpu))
        self._started_now = 0
        await self._send(live)
        self.step_no += 1
        if self.schedule is not None:
            self.schedule.advance(self.step_no)

    async def _send(self, reqs: list[_Request]) -> None:
        """Tell each request's client the tokens sampled since it was last told; release the sequences that
        finished. (By what was sampled, not by a step's result: a step that fails after one mini-batch sampled
        returns nothing, yet those tokens are in the sequences and the repeated step goes on from them.)"""
        by_dest: dict[ActorRef, list[Delta]] = defaultdict(list)
        for req in reqs:
            output = req.seq.output
            if req.reply_to is not None and len(output) > req.sent:
                new = len(output) - req.sent
                delta = Delta(
                    req.seq.request_id, output[req.sent :], req.seq.finish, logprobs=req.seq.last_logprobs(new)
                )
                by_dest[req.reply_to].append(delta)
            req.sent = len(output)
        for dest, deltas in by_dest.items():
            await dest.tell(Tokens(deltas, self.name))
        for req in reqs:
            if req.seq.finish is not None:
                await self._finish(req)

    async def _finish(self, req: _Request, error: str | None = None, admitted: bool = True) -> None:
        """Forget a request: free its staging, release it on its R-worker, give back its reservation."""
        rid = req.seq.request_id
        if self._live.pop(rid, None) is None:
            return
        self.staging.free(req.seq)
        if admitted and req.worker not in self._dead:
            try:
                await self.workers[req.worker].tell(Release([req.sid]))
            except Exception as exc:  # the R-worker is gone: nothing left to free there
                _log.warning("release failed", request_id=rid, error=str(exc))
        self._unplace(req)
        if self.schedule is not None and req.start >= 0:
            self.schedule.remove_sequence(len(req.seq.prompt), req.seq.max_length, req.start, self.step_no)
        if error is not None and req.reply_to is not None:
            await req.reply_to.tell(Tokens([Delta(rid, [], error=error)], self.name))

    async def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        cancelled, self._cancelled = self._cancelled, set()
        self._waiting = deque(r for r in self._waiting if r.seq.request_id not in cancelled)
        for rid in cancelled:
            req = self._live.get(rid)
            if req is not None:
                req.reply_to = None
                await self._finish(req)

    def _staged(self, request_id: str) -> _Request:
        req = self._live.get(request_id)
        if req is None or not req.seq.blocks:
            raise KeyError(f"no KV staged for {request_id!r} on {self.name}")
        return req

    def _check_fits(self, seq: Sequence) -> None:
        if len(self._dead) == len(self.workers):
            raise ValueError("every R-worker of this S-worker was lost")
        need = self.staging.blocks_for(seq.max_length)
        if need > max(self.capacity):
            raise ValueError(f"prompt + max_tokens = {seq.max_length} tokens exceed every R-worker's KV budget")
        if self.staging.blocks_for(len(seq.prompt)) > self.staging.total_blocks:
            raise ValueError(
                f"prompt of {len(seq.prompt)} tokens exceeds the staging pool ({self.config.staging_tokens} tokens)"
            )
