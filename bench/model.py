"""Model: prefill tokens/s, the S-part step time T(B), and colocated decode tokens/s beside transformers.

T(B) is one decode step's S-part over all layers for a batch of B tokens (embedding, every layer's
norms, projections and MLP, final norm and logits; attention left out): the curve the FastDecode
planner sizes the S-worker batch with. Decode compares the colocated engine (paged KV pool, native
attention; KV fp32 for fp32 weights, fp16 for bf16 ones, as transformers' cache follows the model dtype)
with transformers' `generate` on the same GGUF, same batch, same dtype, same prompts
(equal lengths, so transformers needs no padding), 128 new tokens each, greedy, prefill included in both,
in the same process with the same torch threads. The two alternate in rounds (order swapped each round) and
each row's `ratio` is the median of the rounds' own ratios, so a drift of the machine's speed between two
rows' timings does not enter it (`round_ratios` lists them; `elapsed_s` is the whole run's wall time).

Beside each decode row, the limit: `gemm_floor_tokens_per_s` is the batch divided by the time of the
step's 121 matrix products alone (every layer's QKV, O, gate/up and down, plus the lm_head, back to back,
nothing else), and `ceiling_ratio` that floor over transformers' tokens/s: the ratio a step with free
norms, RoPE, attention, sampling and Python would reach. `weight_read_ms` is the weights' bytes over the
read bandwidth measured here (the floor of any step at small batch).

`bound_tokens_per_s` is tighter, for the whole generate call: the prefill's FLOPs (every layer's matrices
over every prompt token, causal attention, the last token's logits) at the peak GEMM rate measured here
(`peak_gflops`: the native kernel over a step's matrices at batch 256), plus every decode step's
matrix products at their measured time (the GEMM floor) and its KV cache read once at the measured read
bandwidth; norms, RoPE, sampling, the KV write and Python cost nothing. `bound_ratio` is that bound over
transformers' tokens/s (the ratio no implementation of this step structure can pass on this machine), and
`of_bound` our tokens/s over the bound.

Each decode row also says where our step's time went in that very run (`StepTimers`): the S-part beside
the GEMM floor (`s_part_ms` vs `gemm_floor_ms`: what norms, RoPE, the K/V store and running inside a step
add to the bare matrix products), attention beside the mean step's KV read at the read bandwidth
(`attention_ms` vs `kv_read_ms`), sampling, the rest, and the prefill.

`--model` takes any supported model (bundled name, .gguf file or HF directory; transformers loads the same
one). Each dtype's load is timed (`load_s`) and its memory measured: `resident_anon_mib` is the anonymous memory
the load added (dequantised, fused and packed weights), `resident_file_mib` the file pages it mapped, and
`ratio_resident_vs_file_size` the first over the bytes of the file(s).
"""

import copy
import os
import statistics
import time

import torch

from aiollm.model import load
from aiollm.model.engine import ReferenceEngine
from aiollm.model.linear import linear
from aiollm.model.loader import resolve
from aiollm.model.sampling import SamplingParams
from aiollm.native.attention import read_sum
from aiollm.native.fused_ops import seconds_buffer
from aiollm.native.gemm import PackedWeight, gemm
from aiollm.report import table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="bundled name, .gguf file or Hugging Face directory")
    parser.add_argument("--quick", action="store_true", help="small sizes only (a short run while developing)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32,bf16")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--gemm-only", action="store_true", help="only the GEMM rows (native kernel vs oneDNN)")
    # 3 rounds made a fp32 run 391 s (over the ~5 min a bench lock hold may take); 2 keep it near 5 min
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternating rounds of ours and transformers' generate per decode batch >= 8",
    )


def _timed(fn, min_seconds: float, max_reps: int) -> float:
    """Seconds per call: one warm-up call, then repeat until min_seconds or max_reps."""
    fn()
    reps, started = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds or reps >= max_reps:
            return elapsed / reps


def s_part_step(model, h: torch.Tensor, rope) -> torch.Tensor:
    """Every layer's S-part for the batch h with attention left out (q stands in for its output), then logits."""
    for layer in range(model.config.n_layers):
        q, _, _ = model.pre_attention(layer, h, None, rope)
        h = model.post_attention(layer, h, q)
    return model.logits(h)


