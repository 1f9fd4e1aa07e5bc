"""Discrete-event simulation of prefill and decode instances, driving the real scheduling policies.

Why this design: the simulator must judge hundreds of placements in seconds, so it is event-driven
over a heap and never loops per token. Between two events a decode lane runs a constant batch B whose
step time grows linearly (each step adds B context tokens), so the time of k steps has a closed form
S(k) = k*(d + e*B + f*C) + f*B*k(k-1)/2 and the next interesting step boundary (a sequence finishing,
a waiting one able to join) is found directly. The policies are the ones the serving workers use:
`aiollm.sched.dispatch.Dispatcher` (shortest prefill queue, least-loaded decode), `prefill_batching.take_batch`
(FCFS up to L_m tokens) and `decode_admission.DecodeAdmission` (FCFS admission by reserved KV blocks).
The event heap is the injected clock: the policies never read time. The per-instance timing rules
(clock, prefill servers, decode lanes) are in `sim_instances.py`; this module routes requests between them.

Modelled: prefill pipelining over pp stages (a batch holds stage 1 for T/pp and finishes after T); a
decode instance with pp stages as pp lanes that each keep one batch in flight, with 1/pp of the KV;
the prefill side holding each request's KV until its decode lane admits it and the pull completes
(transfer time = a fixed set-up + prompt KV bytes / link bandwidth); colocated (vLLM-like) instances
that stop decoding while they run a prefill batch (prefill first). Optional, for replaying a measured
deployment: per-request overheads on the way in and out, the controller's limit on requests sent ahead
to a prefill instance, which token a client sees first, and step times varying over time (a shared
machine's slow spells, as a measured slowdown series). Not modelled: pipeline bubbles, activation
transfer between stages, preemption (admission reserves prompt + output, so none is needed).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from aiollm.planner.latency import LatencyModel
from aiollm.planner.sim_instances import Clock, DecodeLane, PrefillServer
from aiollm.planner.workload import Workload
from aiollm.sched.dispatch import Dispatcher

MODES = ("disaggregated", "colocated", "prefill-only", "decode-only")


@dataclass(frozen=True)
class InstanceSpec:
    """Parallelism of one instance: tp GPUs per stage, pp stages."""

    tp: int
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp <= 0 or self.pp <= 0:
            raise ValueError(f"InstanceSpec: tp and pp must be > 0, got tp={self.tp} pp={self.pp}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class SimConfig:
    """What to simulate. For 'colocated' only `decode` (the one instance kind) and `n_decode` are used."""

    latency: LatencyModel
    mode: str
    prefill: InstanceSpec
    decode: InstanceSpec
    # KV tokens one instance holds (all its GPUs together).
    prefill_kv_tokens: int
    decode_kv_tokens: int
    kv_bytes_per_token: int
    n_prefill: int = 1
    n_decode: int = 1
    # Bytes/s for the prefill->decode KV pull; math.inf for no transfer cost.
    link_bandwidth: float = math.inf
    # L_m: prefill batch token limit; 0 = the latency model's compute-bound length.
    max_batch_tokens: int = 0
    block_size: int = 16
    # Most sequences in one decode batch (0 = only KV memory limits it).
    max_running: int = 0
    # Fixed per-request costs of a real deployment besides the instances' compute, measured on it (0 for the
    # GPU plans, as in DistServe's simulator): from arrival until the prefill queue holds the request plus
    # the first token's way back (HTTP, tokenisation, controller hop), and the KV pull's set-up (its
    # message round trips) on top of the bytes over `link_bandwidth`.
    request_overhead: float = 0.0
    pull_overhead: float = 0.0
    # Instead of the one `request_overhead`: request i's own, overheads[i % len] (a deployment's measured
    # spread of it, e.g. drawn from a real run; a constant would hide the tail that decides attainment).
    request_overheads: tuple[float, ...] = ()
    # Request i's first token reaches its client delays[i % len] after the token was made (the way out),
    # capped at its last token; TPOT is then counted from that first visible token, as a client measures it.
    first_token_delays: tuple[float, ...] = ()
    # Per request (one entry each, or empty for all 0): which token is the first the client sees, 0 = the
    # prefill's, k = the k-th decode step's (a detokeniser holds tokens that are no text yet: a special
    # token, part of a multi-byte character; a property of the request's output, like its length).
    first_visible_steps: tuple[int, ...] = ()
    # How much slower than its latency model each kind of instance runs over time: the factor for time t is
    # slowdown[int(t / slowdown_period) % len] (a shared machine's slow and fast spells, e.g. measured on a
    # real run; the model's times are the average, so the factors average ~1). Empty: always 1.
    prefill_slowdown: tuple[float, ...] = ()
    decode_slowdown: tuple[float, ...] = ()
    slowdown_period: float = 0.5
    # The controller sends a prefill instance at most this many requests whose first token has not come
    # back (aiollm.serving.distserve.controller's prefill_queue_limit) and keeps the rest in its own FCFS queue; this
    # caps a prefill batch at that many prompts however short they are. 0 = no limit (DistServe's simulator).
    prefill_queue_limit: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SimConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.n_prefill <= 0 or self.n_decode <= 0:
            raise ValueError("SimConfig: n_prefill and n_decode must be > 0")
        if (
            self.link_bandwidth <= 0
            or self.block_size <= 0
            or min(self.max_batch_tokens, self.max_running, self.prefill_queue_limit) < 0
        ):
            raise ValueError(
                "SimConfig: link_bandwidth, block_size must be > 0; max_batch_tokens, max_running, "
                "prefill_queue_limit >= 0"
            )
        if (
            self.request_overhead < 0
            or self.pull_overhead < 0
            or min((*self.request_overheads, *self.first_token_delays), default=0) < 0
        ):
            raise ValueError("SimConfig: request_overhead(s), first_token_delays and pull_overhead must be >= 0")
        if min(self.first_visible_steps, default=0) < 0:
            raise ValueError("SimConfig: first_visible_steps must be >= 0")
        if min((*self.prefill_slowdown, *self.decode_slowdown), default=1) <= 0 or self.slowdown_period <= 0:
            raise ValueError("SimConfig: prefill_slowdown, decode_slowdown and slowdown_period must be > 0")


@dataclass
class SimResult:
    """Per-request times (seconds); inf for a request that could not be served."""

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output: np.ndarray
    # when each request's prefill ended (one batch's requests share it; decode-only: its arrival)
    prefilled: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        steps = np.maximum(self.output - 1, 1)
        served = np.isfinite(self.finish)
        with np.errstate(invalid="ignore"):
            per_token = (self.finish - self.first_token) / steps
        return np.where(~served, np.inf, np.where(self.output > 1, per_token, 0.0))

    def attainment(self, ttft_slo: float, tpot_slo: float) -> dict:
        """Share of requests meeting TTFT, TPOT, and both (DistServe's goodput counts both)."""
        ok_ttft = self.ttft <= ttft_slo
        ok_tpot = self.tpot <= tpot_slo
        return {"ttft": float(ok_ttft.mean()), "tpot": float(ok_tpot.mean()), "both": float((ok_ttft & ok_tpot).mean())}


class Simulation:
    """One run: the workload's requests routed through the configured instances."""

    def __init__(self, config: SimConfig, workload: Workload, rate: float) -> None:
        self.config = config
        self.latency = config.latency
        self.clock = Clock()
        self.prompt = workload.prompt.astype(np.int64)
        self.output = workload.output.astype(np.int64)
        self.arrival = workload.at(rate)
        n = len(workload)
        self.first_token = np.full(n, np.inf)
        self.finish = np.full(n, np.inf)
        self.visible = np.full(n, np.inf)  # when a request's first visible decode token was made
        self.visible_steps = np.asarray(config.first_visible_steps) if config.first_visible_steps else None
        if self.visible_steps is not None and len(self.visible_steps) != n:
            raise ValueError(f"SimConfig.first_visible_steps has {len(self.visible_steps)} entries for {n} requests")
        spec = config.decode if config.mode == "colocated" else config.prefill
        self.max_batch_tokens = config.max_batch_tokens or self.latency.compute_bound_length(spec.tp)
        self.dispatch = Dispatcher()
        self.waiting: deque[int] = deque()  # the controller's queue (with a prefill_queue_limit)
        self.prefill_servers: dict[str, PrefillServer] = {}
        self.lanes: dict[str, DecodeLane] = {}
        if config.mode in ("disaggregated", "prefill-only"):
            for i in range(config.n_prefill):
                name = f"p{i}"
                self.prefill_servers[name] = PrefillServer(self, name, config.prefill, config.prefill_kv_tokens)
                self.dispatch.add_prefill(name)
        if config.mode != "prefill-only":
            spec = config.decode
            stack = self.latency.stack(spec.tp)
            kv = config.decode_kv_tokens // spec.pp
            for i in range(config.n_decode):
                for lane in range(spec.pp):
                    name = f"d{i}.{lane}"
                    self.lanes[name] = DecodeLane(self, name, stack, kv, config.mode == "colocated")
                    self.dispatch.add_decode(name, kv)
        self.kv_seconds_per_token = config.kv_bytes_per_token / config.link_bandwidth

    def run(self) -> SimResult:
        spread = self.config.request_overheads
        for r, t in enumerate(self.arrival):
            overhead = spread[r % len(spread)] if spread else self.config.request_overhead
            self.clock.at(float(t) + overhead, self.arrive, r)
        self.clock.run()
        prefilled = self.first_token.copy()  # until here: the prefill's token, made at the batch's end
        if self.visible_steps is not None:
            held = (self.visible_steps > 0) & (self.output > 1)
            self.first_token = np.where(held, np.minimum(self.visible, self.finish), self.first_token)
        delays = self.config.first_token_delays
        if delays:
            way_out = np.resize(np.asarray(delays, dtype=np.float64), len(self.first_token))
            self.first_token = np.minimum(self.first_token + way_out, self.finish)
        return SimResult(self.arrival, self.first_token, self.finish, self.output, prefilled)

    def slowdown(self, kind: str, time: float | None = None) -> float:
        """The factor on `kind`'s step times at `time` (default: now)."""
        series = self.config.prefill_slowdown if kind == "prefill" else self.config.decode_slowdown
        if not series:
            return 1.0
        t = self.clock.now if time is None else time
        return series[int(t // self.config.slowdown_period) % len(series)]

    def next_slowdown_edge(self, time: float) -> float:
        """Where the decode slowdown period holding `time` ends (inf without a decode slowdown)."""
        if not self.config.decode_slowdown:
            return math.inf
        period = self.config.slowdown_period
        return (math.floor(time / period) + 1) * period

    def transfer_time(self, r: int) -> float:
        if self.config.mode != "disaggregated":
            return 0.0
        return self.config.pull_overhead + self.prompt[r] * self.kv_seconds_per_token

    def fail(self, r: int) -> None:
        self.first_token[r] = np.inf
        self.finish[r] = np.inf

    def arrive(self, r: int) -> None:
        mode = self.config.mode
        if mode in ("disaggregated", "prefill-only"):
            self.waiting.append(r)
            self._dispatch()
            return
        if mode == "decode-only":
            self.first_token[r] = self.clock.now
        self._to_lane(r, None)

    def _dispatch(self) -> None:
        """The controller's FCFS queue heads to the shortest prefill queue while it is under the limit."""
        limit = self.config.prefill_queue_limit
        while self.waiting:
            name = self.dispatch.choose_prefill()
            if limit and self.dispatch.prefill[name].queued >= limit:
                return
            r = self.waiting.popleft()
            self.dispatch.assign_prefill(name, int(self.prompt[r]))
            self.prefill_servers[name].submit(r)

    def prefill_done(self, r: int, server: PrefillServer) -> None:
        self.first_token[r] = self.clock.now
        self.dispatch.prefill_done(server.name, int(self.prompt[r]))
        if self.config.mode == "prefill-only":
            self.finish[r] = self.clock.now
            server.release(int(self.prompt[r]))
        else:
            self._to_lane(r, server)
        self._dispatch()

    def _to_lane(self, r: int, source: PrefillServer | None) -> None:
        need = int(self.prompt[r] + self.output[r])
        name = self.dispatch.choose_decode(need)
        self.dispatch.assign_decode(name, need)
        self.lanes[name].enqueue(r, source)

    def decode_done(self, r: int, lane: DecodeLane) -> None:
        self.dispatch.decode_done(lane.name, int(self.prompt[r] + self.output[r]))


def simulate(config: SimConfig, workload: Workload, rate: float) -> SimResult:
    """Run `workload` at `rate` req/s through the configured instances."""
    return Simulation(config, workload, rate).run()
