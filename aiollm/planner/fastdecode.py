"""FastDecode sizing: the batch B and R-worker count P from the S-part step time T(B) and the R-part cost R.

Why P ~= B*S*R / (2*T(B)): under the load-stabilising schedule the B sequences are spread evenly over
lengths 0..S, so a step's attention reads about B*S/2 context tokens, B*S*R/2 seconds of R-part work split
over P R-workers. With the two-minibatch pipeline the R-part of one half overlaps the S-part of the other,
so neither side waits when the R time per step equals the S time T(B): B*S*R / (2*P) = T(B).
B itself is the largest batch whose T(B) meets the latency target, or, without one, the smallest batch that
reaches 90 % of the best measured S-part throughput B/T(B) (past it, more batch adds latency, not tokens/s).
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

THROUGHPUT_KNEE = 0.9


@dataclass(frozen=True)
class Sizing:
    """The chosen batch and R-worker count, with the inputs and the reasoning."""

    batch: int
    t_of_b: float
    r_per_token: float
    seq_len: int
    workers_exact: float
    workers: int
    tokens_per_s: float
    reasoning: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        return "\n".join(self.reasoning + [f"=> B = {self.batch}, P = {self.workers} R-workers "
                                           f"(exact {self.workers_exact:.3g}), ~{self.tokens_per_s:.0f} tokens/s"])


def interpolate(curve: dict[int, float], batch: float) -> float:
    """T(B) by linear interpolation between measured batches (linear extrapolation beyond them)."""
    bs = np.array(sorted(curve), dtype=np.float64)
    ts = np.array([curve[int(b)] for b in bs])
    if len(bs) == 1:
        return float(ts[0] * max(batch, 1) / bs[0])
    if batch > bs[-1]:
        slope = (ts[-1] - ts[-2]) / (bs[-1] - bs[-2])
        return float(ts[-1] + slope * (batch - bs[-1]))
    return float(np.interp(batch, bs, ts))


def size(t_of_b: dict[int, float], r_per_token: float, seq_len: int, latency_target: float | None = None) -> Sizing:
    """Pick B from the measured T(B) curve, then P = B*S*R / (2*T(B))."""
    if not t_of_b or any(b <= 0 or t <= 0 for b, t in t_of_b.items()):
        raise ValueError("t_of_b: need measured {batch: seconds} with positive values")
    if r_per_token <= 0 or seq_len <= 0:
        raise ValueError(f"r_per_token and seq_len must be > 0, got {r_per_token}, {seq_len}")
    batches = sorted(t_of_b)
    lines = ["T(B), the S-part step time measured per batch size: " +
             ", ".join(f"T({b})={t_of_b[b]*1e3:.2f} ms" for b in batches),
             f"R, attention time per context token on one R-worker: {r_per_token*1e9:.2f} ns; S = {seq_len} tokens"]
    if latency_target is not None:
        if latency_target <= 0:
            raise ValueError(f"latency_target must be > 0, got {latency_target}")
        fitting = [b for b in range(1, 2 * batches[-1] + 1) if interpolate(t_of_b, b) <= latency_target]
        if not fitting:
            raise ValueError(f"latency target {latency_target*1e3:.1f} ms is below T(1) = "
                             f"{interpolate(t_of_b, 1)*1e3:.2f} ms: no batch meets it")
        batch = fitting[-1]
        lines.append(f"B = {batch}: the largest batch whose S-part step T(B) stays within the "
                     f"{latency_target*1e3:.1f} ms target (the two-minibatch pipeline keeps the step at ~T(B))")
    else:
        throughput = {b: b / t_of_b[b] for b in batches}
        best = max(throughput.values())
        batch = min(b for b in batches if throughput[b] >= THROUGHPUT_KNEE * best)
        lines.append(f"B = {batch}: the smallest measured batch reaching {THROUGHPUT_KNEE*100:.0f} % of the best "
                     f"S-part throughput ({best:.0f} sequences/s); larger batches add latency, not throughput")
    t = interpolate(t_of_b, batch)
    exact = batch * seq_len * r_per_token / (2 * t)
    workers = max(1, math.ceil(exact - 1e-9))
    lines.append(f"P = B*S*R / (2*T(B)) = {batch}*{seq_len}*{r_per_token:.3e} / (2*{t:.4f}) = {exact:.3g}: "
                 f"a step's attention covers ~B*S/2 tokens (lengths spread over 0..S), which P R-workers finish in T(B)")
    return Sizing(batch, t, r_per_token, seq_len, exact, workers, batch / t, lines)


def read_t_of_b(path: str | Path, key: str = "t_of_b") -> dict[int, float]:
    """T(B) from `python -m bench model --json` output: under `key` (`t_of_b` for fp32, `t_of_b_bf16`...),
    [{"batch": B, "seconds": T}, ...] as bench model writes it, or {B: T}, or [[B, T], ...]."""
    data = json.loads(Path(path).read_text())
    if key not in data:
        raise ValueError(f"{path}: no key {key!r} (expected the JSON of `python -m bench model --json`)")
    raw = data[key]
    if isinstance(raw, dict):
        return {int(b): float(t) for b, t in raw.items()}
    if raw and isinstance(raw[0], dict):
        return {int(row["batch"]): float(row["seconds"]) for row in raw}
    return {int(b): float(t) for b, t in raw}


def measure_t_of_b(model_name: str, batches: str | list[int], repeats: int = 3) -> dict[int, float]:
    """S-part step time (every layer's dense work and the logits, no attention) per batch size."""
    torch, model = _load_model(model_name)
    sizes = [int(b) for b in batches.split(",")] if isinstance(batches, str) else list(batches)
    out = {}
    c = model.config
    with torch.inference_mode():
        for batch in sizes:
            ids = torch.randint(0, c.vocab, (batch,))
            positions = torch.full((batch,), 100)
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                h = model.embed(ids)
                rope = model.rope(positions)
                for layer in range(c.n_layers):
                    q, _, _ = model.pre_attention(layer, h, positions, rope)
                    h = model.post_attention(layer, h, q)
                model.logits(h)
                best = min(best, time.perf_counter() - start)
            out[batch] = best
    return out


def measure_r(model_name: str, seq_len: int, batch: int = 16, repeats: int = 3) -> float:
    """Seconds of decode attention per context token (all layers) on one R-worker, via aiollm.kv."""
    try:
        from aiollm.kv.pool import KVConfig, KVPool
    except ImportError as exc:
        raise ImportError(f"measuring R needs aiollm.kv (not importable: {exc}); pass --r-per-token instead") from None
    torch, model = _load_model(model_name)
    c = model.config
    block = 16
    per_seq = -(-(seq_len + 1) // block)
    pool = KVPool(KVConfig(n_layers=c.n_layers, n_blocks=batch * per_seq, n_kv_heads=c.n_kv_heads,
                           head_dim=c.head_dim, block_size=block, dtype="fp16"))
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    lens = np.full(batch, seq_len, dtype=np.int32)
    q = np.random.default_rng(0).standard_normal((batch, c.n_heads, c.head_dim)).astype(np.float32)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(c.n_layers):
            pool.attend(layer, q, tables, lens)
        best = min(best, time.perf_counter() - start)
    return best / (batch * seq_len)


@functools.lru_cache(maxsize=1)
def _load_model(name: str):
    """The model once per process (T(B) and R are measured on the same one)."""
    try:
        import torch

        from aiollm import model as aiollm_model
        return torch, aiollm_model.load(name, dtype="bf16")
    except ImportError as exc:
        raise ImportError(f"measuring needs aiollm.model (not importable: {exc}); pass --t-of-b PATH instead") from None
