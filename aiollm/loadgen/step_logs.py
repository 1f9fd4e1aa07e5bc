"""The instances' own timings during each rate of a `bench serve` run (`--step-log DIR`), in the form
the planner's simulator-vs-real check fits its latency model to.

Why per rate: how much the instances slow each other down on shared cores depends on the load, so
each rate's simulation gets the step times measured while that rate was served. The request hop
(HTTP, tokenisation, controller) is measured too, per request: from the client's send to the prefill
instance's receipt, and from the end of its prefill batch to the client's first token; requests are
matched to prefill records by prompt length and time, and a request the controller held back (the
instance had its queue limit of requests not yet prefilled, the controller's `prefill_queue_limit`) is
marked, since its way in includes queueing.
"""

from __future__ import annotations

from pathlib import Path

from aiollm.serving.step_log import read_step_log


def read_logs(directory: Path) -> list[dict]:
    return [record for path in sorted(directory.glob("*.jsonl")) for record in read_step_log(path)]


def steps_between(
    records: list[dict],
    start: float,
    end: float,
    prompt_lens: list[int],
    sends: list[float],
    ttfts: list[float | None],
    queue_limit: int = 4,
) -> dict:
    """The records that started in [start, end) as compact lists, and each request's hop delays."""
    mine = [r for r in records if start <= r["start"] < end]
    prefill = [r for r in mine if r["kind"] == "prefill"]
    decode = [r for r in mine if r["kind"] == "decode"]
    out = {
        "prefill": [[sum(r["lengths"]), sum(x * x for x in r["lengths"]), r["end"] - r["start"]] for r in prefill],
        "decode": [[r["batch"], r["context"], r["end"] - r["start"]] for r in decode],
        "pull": [[r["tokens"], r["end"] - r["start"]] for r in mine if r["kind"] == "pull"],
        # when each decode step, prefill batch and pull ran, seconds after `start` (the clock the sends are
        # on): which decode step's token a client saw first, and how the machine's speed varied
        "decode_at": [[r["start"] - start, r["end"] - start] for r in decode],
        "prefill_at": [[r["start"] - start, r["end"] - start] for r in prefill],
        "pull_at": [[r["start"] - start, r["end"] - start, r["tokens"]] for r in mine if r["kind"] == "pull"],
    }
    # (length, receipt time, batch end) of every prefilled request, to match the client's requests against
    received = [(length, recv, r["end"]) for r in prefill for length, recv in zip(r["lengths"], r["recv"])]
    hop_in, hop_out, held = [], [], []
    for length, send, ttft in zip(prompt_lens, sends, ttfts):
        match = (
            None
            if ttft is None
            else min(
                (x for x in received if x[0] == length and send <= x[1] <= send + ttft),
                key=lambda x: x[1],
                default=None,
            )
        )
        hop_in.append(None if match is None else match[1] - send)
        hop_out.append(None if match is None else send + ttft - match[2])
        # the controller holds a request while the instance has `queue_limit` not yet prefilled: then the
        # way in includes queueing, which the simulator models itself
        held.append(sum(1 for _, recv, end in received if recv <= send < end) >= queue_limit)
    out["hop_in"], out["hop_out"], out["held"] = hop_in, hop_out, held
    return out