def gemm_floor(model, b: int) -> float:
    """Seconds of one step's matrix products alone at batch b (best of a few), inputs of the right shapes."""
    c = model.config
    x, x_ffn = torch.randn(b, c.hidden, dtype=model.dtype), torch.randn(b, c.ffn, dtype=model.dtype)
    x_attn = torch.randn(b, c.q_size, dtype=model.dtype)  # the O projection's input: n_heads x head_dim wide

    def products() -> None:
        for w in model.weights.layers:
            for inputs, weight in ((x, w.qkv), (x_attn, w.o), (x, w.gate_up), (x_ffn, w.down)):
                linear(inputs, weight)
        linear(x, model.weights.lm_head)

    with torch.inference_mode():
        products()
        return min(_timed(products, 0.0, 1) for _ in range(3))


def gemm_rows(model, batches: list[int]) -> list[dict]:
    """Each GEMM shape of a step at each batch: the native kernel beside oneDNN with the same weights packed
    its way, every layer's matrix in turn as a step reads them (ms per step, weight GB/s, GFLOPS, and
    oneDNN's time over ours), then the step's sum. Empty where the model's weights are not on the kernel."""
    w = model.weights
    if not isinstance(w.lm_head, PackedWeight):
        return []
    kinds = {name: [getattr(layer, name) for layer in w.layers] for name in ("qkv", "o", "gate_up", "down")}
    kinds["lm_head"] = [w.lm_head]
    onednn = {
        name: [torch.ops.mkldnn._reorder_linear_weight(p.to_dense(), None) for p in packed]
        for name, packed in kinds.items()
    }
    rows = []
    with torch.inference_mode():
        for b in batches:
            step = {"shape": "step", "batch": b, "ours_ms": 0.0, "onednn_ms": 0.0, "gflop": 0.0, "gbytes": 0.0}
            for name, packed in kinds.items():
                n, k = packed[0].shape
                x = torch.randn(b, k, dtype=model.dtype)
                ours = min(_timed(lambda x=x, ws=packed: [gemm(x, p) for p in ws], 0.0, 1) for _ in range(3))
                theirs = min(
                    _timed(
                        lambda x=x, ws=onednn[name]: [
                            torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], "") for d in ws
                        ],
                        0.0,
                        1,
                    )
                    for _ in range(3)
                )
                gbytes = len(packed) * n * k * x.element_size() / 1e9
                gflop = len(packed) * 2 * b * n * k / 1e9
                rows.append(
                    {
                        "shape": f"{name} {n}x{k}",
                        "batch": b,
                        "ours_ms": 1e3 * ours,
                        "onednn_ms": 1e3 * theirs,
                        "ours_gb_s": gbytes / ours,
                        "ours_gflops": gflop / ours,
                        "onednn_gb_s": gbytes / theirs,
                        "onednn_gflops": gflop / theirs,
                        "ratio": theirs / ours,
                    }
                )
                step.update(
                    ours_ms=step["ours_ms"] + 1e3 * ours,
                    onednn_ms=step["onednn_ms"] + 1e3 * theirs,
                    gflop=step["gflop"] + gflop,
                    gbytes=step["gbytes"] + gbytes,
                )
            gflop, gbytes = step.pop("gflop"), step.pop("gbytes")
            step.update(
                ours_gb_s=1e3 * gbytes / step["ours_ms"],
                ours_gflops=1e3 * gflop / step["ours_ms"],
                onednn_gb_s=1e3 * gbytes / step["onednn_ms"],
                onednn_gflops=1e3 * gflop / step["onednn_ms"],
                ratio=step["onednn_ms"] / step["ours_ms"],
            )
            rows.append(step)
    return rows


def peak_gflops(model, batch: int = 256) -> float:
    """GFLOPS of the step's matrix products at a batch large enough to be compute-bound (best of a few)."""
    return 2 * batch * _matrix_params(model, lm_head=True) / gemm_floor(model, batch) / 1e9


