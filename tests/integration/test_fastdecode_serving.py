"""FastDecode end to end: an S-worker (here, on the test's node) and R-workers as separate OS processes
(`python -m aiollm.node --role r-worker`, TCP between them) on a tiny random Llama with fp32 KV.

Greedy tokens equal the colocated `generate()` with and without the two-minibatch pipeline and the
load-stabilising schedule, and also when one R-worker process is killed (SIGKILL) mid-generation (its
sequences are re-prefilled onto the survivor); an R-worker at its budget refuses a sequence with a clear
error and loses nothing it holds; a released sequence gives its blocks back."""

import asyncio
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from aiollm.actors.node import NodeConfig
from aiollm.calibrate.turns import TakingTurns, Turns
from aiollm.deploy.graph import Graph
from aiollm.errors import RemoteError
from aiollm.model.engine import generate
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.sched.sls import SLSConfig
from aiollm.serving import runner
from aiollm.serving.backend import GenerateRequest
from aiollm.serving.distserve.client import ClusterClient
from aiollm.serving.fastdecode.messages import (
    Admit,
    Attend,
    GetRLoad,
    GetTrace,
    Release,
    Synthetic,
)
from aiollm.serving.fastdecode.s_worker import SWorker, SWorkerConfig
from aiollm.testing.fastdecode_cluster import start_r_workers

# mixed lengths, crossing 16-token block boundaries while decoding
PROMPTS = [
    [5, 17, 42, 99, 3],
    list(range(20, 57)),
    [33],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200],
    list(range(100, 131)),
    [9, 9],
]
MAX_TOKENS = [14, 9, 20, 12, 6, 17]


async def _generate(client: ClusterClient, prompts, params) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        out = []
        async for delta in client.submit(GenerateRequest(f"req-{i}", tuple(prompts[i]), params[i])):
            out += delta.token_ids
        return out

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


@pytest.mark.slow
async def test_tokens_equal_colocated_generate_with_and_without_pipeline_and_schedule(tiny_fd):
    model, directory = tiny_fd
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    expected = [c.token_ids for c in generate(model, PROMPTS, params)]
    async with Graph() as graph:
        urls = await start_r_workers(graph, directory, 2, "4MiB")
        workers = [graph.ref(u) for u in urls]
        driver = graph.driver
        for i, (pipeline, schedule) in enumerate(
            [
                (False, None),
                (True, None),
                (False, SLSConfig(batch_size=4, seq_len=48, interval=4)),
                (True, SLSConfig(batch_size=4, seq_len=48, interval=4)),
            ]
        ):
            max_batch = 4 if schedule else 8
            s = await driver.spawn(
                SWorker(model, urls, SWorkerConfig(max_batch=max_batch, pipeline=pipeline, schedule=schedule)), f"s-{i}"
            )
            client = ClusterClient(s.url)
            await driver.spawn(client, f"client-{i}")
            got = await _generate(client, PROMPTS, params)
            assert got == expected, f"pipeline={pipeline} schedule={schedule}"
            trace = await s.ask(GetTrace())
            assert max(trace.batch) <= max_batch
            if schedule is not None:  # micro-batches of M = B*F/S = 1 start at most one per F steps
                assert all(n <= 1 for n in trace.started)
            loads = await asyncio.gather(*(w.ask(GetRLoad()) for w in workers))
            assert all(load.sequences == 0 and load.blocks_used == 0 for load in loads)
            assert all(load.tokens == 0 for load in loads)
            await driver.stop_actor(f"s-{i}")
        # bf16 weights (bf16 q/o on the wire) with fp16 KV, as served: equal to colocated bf16 with fp16 KV
        bf16 = load(directory, dtype="bf16")
        expected = [c.token_ids for c in generate(bf16, PROMPTS, params, kv_dtype="fp16")]
        urls = await start_r_workers(graph, directory, 2, "4MiB", kv_dtype="fp16")
        s = await driver.spawn(SWorker(bf16, urls, SWorkerConfig(max_batch=8)), "s-bf16")
        client = ClusterClient(s.url)
        await driver.spawn(client, "client-bf16")
        assert await _generate(client, PROMPTS, params) == expected
        # each side reports its CPU seconds (the step model's measured terms come from them)
        trace = await s.ask(GetTrace())
        assert len(trace.cpu_s) == len(trace.step_s) and sum(trace.cpu_s) > 0
        assert all(load.cpu_s > 0 for load in await asyncio.gather(*(graph.ref(u).ask(GetRLoad()) for u in urls)))
        # an S-worker stopped mid-generation releases what it holds on the R-workers, which outlive it
        await s.ask(Synthetic([5, 9, 30], 10_000))
        held = await asyncio.gather(*(graph.ref(u).ask(GetRLoad()) for u in urls))
        assert sum(load.sequences for load in held) == 3
        await driver.stop_actor("s-bf16")
        for _ in range(50):  # Release is a tell
            loads = await asyncio.gather(*(graph.ref(u).ask(GetRLoad()) for u in urls))
            if all(load.sequences == 0 for load in loads):
                break
            await asyncio.sleep(0.05)
        assert all(load.sequences == 0 and load.blocks_used == 0 for load in loads)


