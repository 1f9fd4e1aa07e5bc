"""The workload monitor replans on a lasting shift, not on noise, and not twice within its cooldown."""

import numpy as np
import pytest

from aiollm.planner.replan import MonitorConfig, WorkloadMonitor


def feed(monitor, start, rate, n, prompt=500, output=200, seed=0):
    rng = np.random.default_rng(seed)
    t = start
    plans = []
    for _ in range(n):
        t += 1.0 / rate
        plan = monitor.observe(t, int(prompt * rng.uniform(0.95, 1.05)), output)
        if plan is not None:
            plans.append((t, plan))
    return t, plans


def test_replans_on_rate_shift_only():
    calls = []
    emitted = []
    monitor = WorkloadMonitor(
        MonitorConfig(window_s=20, min_requests=20, threshold=0.25, cooldown_s=5),
        replan=lambda stats: calls.append(stats) or f"plan@{stats.rate:.1f}",
        on_plan=lambda plan, stats: emitted.append(plan),
    )
    t, plans = feed(monitor, 0.0, rate=5.0, n=200)
    assert len(plans) == 1 and calls[0].rate == pytest.approx(5.0, rel=0.05)  # the first full window
    t, plans = feed(monitor, t, rate=5.0, n=200, seed=1)
    assert plans == []  # same rate, +-5 % lengths: below the threshold
    t, plans = feed(monitor, t, rate=10.0, n=400)
    assert len(plans) >= 1 and calls[-1].rate == pytest.approx(10.0, rel=0.1)
    assert emitted == [p for p in emitted if p.startswith("plan@")] and len(emitted) == len(calls)


def test_replans_on_length_shift_and_respects_cooldown():
    calls = []
    monitor = WorkloadMonitor(
        MonitorConfig(window_s=10, min_requests=10, threshold=0.3, cooldown_s=100),
        replan=lambda stats: calls.append(stats) or "p",
        on_plan=lambda plan, stats: None,
    )
    t, _ = feed(monitor, 0.0, rate=5.0, n=100)
    t, _ = feed(monitor, t, rate=5.0, n=100, prompt=2000)
    assert len(calls) == 1  # the shift came within the 100 s cooldown
    feed(monitor, t + 100, rate=5.0, n=100, prompt=2000)
    assert len(calls) == 2 and calls[-1].prompt_mean == pytest.approx(2000, rel=0.05)


def test_bad_observations_and_config():
    monitor = WorkloadMonitor(MonitorConfig(), replan=lambda s: None, on_plan=lambda p, s: None)
    with pytest.raises(ValueError):
        monitor.observe(0.0, 0, 10)
    with pytest.raises(ValueError):
        MonitorConfig(window_s=0)