def _matrix_params(model, lm_head: bool) -> int:
    """Weights of every layer's matrices (and of the lm_head if asked): the multiply-adds per token."""
    c = model.config
    per_layer = c.hidden * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden + 3 * c.hidden * c.ffn
    return c.n_layers * per_layer + (c.vocab * c.hidden if lm_head else 0)


def generate_bound(
    model,
    b: int,
    prompt_len: int,
    new_tokens: int,
    step_gemm_s: float,
    kv_bytes_per_token: int,
    peak_flops: float,
    read_bytes_per_s: float,
) -> float:
    """Seconds of a generate call with everything but matrix products and KV reads free (see the module doc)."""
    c = model.config
    prefill_flops = 2 * b * prompt_len * _matrix_params(model, lm_head=False) + 2 * b * c.vocab * c.hidden
    prefill_flops += 2 * b * c.n_layers * c.n_heads * c.head_dim * prompt_len * (prompt_len + 1)  # QK^T and PV, causal
    seconds = prefill_flops / peak_flops
    for step in range(1, new_tokens):  # the first new token comes out of the prefill
        seconds += step_gemm_s + b * (prompt_len + step) * kv_bytes_per_token / read_bytes_per_s
    return seconds


def read_bandwidth() -> float:
    """Bytes/s of one streaming read of 512 MiB with the native kernel's threads (best of 3)."""
    buf = torch.ones(128 * 2**20).numpy()
    read_sum(buf)
    best = min(_timed(lambda: read_sum(buf), 0.0, 1) for _ in range(3))
    return buf.nbytes / best


def t_of_b(model, batches: list[int], min_seconds: float) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(0, model.config.vocab, (b,))
            rope = model.rope(torch.arange(b) % 1024 + 64)
            seconds = _timed(lambda ids=ids, rope=rope: s_part_step(model, model.embed(ids), rope), min_seconds, 20)
            rows.append({"batch": b, "seconds": seconds, "tokens_per_s": b / seconds})
    return rows


def prefill(model, hf, lengths: list[int]) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, model.config.vocab, (n,))
            ours = _timed(lambda ids=ids: model.prefill([ids.tolist()]), 0.5, 3)
            row = {"prompt_len": n, "tokens_per_s": n / ours}
            if hf is not None:
                theirs = _timed(lambda ids=ids: hf(ids[None]), 0.5, 3)
                row.update(transformers_tokens_per_s=n / theirs, ratio=theirs / ours)
            rows.append(row)
    return rows


