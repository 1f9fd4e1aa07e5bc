"""Decode attention over the paged KV cache vs the machine's read bandwidth and torch SDPA.

One layer of each shape is measured: SmolLM2 (9 q heads / 3 kv heads, d=64) and a Llama-7B layer
(32/32, d=128), batch 64 and 256, context 1024 and 4096. Per shape: this kernel with fp16 storage on 1 and
2 threads (KV bytes read per second and tokens/s), with int8 and int4 storage, and torch
`scaled_dot_product_attention` in bf16 and fp32 in its fastest GQA form (enable_gqa=True or the q heads of
a group folded into the query-length axis; never repeat_interleave). The read bandwidth comes from the
library's own STREAM-like read kernel (with the same two-level software prefetch as the fp16 kernel, so the
kernel is never compared with a read it can outrun) on a 1 GiB array, on 1 and 2 threads of the same pool,
measured interleaved with each kernel figure (`paired`): on a shared VM it drifts by up to 2x within minutes,
so a reference taken once at the start would make the ratios swing with the neighbours' load rather than the
kernel.
Each round times every entry once (the read and each kernel, in alternating order, each over ~1 GiB of calls
with the per-call overhead inside); pct_read is the median over rounds of the kernel / read ratio of the same
round, pct_read_best the best kernel round over the best read round (both in the JSON, the headline from the
paired median). Rows whose KV is smaller than the 1 GiB array are also paired with the read kernel over an
array of the KV's own size (read_same_gbs, pct_read_same): the 48 MiB rows are read partly from L3, faster than
DRAM, by the kernel and by that probe alike.

Compute alone: each row also times the kernel on a KV of about 1 MiB that stays in the core's L2 (32 sequences
whose tables name the same blocks), on 1 thread (hot_fp16_1t_gbs, hot_int8_1t_gbs, a one-token call subtracted),
and divides the 1-thread read bandwidth by it (alu_share_fp16 / _int8): the share of a core's time the kernel's
arithmetic needs to keep up with memory. Near 1 the kernel cannot reach the read bandwidth whatever the prefetch
does; at 0.5-0.6 it reaches it only while the memory work and the arithmetic overlap almost perfectly, and loses
first when a neighbour slows the core. The fp16 floor depends on the CPU. GQA 3 at d=64 needs 384 zmm FMAs per 16
tokens of one kv head (3 per K and per V vector of 16 values, 1.5 multiply-adds per KV byte) and 128 vcvtph2ps. On
Intel Xeons with AMX vcvtph2ps takes both FMA ports for a cycle per 16 values, as 2 FMAs do: 640 port slots, ~32
GB/s per core at 2.4 GHz against ~14 GB/s of memory per core. On AMD Zen 4 (one zmm FMA per cycle; at 3.5 GHz with
22-31 GB/s of memory per core) the conversions ride beside the FMAs (a loop of 12 independent zmm FMAs runs at
the same speed with 0-3 vcvtph2ps added per 12 FMAs and ~10 % slower with 4, the kernel's mix): ~37 GB/s per core before the softmax, about one core's read bandwidth with it.
On 1 thread `ceiling_fp16_1t_vs_read_bw_1t` is the same bound for the row that sets `ratio_fp16_1t_vs_read_bw_1t`:
min(1, hot_fp16_1t_gbs / read_1t_gbs), what a perfect overlap of memory and arithmetic would reach there (on such
a Zen 4 host SmolLM2's rows reach 0.86-0.93, below the 0.90 target on most of them).
The same figures on all the bench's threads (hot_*_2t_gbs) bound the DRAM figures: ceil_pct_read (the fp16
arithmetic's rate over the row's read, capped at 100 %; `ceiling_fp16_vs_read_bw` on the row that sets
`ratio_fp16_vs_read_bw`) and ceil_int8_x_fp16 (int8 tokens/s at its arithmetic rate over the measured fp16
tokens/s; `ceiling_int8_vs_fp16`, the lowest row). They are taken at another moment than the DRAM figures, and
on a shared host two vCPUs can give 1.1-1.9x one core's arithmetic between moments of one run, so they show where
the arithmetic binds rather than an exact bound.

The hardware's own bound: fp16 KV needs 2 * group * head_dim multiply-adds per token and kv head against 4 *
head_dim bytes, 2 / group bytes per multiply-add, so the cores' fp32 FMA peak (`attention.fma_peak`: 12 independent
FMA chains of the kernel's vector width and nothing else, the best over the run) bounds the KV bytes per second of
any kernel that does those multiply-adds in fp32, whatever its prefetch: fma_bound_1t_gbs (one core) and
fma_bound_*t_gbs per row, and in the summary `ceiling_fp16_1t_fma_vs_read_bw_1t` / `ceiling_fp16_fma_vs_read_bw`,
the lowest over rows with context >= 1024 of that bound over the row's read bandwidth. Below 0.90 the fp16 target
is out of reach on that CPU for that shape. On a Zen 4 core whose AVX-512 a hypervisor hides (two ymm FMAs a
cycle at 2.8 GHz, 45 G multiply-adds/s) SmolLM2's bound is 30 GB/s, one core's read.

Far prefetch: the AVX-512 kernel's far (L2) software prefetch level is on or off per CPU and storage class
(native/cpu.c: off on AMD Zen 5, where the hardware prefetchers read faster without it, and for int8 / int4 on
Intel). Each row also runs fp16 and int8 with their own class the other way round in the same rounds
(pct_read_far_alt: fp16 so over the read; int8_x_fp16_far_alt: int8 so over fp16 as chosen; the summary's
ratio_*_far_alt), so every run shows whether the default suits the host it runs on.

int4 (two codes a byte, the same fp16 scales) reads 68 bytes per token and kv head at d=64 against int8's 132 and
fp16's 256 (d=128: 132, 260, 512): at one rate of bytes it would reach ~1.9x int8's tokens/s and ~3.8x fp16's.
int4_x_fp16 and int4_x_int8 (best rounds; *_paired the medians of the same round's ratio) show how much of that
the kernel keeps (VNNI dot products on AVX-512 CPUs with VNNI, else the AVX2 kernel's MADD ones);
hot_int4_*_gbs and alu_share_int4 show whether its arithmetic binds.

Block tables are contiguous per sequence (what a freshly admitted batch gets from BlockAllocator); the
fp16 2-thread figure is also given for shuffled tables (single scattered blocks: the worst case of a fragmented pool; `python -m bench kvalloc` measures the tables a churned pool really hands out). Shapes whose fp16 KV exceeds
--max-gib are run with a smaller batch (marked "capped"): the Llama shapes at 4096 x 256 need 17 GiB per
copy, more than a small host's RAM.

SDPA is measured in the same paired rounds as the kernel (an entry like the others, its faster GQA form picked
first by a best-of-reps probe): x_sdpa_* is the median over rounds of the same round's tokens/s ratio. Measured
apart, the two sides could fall in different phases of the memory's drift: a kernel row caught in a slow phase (90 %
of a read that is itself low) can read 2.95x SDPA fp32 where the other Llama rows read 4.0-5.7x.

Ceilings: SDPA reads the same KV bytes (bf16) or twice as many (fp32), so a kernel reading at the full measured
read bandwidth reaches at most ceil_x_sdpa_* = (read bandwidth / fp16 KV bytes per sequence) / SDPA tokens/s
on a row. When SDPA itself reads near the read bandwidth (sdpa_*_gbs), the x_sdpa targets are out of reach for
any kernel on that host; the table and the JSON (`ceiling_fp16_vs_sdpa_*`, the lowest over rows, the bound on
`ratio_fp16_vs_sdpa_*`) show it.
"""

