"""Faults: the same trace served without and with a schedule of faults (every role killed or stopped in turn).

    python -m bench faults [--requests 150] [--rate 2.0] [--json PATH] [--plot faults.png]

One `python -m aiollm serve` cluster (the bundled model, 1 prefill and 1 offloaded decode instance with 2
R-workers, the controller and the frontend, each its own process) serves a fixed workload twice: ShareGPT
prompts at a steady rate, alternately greedy and seeded sampling, through the official openai client. The first
pass is fault-free; during the second the schedule SIGKILLs the decode instance, the prefill instance, an
R-worker, the controller, stops the decode instance with SIGSTOP for 10 s, and SIGKILLs the frontend (whose
streams break: the client sends those requests again, as any client of a restarted server would).

Figures (JSON keys): `requests_total`, `requests_lost` (requests that ended in an error; target 0),
`requests_resent_by_client` (the frontend kill's broken streams), `outputs_identical_fraction` (texts equal to
the fault-free pass, target 1.0, with `_greedy` and `_seeded`), `goodput_under_faults_vs_fault_free` (requests
meeting the SLOs per second, faulted / fault-free; target >= 0.8), and per fault kind
`recovery_seconds_p50_KIND` / `recovery_seconds_max_KIND`: over the requests streaming when the fault struck,
the time from the fault to their next token, and `completion_gap_seconds_KIND`: from the fault to the next request
completed by anyone. `kv_repull_seconds` / `kv_reprefill_seconds` (and their ratio
`kv_repull_vs_reprefill_seconds`): for a request of `--resume-prompt-len` tokens whose decode instance dies before
decoding a token, the seconds from the death to its next token, from a second decode instance, with its KV pulled
again from the prefill instance or prefilled again (in-process nodes over TCP, median of 3). A cut link between
hosts needs network namespaces and is not part of this bench.

Overload: then a burst of 10x the frontend's limit of requests in flight arrives at once. `overload_outcomes`
counts how each ended (completed, or 429 with Retry-After), `overload_accepted_not_completed` (target 0) and
`overload_refused_without_retry_after` (target 0) the failures of the rule, and `overload_rss_growth_mib_max` the
largest growth of any node process's resident memory over the burst.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openai

from aiollm.report import table

# (seconds into the trace, kind, role, signal, seconds stopped)
SCHEDULE = (
    (6.0, "decode_kill", "decode", signal.SIGKILL, 0.0),
    (16.0, "prefill_kill", "prefill", signal.SIGKILL, 0.0),
    (26.0, "r_worker_kill", "r-worker", signal.SIGKILL, 0.0),
    (36.0, "controller_kill", "controller", signal.SIGKILL, 0.0),
    (46.0, "decode_stop", "decode", signal.SIGSTOP, 10.0),
    (62.0, "frontend_kill", "frontend", signal.SIGKILL, 0.0),
)
# the SLOs goodput counts against: generous, since the point is what faults cost, not the box's speed
TTFT_SLO_S, TPOT_SLO_S = 5.0, 0.5
# the frontend's limit of requests in flight, and the burst sent at once against it (10x)
OVERLOAD_IN_FLIGHT = 64
OVERLOAD_BURST = 10 * OVERLOAD_IN_FLIGHT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=150, help="requests per pass")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (steady arrivals)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--max-prompt-len", type=int, default=256, help="longest ShareGPT prompt kept, tokens")
    parser.add_argument("--plot", type=Path, default=Path("faults.png"), help="PNG of requests over time")
    parser.add_argument(
        "--resume-prompt-len", type=int, default=1024, help="prompt tokens of the KV re-pull vs re-prefill timing"
    )


@dataclass
class Outcome:
    """One request as its client saw it (times in seconds from the pass's start)."""

    arrival: float
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    error: str = ""
    resent: int = 0

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)


def _prompts(n: int, max_len: int) -> list[list[int]]:
    from aiollm.model.loader import load_tokenizer
    from aiollm.planner.datasets import read_sharegpt, sharegpt_pairs

    tokenizer, _ = load_tokenizer("smollm2")
    conversations, _ = read_sharegpt()
    out = []
    for prompt, _ in sharegpt_pairs(conversations, 0):
        ids = tokenizer.encode(prompt)
        if 4 <= len(ids) <= max_len:
            out.append(ids)
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT prompts of at most {max_len} tokens")