def decode(
    model,
    hf,
    batches: list[int],
    new_tokens: int,
    prompt: list[int],
    bandwidth: float,
    peak: float,
    floors: dict[int, float],
    rounds: int = 3,
) -> list[dict]:
    """floors: a step's GEMM time per batch measured earlier in the run (the GEMM rows); the floor is the
    lower of that and the one measured beside the row (both are best-of-a-few on a shared machine).

    Ours and transformers' generate calls alternate in `rounds` rounds per batch (batch >= 8; one round at
    batch 1, outside the target), the order swapped every round (ours first, then theirs first, ...), and
    `ratio` is the median of the rounds' own ratios (theirs / ours of the same round): a shared machine's
    speed drifts by up to +-30 % over seconds to minutes, so two rows timed minutes apart could land in different
    phases. `tokens_per_s` and `transformers_tokens_per_s` are the medians of each side's rounds."""
    rows = []
    # KV in 16 bits for a bf16 model, as transformers keeps its cache in the model dtype (fp32 KV read 2x the bytes)
    kv_dtype = "fp32" if model.dtype == torch.float32 else "fp16"
    c = model.config
    kv_bytes_per_token = c.n_layers * 2 * c.kv_size * (4 if kv_dtype == "fp32" else 2)
    engine = ReferenceEngine(model, kv_dtype=kv_dtype, n_blocks=max(batches) * ((len(prompt) + new_tokens) // 16 + 2))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    hf_kwargs = {"do_sample": False, "pad_token_id": model.config.eos_ids[0]}

    def ours(b: int) -> float:
        started = time.perf_counter()
        engine.generate([prompt] * b, params)
        return time.perf_counter() - started

    def theirs(b: int) -> float:
        ids = torch.tensor([prompt] * b)
        with torch.inference_mode():
            started = time.perf_counter()
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                **hf_kwargs,
            )
            return time.perf_counter() - started

    for b in batches:
        n_rounds = 1 if hf is None or b < 8 else rounds
        if hf is not None:
            ids = torch.tensor([prompt] * b)
            with torch.inference_mode():  # warm-up at this batch
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, **hf_kwargs)
        timers = StepTimers(engine)
        ours_s, theirs_s = [], []
        for r in range(n_rounds):
            if r % 2 == 0 or hf is None:
                ours_s.append(ours(b))
                if hf is not None:
                    theirs_s.append(theirs(b))
            else:
                theirs_s.append(theirs(b))
                ours_s.append(ours(b))
        timers.remove()
        ours_med = statistics.median(ours_s)
        floor = min(gemm_floor(model, b), floors.get(b, float("inf")))
        bound = generate_bound(model, b, len(prompt), new_tokens, floor, kv_bytes_per_token, peak * 1e9, bandwidth)
        row = {
            "batch": b,
            "new_tokens": new_tokens,
            "kv_dtype": kv_dtype,
            "rounds": n_rounds,
            "tokens_per_s": b * new_tokens / ours_med,
            "gemm_floor_tokens_per_s": b / floor,
            "bound_tokens_per_s": b * new_tokens / bound,
            "of_bound": bound / ours_med,
            **timers.row(),
            "gemm_floor_ms": 1e3 * floor,
            # the mean decode step's KV cache (prompt + half the new tokens) read once at the read bandwidth
            "kv_read_ms": 1e3 * b * (len(prompt) + new_tokens / 2) * kv_bytes_per_token / bandwidth,
        }
        if hf is not None:
            theirs_med = statistics.median(theirs_s)
            round_ratios = [t / o for t, o in zip(theirs_s, ours_s)]
            row.update(
                transformers_tokens_per_s=b * new_tokens / theirs_med,
                ratio=statistics.median(round_ratios),
                round_ratios=round_ratios,
                ceiling_ratio=row["gemm_floor_tokens_per_s"] * theirs_med / (b * new_tokens),
                bound_ratio=theirs_med / bound,
            )
        rows.append(row)
    return rows


def _shown(row: dict) -> dict:
    """A decode row for the first table: the step breakdown left to the second, the rounds' ratios joined."""
    shown = {k: v for k, v in row.items() if k not in _STEP_COLUMNS and k != "round_ratios"}
    if "round_ratios" in row:
        shown["round_ratios"] = "/".join(f"{r:.2f}" for r in row["round_ratios"])
    return shown


_STEP_COLUMNS = [
    "step_ms",
    "s_part_ms",
    "gemm_floor_ms",
    "attention_ms",
    "kv_read_ms",
    "sampling_ms",
    "other_ms",
    "prefill_ms",
]