@pytest.mark.slow
async def test_s_workers_taking_turns_give_the_same_tokens_and_never_step_at_once(tiny_fd):
    """The schedule trace's two S-workers (aiollm.calibrate.turns), one with the schedule: each decodes exactly as alone, and
    one's steps (its S-part and its R-worker round trips) never overlap the other's."""
    model, directory = tiny_fd
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    expected = [c.token_ids for c in generate(model, PROMPTS, params)]
    async with Graph() as graph:
        urls = await start_r_workers(graph, directory, 2, "4MiB")
        turns = Turns([("plain", 3), ("scheduled", 2)], lead=("scheduled", 4))
        refs = {}
        for name, url, schedule in (
            ("plain", urls[0], None),
            ("scheduled", urls[1], SLSConfig(batch_size=4, seq_len=48, interval=4)),
        ):
            config = SWorkerConfig(max_batch=4, pipeline=True, schedule=schedule)
            refs[name] = await graph.driver.spawn(
                TakingTurns(model, [url], config, turns=turns, turn_name=name), f"s-{name}"
            )

        async def run(name: str) -> list[list[int]]:
            client = ClusterClient(refs[name].url)
            await graph.driver.spawn(client, f"client-{name}")
            got = await _generate(client, PROMPTS, params)
            await turns.leave(name)  # done: its idle loop would hold its next turn
            return got

        got = await asyncio.wait_for(asyncio.gather(run("plain"), run("scheduled")), 120)
        assert got == [expected, expected]
        spans = {}
        for name, ref in refs.items():
            trace = await ref.ask(GetTrace())
            spans[name] = [(end - step, end) for step, end in zip(trace.step_s, trace.ended)]
        assert all(
            b_end <= a_start or a_end <= b_start
            for a_start, a_end in spans["plain"]
            for b_start, b_end in spans["scheduled"]
        )
        assert len(turns.starts["plain"]) >= 2 and len(turns.starts["scheduled"]) >= 2  # they did take turns


@pytest.mark.slow
async def test_killed_r_worker_its_sequences_resume_on_the_survivor_with_the_same_tokens(tiny_fd):
    model, directory = tiny_fd
    params = [SamplingParams(max_tokens=n + 120, ignore_eos=True) for n in MAX_TOKENS]
    expected = [c.token_ids for c in generate(model, PROMPTS, params)]
    async with Graph() as graph:
        urls = await start_r_workers(graph, directory, 2, "4MiB")
        victim = next(h for h in graph.nodes if h.actors.get("r-worker") == urls[0])
        s = await graph.driver.spawn(SWorker(model, urls, SWorkerConfig(max_batch=8, pipeline=True)), "s")
        client = ClusterClient(s.url)
        await graph.driver.spawn(client, "client")
        generating = asyncio.create_task(_generate(client, PROMPTS, params))
        while len((await s.ask(GetTrace())).step_s) < 5:
            await asyncio.sleep(0.001)
        victim.process.kill()  # SIGKILL mid-generation: no goodbye, the connection just drops
        got = await asyncio.wait_for(generating, 120)
        assert got == expected
        trace = await s.ask(GetTrace())
        assert 0 < trace.recovered <= len(PROMPTS) and len(trace.step_s) < max(MAX_TOKENS) + 120
        load = await graph.ref(urls[1]).ask(GetRLoad())
        assert load.sequences == 0 and load.blocks_used == 0