import gc
import time

import numpy as np

from aiollm.native.arrays import aligned_full
from aiollm.report import table

SHAPES = {"smollm2": (9, 3, 64), "llama7b": (32, 32, 128)}
BLOCK = 16
COLUMNS = [
    "shape",
    "batch",
    "ctx",
    "run_batch",
    "kv_mib",
    "read_1t_gbs",
    "fp16_1t_gbs",
    "pct_read_1t",
    "read_gbs",
    "fp16_gbs",
    "pct_read",
    "pct_read_best",
    "read_same_gbs",
    "pct_read_same",
    "fp16_shuf_gbs",
    "pct_read_shuf",
    "pct_read_far_alt",
    "fp16_tok_s",
    "int8_tok_s",
    "int8_x_fp16",
    "int8_x_fp16_paired",
    "int8_x_fp16_far_alt",
    "sdpa_bf16_tok_s",
    "sdpa_fp32_tok_s",
    "x_sdpa_bf16",
    "x_sdpa_fp32",
    "sdpa_bf16_gbs",
    "sdpa_fp32_gbs",
    "ceil_x_sdpa_bf16",
    "ceil_x_sdpa_fp32",
    "hot_fp16_1t_gbs",
    "fma_bound_1t_gbs",
    "hot_int8_1t_gbs",
    "alu_share_fp16",
    "alu_share_int8",
    "ceil_pct_read",
    "ceil_int8_x_fp16",
    "int4_tok_s",
    "int4_x_fp16",
    "int4_x_fp16_paired",
    "int4_x_int8",
    "hot_int4_1t_gbs",
    "alu_share_int4",
]
STORAGE = {"fp16": np.float16, "int8": np.int8, "int4": np.uint8}  # int4: two codes a byte


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="batch 64, context 1024 only, fewer repetitions")
    parser.add_argument("--max-gib", type=float, default=2.0, help="cap on one fp16 KV copy per shape (GiB)")
    parser.add_argument("--threads", type=int, default=2, help="threads for the multi-threaded figures")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="measure only this shape (kernel tuning)")


