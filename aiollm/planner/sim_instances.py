"""The simulator's moving parts: its clock, prefill servers and decode lanes.

Why a module of their own: `simulator.py` holds what a caller configures and reads back (`SimConfig`,
`SimResult`, `simulate`) and the request routing between instances; these classes are the per-instance
timing rules (batching, pipelining, the closed-form step boundaries), which a reader checks against the
serving workers one at a time. They call back into the simulation (`sim`) for the workload, the clock,
the slowdown series and the routing of finished work.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING

from aiollm.planner.latency import StackLatency
from aiollm.sched.decode_admission import DecodeAdmission, blocks_for
from aiollm.sched.prefill_batching import take_batch

if TYPE_CHECKING:
    from aiollm.planner.simulator import InstanceSpec, Simulation


class Clock:
    """The simulation's time and event heap."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, time: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, fn, args))

    def run(self) -> None:
        heap = self._heap
        while heap:
            time, _, fn, args = heapq.heappop(heap)
            self.now = time
            fn(*args)


class PrefillServer:
    """One prefill instance: FCFS queue, batches up to L_m, pp-stage pipeline, KV held until pulled."""

    def __init__(self, sim: Simulation, name: str, spec: InstanceSpec, kv_tokens: int) -> None:
        self.sim, self.name, self.pp = sim, name, spec.pp
        self.stack = sim.latency.stack(spec.tp)
        self.queue: deque[int] = deque()
        self.busy = False
        self.kv_free = kv_tokens

    def submit(self, r: int) -> None:
        self.queue.append(r)
        self.try_start()

    def release(self, tokens: int) -> None:
        self.kv_free += tokens
        self.try_start()

    def try_start(self) -> None:
        if self.busy or not self.queue:
            return
        prompt = self.sim.prompt
        n = take_batch(islice((prompt[r] for r in self.queue), 4096), self.sim.max_batch_tokens)
        lengths = [prompt[self.queue[i]] for i in range(n)]
        while lengths and sum(lengths) > self.kv_free:
            lengths.pop()
        if not lengths:
            return  # blocked until a decode lane pulls some KV
        batch = [self.queue.popleft() for _ in lengths]
        total = sum(lengths)
        self.kv_free -= total
        duration = self.stack.prefill_time(total, sum(x * x for x in lengths)) * self.sim.slowdown("prefill")
        self.busy = True
        clock = self.sim.clock
        clock.at(clock.now + duration / self.pp, self._stage_free)
        clock.at(clock.now + duration, self._done, batch)

    def _stage_free(self) -> None:
        self.busy = False
        self.try_start()

    def _done(self, batch: list[int]) -> None:
        for r in batch:
            self.sim.prefill_done(r, self)