class StepTimers:
    """Where our generate call's time goes, measured in the timed run itself: timers wrap the engine's own
    calls (the model's pre_attention / post_attention / logits, the decode step's attention, sampling) as
    instance attributes, ~0.5 us a call (~50 us of a 30-layer step, <0.1 % at batch >= 8); the one-call decode
    path (model.decode_layers) adds the S-part and attention seconds its native loop measured. Per decode step:
    s_part_ms (norms, projections, RoPE, the K/V store, MLP, logits), attention_ms, sampling_ms, other_ms
    (the rest of the step: Python glue, block tables, embedding); prefill_ms for a generate call's whole prefill
    (the mean over the calls timed)."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine
        self.spent = dict.fromkeys(("s_part", "attention", "sampling", "step", "prefill"), 0.0)
        self.calls = dict.fromkeys(self.spent, 0)
        self._in_step = False
        model = engine.model
        for name in ("pre_attention", "post_attention", "logits"):
            setattr(model, name, self._timed(getattr(model, name), "s_part"))
        # the fused decode path runs every layer in one native call, which times its S-part and attention itself
        decode_layers, seconds = model.decode_layers, seconds_buffer()

        def timed_decode_layers(*args, **kwargs):
            seconds[0] = seconds[1] = 0.0
            h = decode_layers(*args, **kwargs, seconds=seconds)
            if h is not None and self._in_step:
                self.spent["s_part"] += seconds[0]
                self.spent["attention"] += seconds[1]
            return h

        model.decode_layers = timed_decode_layers
        engine._append = self._timed(engine._append, "sampling")
        engine._prefill = self._timed(engine._prefill, "prefill", always=True)
        engine._decode_step = self._timed(engine._decode_step, "step", always=True, marks_step=True)
        prepare = engine.pool.prepare_decode

        def prepare_decode(*args, **kwargs):
            step = prepare(*args, **kwargs)
            step.attend = self._timed(step.attend, "attention")
            return step

        engine.pool.prepare_decode = prepare_decode

    def _timed(self, fn, key: str, always: bool = False, marks_step: bool = False):
        def run(*args, **kwargs):
            if not (always or self._in_step):
                return fn(*args, **kwargs)
            self._in_step |= marks_step
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[key] += time.perf_counter() - started
                self.calls[key] += 1
                if marks_step:
                    self._in_step = False

        return run

    def remove(self) -> None:
        """Back to the class methods."""
        for obj, names in (
            (self.engine.model, ("pre_attention", "post_attention", "logits", "decode_layers")),
            (self.engine, ("_append", "_prefill", "_decode_step")),
            (self.engine.pool, ("prepare_decode",)),
        ):
            for name in names:
                delattr(obj, name)

    def row(self) -> dict:
        n = max(self.calls["step"], 1)
        s = {k: 1e3 * v for k, v in self.spent.items()}
        return {
            "step_ms": s["step"] / n,
            "s_part_ms": s["s_part"] / n,
            "attention_ms": s["attention"] / n,
            "sampling_ms": s["sampling"] / n,
            "other_ms": (s["step"] - s["s_part"] - s["attention"] - s["sampling"]) / n,
            "prefill_ms": s["prefill"] / max(self.calls["prefill"], 1),
        }


def _load_transformers(model: str, dtype: torch.dtype, cache: dict):
    if "fp32" not in cache:
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformers import AutoModelForCausalLM

        path = resolve(model)
        where = (
            dict(pretrained_model_name_or_path=path)
            if path.is_dir()
            else dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name)
        )
        cache["fp32"] = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    if dtype == torch.float32:
        return cache["fp32"]
    return copy.deepcopy(cache["fp32"]).to(dtype)


def _memory() -> dict[str, int]:
    """This process's resident memory in bytes: anonymous (its own heap) and file-backed (mapped pages)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def timed_load(model: str, dtype: torch.dtype, name: str) -> tuple[object, dict]:
    """Load the model, timing it and measuring the memory it holds against the size of its file(s):
    `ratio_resident_vs_file_size` is the anonymous memory the load added over the bytes of the files."""
    path = resolve(model)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    file_bytes = sum(f.stat().st_size for f in files)
    before = _memory()
    started = time.perf_counter()
    loaded = load(model, dtype=dtype)
    seconds = time.perf_counter() - started
    after = _memory()
    anon = after.get("RssAnon", 0) - before.get("RssAnon", 0)
    row = {
        "dtype": name,
        "files": len(files),
        "file_mib": file_bytes / 2**20,
        "load_s": seconds,
        "resident_anon_mib": anon / 2**20,
        "resident_file_mib": (after.get("RssFile", 0) - before.get("RssFile", 0)) / 2**20,
        "ratio_resident_vs_file_size": anon / file_bytes if file_bytes else 0.0,
    }
    return loaded, row