async def test_a_prefill_longer_than_the_heartbeat_timeout_loses_no_r_worker(tiny_fd, monkeypatch):
    """The S-worker prefills off its event loop: with each prefill slowed past the cluster's heartbeat timeout its
    node keeps answering heartbeats, so the R-worker processes keep it and the tokens are generate()'s. (Run on
    the loop, a 4096-token prefill on a slow host would keep it silent for seconds, and the R-workers would drop
    it.)"""
    model, directory = tiny_fd
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS[:3]]
    expected = [c.token_ids for c in generate(model, PROMPTS[:3], params)]
    prefill_into = runner.prefill_into

    def slow_prefill(*args):
        time.sleep(1.2)  # releases the GIL, as torch does: only a loop that waits on the call stalls
        return prefill_into(*args)

    monkeypatch.setattr(runner, "prefill_into", slow_prefill)
    config = NodeConfig(secret=secrets.token_hex(32).encode(), heartbeat_interval=0.1, heartbeat_timeout=0.5)
    async with Graph(config) as graph:
        urls = await start_r_workers(graph, directory, 1, "4MiB")
        s = await graph.driver.spawn(SWorker(model, urls, SWorkerConfig(max_batch=8)), "s")
        client = ClusterClient(s.url)
        await graph.driver.spawn(client, "client")
        got = await asyncio.wait_for(_generate(client, PROMPTS[:3], params), 60)
        assert got == expected
        assert (await s.ask(GetTrace())).recovered == 0  # no R-worker was lost and re-placed


async def test_r_worker_at_budget_refuses_and_keeps_what_it_holds(tiny_fd):
    model, directory = tiny_fd
    c = model.config
    # fp32, 2 layers, 2 KV heads x 16 dims: 8 KiB per 16-token block; 64 KiB = 8 blocks = 128 tokens
    async with Graph() as graph:
        (url,) = await start_r_workers(graph, directory, 1, "64KiB")
        r = graph.ref(url)
        load = await r.ask(Admit(0, "a", 20, 100))
        assert (load.sequences, load.tokens, load.blocks_used, load.blocks_total) == (1, 20, 7, 8)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, c.n_heads, c.head_dim, generator=gen)
        k = torch.randn(1, c.n_kv_heads, c.head_dim, generator=gen)
        first = (await r.ask(Attend(0, 0, np.array([0]), torch.cat((q, k, k), 1), np.array([20])))).o
        assert torch.allclose(first, _expected_o(q, k, zeros=20, copies=1), atol=1e-5)
        with pytest.raises(RemoteError) as refused:
            await r.ask(Admit(1, "b", 10, 40))
        assert refused.value.type_name == "AdmissionRefused"
        assert "KV budget" in refused.value.message and "refuses sequence b" in refused.value.message
        load = await r.ask(GetRLoad())
        assert (load.sequences, load.tokens, load.blocks_used) == (1, 21, 7)
        # the held sequence still attends over exactly what it held, plus the new entry
        second = (await r.ask(Attend(0, 0, np.array([0]), torch.cat((q, k, k), 1), np.array([21])))).o
        assert torch.allclose(second, _expected_o(q, k, zeros=20, copies=2), atol=1e-5)
        await r.tell(Release([0]))
        load = await r.ask(GetRLoad())
        assert (load.sequences, load.tokens, load.blocks_used) == (0, 0, 0)
        load = await r.ask(Admit(1, "b", 10, 40))
        assert (load.sequences, load.blocks_used) == (1, 3)


def _expected_o(q, k, zeros: int, copies: int) -> torch.Tensor:
    """Attention of q over `zeros` zero entries then `copies` entries with K = V = k (grouped heads)."""
    group = q.shape[1] // k.shape[1]
    kk = k[0].repeat_interleave(group, dim=0)  # [n_heads, d]
    score = (q[0] * kk).sum(-1) / q.shape[-1] ** 0.5
    weight = copies * torch.exp(score) / (zeros + copies * torch.exp(score))
    return (weight[:, None] * kk)[None]


@pytest.mark.slow
def test_example_graph_runs_s_worker_and_r_worker_processes(tiny_fd):
    _, directory = tiny_fd
    example = Path(__file__).parents[2] / "examples" / "fastdecode_graph.py"
    done = subprocess.run(
        [
            sys.executable,
            str(example),
            "--model",
            str(directory),
            "--max-tokens",
            "4",
            "--kv-dtype",
            "fp32",
            "--sls-interval",
            "4",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "16 tokens in" in done.stdout and "1 S-worker + 2 R-worker processes" in done.stdout
