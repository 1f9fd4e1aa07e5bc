"""Replanning: watch the recent workload and re-run placement when it drifts.

Why a sliding window with a relative threshold and a cooldown: the best placement depends on the
request rate and the prompt/output lengths; small fluctuations should not move instances around (a
replan costs a KV drain and restarts), but a lasting shift (rate +50 %, prompts twice as long) should.
Time is passed in by the caller (the controller's clock, or a test's), never read here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from aiollm.planner.placement import PlacementConfig, Plan, Planner
from aiollm.planner.workload import LengthSample, Workload


@dataclass(frozen=True)
class MonitorConfig:
    """When the monitor replans."""

    # Seconds of recent requests the statistics cover.
    window_s: float = 60.0
    # No decision before the window holds this many requests.
    min_requests: int = 50
    # Relative change of the rate, mean prompt or mean output length (vs the last plan's) that triggers a replan.
    threshold: float = 0.25
    # Seconds after a replan during which no other replan happens.
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.min_requests <= 0 or self.threshold <= 0 or self.cooldown_s < 0:
            raise ValueError("MonitorConfig: window_s, min_requests, threshold must be > 0 and cooldown_s >= 0")


@dataclass(frozen=True)
class WorkloadStats:
    """The window's workload: arrival rate, mean lengths, and the requests themselves."""

    rate: float
    prompt_mean: float
    output_mean: float
    requests: int
    prompt: np.ndarray
    output: np.ndarray

    def drift(self, other: WorkloadStats) -> float:
        """Largest relative change of rate, mean prompt and mean output from `other`."""
        pairs = ((self.rate, other.rate), (self.prompt_mean, other.prompt_mean), (self.output_mean, other.output_mean))
        return max(abs(a - b) / b for a, b in pairs if b > 0)


class WorkloadMonitor:
    """Feed it every finished request; it calls `replan(stats)` and then `on_plan(plan, stats)` on drift."""

    def __init__(
        self,
        config: MonitorConfig,
        replan: Callable[[WorkloadStats], Plan],
        on_plan: Callable[[Plan, WorkloadStats], None],
    ) -> None:
        self.config = config
        self._replan = replan
        self._on_plan = on_plan
        self._window: deque[tuple[float, int, int]] = deque()
        self.baseline: WorkloadStats | None = None
        self._last_replan = -np.inf
        self._latest = -np.inf

    def observe(self, arrival_time: float, prompt_len: int, output_len: int) -> Plan | None:
        """Record one request (arrival time on the caller's clock); returns the new plan if it replanned."""
        if prompt_len <= 0 or output_len <= 0:
            raise ValueError(f"prompt_len and output_len must be > 0, got {prompt_len}, {output_len}")
        self._window.append((arrival_time, prompt_len, output_len))
        # requests are observed as they finish, so arrivals come out of order: the window is the latest one's
        self._latest = max(self._latest, arrival_time)
        self._window = deque(w for w in self._window if w[0] >= self._latest - self.config.window_s)
        stats = self.stats()
        if stats is None or self._latest - self._last_replan < self.config.cooldown_s:
            return None
        if self.baseline is not None and stats.drift(self.baseline) <= self.config.threshold:
            return None
        plan = self._replan(stats)
        self.baseline = stats
        self._last_replan = self._latest
        self._on_plan(plan, stats)
        return plan

    def stats(self) -> WorkloadStats | None:
        """Statistics of the current window, None while it holds fewer than min_requests."""
        if len(self._window) < self.config.min_requests:
            return None
        times = np.array([w[0] for w in self._window])
        prompt = np.array([w[1] for w in self._window])
        output = np.array([w[2] for w in self._window])
        span = times.max() - times.min()
        rate = (len(times) - 1) / span if span > 0 else float("inf")
        return WorkloadStats(rate, float(prompt.mean()), float(output.mean()), len(times), prompt, output)


def placement_replanner(base: PlacementConfig, requests: int = 300, seed: int = 0) -> Callable[[WorkloadStats], Plan]:
    """A `replan` callable: the base placement config, sized for the window's rate, simulated on the
    window's own (prompt, output) pairs resampled to `requests` requests."""

    def replan(stats: WorkloadStats) -> Plan:
        lengths = LengthSample("observed", stats.prompt, stats.output, f"last {stats.requests} requests")
        workload = Workload.build(lengths, requests, seed)
        return Planner(replace(base, rate=stats.rate), workload).plan()

    return replan
