"""The noise of the simulator-vs-real check: standard errors and confidence intervals of an attainment
difference over the same requests, the per-request errors of the simulated times, and the plot.

Why two standard errors: the per-request (paired, McNemar-like) s.e. treats requests as independent, but
requests close in time share a queue, so their outcomes are correlated; the batch-means s.e. (the
differences averaged over consecutive blocks of requests, the s.d. of the block means over sqrt(blocks))
keeps that correlation inside each block. The larger of the two is used for the interval.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

# consecutive blocks of requests (in arrival order) per pass for the batch-means standard error
BLOCKS = 10
# two-sided 95 % normal quantile
Z95 = 1.96


def batch_means_se(diffs: list[np.ndarray], blocks: int = BLOCKS) -> float:
    """S.e. (points) of the mean difference from block means: each array (one pass, arrival order) is cut into
    `blocks` consecutive blocks; the s.e. is the s.d. of all block means over sqrt(their count)."""
    means = [
        float(np.mean(b)) for d in diffs for b in np.array_split(np.asarray(d, dtype=np.float64), blocks) if len(b)
    ]
    if len(means) < 2:
        return float("nan")
    return float(np.std(means, ddof=1) / math.sqrt(len(means))) * 100


def difference(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    """Mean of a - b over the same requests of one or more passes (points), its two standard errors and the
    95 % interval on the larger."""
    d = [np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64) for x, y in zip(a, b)]
    flat = np.concatenate(d)
    paired = math.sqrt(max(0.0, float(np.var(flat))) / len(flat)) * 100
    blocked = batch_means_se(d)
    se = max(paired, blocked) if np.isfinite(blocked) else paired
    mean = float(flat.mean()) * 100
    return {
        "diff": mean,
        "paired_se": paired,
        "batch_se": blocked,
        "se": se,
        "ci95": (mean - Z95 * se, mean + Z95 * se),
    }


def request_errors(sim: np.ndarray, real: np.ndarray) -> dict:
    """Simulated minus measured time of the same requests (ms): median (the bias), median |error|, p90 |error|."""
    sim, real = np.asarray(sim, dtype=np.float64), np.asarray(real, dtype=np.float64)
    keep = np.isfinite(sim) & np.isfinite(real)
    err = (sim[keep] - real[keep]) * 1e3
    if not len(err):
        return {"bias_ms": float("nan"), "mae_ms": float("nan"), "p90_abs_ms": float("nan")}
    return {
        "bias_ms": float(np.median(err)),
        "mae_ms": float(np.median(np.abs(err))),
        "p90_abs_ms": float(np.percentile(np.abs(err), 90)),
    }


def plot(path: Path, rates: list[dict], title: str) -> None:
    """Left: attainment vs rate — every real pass, the simulator's prediction for each, the means with the 95 %
    interval of sim - real around the real mean, and the SLO-alone curves. Right: every pass as a point,
    simulated against real attainment, with its 95 % interval, beside the diagonal and the +-2 point band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.6), gridspec_kw={"width_ratios": [1.35, 1]})
    x = [r["rate"] for r in rates]
    for r in rates:
        ax.scatter([r["rate"]] * len(r["real_passes"]), r["real_passes"], color="tab:blue", marker="x", s=20, zorder=3)
        ax.scatter([r["rate"]] * len(r["sim_passes"]), r["sim_passes"], color="tab:orange", marker="+", s=30, zorder=3)
    ax.plot(x, [r["real"] for r in rates], color="tab:blue", marker="o", label="real (x: each pass): both SLOs")
    ax.errorbar(
        x,
        [r["sim"] for r in rates],
        yerr=[
            [r["sim"] - r["real"] - r["ci95"][0] for r in rates],
            [r["real"] + r["ci95"][1] - r["sim"] for r in rates],
        ],
        color="tab:orange",
        marker="s",
        capsize=4,
        label="simulated (+: each pass), 95 % CI of sim - real",
    )
    for key, style in (("ttft", ":"), ("tpot", "--")):
        ax.plot(
            x, [r[f"real_{key}"] for r in rates], linestyle=style, color="tab:blue", label=f"real: {key.upper()} only"
        )
        ax.plot(
            x, [r[f"sim_{key}"] for r in rates], linestyle=style, color="tab:orange", label=f"sim: {key.upper()} only"
        )
    values = [v for r in rates for v in (*r["real_passes"], *r["sim_passes"])]
    ax.set_ylim(max(-5.0, min(values) - 15), 102)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="lower left")
    reals = [v for r in rates for v in r["real_passes"]]
    sims = [v for r in rates for v in r["sim_passes"]]
    errs = [
        (s - (re + lo_hi[0]), re + lo_hi[1] - s)
        for r in rates  # the sim value's interval: real + CI of sim - real
        for re, s, lo_hi in zip(r["real_passes"], r["sim_passes"], r["pass_ci95"])
    ]
    ax2.errorbar(reals, sims, yerr=np.array(errs).T.clip(min=0), fmt="o", color="tab:orange", capsize=3)
    for r in rates:
        for k, (re, s) in enumerate(zip(r["real_passes"], r["sim_passes"])):
            ax2.annotate(f"{r['rate']:g}/s #{k + 1}", (re, s), fontsize=6, xytext=(3, -9), textcoords="offset points")
    lo, hi = min(reals + sims) - 5, min(100.0, max(reals + sims) + 5)
    ax2.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
    ax2.fill_between([lo, hi], [lo - 2, hi - 2], [lo + 2, hi + 2], color="grey", alpha=0.2, label="within 2 points")
    ax2.set_xlim(lo, hi)
    ax2.set_ylim(lo, hi)
    ax2.set_xlabel("real attainment of the pass (%)")
    ax2.set_ylabel("simulated (same-run model) (%), 95 % CI of sim - real")
    ax2.set_title("each pass of the same trace", fontsize=8)
    ax2.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