class Cluster:
    """`python -m aiollm serve` on a free port; `kill(role)` signals one of its node processes."""

    def __init__(self, directory: Path) -> None:
        config = directory / "cluster.toml"
        config.write_text(
            '[model]\nname = "smollm2"\n[decode]\nr_workers = 2\n[r_worker]\nkv_memory = "256MiB"\n'
            "[node]\nheartbeat_interval = 0.5\nheartbeat_timeout = 2.5\n[controller]\nresume_timeout_s = 90\n"
            f"[frontend]\nport = 0\nmax_in_flight = {OVERLOAD_IN_FLIGHT}\n"
        )
        self.log = (directory / "serve.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aiollm", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        line = ""
        while "serving" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with status {self.proc.returncode}; see {self.log.name}")
        self.base_url = line.split(" at ")[1].split()[0]

    def pid(self, role: str) -> int:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        for pid in map(int, out.stdout.split()):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if f"--role {role} " in cmd + " ":
                return pid
        raise RuntimeError(f"no {role} process")

    def rss_mib(self) -> dict[str, float]:
        """Resident memory of each node process, by role (and pid, for roles with several)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        rss = {}
        for pid in map(int, out.stdout.split()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            role = cmd[cmd.index(b"--role") + 1].decode() if b"--role" in cmd else "?"
            kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            rss[f"{role}:{pid}"] = kib / 1024
        return rss

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def _request(client: openai.AsyncOpenAI, i: int, prompt: list[int], args, start: float) -> Outcome:
    """Stream request i; on a broken connection (a killed frontend) send it again after a pause, as a client
    of a restarted server does. Even i are greedy, odd i seeded sampling."""
    outcome = Outcome(time.perf_counter() - start)
    sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 10_000 + i}
    deadline = time.perf_counter() + 180
    while True:
        text, times = [], []
        try:
            stream = await client.completions.create(
                model="smollm2",
                prompt=prompt,
                max_tokens=args.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
                **sampling,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    text.append(chunk.choices[0].text)
                    times.append(time.perf_counter() - start)
            outcome.text, outcome.token_times = "".join(text), outcome.token_times + times
            return outcome
        except openai.APIConnectionError as exc:
            if time.perf_counter() > deadline:
                outcome.error = f"connection: {exc}"
                return outcome
            outcome.resent += 1
            outcome.token_times += times
            await asyncio.sleep(1.0)
        except openai.APIError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
            outcome.token_times += times
            return outcome


async def _pass(cluster: Cluster, prompts: list[list[int]], args, faults: bool) -> tuple[list[Outcome], list, float]:
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="bench", max_retries=0, timeout=300)
    start = time.perf_counter()
    injected: list[tuple[float, str]] = []

    async def timed(i: int) -> Outcome:
        await asyncio.sleep(max(0.0, start + i / args.rate - time.perf_counter()))
        return await _request(client, i, prompts[i], args, start)

    async def schedule() -> None:
        for at, kind, role, sig, stopped in SCHEDULE:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            pid = cluster.pid(role)
            os.kill(pid, sig)
            injected.append((time.perf_counter() - start, kind))
            print(f"  t={injected[-1][0]:5.1f} s: {kind} (pid {pid})", flush=True)
            if stopped:
                await asyncio.sleep(stopped)
                os.kill(pid, signal.SIGCONT)

    tasks = [asyncio.create_task(timed(i)) for i in range(len(prompts))]
    faulter = asyncio.create_task(schedule()) if faults else None
    outcomes = await asyncio.gather(*tasks)
    if faulter is not None:
        await faulter
    await client.close()
    return list(outcomes), injected, time.perf_counter() - start


async def _burst(cluster: Cluster, prompts: list[list[int]], args) -> dict:
    """OVERLOAD_BURST requests at once against a frontend that serves OVERLOAD_IN_FLIGHT: every accepted request
    must complete, every other get 429 with Retry-After, and no process may grow without bound."""
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="bench", max_retries=0, timeout=600)
    before = cluster.rss_mib()

    async def one(i: int) -> str:
        try:
            out = await client.completions.with_raw_response.create(
                model="smollm2", prompt=prompts[i % len(prompts)], max_tokens=16, temperature=0
            )
            return "completed" if out.parse().choices[0].finish_reason else "no finish"
        except openai.RateLimitError as exc:
            return "429 retry-after" if exc.response.headers.get("retry-after") else "429"
        except openai.APIError as exc:
            return f"error: {type(exc).__name__}"

    outcomes = await asyncio.gather(*(one(i) for i in range(OVERLOAD_BURST)))
    after = cluster.rss_mib()
    await client.close()
    counts = {kind: outcomes.count(kind) for kind in sorted(set(outcomes))}
    growth = {name: after[name] - before[name] for name in after if name in before}
    return {
        "overload_burst_requests": OVERLOAD_BURST,
        "overload_frontend_max_in_flight": OVERLOAD_IN_FLIGHT,
        "overload_outcomes": counts,
        "overload_refused_without_retry_after": counts.get("429", 0),
        "overload_accepted_not_completed": sum(n for k, n in counts.items() if not k.startswith(("completed", "429"))),
        "overload_rss_growth_mib_max": max(growth.values()) if growth else None,
        "overload_rss_after_mib": after,
    }


def _goodput(outcomes: list[Outcome], duration: float) -> float:
    good = 0
    for o in outcomes:
        if not o.ok:
            continue
        ttft = o.token_times[0] - o.arrival
        tpot = (o.token_times[-1] - o.token_times[0]) / max(1, len(o.token_times) - 1)
        good += ttft <= TTFT_SLO_S and tpot <= TPOT_SLO_S
    return good / duration


def _recovery(outcomes: list[Outcome], at: float) -> list[float]:
    """For each request streaming at `at` (arrived, not finished): seconds from `at` to its next token."""
    out = []
    for o in outcomes:
        if o.arrival < at and o.token_times and o.token_times[-1] > at:
            out.append(next(t for t in o.token_times if t > at) - at)
    return out


def _completion_gap(outcomes: list[Outcome], at: float) -> float | None:
    """Seconds from `at` to the next request completed after it."""
    done = [o.token_times[-1] for o in outcomes if o.ok and o.token_times[-1] > at]
    return min(done) - at if done else None


async def _resume_seconds(model, prompt: list[int], repull: bool) -> float:
    """Seconds from the death of a request's decode instance (before it decoded a token) to the request's next
    token, served by a second decode instance: its KV pulled again from the prefill instance, or prefilled again.
    In-process nodes over TCP; the dead instance never pulled, so the cost is the recovery path alone."""
    from aiollm.actors import Node, NodeConfig
    from aiollm.model.sampling import SamplingParams
    from aiollm.serving.backend import GenerateRequest
    from aiollm.serving.distserve.client import ClusterClient
    from aiollm.serving.distserve.controller import Controller, ControllerConfig
    from aiollm.serving.distserve.decode import DecodeConfig, DecodeInstance
    from aiollm.serving.distserve.prefill import PrefillConfig, PrefillInstance
    from aiollm.testing.silent_decode import SilentDecode

    blocks = len(prompt) // 16 + 8
    nodes = []
    for _ in range(5):
        node = Node(NodeConfig(secret=b"bench-faults-resume-secret-0123"))
        await node.start(["tcp://127.0.0.1:0"])
        nodes.append(node)
    try:
        prefill_url = (await nodes[0].spawn(PrefillInstance(model, PrefillConfig(kv_blocks=blocks)), "p")).url
        silent = SilentDecode()
        silent_url = (await nodes[1].spawn(silent, "d0")).url
        decode = DecodeInstance(model, DecodeConfig(kv_blocks=blocks * 2))
        decode_url = (await nodes[2].spawn(decode, "d1")).url
        urls = {"d0": silent_url, "d1": decode_url}
        controller = Controller({"p": prefill_url}, urls, ControllerConfig(repull=repull))
        client = ClusterClient((await nodes[3].spawn(controller, "c")).url)
        await nodes[4].spawn(client, "f")
        times: list[float] = []

        async def stream() -> None:
            request = GenerateRequest("r", tuple(prompt), SamplingParams(max_tokens=4, ignore_eos=True))
            async for _ in client.submit(request):
                times.append(time.perf_counter())

        streaming = asyncio.create_task(stream())
        while not (silent.got and times):
            await asyncio.sleep(0.01)
        died = time.perf_counter()
        await nodes[1].stop()
        while len(times) < 2:
            await asyncio.sleep(0.001)
        await streaming
        return times[1] - died
    finally:
        for node in reversed(nodes):
            await node.stop()


def _plot(path: Path, clean: list[Outcome], faulted: list[Outcome], injected: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for outcomes, label in ((clean, "fault-free"), (faulted, "under faults")):
        done = sorted(o.token_times[-1] for o in outcomes if o.ok)
        ax.step(done, range(1, len(done) + 1), where="post", label=label)
    for at, kind in injected:
        ax.axvline(at, color="red", alpha=0.4, linestyle="--")
        ax.text(at, ax.get_ylim()[1] * 0.95, kind, rotation=90, va="top", fontsize=7, color="red")
    ax.set_xlabel("seconds into the trace")
    ax.set_ylabel("requests completed")
    ax.set_title("Requests completed over time, with the faults marked")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    prompts = _prompts(args.requests, args.max_prompt_len)
    with tempfile.TemporaryDirectory(prefix="aiollm-faults-") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            print(f"fault-free pass: {args.requests} requests at {args.rate} req/s", flush=True)
            clean, _, clean_s = asyncio.run(_pass(cluster, prompts, args, faults=False))
            print("pass under faults:", flush=True)
            faulted, injected, faulted_s = asyncio.run(_pass(cluster, prompts, args, faults=True))
            print(f"burst: {OVERLOAD_BURST} requests at once, {OVERLOAD_IN_FLIGHT} served at a time", flush=True)
            overload = asyncio.run(_burst(cluster, prompts, args))
        finally:
            cluster.close()
    same = [c.ok and f.ok and c.text == f.text for c, f in zip(clean, faulted)]
    figures: dict = {
        "requests_total": len(faulted),
        "requests_lost": sum(not f.ok for f in faulted),
        "requests_lost_fault_free": sum(not c.ok for c in clean),
        "requests_resent_by_client": sum(f.resent > 0 for f in faulted),
        "outputs_identical_fraction": sum(same) / len(same),
        "outputs_identical_fraction_greedy": float(np.mean(same[0::2])),
        "outputs_identical_fraction_seeded": float(np.mean(same[1::2])),
        "goodput_fault_free_rps": _goodput(clean, clean_s),
        "goodput_under_faults_rps": _goodput(faulted, faulted_s),
        "slo_ttft_s": TTFT_SLO_S,
        "slo_tpot_s": TPOT_SLO_S,
        "errors": sorted({f.error[:200] for f in faulted if f.error}),
        **overload,
    }
    from aiollm.model.loader import load

    model = load("smollm2")
    long_prompt = [i for p in prompts for i in p][: args.resume_prompt_len]
    for repull in (True, False):
        key = "kv_repull_seconds" if repull else "kv_reprefill_seconds"
        figures[key] = float(np.median([asyncio.run(_resume_seconds(model, long_prompt, repull)) for _ in range(3)]))
    figures["kv_repull_vs_reprefill_seconds"] = figures["kv_repull_seconds"] / figures["kv_reprefill_seconds"]
    figures["kv_resume_prompt_tokens"] = len(long_prompt)
    fault_free = figures["goodput_fault_free_rps"]
    figures["goodput_under_faults_vs_fault_free"] = (
        figures["goodput_under_faults_rps"] / fault_free if fault_free else None
    )
    rows = []
    for at, kind in injected:
        stalls = _recovery(faulted, at)
        p50 = float(np.median(stalls)) if stalls else None
        worst = float(max(stalls)) if stalls else None
        figures[f"recovery_seconds_p50_{kind}"], figures[f"recovery_seconds_max_{kind}"] = p50, worst
        gap = figures[f"completion_gap_seconds_{kind}"] = _completion_gap(faulted, at)
        rows.append(
            {"fault": kind, "at_s": round(at, 1), "streaming": len(stalls), "p50_s": p50, "max_s": worst, "gap_s": gap}
        )
    print(table(rows))
    _plot(args.plot, clean, faulted, injected)
    print(f"wrote {args.plot}")
    return figures