class DecodeLane:
    """One batch in flight on a decode instance (an instance with pp stages has pp lanes).

    In colocated mode the same lane also prefills (vLLM-like, prefill first), and KV never moves."""

    def __init__(self, sim: Simulation, name: str, stack: StackLatency, kv_tokens: int, colocated: bool) -> None:
        self.sim, self.name, self.stack, self.colocated = sim, name, stack, colocated
        block = sim.config.block_size
        self.admission = DecodeAdmission(max(1, kv_tokens // block), block, sim.config.max_running or 10**9)
        self.capacity = kv_tokens
        self.running: list[tuple[int, int]] = []  # heap of (finish step, request)
        self.marks: list[tuple[int, int]] = []  # heap of (step, request) whose token is its first visible one
        self.pending: list[tuple[float, int]] = []  # heap of (KV ready time, request)
        self.to_prefill: deque[int] = deque()  # colocated: admitted, not yet prefilled
        self.source: dict[int, PrefillServer | None] = {}
        self.steps = 0
        self.batch = 0
        self.ctx = 0
        self.anchor = 0.0  # time of the last step boundary
        self.version = 0  # invalidates a scheduled boundary that was superseded
        self.next_k = -1  # steps after `anchor` of the scheduled boundary (-1: none)
        self.in_prefill = False

    # --- entry points -------------------------------------------------------------------------
    def enqueue(self, r: int, source: PrefillServer | None) -> None:
        need = int(self.sim.prompt[r] + self.sim.output[r])
        if blocks_for(need, self.admission.block_size) > self.admission.total_blocks:
            self.sim.fail(r)
            if source is not None:
                source.release(int(self.sim.prompt[r]))
            return
        self.admission.enqueue(r, need)
        self.source[r] = source
        self._wake(self.sim.clock.now)

    # --- step timing --------------------------------------------------------------------------
    def _step_terms(self) -> tuple[float, float]:
        """(first step, growth per step) from the anchor on, at the speed of the anchor's slowdown period (a
        planned boundary never crosses into the next period, see `_plan_next`)."""
        d, e, f = self.stack.decode_coeffs(self.batch)
        factor = self.sim.slowdown("decode", self.anchor)
        return (d + e * self.batch + f * self.ctx) * factor, f * self.batch * factor

    def _elapsed(self, k: int) -> float:
        base, growth = self._step_terms()
        return k * base + growth * k * (k - 1) / 2

    def _steps_until(self, delta: float) -> int:
        """Fewest steps (>= 1) after the anchor whose end is at or after anchor + delta."""
        base, growth = self._step_terms()
        if delta <= 0:
            return 1
        if growth > 0:
            lin = base - growth / 2
            k = math.ceil((-lin + math.sqrt(lin * lin + 2 * growth * delta)) / growth)
        else:
            k = math.ceil(delta / base)
        k = max(k, 1)
        while k * base + growth * k * (k - 1) / 2 < delta:
            k += 1
        while k > 1 and (k - 1) * base + growth * (k - 1) * (k - 2) / 2 >= delta:
            k -= 1
        return k

    def _schedule(self, k: int) -> None:
        self.version += 1
        self.next_k = k
        self.sim.clock.at(self.anchor + (self._elapsed(k) if k else 0.0), self._boundary, self.version)

    def _wake(self, time: float) -> None:
        """Make sure a boundary happens at the first step end at or after `time`."""
        if self.in_prefill:
            return  # the end of the prefill is a boundary
        if self.batch == 0:
            if self.next_k < 0 or self.anchor > time:
                self.anchor = max(time, self.sim.clock.now)
                self._schedule(0)
            return
        k = self._steps_until(time - self.anchor)
        if self.next_k < 0 or k < self.next_k:
            self._schedule(k)

    # --- the boundary -------------------------------------------------------------------------
    def _boundary(self, version: int) -> None:
        if version != self.version:
            return
        now = self.sim.clock.now
        k = self.next_k
        if self.batch and k > 0:
            self.steps += k
            self.ctx += self.batch * k
        self.anchor = now
        self.next_k = -1
        while self.marks and self.marks[0][0] <= self.steps:
            self.sim.visible[heapq.heappop(self.marks)[1]] = now
        self._finish_done(now)
        self._admit(now)
        self._join_ready(now)
        if self.colocated and self.to_prefill:
            self._start_prefill(now)
            return
        self._plan_next()

    def _finish_done(self, now: float) -> None:
        sim = self.sim
        while self.running and self.running[0][0] <= self.steps:
            _, r = heapq.heappop(self.running)
            self.batch -= 1
            self.ctx -= int(sim.prompt[r] + sim.output[r])
            sim.finish[r] = now
            self.admission.release(r)
            sim.decode_done(r, self)

    def _admit(self, now: float) -> None:
        sim = self.sim
        for adm in self.admission.admit():
            r = adm.seq_id
            if self.colocated:
                self.to_prefill.append(r)
            else:
                heapq.heappush(self.pending, (now + sim.transfer_time(r), r))

    def _join_ready(self, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            _, r = heapq.heappop(self.pending)
            source = self.source.pop(r)
            if source is not None:
                source.release(int(self.sim.prompt[r]))
            self._join(r, now)

    def _join(self, r: int, now: float) -> None:
        sim = self.sim
        remaining = int(sim.output[r]) - 1
        if remaining <= 0:
            sim.finish[r] = now
            self.admission.release(r)
            sim.decode_done(r, self)
            return
        heapq.heappush(self.running, (self.steps + remaining, r))
        if sim.visible_steps is not None and sim.visible_steps[r] > 0:
            heapq.heappush(self.marks, (self.steps + min(int(sim.visible_steps[r]), remaining), r))
        self.batch += 1
        self.ctx += int(sim.prompt[r]) + 1

    def _start_prefill(self, now: float) -> None:
        prompt = self.sim.prompt
        n = take_batch(islice((prompt[r] for r in self.to_prefill), 4096), self.sim.max_batch_tokens)
        batch = [self.to_prefill.popleft() for _ in range(n)]
        lengths = [int(prompt[r]) for r in batch]
        duration = self.stack.prefill_time(sum(lengths), sum(x * x for x in lengths)) * self.sim.slowdown("prefill")
        self.in_prefill = True
        self.version += 1
        self.sim.clock.at(now + duration, self._prefill_end, batch)

    def _prefill_end(self, batch: list[int]) -> None:
        now = self.sim.clock.now
        self.in_prefill = False
        self.anchor = now
        for r in batch:
            self.sim.first_token[r] = now
            self.source.pop(r, None)
            self._join(r, now)
        self.next_k = 0
        self._boundary(self.version)

    def _plan_next(self) -> None:
        if self.batch == 0:
            if self.pending:
                self.anchor = self.pending[0][0]
                self._schedule(0)
            return
        k = min(self.running[0][0], self.marks[0][0] if self.marks else math.inf) - self.steps
        if self.pending:
            k = min(k, self._steps_until(self.pending[0][0] - self.anchor))
        edge = self.sim.next_slowdown_edge(self.anchor)
        if edge < math.inf:  # a boundary at the first step end in the next period picks up its speed
            k = min(k, self._steps_until(edge - self.anchor))
        self._schedule(max(k, 1))
