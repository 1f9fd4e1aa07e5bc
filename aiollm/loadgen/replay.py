"""Client side of the serving benchmark: replay timed requests through the openai client and
turn what each one saw into TTFT/TPOT percentiles, SLO attainment and goodput.

Why token-id prompts and `ignore_eos`: every request then has exactly its dataset's prompt and
output lengths, so disaggregated and colocated runs do the same work (vLLM's bench does the same).
TTFT is arrival to the first streamed text; TPOT is (last - first) / (tokens - 1), DistServe's
definition; a request meets the SLO when both are under their limits.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np
import openai


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""


async def _one(client: openai.AsyncOpenAI, model: str, request: BenchRequest) -> RequestResult:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt_ids,
            max_tokens=request.output_len,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason):
                first = first or now
                last = now
    except openai.APIError as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    if first is None:
        return RequestResult(False, error="no tokens")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return RequestResult(True, first - start, tpot, last - start, tokens)


async def run_rate(
    base_url: str, model: str, requests: list[BenchRequest], arrivals: np.ndarray, timeout: float = 600.0
) -> tuple[list[RequestResult], float]:
    """Send request i at arrivals[i] seconds after the start; returns the results and the wall time."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=timeout)
    start = time.perf_counter()

    async def timed(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + float(arrivals[i]) - time.perf_counter()))
        return await _one(client, model, requests[i])

    try:
        results = await asyncio.gather(*(timed(i) for i in range(len(requests))))
    finally:
        await client.close()
    return list(results), time.perf_counter() - start


def summarise(results: list[RequestResult], duration: float, ttft_slo: float, tpot_slo: float) -> dict:
    """Percentiles in ms, SLO attainment (share of all requests), and goodput (good requests/s)."""
    ok = [r for r in results if r.ok]
    out: dict = {"requests": len(results), "failed": len(results) - len(ok), "duration_s": duration}
    for name in ("ttft", "tpot", "e2e"):
        values = np.array([getattr(r, name) for r in ok]) * 1e3
        for p in (50, 90, 99):
            out[f"{name}_p{p}_ms"] = float(np.percentile(values, p)) if len(values) else float("nan")
    good = sum(1 for r in ok if r.ttft <= ttft_slo and r.tpot <= tpot_slo)
    out["attainment"] = good / len(results) if results else 0.0
    out["attainment_ttft"] = sum(1 for r in ok if r.ttft <= ttft_slo) / max(1, len(results))
    out["attainment_tpot"] = sum(1 for r in ok if r.tpot <= tpot_slo) / max(1, len(results))
    out["goodput_rps"] = good / duration if duration > 0 else 0.0
    out["output_tokens_per_s"] = sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0
    return out


def max_rate_at(rates: list[float], attainments: list[float], target: float = 0.9) -> float:
    """DistServe's goodput: the highest rate whose attainment is >= target, interpolated linearly
    between the last rate that meets it and the next that does not; 0 if the lowest rate misses."""
    pairs = sorted(zip(rates, attainments))
    best = 0.0
    for (r0, a0), (r1, a1) in zip(pairs, pairs[1:] + [(None, None)]):
        if a0 < target:
            break
        best = r0
        if r1 is not None and a1 < target:
            best = r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
            break
    return best


def p90_tpot(results: list[RequestResult]) -> float:
    """The TPOT (s) that 90 % of the requests meet (a failed request meets none): the SLO at which
    these results attain exactly 90 % (the bench's rule for picking the TPOT SLO)."""
    values = sorted(r.tpot if r.ok else float("inf") for r in results)
    return values[max(0, math.ceil(0.9 * len(values)) - 1)] if values else float("inf")


def attainment(results: list[RequestResult], ttft_slo: float, tpot_slo: float) -> float:
    return sum(1 for r in results if r.ok and r.ttft <= ttft_slo and r.tpot <= tpot_slo) / max(1, len(results))


def goodput_ratio(
    runs: dict[str, dict[float, list[RequestResult]]], ttft_slo: float, tpot_slo: float | None, target: float = 0.9
) -> tuple[float | None, float, dict[str, float]]:
    """(disaggregated / colocated goodput, the TPOT SLO used, each setup's goodput) over the same rates.

    `tpot_slo` None applies the rule: the colocated setup's p90 TPOT at the lowest rate, i.e. the TPOT
    SLO at which colocated attains 90 % there. The ratio is None when colocated's goodput is 0."""
    if tpot_slo is None:
        colocated = runs["colocated"]
        tpot_slo = p90_tpot(colocated[min(colocated)])
    goodput = {
        setup: max_rate_at(list(by_rate), [attainment(r, ttft_slo, tpot_slo) for r in by_rate.values()], target)
        for setup, by_rate in runs.items()
    }
    ratio = goodput["disaggregated"] / goodput["colocated"] if goodput["colocated"] > 0 else None
    return ratio, tpot_slo, goodput


def bootstrap_ratio(
    runs: dict[str, dict[float, list[RequestResult]]],
    ttft_slo: float,
    tpot_slo: float | None,
    samples: int = 400,
    seed: int = 0,
) -> tuple[float, float]:
    """10th and 90th percentile of the ratio over resampled requests (each run's requests drawn with
    replacement, the SLO rule applied again to each draw): the sampling noise of the ratio. A draw
    with no finite ratio counts as 0."""
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(samples):
        drawn = {
            setup: {
                rate: [results[i] for i in rng.integers(0, len(results), len(results))]
                for rate, results in by_rate.items()
            }
            for setup, by_rate in runs.items()
        }
        ratio, _, _ = goodput_ratio(drawn, ttft_slo, tpot_slo)
        ratios.append(ratio or 0.0)
    return float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))
