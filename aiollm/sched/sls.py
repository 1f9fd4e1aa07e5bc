"""FastDecode's sequence-level load-stabilising schedule (Algorithm 1), as pure bookkeeping.

Why: the R-part's cost at a decode step is proportional to the total number of KV tokens the
active sequences hold (the *workload* W). If a whole batch of B sequences starts together, W
climbs from ~0 to B*S over S steps and then collapses: the R-workers are idle early and the
critical path late. Starting micro-batches of M = B*F/S sequences every F steps keeps sequences
at staggered ages, so W stays near its mean and peaks at B*(S+F)/2 instead of B*S.

`LoadSchedule` keeps the predicted W for every future step. `earliest_step` is GETEARLIESTSTEP:
the first F-aligned step, not yet used by another micro-batch, at which adding the micro-batch keeps
W under the limit W_lim over its whole life; `add_micro_batch` is ADDMICROBATCH. No I/O and no
clock: the caller passes step numbers, so the same code runs in the S-worker and in simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aiollm.errors import require_positive


@dataclass(frozen=True)
class SLSConfig:
    """Sizing of the load-stabilising schedule."""

    # B: the most sequences decoding at once.
    batch_size: int
    # S: the sequence length (prompt + generated tokens) the schedule plans for.
    seq_len: int
    # F: steps between two micro-batch starts.
    interval: int
    # W_lim: the most KV tokens the R-side may hold at any step; None means B*(S+F)/2.
    workload_limit: int | None = None

    def __post_init__(self) -> None:
        require_positive(self, "batch_size", "seq_len", "interval")
        if self.interval > self.seq_len:
            raise ValueError(f"SLSConfig.interval ({self.interval}) must be <= seq_len ({self.seq_len})")
        if self.workload_limit is not None and self.workload_limit <= 0:
            raise ValueError(f"SLSConfig.workload_limit must be > 0, got {self.workload_limit}")

    @property
    def micro_batch_size(self) -> int:
        """M = B*F/S, at least 1: the sequences that start together."""
        return max(1, math.ceil(self.batch_size * self.interval / self.seq_len))

    @property
    def limit(self) -> int:
        """W_lim in KV tokens: the configured one, or the paper's steady-state peak B*(S+F)/2."""
        if self.workload_limit is not None:
            return self.workload_limit
        return math.ceil(self.batch_size * (self.seq_len + self.interval) / 2)


def sequence_load(prompt_len: int, max_len: int) -> np.ndarray:
    """Predicted KV tokens one sequence holds at each of its decode steps (prompt, then +1 a step)."""
    if not 0 < prompt_len < max_len:
        raise ValueError(f"need 0 < prompt_len < max_len, got prompt_len={prompt_len}, max_len={max_len}")
    return np.arange(prompt_len + 1, max_len + 1, dtype=np.int64)


class LoadSchedule:
    """Predicted per-step R-side workload, and the micro-batch admission rule over it."""

    def __init__(self, config: SLSConfig) -> None:
        self.config = config
        # load[i] is the predicted workload at absolute step base + i.
        self._base = 0
        self._load = np.zeros(4 * config.seq_len, dtype=np.int64)
        self._used_slots: set[int] = set()

    def load_at(self, step: int) -> int:
        """Predicted workload (KV tokens) at `step`."""
        i = step - self._base
        return int(self._load[i]) if 0 <= i < len(self._load) else 0

    def peak(self) -> int:
        """Highest predicted workload at any future step."""
        return int(self._load.max(initial=0))

    def micro_batch_load(self, prompt_lens: Sequence[int], max_lens: Sequence[int]) -> np.ndarray:
        """Summed per-step load of a micro-batch whose sequences all start at the same step."""
        if len(prompt_lens) != len(max_lens) or not prompt_lens:
            raise ValueError(
                f"need equal, non-empty prompt_lens and max_lens, got {len(prompt_lens)} and {len(max_lens)}"
            )
        profile = np.zeros(max(m - p for p, m in zip(prompt_lens, max_lens)), dtype=np.int64)
        for p, m in zip(prompt_lens, max_lens):
            seq = sequence_load(p, m)
            profile[: len(seq)] += seq
        return profile

    def earliest_step(self, profile: np.ndarray, not_before: int) -> int:
        """GETEARLIESTSTEP: the first free F-aligned step >= not_before where `profile` fits under W_lim."""
        limit = self.config.limit
        if int(profile.max(initial=0)) > limit:
            raise ValueError(f"micro-batch peak load {int(profile.max())} alone exceeds W_lim={limit}")
        interval = self.config.interval
        step = max(not_before, self._base)
        step = -(-step // interval) * interval
        while True:
            if step not in self._used_slots and self._fits(profile, step, limit):
                return step
            step += interval

    def add_micro_batch(self, profile: np.ndarray, start: int) -> None:
        """ADDMICROBATCH: account for a micro-batch starting at `start`."""
        if start < self._base:
            raise ValueError(f"start step {start} is in the past (now {self._base})")
        self._used_slots.add(start)
        self._add(profile, start, +1)

    def remove_sequence(self, prompt_len: int, max_len: int, start: int, finished_at: int) -> None:
        """Give back the load a sequence would have held after it finished early (EOS, stop string)."""
        seq = sequence_load(prompt_len, max_len)
        done = finished_at - start + 1
        if done < len(seq):
            self._add(seq[done:], start + done, -1)

    def advance(self, now: int) -> None:
        """Forget every step before `now`."""
        shift = now - self._base
        if shift <= 0:
            return
        self._load = np.concatenate([self._load[shift:], np.zeros(min(shift, len(self._load)), dtype=np.int64)])[
            : len(self._load)
        ]
        self._base = now
        self._used_slots = {s for s in self._used_slots if s >= now}

    def _fits(self, profile: np.ndarray, start: int, limit: int) -> bool:
        i = start - self._base
        window = self._load[i : i + len(profile)] if i < len(self._load) else self._load[:0]
        head = profile[: len(window)]
        return bool(np.all(window + head <= limit)) and bool(np.all(profile[len(window) :] <= limit))

    def _add(self, profile: np.ndarray, start: int, sign: int) -> None:
        i = start - self._base
        end = i + len(profile)
        if end > len(self._load):
            self._load = np.concatenate([self._load, np.zeros(end - len(self._load), dtype=np.int64)])
        self._load[i:end] += sign * profile