def _best(fn, reps: int) -> float:
    fn()  # warm-up: page faults, thread start-up, caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _cache(batch: int, ctx: int, n_kv: int, d: int, dtype: str):
    n_blocks = batch * ctx // BLOCK
    fill = {"fp16": 0.01, "int8": 1, "int4": 0x99}[dtype]  # int4: codes 1 and 1 (stored 9 = 1 + 8)
    pack = 2 if dtype == "int4" else 1
    k = aligned_full((n_blocks, n_kv, d, BLOCK // pack), fill, STORAGE[dtype])  # on cache lines, as KVPool allocates
    v = aligned_full((n_blocks, n_kv, BLOCK, d // pack), fill, STORAGE[dtype])
    # int8 / int4: K and V scales in arrays of their own, as a pool holds them (one shared array would read half the
    # bytes)
    scales = (
        tuple(aligned_full((n_blocks, n_kv, BLOCK), 0.01, np.float16) for _ in range(2)) if dtype != "fp16" else None
    )
    return k, v, scales, np.arange(n_blocks, dtype=np.int32).reshape(batch, ctx // BLOCK)


WINDOW = 1 << 30  # bytes each entry reads per round
SETTLE_S = 0.02  # pause before each paired entry (libgomp's spin after a torch call lasts well under this)


def paired(entries, rounds: int) -> list[list[float]]:
    """GB/s per round of each (fn, nbytes) entry, all measured the same way and interleaved: each round times
    every entry once, as back-to-back calls covering ~WINDOW bytes (the per-call overhead inside), in forward
    order on even rounds and reverse order on odd ones. Within a round all see the same machine state (a shared VM's
    memory bandwidth drifts by up to 2x within minutes while other tenants run). Each entry starts SETTLE_S after
    the one before, untimed: torch's OpenMP workers spin-wait for a while after an SDPA entry, and the next entry
    must not share the cores with them."""
    for fn, _ in entries:
        fn()  # warm-up: page faults, thread start-up
    got = [[] for _ in entries]
    for r in range(rounds):
        order = list(range(len(entries)))
        for i in order if r % 2 == 0 else order[::-1]:
            fn, nbytes = entries[i]
            calls = max(1, -(-WINDOW // nbytes))
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            got[i].append(calls * nbytes / (time.perf_counter() - t0) / 1e9)
    return got


def paired_ratio(kern: list[float], ref: list[float]) -> float:
    """Median over rounds of kern / ref in the same round."""
    return float(np.median(np.asarray(kern) / np.asarray(ref)))


def reader(buf: np.ndarray, n_threads: int):
    """(fn, bytes) of the library's read kernel over buf on n_threads."""
    from aiollm.native import attention

    return (lambda: attention.read_sum(buf, n_threads)), buf.nbytes


def kernel(k, v, scales, tables, q, n_threads: int):
    """(fn, KV bytes read) of one decode_attention call over one layer; scales: (k_scale, v_scale) for int8 /
    int4."""
    from aiollm.native import attention

    lens = np.full(q.shape[0], tables.shape[1] * BLOCK, np.int32)
    out = np.empty_like(q)
    k_scale, v_scale = scales if scales is not None else (None, None)
    nbytes = k.nbytes + v.nbytes + (k_scale.nbytes + v_scale.nbytes if scales is not None else 0)
    return (
        lambda: attention.decode_attention(
            k, v, q, tables, lens, k_scale=k_scale, v_scale=v_scale, out=out, n_threads=n_threads
        )
    ), nbytes


def far_swapped(entry, storage: str):
    """(fn, bytes) of entry run with the far prefetch level of `storage`'s class the other way round from the
    library's choice (the other class as chosen)."""
    from aiollm.native import attention

    fn, nbytes = entry
    other = not attention.far_prefetch(storage)

    def run():
        attention.force_far_prefetch(other, storage)
        try:
            fn()
        finally:
            attention.force_far_prefetch(None)

    return run, nbytes


def kernel_figures(row: dict, shape: tuple, n_threads: int, big: np.ndarray, rounds: int, reps: int) -> None:
    """fp16 on 1 thread beside the 1-thread read; fp16 (contiguous and shuffled tables), int8, int4 and torch SDPA
    (bf16, fp32) on n_threads interleaved with each other and the n-thread reads, so every ratio compares figures taken
    under the same conditions. Rates are each entry's best round; pct_*, x_sdpa_* and *_paired the medians over
    rounds of the same round's ratio (see the module docstring)."""
    batch, ctx, n_q, n_kv, d = shape
    k, v, _, tables = _cache(batch, ctx, n_kv, d, "fp16")
    shuffled = np.random.default_rng(0).permutation(tables.size).astype(np.int32).reshape(tables.shape)
    k8, v8, scales, _ = _cache(batch, ctx, n_kv, d, "int8")
    k4, v4, scales4, _ = _cache(batch, ctx, n_kv, d, "int4")
    q = np.random.default_rng(1).standard_normal((batch, n_q, d)).astype(np.float32)
    fp16_1t, read_1t = paired([kernel(k, v, None, tables, q, 1), reader(big, 1)], rounds)
    row["fp16_1t_gbs"], row["read_1t_gbs"] = max(fp16_1t), max(read_1t)
    row["pct_read_1t"] = 100 * paired_ratio(fp16_1t, read_1t)
    fp16 = kernel(k, v, None, tables, q, n_threads)
    int8 = kernel(k8, v8, scales, tables, q, n_threads)
    entries = [
        fp16,
        kernel(k, v, None, shuffled, q, n_threads),
        int8,
        reader(big, n_threads),
        far_swapped(fp16, "fp16"),
        far_swapped(int8, "int8"),
    ]
    bf16, fp32 = sdpa_entry(shape, "bf16", n_threads, reps), sdpa_entry(shape, "fp32", n_threads, reps)
    int4 = kernel(k4, v4, scales4, tables, q, n_threads)
    entries += [bf16, fp32, int4]
    same = aligned_full(((k.nbytes + v.nbytes) // 4,), 1, np.float32) if k.nbytes + v.nbytes < big.nbytes else None
    if same is not None:
        entries.append(reader(same, n_threads))
    got = paired(entries, rounds)
    fp16_r, shuf_r, int8_r, read_r, fp16_alt, int8_alt, bf16_r, fp32_r = got[:8]
    for name, (_, nbytes), rates in (("bf16", bf16, bf16_r), ("fp32", fp32, fp32_r)):
        row[f"sdpa_{name}_tok_s"] = max(rates) * 1e9 / nbytes * batch
        row[f"x_sdpa_{name}"] = paired_ratio([g / fp16[1] for g in fp16_r], [g / nbytes for g in rates])
    row["pct_read_far_alt"] = 100 * paired_ratio(fp16_alt, read_r)
    row["int8_x_fp16_far_alt"] = paired_ratio([g / int8[1] for g in int8_alt], [g / fp16[1] for g in fp16_r])
    row["fp16_gbs"], row["fp16_shuf_gbs"], row["read_gbs"] = max(fp16_r), max(shuf_r), max(read_r)
    row["pct_read"] = 100 * paired_ratio(fp16_r, read_r)
    row["pct_read_best"] = 100 * row["fp16_gbs"] / row["read_gbs"]
    row["pct_read_shuf"] = 100 * paired_ratio(shuf_r, read_r)
    int4_r = got[8]
    same_r = got[9] if same is not None else read_r
    row["read_same_gbs"] = max(same_r)
    row["pct_read_same"] = 100 * paired_ratio(fp16_r, same_r)
    row["fp16_tok_s"] = row["fp16_gbs"] * 1e9 / fp16[1] * batch
    row["int8_tok_s"] = max(int8_r) * 1e9 / int8[1] * batch
    row["int8_x_fp16_paired"] = paired_ratio([g / int8[1] for g in int8_r], [g / fp16[1] for g in fp16_r])
    row["int4_tok_s"] = max(int4_r) * 1e9 / int4[1] * batch
    row["int4_x_fp16_paired"] = paired_ratio([g / int4[1] for g in int4_r], [g / fp16[1] for g in fp16_r])


HOT_BYTES = 1 << 20  # fp16 KV of the compute-alone figure: fits one core's L2 with room to spare
HOT_SEQS = 32  # sequences reading it per call (the call overhead then ~3 % of the call)


def _per_call(fn, reps: int, calls: int) -> float:
    """Best over reps of the mean time of `calls` back-to-back calls."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def hot_figures(row: dict, n_q: int, n_kv: int, d: int, reps: int, n_threads: int) -> None:
    """The kernel's arithmetic alone: HOT_SEQS sequences whose block tables all name the same blocks, an fp16 KV
    of ~HOT_BYTES that stays in L2, fp16, int8 and int4 storage, on 1 thread and on n_threads: GB/s of KV bytes read,
    with the time of a one-token call of the same batch (Python and dispatch overhead) subtracted.
    alu_share_* = the row's 1-thread read bandwidth / the 1-thread rate. The n-thread rates show where the
    arithmetic binds the DRAM figures: ceil_pct_read = 100 * min(1, hot fp16 rate / the row's n-thread read), and
    ceil_int8_x_fp16 = int8 tokens/s at its n-thread arithmetic rate / the row's measured fp16 tokens/s."""
    from aiollm.native import attention

    ctx = max(BLOCK, HOT_BYTES // (n_kv * d * 2 * 2) // BLOCK * BLOCK)
    for nt in sorted({1, n_threads}):  # multiply-adds per second, at the same moment as the figures below
        row[f"fma_{nt}t_glanes"] = attention.fma_peak(nt, reps) / 1e9
    q = np.random.default_rng(1).standard_normal((HOT_SEQS, n_q, d)).astype(np.float32)
    for dtype in ("fp16", "int8", "int4"):
        k, v, scales, tables = _cache(1, ctx, n_kv, d, dtype)
        for nt in sorted({1, n_threads}):  # --threads 1: measured once
            full, nbytes = kernel(k, v, scales, np.repeat(tables, HOT_SEQS, axis=0), q, nt)
            empty, _ = kernel(k, v, scales, np.repeat(tables[:, :1], HOT_SEQS, axis=0), q, nt)
            t_empty = _per_call(empty, reps, 20)
            t_full = _per_call(full, reps, 5)
            row[f"hot_{dtype}_{nt}t_gbs"] = HOT_SEQS * nbytes / max(t_full - t_empty, 1e-9) / 1e9
        row[f"alu_share_{dtype}"] = row["read_1t_gbs"] / row[f"hot_{dtype}_1t_gbs"]
        if dtype == "int8":  # decode tokens/s at the row's context, at int8's arithmetic rate (bytes as kernel())
            int8_tok_s = row[f"hot_int8_{n_threads}t_gbs"] * 1e9 / (nbytes / ctx * row["ctx"])
            row["ceil_int8_x_fp16"] = int8_tok_s / row["fp16_tok_s"]
    row["ceil_pct_read"] = 100 * min(1.0, row[f"hot_fp16_{n_threads}t_gbs"] / row["read_gbs"])


def sdpa_entry(shape: tuple, dtype: str, n_threads: int, reps: int):
    """(fn, KV bytes read) of torch SDPA on one layer: the faster (best of reps) of enable_gqa=True and folding a
    group's q heads into the query axis."""
    import torch
    import torch.nn.functional as F

    batch, ctx, n_q, n_kv, d = shape
    torch.set_num_threads(n_threads)
    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    k = torch.full((batch, n_kv, ctx, d), 0.01, dtype=tdt)
    v = torch.full((batch, n_kv, ctx, d), 0.01, dtype=tdt)
    q = torch.randn(batch, n_q, 1, d).to(tdt)
    group = n_q // n_kv
    variants = {"folded": lambda: F.scaled_dot_product_attention(q.view(batch, n_kv, group, d), k, v)}
    if group > 1:
        variants["enable_gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with torch.inference_mode():
        fastest = min(variants.values(), key=lambda fn: _best(fn, reps))

    def call():
        with torch.inference_mode():
            fastest()

    return call, k.nbytes + v.nbytes


def torch_interaction(n_threads: int, reps: int) -> dict:
    """ms per attention call (SmolLM2, batch 64, context 1024) alone, right after a torch GEMM in the same
    thread (torch's OpenMP team just went idle), and while another Python thread runs torch GEMMs."""
    import threading

    import torch

    from aiollm.native import attention

    k, v, _, tables = _cache(64, 1024, 3, 64, "fp16")
    q = np.random.default_rng(1).standard_normal((64, 9, 64)).astype(np.float32)
    lens = np.full(64, 1024, np.int32)
    a = torch.randn(512, 2048)
    b = torch.randn(2048, 2048)

    def attend():
        attention.decode_attention(k, v, q, tables, lens, n_threads=n_threads)

    def gemm_then_attend():
        torch.mm(a, b)
        t0 = time.perf_counter()
        attend()
        return time.perf_counter() - t0

    torch.set_num_threads(n_threads)
    figures = {"alone_ms": _best(attend, reps * 3) * 1e3}
    gemm_then_attend()
    figures["after_torch_ms"] = min(gemm_then_attend() for _ in range(reps * 3)) * 1e3
    for torch_threads in sorted({1, n_threads}):
        torch.set_num_threads(torch_threads)
        stop = threading.Event()

        def churn(stop=stop):
            while not stop.is_set():
                torch.mm(a, b)

        worker = threading.Thread(target=churn)
        worker.start()
        try:
            figures[f"concurrent_torch{torch_threads}_ms"] = _best(attend, reps * 3) * 1e3
        finally:
            stop.set()
            worker.join()
    torch.set_num_threads(n_threads)
    return figures


def fma_bound_rows(rows: list[dict], n_threads: int) -> None:
    """fma_bound_*_gbs on every row: the fp16 KV bytes per second the cores' best FMA rate over the run allows (2 /
    group bytes per multiply-add), and fma_pct_read_* = 100 * bound / the row's read (1 and n_threads threads)."""
    for nt, read in ((1, "read_1t_gbs"), (n_threads, "read_gbs")):
        peak = max(r[f"fma_{nt}t_glanes"] for r in rows)
        for r in rows:
            n_q, n_kv, _ = SHAPES[r["shape"]]
            r[f"fma_bound_{nt}t_gbs"] = peak * 2 / (n_q // n_kv)
            r[f"fma_pct_read_{nt}t"] = 100 * r[f"fma_bound_{nt}t_gbs"] / r[read]


def _shape_list(quick: bool, only: str | None = None):
    for name, (n_q, n_kv, d) in SHAPES.items():
        if only and name != only:
            continue
        for batch in (64,) if quick else (64, 256):
            for ctx in (1024,) if quick else (1024, 4096):
                yield name, n_q, n_kv, d, batch, ctx


def _bytes_ratio(row: dict, other: str) -> float:
    """KV bytes per token of `other` storage over int4's on the row's shape (K and V, with the fp16 scales)."""
    d = SHAPES[row["shape"]][2]
    per_head = {"fp16": 4 * d, "int8": 2 * d + 4, "int4": d + 4}
    return per_head[other] / per_head["int4"]


def run(args) -> dict:
    from aiollm.native import attention

    reps = 2 if args.quick else 3
    rounds = 3 if args.quick else 5
    nt = args.threads
    buf = aligned_full((WINDOW // 4,), 1, np.float32)  # aligned like the KV, so the read is the best one
    far, far_int8 = attention.far_prefetch("fp16"), attention.far_prefetch("int8")
    print(
        f"kernel {attention.isa()}, far prefetch fp16 {'on' if far else 'off'}, int8 / int4 {'on' if far_int8 else 'off'} "
        f"(this CPU's default; *_far_alt: the other way for that storage, paired in the same rounds); read bandwidth measured beside each kernel figure (1 GiB, 1 and {nt} threads; "
        f"pct_* = median over {rounds} rounds of the same round's ratio)"
    )
    inter = torch_interaction(nt, reps)
    print("attention next to torch (SmolLM2 64x1024, ms/call): " + ", ".join(f"{k} {v:.2f}" for k, v in inter.items()))
    rows = []
    for name, n_q, n_kv, d, batch, ctx in _shape_list(args.quick, args.shape):
        per_seq = ctx * n_kv * d * 2 * 2
        run_batch = min(batch, max(1, int(args.max_gib * 2**30 // per_seq)))
        row = {
            "shape": name,
            "batch": batch,
            "ctx": ctx,
            "run_batch": run_batch,
            "kv_mib": round(run_batch * per_seq / 2**20),
        }
        s = (run_batch, ctx, n_q, n_kv, d)
        kernel_figures(row, s, nt, buf, rounds, reps)
        gc.collect()
        hot_figures(row, n_q, n_kv, d, reps + 2, nt)
        row["int8_x_fp16"] = row["int8_tok_s"] / row["fp16_tok_s"]
        row["int4_x_fp16"] = row["int4_tok_s"] / row["fp16_tok_s"]
        row["int4_x_int8"] = row["int4_tok_s"] / row["int8_tok_s"]
        row["sdpa_bf16_gbs"] = per_seq * row["sdpa_bf16_tok_s"] / 1e9  # bf16 KV: the fp16 bytes
        row["sdpa_fp32_gbs"] = 2 * per_seq * row["sdpa_fp32_tok_s"] / 1e9  # fp32 KV: twice as many
        ideal_tok_s = row["read_gbs"] * 1e9 / per_seq  # fp16 kernel at 100 % of the read bandwidth
        row["ceil_x_sdpa_bf16"] = ideal_tok_s / row["sdpa_bf16_tok_s"]
        row["ceil_x_sdpa_fp32"] = ideal_tok_s / row["sdpa_fp32_tok_s"]
        rows.append(row)
        print(f"measured {name} batch {batch} ctx {ctx}", flush=True)
    fma_bound_rows(rows, nt)
    print()
    print(table(rows, COLUMNS))
    long = [r for r in rows if r["ctx"] >= 1024]
    low = min(long, key=lambda r: r["pct_read"])
    print(
        f"lowest fp16 / read bandwidth ({nt} threads): {low['pct_read']:.1f} % on {low['shape']} "
        f"{low['batch']}x{low['ctx']} (best rounds {low['pct_read_best']:.1f} %, vs a read of its own size "
        f"{low['pct_read_same']:.1f} %)"
    )
    ceil_bf16 = min(rows, key=lambda r: r["ceil_x_sdpa_bf16"])
    ceil_fp32 = min(rows, key=lambda r: r["ceil_x_sdpa_fp32"])
    for name, r in (("bf16", ceil_bf16), ("fp32", ceil_fp32)):
        print(
            f"ceiling vs SDPA {name}: at 100 % of the {nt}-thread read bandwidth the fp16 kernel would reach "
            f"{r[f'ceil_x_sdpa_{name}']:.2f}x on {r['shape']} {r['batch']}x{r['ctx']} "
            f"(SDPA {name} reads {r[f'sdpa_{name}_gbs']:.1f} GB/s of {r['read_gbs']:.1f})"
        )
    for dtype in ("fp16", "int8", "int4"):
        r = max(rows, key=lambda r: r[f"alu_share_{dtype}"])
        print(
            f"{dtype} arithmetic alone (KV in L2, 1 thread): {min(x[f'hot_{dtype}_1t_gbs'] for x in rows):.1f}-"
            f"{max(x[f'hot_{dtype}_1t_gbs'] for x in rows):.1f} GB/s; at the 1-thread read bandwidth it needs up to "
            f"{100 * r[f'alu_share_{dtype}']:.0f} % of the core ({r['shape']} {r['batch']}x{r['ctx']})"
        )
    low_1t = min(long, key=lambda r: r["pct_read_1t"])
    ceil_1t = min(1.0, low_1t["hot_fp16_1t_gbs"] / low_1t["read_1t_gbs"])
    print(
        f"lowest fp16 / read bandwidth (1 thread): {low_1t['pct_read_1t']:.1f} % on {low_1t['shape']} "
        f"{low_1t['batch']}x{low_1t['ctx']}, whose arithmetic alone (KV in L2) reads {low_1t['hot_fp16_1t_gbs']:.1f} "
        f"GB/s against one core's read of {low_1t['read_1t_gbs']:.1f}: with a perfect overlap of the two at most "
        f"{100 * ceil_1t:.0f} % of the read"
    )
    print(
        f"fp16 arithmetic alone on {nt} threads (KV in L2): {low[f'hot_fp16_{nt}t_gbs']:.1f} GB/s on the lowest row "
        f"against its read of {low['read_gbs']:.1f}: at that rate it could reach {low['ceil_pct_read']:.0f} % of "
        "the read"
    )
    fma_1t = min(long, key=lambda r: r["fma_pct_read_1t"])
    fma_nt = min(long, key=lambda r: r[f"fma_pct_read_{nt}t"])
    fma_nt_pct = fma_nt[f"fma_pct_read_{nt}t"]
    print(
        f"fp32 multiply-add peak (12 FMA chains alone, best over the run): {max(r['fma_1t_glanes'] for r in rows):.1f} "
        f"G/s on 1 thread, {max(r[f'fma_{nt}t_glanes'] for r in rows):.1f} on {nt}; at 2 / group bytes of fp16 KV per "
        f"multiply-add no fp32 kernel passes {fma_1t['fma_bound_1t_gbs']:.1f} GB/s on one core for {fma_1t['shape']}: "
        f"{fma_1t['fma_pct_read_1t']:.0f} % of one core's read on {fma_1t['batch']}x{fma_1t['ctx']}, and "
        f"{fma_nt_pct:.0f} % of the {nt}-thread read on {fma_nt['shape']} "
        f"{fma_nt['batch']}x{fma_nt['ctx']}"
    )
    ceil_i8 = min(rows, key=lambda r: r["ceil_int8_x_fp16"])
    print(
        f"int8 arithmetic alone on {nt} threads: {ceil_i8[f'hot_int8_{nt}t_gbs']:.1f} GB/s of int8 KV on "
        f"{ceil_i8['shape']} {ceil_i8['batch']}x{ceil_i8['ctx']}, at that rate "
        f"{ceil_i8['ceil_int8_x_fp16']:.2f}x the fp16 tokens/s measured there"
    )
    low4 = min(rows, key=lambda r: r["int4_x_fp16"])
    print(
        f"int4 vs fp16 tokens/s: lowest {low4['int4_x_fp16']:.2f}x (paired {low4['int4_x_fp16_paired']:.2f}x) on "
        f"{low4['shape']} {low4['batch']}x{low4['ctx']}, {low4['int4_x_int8']:.2f}x int8 there; at one rate of bytes "
        f"it would be {_bytes_ratio(low4, 'fp16'):.2f}x fp16 and {_bytes_ratio(low4, 'int8'):.2f}x int8"
    )
    return {
        "isa": attention.isa(),
        "far_prefetch": far,
        "far_prefetch_int8": far_int8,
        "threads": nt,
        "read_bw_1t_gbs": max(r["read_1t_gbs"] for r in rows),
        f"read_bw_{nt}t_gbs": max(r["read_gbs"] for r in rows),
        "rows": rows,
        **{f"torch_{k}": v for k, v in inter.items()},
        "ratio_fp16_vs_read_bw": min(r["pct_read"] for r in long) / 100,
        "ratio_fp16_vs_read_bw_best": min(r["pct_read_best"] for r in long) / 100,
        "ratio_fp16_vs_read_bw_same_size": min(r["pct_read_same"] for r in long) / 100,
        "ratio_fp16_1t_vs_read_bw_1t": min(r["pct_read_1t"] for r in long) / 100,
        "ratio_fp16_shuffled_vs_read_bw": min(r["pct_read_shuf"] for r in long) / 100,
        "ratio_fp16_vs_sdpa_bf16": min(r["x_sdpa_bf16"] for r in rows),
        "ratio_fp16_vs_sdpa_fp32": min(r["x_sdpa_fp32"] for r in rows),
        "ratio_int8_vs_fp16": min(r["int8_x_fp16"] for r in rows),
        "ratio_int8_vs_fp16_paired": min(r["int8_x_fp16_paired"] for r in rows),
        "ratio_int4_vs_fp16": min(r["int4_x_fp16"] for r in rows),
        "ratio_int4_vs_fp16_paired": min(r["int4_x_fp16_paired"] for r in rows),
        "ratio_int4_vs_int8": min(r["int4_x_int8"] for r in rows),
        "ratio_fp16_vs_read_bw_far_alt": min(r["pct_read_far_alt"] for r in long) / 100,
        "ratio_int8_vs_fp16_far_alt": min(r["int8_x_fp16_far_alt"] for r in rows),
        "ceiling_fp16_vs_sdpa_bf16": ceil_bf16["ceil_x_sdpa_bf16"],
        "ceiling_fp16_vs_sdpa_fp32": ceil_fp32["ceil_x_sdpa_fp32"],
        "alu_share_fp16_max": max(r["alu_share_fp16"] for r in rows),
        "alu_share_int8_max": max(r["alu_share_int8"] for r in rows),
        "alu_share_int4_max": max(r["alu_share_int4"] for r in rows),
        "ceiling_fp16_vs_read_bw": low["ceil_pct_read"] / 100,  # on the row that sets ratio_fp16_vs_read_bw
        "ceiling_fp16_1t_vs_read_bw_1t": ceil_1t,  # on the row that sets ratio_fp16_1t_vs_read_bw_1t
        "ceiling_int8_vs_fp16": ceil_i8["ceil_int8_x_fp16"],
        "fma_peak_1t_glanes": max(r["fma_1t_glanes"] for r in rows),
        f"fma_peak_{nt}t_glanes": max(r[f"fma_{nt}t_glanes"] for r in rows),
        "ceiling_fp16_1t_fma_vs_read_bw_1t": fma_1t["fma_pct_read_1t"] / 100,  # the multiply-adds alone, 1 thread
        "ceiling_fp16_fma_vs_read_bw": fma_nt_pct / 100,
    }