def run(args) -> dict:
    run_started = time.perf_counter()
    quick = args.quick
    batches_t = [2**i for i in range(7 if quick else 11)]
    lengths = [128] if quick else [128, 512, 2048]
    decode_batches = [1, 8] if quick else [1, 8, 32, 64]
    new_tokens = 32 if quick else 128
    # OMP_WAIT_POLICY decides whether torch's idle OpenMP threads spin; on shared cores spinning threads
    # slow every other process (and each other) by up to 10x, so the figures say which policy they ran under
    figures: dict = {
        "torch_threads": torch.get_num_threads(),
        "quick": quick,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }
    hf_cache: dict = {}
    ratios = []
    bandwidth = read_bandwidth()
    figures["read_bandwidth_gb_s"] = bandwidth / 1e9
    figures["model"] = str(args.model)
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        model, loading = timed_load(args.model, dtype, name)
        figures[f"load_{name}"] = loading
        figures[f"ratio_resident_vs_file_size_{name}"] = loading["ratio_resident_vs_file_size"]
        print(
            f"\n-- {name}: load of {args.model} ({model.config.family}; anonymous memory added over the files' bytes, "
            f"file-backed pages mapped)\n{table([loading])}"
        )
        gemms = gemm_rows(model, [1, 8, 32, 64])
        if gemms:
            figures[f"gemm_{name}"] = gemms
            figures[f"ratio_gemm_vs_onednn_{name}"] = min(
                r["ratio"] for r in gemms if r["shape"] == "step" and r["batch"] >= 8
            )
            print(
                f"\n-- {name}: a step's GEMMs, native kernel vs oneDNN (ratio: oneDNN's time over ours; "
                f"read bandwidth {bandwidth / 1e9:.1f} GB/s)\n{table(gemms)}"
            )
        if args.gemm_only:
            continue
        hf = None if args.no_transformers else _load_transformers(args.model, dtype, hf_cache)
        prompt = model.tokenizer.encode(
            model.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Tell me a long story about a dragon who learns to cook."}]
            )
        )
        curve = t_of_b(model, batches_t, 0.2 if quick else 0.5)
        pre = prefill(model, hf, lengths)
        peak = peak_gflops(model)
        figures[f"peak_gflops_{name}"] = peak
        floors = {r["batch"]: r["ours_ms"] / 1e3 for r in gemms if r["shape"] == "step"}
        dec = decode(model, hf, decode_batches, new_tokens, prompt, bandwidth, peak, floors, args.rounds)
        weight_bytes = model.config.n_params * torch.finfo(dtype).bits // 8
        figures[f"weight_read_ms_{name}"] = 1e3 * weight_bytes / bandwidth
        key = "t_of_b" if name == "fp32" else f"t_of_b_{name}"
        figures[key] = [{"batch": r["batch"], "seconds": r["seconds"]} for r in curve]
        figures[f"prefill_{name}"] = pre
        figures[f"decode_{name}"] = dec
        print(f"\n-- {name}: S-part step time T(B) (all layers + logits, no attention)\n{table(curve)}")
        print(f"\n-- {name}: prefill, one prompt\n{table(pre)}")
        print(
            f"\n-- {name}: colocated decode, {new_tokens} new tokens, prompt {len(prompt)} tokens "
            f"(weights {weight_bytes / 2**20:.0f} MiB: {figures[f'weight_read_ms_{name}']:.1f} ms a step at "
            f"{bandwidth / 1e9:.1f} GB/s; bound: prefill at {peak:.0f} GFLOPS, GEMM floor, KV at read "
            f"bandwidth; ratio: median of the rounds' paired ratios)\n{table([_shown(r) for r in dec])}"
        )
        print(
            f"\n-- {name}: where our decode step goes (ms per step of the run above; s_part: norms, projections, "
            f"RoPE, K/V store, MLP, logits, beside the step's GEMM floor; attention beside the mean step's KV read "
            f"at {bandwidth / 1e9:.1f} GB/s)\n{table(dec, ['batch', *_STEP_COLUMNS])}"
        )
        if hf is not None:
            ratio = min(r["ratio"] for r in dec if r["batch"] >= 8)
            figures[f"ratio_decode_vs_transformers_{name}"] = ratio
            figures[f"bound_ratio_decode_{name}"] = min(r["bound_ratio"] for r in dec if r["batch"] >= 8)
            ratios.append(ratio)
    if ratios:
        figures["ratio_decode_vs_transformers"] = min(ratios)
    figures["elapsed_s"] = time.perf_counter() - run_started
    return figures
