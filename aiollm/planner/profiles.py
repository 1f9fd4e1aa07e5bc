"""Where latency coefficients come from: DistServe's A100 profiles, this machine's measured profile,
and profiles derived from datasheet numbers.

Why three sources: DistServe's A100-80G profiles let our plans be compared with its simulator on equal
terms; the local profile (`python -m aiollm.plan profile`) drives plans for the bundled model on this
machine; derived profiles cover hardware and models nobody profiled (H100, H200, OPT-175B, Llama-2).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from aiollm.planner.hardware import GPUSpec, get_gpu
from aiollm.planner.latency import DEFAULT_TP_SERIAL, LatencyModel, StackLatency, amdahl, piecewise
from aiollm.planner.models import HF_NAMES, ModelSpec, get_model

# DistServe's published profiles, shipped with the package (Apache-2.0: LICENSE and README.md beside them).
DISTSERVE_DIR = Path(__file__).resolve().parent / "data" / "distserve"
LOCAL_PROFILE = Path.home() / ".cache" / "aiollm" / "latency-profile-local.json"
LOCAL_FORMAT = "aiollm-latency-profile/1"

# Constants of the derived profiles, fitted by least squares on DistServe's measured A100-80G profile
# (OPT-13B TP 1/2/4, OPT-66B TP 2/3/4/8) and then applied unchanged to every model and GPU:
# - fixed cost of an iteration = per-layer overhead that TP does not shrink + weight bytes / (tp * BW * k):
#   prefill 0.266 ms/layer and k = 1.29 (fits a within 13 %), decode 0.196 ms/layer and k = 0.913 (d within 8 %);
# - prefill GEMMs run at 80 % of dense bf16 peak (b = GEMM FLOPs per token / (0.8*peak), 1 % off at TP=1);
# - prefill attention runs at 18 % of peak (c = attention FLOPs per len^2 / (0.18*peak));
# - KV is read at 64 % of HBM bandwidth (f = KV bytes per token / (0.64*BW), 0.2 % off);
# - a decode step's per-sequence GEMMs mostly hide behind the weight stream: e = 0.4 x the GEMM time at 80 % peak;
# - b, c, e, f scale with TP by the Amdahl fractions of latency.DEFAULT_TP_SERIAL (fitted on the same data).
# On H100/H200 the per-layer overheads are kept as on A100 (conservative: launches do not get slower).
PREFILL_LAYER_OVERHEAD = 0.266e-3
PREFILL_WEIGHT_BW_FACTOR = 1.29
DECODE_LAYER_OVERHEAD = 0.196e-3
DECODE_WEIGHT_BW_FACTOR = 0.913
MEM_EFFICIENCY = 0.64
GEMM_EFFICIENCY = 0.80
ATTENTION_EFFICIENCY = 0.18
DECODE_GEMM_FRACTION = 0.4
# TP degrees a derived profile is tabulated for.
DERIVED_TPS = (1, 2, 3, 4, 6, 8, 16)
# Share of HBM usable for weights + KV (the rest: activations, workspace, fragmentation).
MEMORY_UTILISATION = 0.9


def distserve_dir(override: str | Path | None = None) -> Path:
    """The DistServe profile directory: `override`, else the copy shipped in the package (`DISTSERVE_DIR`)."""
    path = Path(override) if override else DISTSERVE_DIR
    if not (path / "profiler-a100-80g.distserve.json").is_file():
        raise FileNotFoundError(
            f"DistServe profiles not found in {path}: expected profiler-a100-80g.distserve.json there"
        )
    return path


def load_distserve(directory: str | Path | None = None, engine: str = "distserve") -> dict[str, LatencyModel]:
    """DistServe's A100-80G profiles for `engine` ('distserve' or 'vllm'), per model name.

    Their files are in ms with decode as [a, b*context, c*batch]; ours are seconds and (d, e*batch, f*context).
    A few of their fitted coefficients are slightly negative (vLLM's OPT-66B attention terms, ~-1e-8 s);
    those are clipped to 0, which changes no step time by more than a microsecond.
    """
    if engine not in ("distserve", "vllm"):
        raise ValueError(f"engine must be 'distserve' or 'vllm', got {engine!r}")
    path = distserve_dir(directory)
    data = json.loads((path / f"profiler-a100-80g.{engine}.json").read_text())
    capacity = _distserve_capacity(path / "max_num_tokens.csv")
    models = {}
    for hf_name, per_tp in data.items():
        name = HF_NAMES.get(hf_name, hf_name)
        by_tp = {}
        for tp, entry in per_tp.items():
            small = entry["decoding_smallbs"]
            large = entry["decoding_largebs"]
            by_tp[int(tp)] = StackLatency(
                prefill=tuple(_seconds(x) for x in entry["prefill"]),
                decode=(_seconds(small[0]), _seconds(small[2]), _seconds(small[1])),
                decode_large=(_seconds(large[0]), _seconds(large[2]), _seconds(large[1])),
                large_batch_threshold=int(entry["decoding_large_small_bs_threshold"]),
            )
        models[name] = LatencyModel(
            name, "A100-80G", f"DistServe A100-80G profile ({engine})", by_tp, kv_capacity=capacity.get(name, {})
        )
    return models


def _seconds(ms: float) -> float:
    return max(0.0, ms / 1000)


def _distserve_capacity(path: Path) -> dict[str, dict[tuple[int, int], int]]:
    out: dict[str, dict[tuple[int, int], int]] = {}
    if not path.is_file():
        return out
    with path.open() as handle:
        for row in csv.DictReader(handle):
            name = HF_NAMES.get(row["model"], row["model"])
            out.setdefault(name, {})[(int(row["tp"]), int(row["pp"]))] = int(row["max_num_tokens"])
    return out


def derive(model: ModelSpec, gpu: GPUSpec) -> LatencyModel:
    """A profile from the datasheet and the constants above, tabulated for DERIVED_TPS."""
    gemm = model.gemm_flops_per_token / (gpu.peak_flops * GEMM_EFFICIENCY)
    attention = model.attention_flops_per_token_sq / (gpu.peak_flops * ATTENTION_EFFICIENCY)
    kv_read = model.kv_bytes_per_token / (gpu.mem_bandwidth * MEM_EFFICIENCY)
    s_b, s_c, s_e, s_f = (DEFAULT_TP_SERIAL[i] for i in (1, 2, 4, 5))
    by_tp = {}
    for tp in DERIVED_TPS:
        weights = model.param_bytes / (tp * gpu.mem_bandwidth)
        by_tp[tp] = StackLatency(
            prefill=(
                model.layers * PREFILL_LAYER_OVERHEAD + weights / PREFILL_WEIGHT_BW_FACTOR,
                gemm * amdahl(tp, s_b),
                attention * amdahl(tp, s_c),
            ),
            decode=(
                model.layers * DECODE_LAYER_OVERHEAD + weights / DECODE_WEIGHT_BW_FACTOR,
                DECODE_GEMM_FRACTION * gemm * amdahl(tp, s_e),
                kv_read * amdahl(tp, s_f),
            ),
        )
    return LatencyModel(model.name, gpu.name, f"derived from the {gpu.name} datasheet (see profiles.py)", by_tp)


def load_local(path: str | Path | None = None) -> dict[str, LatencyModel]:
    """Profiles written by `python -m aiollm.plan profile` (default ~/.cache/aiollm/latency-profile-local.json)."""
    file = Path(path) if path else LOCAL_PROFILE
    if not file.is_file():
        raise FileNotFoundError(f"no local latency profile at {file}: run `python -m aiollm.plan profile` first")
    data = json.loads(file.read_text())
    if data.get("format") != LOCAL_FORMAT:
        raise ValueError(f"{file}: not an aiollm latency profile (format {data.get('format')!r})")
    models = {}
    for name, entry in data["models"].items():
        stack = StackLatency(
            prefill=tuple(entry["prefill"]),
            decode=tuple(entry["decode"]),
            prefill_table=_prefill_table(entry),
            decode_table=_decode_table(entry),
        )
        how = "measured points interpolated" if stack.prefill_table else "linear fit"
        models[name] = LatencyModel(
            name,
            data["hardware"],
            f"measured on {data['hardware']} ({file.name}, {how})",
            {1: stack},
            weights_bytes=int(entry.get("weights_bytes", 0)),
            kv_bytes_per_token=float(entry.get("kv_bytes_per_token", 0.0)),
        )
    return models


def _prefill_table(entry: dict) -> tuple:
    """The measured prefill points as a table over total tokens t, after taking out the fitted c*t2 term
    (so batches of several prompts keep their smaller attention cost)."""
    points = entry.get("prefill_points", [])
    c = entry["prefill"][2]
    t = [p["batch"] * p["length"] for p in points]
    base = [p["seconds"] - c * p["batch"] * p["length"] ** 2 for p in points]
    return piecewise(t, base) if len(set(t)) >= 2 else ()


def _decode_table(entry: dict) -> tuple:
    """The measured decode steps as a table over the batch size, after taking out the fitted f*context term."""
    points = entry.get("decode_points", [])
    f = entry["decode"][2]
    batch = [p["batch"] for p in points]
    base = [p["seconds"] - f * p["batch"] * (p["context"] + 1) for p in points]
    return piecewise(batch, base) if len(set(batch)) >= 2 else ()


def latency_model(model: str, gpu: str, profile: str | Path = "auto") -> LatencyModel:
    """The latency model for (model, gpu). `profile`: 'auto' (DistServe's profile for the OPT models it
    has on A100-80G, else derived), 'distserve', 'vllm', 'derived', 'local', or a path to a profile file
    (DistServe directory or aiollm JSON)."""
    spec = get_model(model)
    gpu_spec = get_gpu(gpu) if gpu.lower() != "local" else None
    kind = str(profile)
    if kind == "local" or (gpu_spec is None):
        models = load_local(None if kind in ("local", "auto") else kind)
        return _pick(models, spec.name, "local profile")
    if kind == "derived":
        return derive(spec, gpu_spec)
    if kind in ("auto", "distserve", "vllm") or Path(kind).is_dir():
        want_distserve = kind in ("distserve", "vllm") or Path(kind).is_dir()
        if gpu_spec.name != "A100-80G":
            if want_distserve:
                raise ValueError(f"DistServe's profiles are for A100-80G only, not {gpu_spec.name}")
            return derive(spec, gpu_spec)
        try:
            directory = kind if Path(kind).is_dir() else None
            models = load_distserve(directory, "vllm" if kind == "vllm" else "distserve")
        except FileNotFoundError:
            if want_distserve:
                raise
            return derive(spec, gpu_spec)
        if spec.name in models:
            return models[spec.name]
        if want_distserve:
            raise ValueError(f"DistServe's profile has no {spec.name}; it has {', '.join(sorted(models))}")
        return derive(spec, gpu_spec)
    if Path(kind).is_file():
        return _pick(load_local(kind), spec.name, kind)
    raise ValueError(f"profile {kind!r}: expected auto|distserve|vllm|derived|local or an existing path")


def _pick(models: dict[str, LatencyModel], name: str, where: str) -> LatencyModel:
    if name not in models:
        raise ValueError(f"{where} has no model {name!r}; it has {', '.join(sorted(models))}")
    return models[name]


def kv_capacity_tokens(model: ModelSpec, gpu: GPUSpec, tp: int, pp: int, latency: LatencyModel | None = None) -> int:
    """KV tokens an instance of tp*pp GPUs holds after its weights; 0 if the weights do not fit.
    Uses the profile's own table (DistServe's max_num_tokens.csv) when it has this (tp, pp)."""
    if latency is not None and (tp, pp) in latency.kv_capacity:
        return latency.kv_capacity[(tp, pp)]
    free = gpu.mem_bytes * MEMORY_UTILISATION * tp * pp - model.param_bytes
    return max(0, int(free // model.kv_bytes_per_token))
