"""FastDecode's load-stabilising schedule: the paper's peak workload B*(S+F)/2 vs B*S without it."""

import numpy as np
import pytest

from aiollm.sched.sls import LoadSchedule, SLSConfig, sequence_load

B, S, F = 64, 256, 32


def _run(steps: int, use_sls: bool, prompt_len: int = 1) -> np.ndarray:
    """Per-step workload of an always-full queue: with SLS by micro-batches, without by whole batches."""
    config = SLSConfig(batch_size=B, seq_len=S, interval=F)
    schedule = LoadSchedule(config)
    workload = np.zeros(steps, dtype=np.int64)
    ends: list[int] = []  # finish step of each active sequence
    next_start = 0
    for step in range(steps):
        if use_sls:
            while next_start <= step + S:  # keep the plan S steps ahead, as a full queue would
                profile = schedule.micro_batch_load(
                    [prompt_len] * config.micro_batch_size, [S] * config.micro_batch_size
                )
                start = schedule.earliest_step(profile, not_before=next_start)
                schedule.add_micro_batch(profile, start)
                workload[start : start + len(profile)] += profile[: max(0, steps - start)]
                next_start = start + 1
        else:
            ends = [e for e in ends if e > step]
            if not ends:  # the whole batch finished together: start the next one
                seq = sequence_load(prompt_len, S)
                workload[step : step + len(seq)] += B * seq[: max(0, steps - step)]
                ends = [step + len(seq)] * B
    return workload


def test_sls_peak_matches_paper_and_halves_the_unscheduled_peak():
    with_sls = _run(6 * S, use_sls=True)
    without = _run(6 * S, use_sls=False)
    steady = slice(2 * S, 5 * S)
    assert without[steady].max() == B * S
    expected = B * (S + F) / 2
    assert with_sls[steady].max() <= expected
    assert with_sls[steady].max() >= 0.95 * expected
    # Flat: the steady-state load stays within F/S of its peak, while the unscheduled one swings to ~0.
    assert with_sls[steady].min() >= with_sls[steady].max() * (1 - 2 * F / S)
    assert without[steady].min() <= B * 2


def test_micro_batches_start_every_f_steps_in_steady_state():
    config = SLSConfig(batch_size=B, seq_len=S, interval=F)
    schedule = LoadSchedule(config)
    profile = schedule.micro_batch_load([1] * config.micro_batch_size, [S] * config.micro_batch_size)
    starts = []
    for _ in range(3 * S // F):
        start = schedule.earliest_step(profile, not_before=starts[-1] + 1 if starts else 0)
        schedule.add_micro_batch(profile, start)
        starts.append(start)
    gaps = np.diff(starts)
    assert set(gaps.tolist()) == {F}
    assert config.micro_batch_size == B * F // S


def test_early_finish_frees_future_load_and_admits_sooner():
    config = SLSConfig(batch_size=4, seq_len=16, interval=4, workload_limit=16)
    schedule = LoadSchedule(config)
    profile = schedule.micro_batch_load([1], [16])
    schedule.add_micro_batch(profile, 0)
    other = schedule.micro_batch_load([8], [16])  # holds 9..16 tokens: cannot overlap the first
    assert schedule.earliest_step(other, not_before=0) == 16
    schedule.remove_sequence(1, 16, start=0, finished_at=3)
    assert schedule.earliest_step(other, not_before=0) == 4
    schedule.advance(4)
    assert schedule.load_at(3) == 0 and schedule.peak() == 0


def test_bad_configs_and_inputs_name_the_field():
    with pytest.raises(ValueError, match="batch_size"):
        SLSConfig(batch_size=0, seq_len=8, interval=2)
    with pytest.raises(ValueError, match="interval"):
        SLSConfig(batch_size=4, seq_len=8, interval=9)
    with pytest.raises(ValueError, match="prompt_len"):
        sequence_load(8, 8)
    schedule = LoadSchedule(SLSConfig(batch_size=2, seq_len=8, interval=2, workload_limit=4))
    with pytest.raises(ValueError, match="exceeds W_lim"):
        schedule.earliest_step(schedule.micro_batch_load([1], [8]), not_before=0)
