"""Changing a running local cluster: instances added, removed (drained first) and switched between prefill and
decode; and the replanning loop that decides when.

`Scaler` acts on a `LocalCluster`: a new instance starts with `--controller`, so it registers and gets work as soon
as it is up; a removed one is drained by the controller first (no new work; its requests finish there, a prefill
instance's KV is pulled) and only then stopped, so no request is lost and nothing is prefilled again. Switching an
idle instance's kind is removing one of the kind and adding one of the other.

`Replanner` closes the planner's loop: it reads the requests the controller finished (`GetWorkload`), feeds the
planner's `WorkloadMonitor`, and when the workload drifts past its threshold asks a policy for the instance
counts (the DistServe placement under the spec's budget, `placement_policy`) and has the scaler enact them.
Each replan is recorded (when, why, before, after, seconds until the new instances served) and told to the
controller for /metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiollm.deploy.local import LocalCluster, Started
from aiollm.deploy.roles import Wiring
from aiollm.deploy.spec import ClusterSpec
from aiollm.log import get_logger
from aiollm.planner.replan import MonitorConfig, WorkloadMonitor, WorkloadStats
from aiollm.serving.distserve.messages import Drain, GetLoad, GetWorkload, Replanned

_log = get_logger("deploy.scale")

KINDS = ("prefill", "decode")
# seconds between the replanner's reads of the controller's finished requests
POLL_S = 1.0
# seconds a drain may take before the instance is stopped anyway (its requests then resume elsewhere)
DRAIN_TIMEOUT_S = 300.0

# a policy: the window's workload -> (prefill instances, decode instances)
Policy = Callable[[WorkloadStats], tuple[int, int]]


class Scaler:
    """Adds and removes prefill/decode instances of a running local cluster."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.controller = cluster.graph.ref(cluster.controller)
        numbers = [int(re.sub(r"\D", "", s.wiring.actor) or 0) for s in cluster.nodes.values() if s.role in KINDS]
        # name suffixes never reused, so a new instance is never mistaken for a drained one
        self._numbers = itertools.count(1 + max(numbers, default=-1))

    def instances(self, kind: str) -> list[tuple[str, Started]]:
        """(node URL, how it was started) of each running instance of `kind`, oldest first."""
        return [(url, s) for url, s in self.cluster.nodes.items() if s.role == kind]

    def counts(self) -> dict[str, int]:
        return {kind: len(self.instances(kind)) for kind in KINDS}

    async def add(self, kind: str) -> str:
        """Start one more `kind` instance; returns its name once the controller dispatches to it."""
        spec, graph = self.cluster.spec, self.cluster.graph
        name = f"{kind}{next(self._numbers)}"
        r_workers: tuple[str, ...] = ()
        if kind == "decode" and spec.decode.r_workers:
            handles = await asyncio.gather(
                *(graph.start_node("r-worker", process=True, spec=spec) for _ in range(spec.decode.r_workers))
            )
            for handle in handles:
                self.cluster.nodes[handle.url] = Started("r-worker", Wiring(), handle.url)
            r_workers = tuple(h.actors["r-worker"] for h in handles)
        wiring = Wiring(actor=name, controller=self.cluster.controller, r_workers=r_workers)
        handle = await graph.start_node(kind, process=True, spec=spec, wiring=wiring)
        self.cluster.nodes[handle.url] = Started(kind, Wiring(actor=name, r_workers=r_workers), handle.url)
        self.cluster.changed.set()
        await self._until_alive(name)
        _log.warning("instance added", instance=name, url=handle.url)
        return name

    async def remove(self, kind: str) -> str:
        """Drain the newest `kind` instance and stop it (its R-workers too); returns its name."""
        url, started = self.instances(kind)[-1]
        name = started.wiring.actor
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while (await self.controller.ask(Drain(name), timeout=10.0)).left and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        stopping = [url, *(u for u, s in self.cluster.nodes.items() if s.role == "r-worker" and _serves(s, started))]
        for node_url in stopping:
            self.cluster.nodes.pop(node_url, None)
        handles = [h for h in self.cluster.graph.nodes if h.url in stopping]
        await asyncio.gather(*(self.cluster.graph.stop_node(h) for h in handles))
        self.cluster.changed.set()
        _log.warning("instance drained and stopped", instance=name)
        return name

    async def resize(self, prefill: int, decode: int) -> None:
        """Add or remove instances until the cluster runs `prefill` and `decode` of them (at least one each).
        Additions come first, so capacity never dips below the smaller of the two sizes."""
        target = {"prefill": max(1, prefill), "decode": max(1, decode)}
        adds = [kind for kind in KINDS for _ in range(target[kind] - self.counts()[kind])]
        await asyncio.gather(*(self.add(kind) for kind in adds))
        for kind in KINDS:
            while self.counts()[kind] > target[kind]:
                await self.remove(kind)

    async def switch(self, kind: str) -> None:
        """Turn one instance of the other kind into a `kind` instance (for a budget that is full)."""
        other = "decode" if kind == "prefill" else "prefill"
        await self.remove(other)
        await self.add(kind)

    async def _until_alive(self, name: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not (await self.controller.ask(GetLoad(), timeout=10.0)).alive.get(name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"instance {name} did not join the controller within {timeout:g} s")
            await asyncio.sleep(0.2)


def _serves(r_worker: Started, decode: Started) -> bool:
    """Whether the R-worker node `r_worker` is one of decode instance `decode`'s."""
    return any(url.startswith(r_worker.listen + "/") for url in decode.wiring.r_workers)


@dataclass(frozen=True)
class ReplanRecord:
    """One enacted replan."""

    # seconds on the launcher's clock when the drift was detected
    at: float
    why: str
    before: dict[str, int]
    after: dict[str, int]
    # seconds from detection until the new counts served (new instances registered, removed ones drained)
    seconds: float


class Replanner:
    """Watches the controller's finished requests and enacts a new placement when the workload drifts."""

    def __init__(self, scaler: Scaler, policy: Policy, config: MonitorConfig, budget: int) -> None:
        if budget < 2:
            raise ValueError(f"budget: a cluster needs at least 2 instances, got {budget}")
        self.scaler, self.policy, self.budget = scaler, policy, budget
        self.monitor = WorkloadMonitor(config, self._decide, self._queue_plan)
        self.history: list[ReplanRecord] = []
        self._after = 0
        self._pending: asyncio.Queue[tuple[tuple[int, int], WorkloadStats, float]] = asyncio.Queue()

    def _decide(self, stats: WorkloadStats) -> tuple[int, int]:
        prefill, decode = self.policy(stats)
        prefill, decode = max(1, prefill), max(1, decode)
        while prefill + decode > self.budget:  # the budget binds: trim the larger side
            if prefill >= decode:
                prefill -= 1
            else:
                decode -= 1
        return prefill, decode

    def _queue_plan(self, counts: tuple[int, int], stats: WorkloadStats) -> None:
        self._pending.put_nowait((counts, stats, time.monotonic()))

    async def forget_past(self) -> None:
        """Watch only the requests that finish from now on."""
        workload = await self.scaler.controller.ask(GetWorkload(self._after), timeout=10.0)
        self._after = max([self._after, *(row[0] for row in workload.finished)])

    async def run(self) -> None:
        """Poll and enact until cancelled."""
        enact = asyncio.create_task(self._enact())
        try:
            while True:
                workload = await self.scaler.controller.ask(GetWorkload(self._after), timeout=10.0)
                for number, arrival, prompt_len, output_len in workload.finished:
                    self._after = max(self._after, number)
                    self.monitor.observe(arrival, max(1, prompt_len), max(1, output_len))
                await asyncio.sleep(POLL_S)
        finally:
            enact.cancel()

    async def _enact(self) -> None:
        while True:
            (prefill, decode), stats, detected = await self._pending.get()
            before = self.scaler.counts()
            after = {"prefill": prefill, "decode": decode}
            if after == before:
                continue
            why = f"rate {stats.rate:.2f}/s, prompt {stats.prompt_mean:.0f}, output {stats.output_mean:.0f} tokens"
            await self.scaler.resize(prefill, decode)
            record = ReplanRecord(detected, why, before, after, time.monotonic() - detected)
            self.history.append(record)
            _log.warning("replanned", why=why, before=before, after=after, seconds=round(record.seconds, 2))
            await self.scaler.controller.tell(Replanned(detected, why, before, after))


def placement_policy(spec: ClusterSpec) -> Policy:
    """The DistServe placement (aiollm.planner) for the window's workload: the spec's model and SLOs, the
    latency profile it names, a budget of `planner.max_instances` one-core instances."""
    from dataclasses import replace

    from aiollm.planner.goodput import SLO
    from aiollm.planner.hardware import parse_cluster
    from aiollm.planner.models import get_model
    from aiollm.planner.placement import PlacementConfig, Planner
    from aiollm.planner.profiles import latency_model
    from aiollm.planner.workload import LengthSample, Workload

    p = spec.planner
    model = get_model(spec.model.name)
    cluster = parse_cluster(f"1x{p.max_instances}xA100-80G")
    latency = latency_model(model.name, cluster.gpu.name, p.profile)
    slo = SLO(p.ttft_slo_s, p.tpot_slo_s, p.attainment, "joint")
    base = PlacementConfig(model, cluster, latency, slo, "low", None, workers=1)

    def policy(stats: WorkloadStats) -> tuple[int, int]:
        lengths = LengthSample("observed", stats.prompt, stats.output, f"last {stats.requests} requests")
        plan = Planner(replace(base, rate=stats.rate), Workload.build(lengths, 200, 0)).plan()
        prefill = plan.prefill.count if plan.prefill is not None else 1
        return prefill, plan.decode.count

    return policy
