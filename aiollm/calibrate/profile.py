"""`python -m aiollm.plan profile`: measure this machine's prefill and decode step times for the bundled
model and fit the latency model's coefficients to them.

Why measure whole steps through aiollm.model (not a micro-benchmark): the planner simulates whole
prefill iterations and decode steps, so the profile is exactly those: `model.prefill` on packed prompts,
and a decode step of every layer's S-part plus paged attention over a KV pool (aiollm.kv) at a given
batch and context. The fitted points are stored with the coefficients, so the fit can be checked.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from aiollm.planner.latency import fit_decode, fit_prefill
from aiollm.planner.profiles import LOCAL_FORMAT, LOCAL_PROFILE

# Single prompts cover the lengths served (their points also build the piecewise table, see
# profiles.load_local); multi-prompt batches check the sum-of-squares term.
PREFILL_GRID = [(1, 32), (1, 64), (1, 128), (1, 256), (1, 512), (1, 1024), (4, 128), (4, 256), (2, 512), (8, 128)]
# Small batches densely: on a CPU the step time is far from linear in the batch below ~8.
DECODE_GRID = [
    (1, 128),
    (1, 1024),
    (2, 256),
    (4, 256),
    (8, 256),
    (8, 1024),
    (16, 256),
    (32, 256),
    (32, 1024),
    (64, 512),
    (128, 256),
]
QUICK_PREFILL = [(1, 32), (1, 256), (2, 256), (4, 64)]
QUICK_DECODE = [(1, 128), (8, 256), (32, 128), (16, 512)]


def measure_profile(
    model_name: str = "smollm2",
    out: Path | None = None,
    quick: bool = False,
    dtype: str = "fp32",
    kv_dtype: str = "fp32",
    threads: int = 1,
) -> Path:
    """Measure, fit, and write the profile JSON; returns its path. The defaults match one serving
    instance (`python -m aiollm.node --role prefill|decode`: fp32 weights and KV, one thread)."""
    try:
        import torch

        from aiollm import model as aiollm_model
        from aiollm.kv.pool import KVConfig, KVPool
        from aiollm.model.attention import paged_decode_attention
    except ImportError as exc:
        raise ImportError(f"`profile` needs aiollm.model and aiollm.kv (not importable: {exc})") from None
    torch.set_num_threads(threads)
    model = aiollm_model.load(model_name, dtype=dtype)
    c = model.config
    prefill_pts, decode_pts = [], []
    with torch.inference_mode():
        for batch, length in QUICK_PREFILL if quick else PREFILL_GRID:
            prompts = [list(np.random.default_rng(i).integers(0, c.vocab, length)) for i in range(batch)]
            seconds = _best_of(lambda: model.prefill(prompts))
            prefill_pts.append({"batch": batch, "length": length, "seconds": seconds})
        for batch, ctx in QUICK_DECODE if quick else DECODE_GRID:
            block = 16
            per_seq = -(-(ctx + 1) // block)
            pool = KVPool(KVConfig.for_model(c, batch * per_seq, block, kv_dtype))
            tables = torch.arange(batch * per_seq, dtype=torch.int32).reshape(batch, per_seq)
            lens = torch.full((batch,), ctx + 1, dtype=torch.int32)
            slots = tables[:, ctx // block].long() * block + ctx % block
            ids = torch.randint(0, c.vocab, (batch,))
            positions = torch.full((batch,), ctx)

            def step():
                h = model.embed(ids)
                rope = model.rope(positions)
                for layer in range(c.n_layers):
                    q, k, v = model.pre_attention(layer, h, positions, rope)
                    o = paged_decode_attention(pool, layer, q, k, v, slots, tables, lens, n_threads=threads)
                    h = model.post_attention(layer, h, o)
                model.logits(h)

            decode_pts.append({"batch": batch, "context": ctx, "seconds": _best_of(step)})
    a, b, cc = fit_prefill(
        [p["batch"] * p["length"] for p in prefill_pts],
        [p["batch"] * p["length"] ** 2 for p in prefill_pts],
        [p["seconds"] for p in prefill_pts],
    )
    d, e, f = fit_decode(
        [p["batch"] for p in decode_pts],
        [p["batch"] * (p["context"] + 1) for p in decode_pts],
        [p["seconds"] for p in decode_pts],
    )
    prefill_err = max(
        abs(a + b * p["batch"] * p["length"] + cc * p["batch"] * p["length"] ** 2 - p["seconds"]) / p["seconds"]
        for p in prefill_pts
    )
    decode_err = max(
        abs(d + e * p["batch"] + f * p["batch"] * (p["context"] + 1) - p["seconds"]) / p["seconds"] for p in decode_pts
    )
    hardware = f"{_cpu_name()} ({os.cpu_count()} cores, {threads} thread(s), {dtype} weights, {kv_dtype} KV)"
    path = Path(out) if out else LOCAL_PROFILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": LOCAL_FORMAT,
        "hardware": hardware,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "models": {
            _planner_name(model_name): {
                "prefill": [a, b, cc],
                "decode": [d, e, f],
                "prefill_points": prefill_pts,
                "decode_points": decode_pts,
                "max_relative_error": {"prefill": prefill_err, "decode": decode_err},
                **model_size(c, dtype, kv_dtype),
            }
        },
    }
    path.write_text(json.dumps(data, indent=2))
    return path


def model_size(config, dtype: str, kv_dtype: str) -> dict[str, float]:
    """The profiled model's size, stored beside its coefficients: the weights in `dtype` and the KV per token in
    `kv_dtype` (aiollm.model.size), in bytes."""
    from aiollm.model.size import kv_bytes_per_token, weights_bytes

    return {"weights_bytes": weights_bytes(config, dtype), "kv_bytes_per_token": kv_bytes_per_token(config, kv_dtype)}


def _best_of(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _planner_name(name: str) -> str:
    from aiollm.planner.models import get_model

    return get_model(name).name


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
