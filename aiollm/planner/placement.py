"""Placement search: DistServe's Algorithm 1 (high node affinity), Algorithm 2 (low affinity), and the
colocated baseline; the memory constraint; replica counts for a target rate.

Why two algorithms: with fast links between nodes (high affinity) prefill and decode instances can be
sized independently, each for its own best goodput per GPU, then replicated. With slow links (DistServe's
25 Gbit/s testbed) the KV transfer must stay on NVLink, so each pipeline stage keeps its prefill and decode
segments in one node and the pair is simulated together. Search speed comes from memoising each phase's
goodput and from a bound: a pair can never beat min(prefill goodput, decode goodput) of its parts, so pairs
whose bound per GPU is below the best found are never simulated.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from aiollm.planner.goodput import SLO, InfeasibleSLO, goodput, goodput_task, probe_workload
from aiollm.planner.hardware import ClusterSpec
from aiollm.planner.latency import LatencyModel
from aiollm.planner.models import ModelSpec
from aiollm.planner.profiles import kv_capacity_tokens
from aiollm.planner.simulator import InstanceSpec, SimConfig, simulate
from aiollm.planner.workload import Workload

AFFINITIES = ("high", "low", "colocated")


@dataclass(frozen=True)
class PlacementConfig:
    """Everything a placement search depends on."""

    model: ModelSpec
    cluster: ClusterSpec
    latency: LatencyModel
    slo: SLO
    affinity: str = "low"
    # Target request rate (req/s) to size replicas for; None = fill the cluster.
    rate: float | None = None
    # Prefill batch token limit L_m; 0 = from the latency model.
    max_batch_tokens: int = 0
    # Goodput search stops when hi/lo - 1 < rel_tol.
    rel_tol: float = 0.03
    # Simulate the whole chosen plan (all replicas together) and report its own goodput.
    verify: bool = True
    # Latency model of colocated instances (DistServe compares against vLLM's own A100 profile); None = `latency`.
    colocated_latency: LatencyModel | None = None
    # Largest pipeline degree searched (None: whatever the cluster and model allow).
    max_pp: int | None = None
    # Processes that run independent goodput searches in parallel (1: in this process).
    workers: int = 1

    def __post_init__(self) -> None:
        if self.affinity not in AFFINITIES:
            raise ValueError(f"PlacementConfig.affinity must be one of {AFFINITIES}, got {self.affinity!r}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"PlacementConfig.rate must be > 0, got {self.rate}")
        if not 0 < self.rel_tol < 1:
            raise ValueError(f"PlacementConfig.rel_tol must be in (0, 1), got {self.rel_tol}")


@dataclass(frozen=True)
class InstancePlan:
    """`count` instances of tp x pp GPUs, each sustaining `goodput` req/s alone."""

    tp: int
    pp: int
    count: int
    goodput: float
    kv_tokens: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.count


@dataclass
class Plan:
    """A placement and what the simulator says it sustains."""

    model: str
    cluster: str
    affinity: str
    profile: str
    workload: str
    slo: dict
    # None for a colocated plan (then `decode` is the colocated instance kind).
    prefill: InstancePlan | None
    decode: InstancePlan
    # Best per-GPU goodput of one placement unit (a prefill+decode pair or one instance): what the
    # algorithms rank by, and what DistServe's simulator prints as "best per GPU rate".
    unit_per_gpu_goodput: float
    # Goodput of the whole plan from its parts' goodputs (min of the phases' totals).
    system_goodput: float
    gpus_used: int
    fits: bool
    target_rate: float | None
    configs_simulated: int
    search_seconds: float
    # The whole plan simulated together: its own goodput and attainment at the target (or system) rate.
    simulated: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def per_gpu_goodput(self) -> float:
        return self.system_goodput / self.gpus_used if self.gpus_used else 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        out["per_gpu_goodput"] = self.per_gpu_goodput
        return out

    def describe(self) -> str:
        lines = [
            f"plan for {self.model} on {self.cluster} ({self.affinity} affinity), workload {self.workload}",
            f"  latency profile: {self.profile}",
            f"  SLO: TTFT {self.slo['ttft'] * 1e3:.0f} ms, TPOT {self.slo['tpot'] * 1e3:.0f} ms, "
            f"{self.slo['attainment'] * 100:.0f} % ({self.slo['mode']})",
        ]
        if self.prefill is not None:
            lines.append(_instance_line("prefill", self.prefill))
            lines.append(_instance_line("decode", self.decode))
        else:
            lines.append(_instance_line("colocated", self.decode))
        lines.append(
            f"  unit per-GPU goodput {self.unit_per_gpu_goodput:.3f} req/s/GPU; system goodput "
            f"{self.system_goodput:.3f} req/s on {self.gpus_used} GPUs ({self.per_gpu_goodput:.3f} req/s/GPU)"
        )
        if self.target_rate is not None:
            lines.append(
                f"  target rate {self.target_rate:.3f} req/s: {'fits' if self.fits else 'DOES NOT FIT'} "
                f"the cluster's {self.cluster}"
            )
        if self.simulated:
            sim = self.simulated
            lines.append(
                f"  whole plan simulated together: goodput {sim['goodput']:.3f} req/s; at {sim['rate']:.3f} "
                f"req/s attainment {sim['attainment']['both'] * 100:.1f} % (TTFT {sim['attainment']['ttft'] * 100:.1f} %,"
                f" TPOT {sim['attainment']['tpot'] * 100:.1f} %)"
            )
        lines.append(f"  searched {self.configs_simulated} configurations in {self.search_seconds:.2f} s")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def _instance_line(kind: str, inst: InstancePlan) -> str:
    return (
        f"  {kind}: {inst.count} x (tp={inst.tp}, pp={inst.pp}) = {inst.gpus} GPUs, "
        f"{inst.goodput:.3f} req/s each alone, KV {inst.kv_tokens} tokens each"
    )


class Planner:
    """Runs the searches for one PlacementConfig and one workload sample, memoising simulations."""

    def __init__(self, config: PlacementConfig, workload: Workload) -> None:
        self.config = config
        self.workload = workload
        self.max_request = int((workload.prompt + workload.output).max())
        self._memo: dict[tuple, float] = {}
        self.simulated = 0

    # --- feasibility ----------------------------------------------------------------------------
    def tps(self) -> list[int]:
        m = self.config.model
        candidates = {1, 2, 4, 8, 16} | set(self.config.latency.by_tp)
        return sorted(tp for tp in candidates if tp <= self.config.cluster.gpus_per_node and m.heads % tp == 0)

    def kv_tokens(self, tp: int, pp: int) -> int:
        """KV tokens of a tp x pp instance, 0 if it cannot hold the weights plus the longest request."""
        c = self.config
        if pp > c.model.layers:
            return 0
        tokens = kv_capacity_tokens(c.model, c.cluster.gpu, tp, pp, c.latency)
        return tokens if tokens >= self.max_request * pp else 0

    def instance_configs(self, max_gpus: int, max_pp: int) -> list[tuple[int, int]]:
        out = []
        for tp in self.tps():
            pp = 1
            while tp * pp <= max_gpus and pp <= min(max_pp, self.config.max_pp or max_pp):
                if self.kv_tokens(tp, pp):
                    out.append((tp, pp))
                pp *= 2
        return out

    # --- simulations ------------------------------------------------------------------------------
    def sim_config(
        self,
        mode: str,
        prefill: tuple[int, int],
        decode: tuple[int, int],
        bandwidth: float,
        n_prefill: int = 1,
        n_decode: int = 1,
    ) -> SimConfig:
        """A simulation of these instances of this planner's model on its cluster (KV capacity from memory)."""
        c = self.config
        return SimConfig(
            c.latency,
            mode,
            InstanceSpec(*prefill),
            InstanceSpec(*decode),
            self.kv_tokens(*prefill) or 1,
            self.kv_tokens(*decode) or 1,
            c.model.kv_bytes_per_token,
            n_prefill=n_prefill,
            n_decode=n_decode,
            link_bandwidth=bandwidth,
            max_batch_tokens=c.max_batch_tokens,
        )

    def _goodput(self, key: tuple, config: SimConfig, phase: str) -> float:
        if key not in self._memo:
            self._memo[key] = goodput(config, self.workload, self.config.slo, phase, self.config.rel_tol)
            self.simulated += 1
        return self._memo[key]

    def _prefetch_phases(self, configs: list[tuple[int, int]]) -> None:
        """Run the missing per-phase goodput searches for `configs`, in parallel when workers > 1."""
        jobs = []
        for phase in ("prefill", "decode"):
            for tp, pp in configs:
                if (phase, tp, pp) not in self._memo:
                    config, factor = self._phase_config(phase, tp, pp)
                    jobs.append(
                        ((phase, tp, pp), factor, (config, self.workload, self.config.slo, phase, self.config.rel_tol))
                    )
        if self.config.workers <= 1 or len(jobs) < 2:
            return
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(self.config.workers, mp_context=context) as pool:
            for (key, factor, _), value in zip(jobs, pool.map(goodput_task, [job[2] for job in jobs])):
                self._memo[key] = factor * value
                self.simulated += 1

    def _phase_config(self, phase: str, tp: int, pp: int) -> tuple[SimConfig, int]:
        """The simulation that measures one phase of a tp x pp instance, and the factor its goodput is
        multiplied by. A decode instance's pp lanes are independent batches with 1/pp of the KV each, fed
        by the least-loaded dispatch; the search simulates one lane at 1/pp of the rate (pp times fewer
        requests per probe; a random split, so slightly pessimistic) and the verification of the chosen
        plan simulates every lane together."""
        if phase == "prefill":
            return self.sim_config("prefill-only", (tp, pp), (tp, pp), math.inf), 1
        lane = replace(
            self.sim_config("decode-only", (tp, 1), (tp, 1), math.inf),
            decode_kv_tokens=max(1, self.kv_tokens(tp, pp) // pp),
        )
        return lane, pp

    def phase_goodput(self, phase: str, tp: int, pp: int) -> float:
        key = (phase, tp, pp)
        if key not in self._memo:
            config, factor = self._phase_config(phase, tp, pp)
            self._memo[key] = factor * goodput(config, self.workload, self.config.slo, phase, self.config.rel_tol)
            self.simulated += 1
        return self._memo[key]

    def pair_goodput(self, prefill: tuple[int, int], decode: tuple[int, int], bandwidth: float) -> float:
        cfg = self.sim_config("disaggregated", prefill, decode, bandwidth)
        return self._goodput(("pair", prefill, decode, bandwidth), cfg, "both")

    def colocated_goodput(self, tp: int, pp: int) -> float:
        cfg = self.sim_config("colocated", (tp, pp), (tp, pp), math.inf)
        if self.config.colocated_latency is not None:
            cfg = replace(cfg, latency=self.config.colocated_latency)
        return self._goodput(("colocated", tp, pp), cfg, "both")

    # --- algorithms ---------------------------------------------------------------------------------
    def plan(self) -> Plan:
        start = time.perf_counter()
        kind = self.config.affinity
        plan = {"high": self._high_affinity, "low": self._low_affinity, "colocated": self._colocated}[kind]()
        if self.config.verify:
            self._verify(plan)
        plan.search_seconds = time.perf_counter() - start
        plan.configs_simulated = self.simulated
        return plan

    def _high_affinity(self) -> Plan:
        """Algorithm 1: each phase's goodput per (tp, pp) simulated on its own, then the pair of phase
        configurations and replica counts with the best goodput per GPU that the cluster holds (for a
        target rate: the fewest GPUs that sustain it)."""
        c = self.config
        configs = self.instance_configs(c.cluster.total_gpus, c.cluster.total_gpus)
        self._require(configs)
        self._prefetch_phases(configs)
        scores = {}
        for phase in ("prefill", "decode"):
            scores[phase] = {cfg: self.phase_goodput(phase, *cfg) for cfg in configs}
            if max(scores[phase].values()) <= 0:
                raise self._infeasible(configs, phase)
        best = None
        for cfg_p, g_p in scores["prefill"].items():
            for cfg_d, g_d in scores["decode"].items():
                if g_p <= 0 or g_d <= 0:
                    continue
                split = self._replicas_split(g_p, cfg_p[0] * cfg_p[1], g_d, cfg_d[0] * cfg_d[1])
                if split is None:
                    continue
                n_p, n_d, rate, used = split
                key = (-used, rate) if c.rate is not None else (rate / used, -used)
                if best is None or key > best[0]:
                    best = (key, cfg_p, g_p, n_p, cfg_d, g_d, n_d, rate)
        if best is None and c.rate is not None:
            # The target needs more than the cluster: the pair that needs the fewest GPUs, marked as not fitting.
            for cfg_p, g_p in scores["prefill"].items():
                for cfg_d, g_d in scores["decode"].items():
                    if g_p > 0 and g_d > 0:
                        n_p, n_d = math.ceil(c.rate / g_p), math.ceil(c.rate / g_d)
                        used = n_p * cfg_p[0] * cfg_p[1] + n_d * cfg_d[0] * cfg_d[1]
                        if best is None or -used > best[0][0]:
                            best = ((-used, 0.0), cfg_p, g_p, n_p, cfg_d, g_d, n_d, min(n_p * g_p, n_d * g_d))
        if best is None:
            raise ValueError(f"no prefill + decode pair fits {c.cluster.describe()} for {c.model.name}")
        _, (tp_p, pp_p), g_p, n_p, (tp_d, pp_d), g_d, n_d, rate = best
        prefill = InstancePlan(tp_p, pp_p, n_p, g_p, self.kv_tokens(tp_p, pp_p))
        decode = InstancePlan(tp_d, pp_d, n_d, g_d, self.kv_tokens(tp_d, pp_d))
        plan = self._make_plan(
            prefill,
            decode,
            rate / (prefill.gpus + decode.gpus),
            rate,
            [
                "Algorithm 1: phases sized independently; KV crosses nodes at "
                f"{c.cluster.inter_node_bandwidth * 8 / 1e9:.0f} Gbit/s in the whole-plan simulation"
            ],
        )
        return plan

    def _replicas_split(self, g_p: float, gpus_p: int, g_d: float, gpus_d: int) -> tuple[int, int, float, int] | None:
        """(prefill count, decode count, sustained rate, GPUs used). For a target rate: the counts that
        reach it, None if they exceed the cluster.
        Without: the counts within the cluster with the highest rate, then the fewest GPUs."""
        total = self.config.cluster.total_gpus
        if self.config.rate is not None:
            n_p = max(1, math.ceil(self.config.rate / g_p))
            n_d = max(1, math.ceil(self.config.rate / g_d))
            used = n_p * gpus_p + n_d * gpus_d
            return (n_p, n_d, min(n_p * g_p, n_d * g_d), used) if used <= total else None
        best = None
        for n_p in range(1, total // gpus_p + 1):
            n_d = (total - n_p * gpus_p) // gpus_d
            if n_d < 1:
                break
            rate = min(n_p * g_p, n_d * g_d)
            # Only as many instances of each phase as that rate needs.
            n_p_min = max(1, math.ceil(rate / g_p - 1e-9))
            n_d_min = max(1, math.ceil(rate / g_d - 1e-9))
            used = n_p_min * gpus_p + n_d_min * gpus_d
            if best is None or rate > best[2] + 1e-12 or (abs(rate - best[2]) <= 1e-12 and used < best[3]):
                best = (n_p_min, n_d_min, rate, used)
        return best

    def _low_affinity(self) -> Plan:
        """Algorithm 2: per pipeline stage, the prefill and decode segments share a node (NVLink KV
        transfer); pairs ranked by a bound from their phases, simulated together only if they can win."""
        c = self.config
        per_node = c.cluster.gpus_per_node
        candidates = []
        self._prefetch_phases(
            [
                (tp, pp)
                for tp in self.tps()
                for pp in _powers_of_two(min(c.cluster.nodes, c.max_pp or c.cluster.nodes))
                if self.kv_tokens(tp, pp)
            ]
        )
        pp = 1
        while pp <= min(c.cluster.nodes, c.max_pp or c.cluster.nodes):
            for tp_p in self.tps():
                for tp_d in self.tps():
                    if tp_p + tp_d > per_node or not self.kv_tokens(tp_p, pp) or not self.kv_tokens(tp_d, pp):
                        continue
                    gpus = pp * (tp_p + tp_d)
                    bound = min(self.phase_goodput("prefill", tp_p, pp), self.phase_goodput("decode", tp_d, pp)) / gpus
                    candidates.append((bound, -gpus, tp_p, tp_d, pp))
            pp *= 2
        if not candidates:
            self._require([])
        candidates.sort(reverse=True)
        if candidates[0][0] <= 0:
            raise self._infeasible([(tp, p) for _, _, tp, _, p in candidates], "both")
        best = None
        for bound, neg_gpus, tp_p, tp_d, pp in candidates:
            if best is not None and bound <= best[0]:
                break
            g = self.pair_goodput((tp_p, pp), (tp_d, pp), c.cluster.gpu.nvlink_bandwidth)
            per_gpu = g / -neg_gpus
            if best is None or per_gpu > best[0] + 1e-12:
                best = (per_gpu, g, tp_p, tp_d, pp)
        per_gpu, g, tp_p, tp_d, pp = best
        if g <= 0:
            raise self._infeasible([(tp_p, pp)], "both")
        stages_per_node = per_node // (tp_p + tp_d)
        max_pairs = (c.cluster.nodes * stages_per_node) // pp
        pairs = math.ceil(c.rate / g) if c.rate is not None else max_pairs
        # Each instance's own goodput (its phase alone); the pair sustains g together.
        prefill = InstancePlan(tp_p, pp, pairs, self.phase_goodput("prefill", tp_p, pp), self.kv_tokens(tp_p, pp))
        decode = InstancePlan(tp_d, pp, pairs, self.phase_goodput("decode", tp_d, pp), self.kv_tokens(tp_d, pp))
        plan = self._make_plan(
            prefill,
            decode,
            per_gpu,
            pairs * g,
            [
                "Algorithm 2: each stage's prefill and decode segments share a node; KV moves over "
                f"NVLink at {c.cluster.gpu.nvlink_bandwidth / 1e9:.0f} GB/s"
            ],
        )
        if pairs > max_pairs:
            plan.fits = False
        return plan

    def _colocated(self) -> Plan:
        """The baseline: one instance kind doing both phases (vLLM-like), best (tp, pp) per GPU, replicated."""
        c = self.config
        configs = self.instance_configs(c.cluster.total_gpus, c.cluster.total_gpus)
        self._require(configs)
        scored = [(self.colocated_goodput(tp, pp) / (tp * pp), -tp * pp, tp, pp) for tp, pp in configs]
        per_gpu, _, tp, pp = max(scored)
        if per_gpu <= 0:
            raise self._infeasible(configs, "both")
        g = per_gpu * tp * pp
        count = math.ceil(c.rate / g) if c.rate is not None else c.cluster.total_gpus // (tp * pp)
        inst = InstancePlan(tp, pp, count, g, self.kv_tokens(tp, pp))
        return self._make_plan(
            None,
            inst,
            per_gpu,
            count * g,
            ["colocated baseline: prefill and decode batched in one instance, prefill first (vLLM's policy)"],
        )

    def _make_plan(self, prefill, decode, unit, system, notes) -> Plan:
        c = self.config
        gpus = (prefill.gpus if prefill else 0) + decode.gpus
        latency = c.colocated_latency if prefill is None and c.colocated_latency is not None else c.latency
        return Plan(
            c.model.name,
            c.cluster.describe(),
            c.affinity,
            latency.source,
            self.workload.lengths.name,
            {"ttft": c.slo.ttft, "tpot": c.slo.tpot, "attainment": c.slo.attainment, "mode": c.slo.mode},
            prefill,
            decode,
            unit,
            system,
            gpus,
            gpus <= c.cluster.total_gpus,
            c.rate,
            0,
            0.0,
            {},
            notes,
        )

    def _verify(self, plan: Plan) -> None:
        """Simulate all instances of the plan together (with the KV transfer) and record what they sustain."""
        c = self.config
        if plan.prefill is None:
            cfg = self.sim_config(
                "colocated",
                (plan.decode.tp, plan.decode.pp),
                (plan.decode.tp, plan.decode.pp),
                math.inf,
                n_decode=plan.decode.count,
            )
            if c.colocated_latency is not None:
                cfg = replace(cfg, latency=c.colocated_latency)
        else:
            bandwidth = c.cluster.inter_node_bandwidth if plan.affinity == "high" else c.cluster.gpu.nvlink_bandwidth
            cfg = self.sim_config(
                "disaggregated",
                (plan.prefill.tp, plan.prefill.pp),
                (plan.decode.tp, plan.decode.pp),
                bandwidth,
                plan.prefill.count,
                plan.decode.count,
            )
        # More requests for more replicas, so the sample spans the same time at the higher rate.
        rate = c.rate if c.rate is not None else plan.system_goodput
        workload = self.workload
        result = simulate(cfg, probe_workload(workload, c.slo, rate), rate)
        plan.simulated = {
            "goodput": goodput(cfg, workload, c.slo, "both", c.rel_tol, hint=plan.system_goodput),
            "rate": rate,
            "attainment": result.attainment(c.slo.ttft, c.slo.tpot),
            "ttft_p90": float(np.percentile(result.ttft, 90)),
            "tpot_p90": float(np.percentile(result.tpot, 90)),
        }

    # --- errors -----------------------------------------------------------------------------------
    def _require(self, configs) -> None:
        if configs:
            return
        c = self.config
        need = math.ceil(c.model.param_bytes / (c.cluster.gpu.mem_bytes * 0.9))
        raise ValueError(
            f"{c.model.name} ({c.model.param_bytes / 1e9:.0f} GB of weights, longest request "
            f"{self.max_request} tokens) fits no instance on {c.cluster.describe()}: it needs at least "
            f"{need} {c.cluster.gpu.name} GPUs for the weights alone"
        )

    def _infeasible(self, configs, phase: str) -> InfeasibleSLO:
        c = self.config
        lat = c.latency
        median_prompt = float(np.median(self.workload.prompt))
        best_ttft = min(lat.prefill_time([median_prompt], tp) for tp, _ in configs) if configs else math.inf
        best_tpot = min(lat.decode_time(1, median_prompt, tp) for tp, _ in configs) if configs else math.inf
        return InfeasibleSLO(
            f"no configuration attains {c.slo.attainment * 100:.0f} % of requests within TTFT {c.slo.ttft * 1e3:.0f} ms and "
            f"TPOT {c.slo.tpot * 1e3:.0f} ms ({phase}) for {c.model.name} on {c.cluster.describe()}: an unloaded median "
            f"prompt alone takes {best_ttft * 1e3:.1f} ms to prefill and {best_tpot * 1e3:.1f} ms per decode step at best"
        )
