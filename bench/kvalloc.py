"""Decode attention over the block tables a serving pool really hands out: fresh, after churn, grown in lockstep.

The kernel streams a sequence's blocks in table order, and the hardware prefetchers follow a run of adjacent
blocks but restart at every jump, so how the allocator lays sequences out in the pool sets the R-part's speed
as much as the kernel does. One layer of SmolLM2 (9 q / 3 kv heads, d=64, 6 KiB of fp16 K per block), a batch
of B sequences of S tokens in a pool of twice their blocks, on the bench's threads; each table kind is paired
in the same rounds with the library's read kernel (bench.attention.paired):
- fresh: each sequence one run (a pool nothing was freed from yet);
- churned: the pool first lives through an R-worker's admissions and frees of mixed lengths (4-128 blocks,
  filled to 95 %, ~4 % freed per round), then the batch is admitted, once with aiollm's BlockAllocator (best-fit
  runs) and once with a LIFO free list, sorted per sequence (the simplest allocator, the baseline), from the same
  sequence of requests;
- lockstep: the batch grows from one block each, one block per sequence per round (a decode batch), through
  BlockTable with its default extent (16 blocks per growth) and with extent 1 (every round's blocks interleaved:
  no reservation).
Figures: blocks per run of the batch's tables, GB/s of KV read, the share of the read kernel (pct_read, median
over rounds of the same round's ratio), and the ratios between table kinds (`ratio_churned_vs_lifo`,
`ratio_lockstep_extent_vs_single`, `ratio_churned_vs_fresh`). A histogram of blocks per run goes to --plot.
"""

from pathlib import Path

import numpy as np

from aiollm.kv.layouts import LifoFreeList, blocks_per_run, churned_tables, lockstep_tables
from aiollm.native.arrays import aligned_full
from aiollm.report import table
from bench.attention import WINDOW, paired, paired_ratio, reader

N_Q, N_KV, HEAD_DIM, BLOCK = 9, 3, 64, 16


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=256, help="sequences attended per call (default 256)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument(
        "--churn-rounds",
        type=int,
        default=2000,
        help="admit/free rounds before the batch (an R-worker some hours into its life)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="paired measurement rounds")
    parser.add_argument("--threads", type=int, default=2, help="attention threads")
    parser.add_argument("--plot", type=Path, default=Path("kvalloc_runs.png"), help="PNG of blocks per run")


def attention_entry(k, v, scales, tables: np.ndarray, q: np.ndarray, n_threads: int):
    """(fn, KV bytes the call reads) of decode_attention over tables (the batch's blocks, not the whole pool)."""
    from aiollm.native import attention

    lens = np.full(len(tables), tables.shape[1] * BLOCK, np.int32)
    out = np.empty_like(q)
    per_block = (k[0].nbytes + v[0].nbytes) + (2 * scales[0].nbytes if scales is not None else 0)
    return (
        lambda: attention.decode_attention(
            k, v, q, tables, lens, k_scale=scales, v_scale=scales, out=out, n_threads=n_threads
        )
    ), tables.size * per_block


def run(args) -> dict:
    from aiollm.kv.blocks import BlockAllocator

    batch, blocks = args.batch, -(-args.seq_len // BLOCK)
    n_blocks = 2 * batch * blocks
    kinds = {
        "fresh": np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks),
        "churned": churned_tables(BlockAllocator(n_blocks), batch, blocks, args.churn_rounds),
        "churned_lifo": churned_tables(LifoFreeList(n_blocks), batch, blocks, args.churn_rounds),
        "lockstep": lockstep_tables(n_blocks, batch, blocks, 16),
        "lockstep_single": lockstep_tables(n_blocks, batch, blocks, 1),
    }
    k = aligned_full((n_blocks, N_KV, HEAD_DIM, BLOCK), 0.01, np.float16)  # on cache lines, as KVPool allocates
    v = aligned_full((n_blocks, N_KV, BLOCK, HEAD_DIM), 0.01, np.float16)
    k8, v8 = aligned_full(k.shape, 1, np.int8), aligned_full(v.shape, 1, np.int8)
    scales = aligned_full((n_blocks, N_KV, BLOCK), 0.01, np.float16)
    q = np.random.default_rng(1).standard_normal((batch, N_Q, HEAD_DIM)).astype(np.float32)
    print(
        f"SmolLM2 layer, {batch} sequences x {blocks * BLOCK} tokens in a pool of {n_blocks} blocks, "
        f"{args.threads} threads, {args.rounds} paired rounds against the read kernel (1 GiB)",
        flush=True,
    )
    # (table kind, dtype): every fp16 kind, and int8 where the allocators differ
    measured = [(name, "fp16") for name in kinds] + [("churned", "int8"), ("churned_lifo", "int8")]
    caches = {"fp16": (k, v, None), "int8": (k8, v8, scales)}
    entries = [attention_entry(*caches[dtype], kinds[name], q, args.threads) for name, dtype in measured]
    entries.append(reader(np.ones(WINDOW // 4, np.float32), args.threads))
    got = paired(entries, args.rounds)
    read = got[-1]
    rows = []
    for (name, dtype), rates in zip(measured, got):
        runs = blocks_per_run(kinds[name])
        rows.append(
            {
                "tables": name,
                "dtype": dtype,
                "blocks_per_run": float(runs.mean()),
                "blocks_per_run_p10": float(np.percentile(runs, 10)),
                "gbs": max(rates),
                "pct_read": 100 * paired_ratio(rates, read),
            }
        )
    print(table(rows))
    by = {f"{name}_{dtype}": rates for (name, dtype), rates in zip(measured, got)}
    _plot({name: blocks_per_run(t) for name, t in kinds.items()}, args.plot)
    print(f"wrote {args.plot}")
    return {
        "batch": batch,
        "seq_len": blocks * BLOCK,
        "pool_blocks": n_blocks,
        "threads": args.threads,
        "read_gbs": max(read),
        "rows": rows,
        **{f"blocks_per_run_{name}": float(blocks_per_run(t).mean()) for name, t in kinds.items()},
        "ratio_churned_vs_lifo": paired_ratio(by["churned_fp16"], by["churned_lifo_fp16"]),
        "ratio_churned_vs_lifo_int8": paired_ratio(by["churned_int8"], by["churned_lifo_int8"]),
        "ratio_lockstep_extent_vs_single": paired_ratio(by["lockstep_fp16"], by["lockstep_single_fp16"]),
        "ratio_churned_vs_fresh": paired_ratio(by["churned_fp16"], by["fresh_fp16"]),
    }


def _plot(runs: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    top = max(float(r.max()) for r in runs.values())
    bins = np.logspace(0, np.log10(max(2.0, top) * 1.2), 30)
    for name, r in runs.items():
        ax.hist(r, bins=bins, histtype="step", label=f"{name} (mean {r.mean():.1f})")
    ax.set_xscale("log")
    ax.set_xlabel("blocks per run of consecutive ids (per sequence)")
    ax.set_ylabel("sequences")
    ax.set_title("How the pool lays out a decode batch's KV")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
