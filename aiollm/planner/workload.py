"""Workloads for the simulator: request lengths (sampled, fitted, resampled) and seeded arrivals.

Why separate lengths from arrivals: goodput search replays the same requests at many rates, so a
workload is a fixed sample of (prompt, output) lengths plus unit-rate inter-arrival gaps that are
divided by the rate; attainment then changes only because of the rate, not because of a new sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthSample:
    """Observed (prompt, output) token lengths of one dataset, paired per request."""

    name: str
    prompt: np.ndarray
    output: np.ndarray
    # How the lengths were obtained (dataset, tokenizer, filters): printed with every plan.
    provenance: str = ""

    def __post_init__(self) -> None:
        if len(self.prompt) == 0 or len(self.prompt) != len(self.output):
            raise ValueError(f"LengthSample {self.name}: need equal, non-empty prompt/output arrays")
        if (np.asarray(self.prompt) <= 0).any() or (np.asarray(self.output) <= 0).any():
            raise ValueError(f"LengthSample {self.name}: lengths must be > 0")

    def resample(self, n: int, seed: int = 0) -> LengthSample:
        """n requests drawn with replacement, keeping each prompt with its own output (their correlation)."""
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n}")
        idx = np.random.default_rng(seed).integers(0, len(self.prompt), n)
        return LengthSample(self.name, self.prompt[idx], self.output[idx], self.provenance)

    def fit_lognormal(self) -> LognormalLengths:
        """Log-normal fit of both lengths and their log-correlation (for synthetic variants)."""
        lp, lo = np.log(self.prompt), np.log(self.output)
        corr = float(np.corrcoef(lp, lo)[0, 1]) if len(lp) > 1 and lp.std() > 0 and lo.std() > 0 else 0.0
        return LognormalLengths(
            self.name,
            float(lp.mean()),
            float(lp.std()),
            float(lo.mean()),
            float(lo.std()),
            corr,
            int(self.prompt.max()),
            int(self.output.max()),
        )

    def summary(self) -> dict:
        return {
            "name": self.name,
            "requests": int(len(self.prompt)),
            "prompt_mean": float(self.prompt.mean()),
            "prompt_p50": float(np.median(self.prompt)),
            "output_mean": float(self.output.mean()),
            "output_p50": float(np.median(self.output)),
            "provenance": self.provenance,
        }


@dataclass(frozen=True)
class LognormalLengths:
    """A fitted length distribution: log-normal marginals with a correlation in log space."""

    name: str
    prompt_mu: float
    prompt_sigma: float
    output_mu: float
    output_sigma: float
    log_corr: float
    prompt_max: int
    output_max: int

    def sample(self, n: int, seed: int = 0) -> LengthSample:
        rng = np.random.default_rng(seed)
        z1 = rng.standard_normal(n)
        z2 = self.log_corr * z1 + np.sqrt(max(0.0, 1 - self.log_corr**2)) * rng.standard_normal(n)
        prompt = np.clip(np.rint(np.exp(self.prompt_mu + self.prompt_sigma * z1)), 1, self.prompt_max).astype(np.int64)
        output = np.clip(np.rint(np.exp(self.output_mu + self.output_sigma * z2)), 1, self.output_max).astype(np.int64)
        return LengthSample(self.name, prompt, output, f"log-normal fit of {self.name}")


def unit_arrivals(n: int, process: str = "poisson", burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival times of n requests at rate 1 req/s (divide by the rate to rescale).

    'poisson': exponential gaps. 'gamma': gamma gaps with shape = burstiness (vLLM's convention), so
    burstiness < 1 is burstier than Poisson and 1 is Poisson; the mean gap stays 1 s. 'constant': a
    request every second exactly (hand-checkable cases).
    """
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    rng = np.random.default_rng(seed)
    if process == "poisson":
        gaps = rng.exponential(1.0, n)
    elif process == "constant":
        gaps = np.ones(n)
    elif process == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(burstiness, 1.0 / burstiness, n)
    else:
        raise ValueError(f"arrival process {process!r}: expected 'poisson', 'gamma' or 'constant'")
    return np.cumsum(gaps)


@dataclass(frozen=True)
class Workload:
    """n requests: lengths and unit-rate arrival times; `at(rate)` gives the arrival times at a rate."""

    lengths: LengthSample
    unit_times: np.ndarray
    # How unit_times were drawn (so `longer` can draw more of the same stream).
    process: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.unit_times) != len(self.lengths.prompt):
            raise ValueError("Workload: one arrival time per request")

    @classmethod
    def build(
        cls, lengths: LengthSample, n: int, seed: int = 0, process: str = "poisson", burstiness: float = 1.0
    ) -> Workload:
        return cls(
            lengths.resample(n, seed), unit_arrivals(n, process, burstiness, seed + 1), process, burstiness, seed
        )

    def longer(self, n: int) -> Workload:
        """At least n requests: this sample repeated cyclically, arrivals continuing the same seeded
        stream (numpy's generator yields the same prefix for a longer draw). Used so that a simulation
        at a high rate still spans several request lifetimes and an overload cannot hide in a short burst."""
        if n <= len(self):
            return self
        idx = np.arange(n) % len(self)
        lengths = LengthSample(self.lengths.name, self.prompt[idx], self.output[idx], self.lengths.provenance)
        return Workload(
            lengths,
            unit_arrivals(n, self.process, self.burstiness, self.seed + 1),
            self.process,
            self.burstiness,
            self.seed,
        )

    @property
    def prompt(self) -> np.ndarray:
        return self.lengths.prompt

    @property
    def output(self) -> np.ndarray:
        return self.lengths.output

    def __len__(self) -> int:
        return len(self.unit_times)

    def at(self, rate: float) -> np.ndarray:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        return self.unit_times / rate


def summarisation_lengths(n: int = 2000, seed: int = 0, max_context: int = 2048) -> LengthSample:
    """Synthetic long-prompt summarisation profile (documents in, short summaries out), shaped after
    LongBench's summarisation tasks as DistServe used them, but cut to fit a 2k-context model:
    prompt ~ normal(mean 1500, sd 250) clipped to [600, max_context-201]; output ~ log-normal
    (median 110, sigma 0.5) clipped to [16, 200]. Synthetic: no dataset is downloaded."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.rint(rng.normal(1500, 250, n)), 600, max_context - 201).astype(np.int64)
    output = np.clip(np.rint(np.exp(rng.normal(np.log(110), 0.5, n))), 16, 200).astype(np.int64)
    return LengthSample(
        "summarisation",
        prompt,
        output,
        "synthetic long-prompt summarisation (normal 1500+-250 prompts, ~110-token summaries)",
    )
