"""The planner's loop on a running local cluster: a workload shift makes the replanner add a decode instance
(it registers and serves), a shift back removes it again (drained first), no request is lost or changed during
either change, and /metrics shows the instance counts and the replans. The policy here is a rate threshold (the
DistServe placement needs a latency profile of this machine, which `python -m aiollm.plan profile` measures);
the loop, the scaler and the drain are the ones `serve` runs with `[planner] replan = true`."""

import asyncio
import time

import httpx
import openai
import pytest

from aiollm.actors import NodeConfig
from aiollm.deploy.graph import Graph
from aiollm.deploy.local import start_cluster
from aiollm.deploy.scale import Replanner, Scaler
from aiollm.deploy.spec import ClusterSpec
from aiollm.planner.replan import MonitorConfig
from aiollm.testing.actor_helpers import SECRET
from aiollm.testing.tiny_llama import write_hf_dir

PROMPTS = ["The capital of France", "Once upon a time", "def add(a, b):", "Hello there"]


async def _load(client: openai.AsyncOpenAI, model: str, rate: float, seconds: float) -> list[str]:
    """Requests at `rate` per second for `seconds`, all awaited; their texts."""
    tasks = []
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < seconds:
        prompt = PROMPTS[i % len(PROMPTS)]
        tasks.append(
            asyncio.create_task(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0))
        )
        i += 1
        await asyncio.sleep(1 / rate)
    return [r.choices[0].text for r in await asyncio.gather(*tasks)]


@pytest.mark.slow
async def test_a_workload_shift_changes_the_instance_counts_and_a_shift_back_reverses_it(tmp_path):
    write_hf_dir(tmp_path)
    spec = ClusterSpec.from_dict(
        {
            "model": {"name": str(tmp_path)},
            "frontend": {"port": 0},
            "planner": {"replan": True, "max_instances": 3},
        }
    )
    config = NodeConfig(secret=SECRET, heartbeat_interval=0.2, heartbeat_timeout=2.0)
    async with Graph(config, startup_timeout=120) as graph:
        cluster = await start_cluster(graph, spec)
        scaler = Scaler(cluster)
        monitor = MonitorConfig(window_s=4.0, min_requests=3, threshold=0.5, cooldown_s=6.0)
        replanner = Replanner(scaler, lambda stats: (1, 2 if stats.rate > 3.0 else 1), monitor, budget=3)
        client = openai.AsyncOpenAI(base_url=f"{cluster.base_urls[0]}/v1", api_key="t", max_retries=0, timeout=120)
        loop = None
        try:
            reference = [
                r.choices[0].text
                for r in [
                    await client.completions.create(model=tmp_path.name, prompt=p, max_tokens=8, temperature=0)
                    for p in PROMPTS
                ]
            ]

            def expected(texts):
                return [reference[i % len(PROMPTS)] for i in range(len(texts))]

            await replanner.forget_past()  # the reference requests above are no workload
            loop = asyncio.create_task(replanner.run())

            calm = await _load(client, tmp_path.name, rate=1.0, seconds=8)
            assert calm == expected(calm) and scaler.counts() == {"prefill": 1, "decode": 1}
            busy = await _load(client, tmp_path.name, rate=6.0, seconds=8)  # the shift: a second decode joins
            assert busy == expected(busy)
            deadline = time.monotonic() + 60
            while scaler.counts()["decode"] < 2:
                assert time.monotonic() < deadline, "no replan to 2 decode instances"
                await asyncio.sleep(0.5)
            during = await _load(client, tmp_path.name, rate=1.0, seconds=8)  # the shift back: drained away
            assert during == expected(during)
            while scaler.counts()["decode"] > 1:
                assert time.monotonic() < deadline + 60, "no replan back to 1 decode instance"
                await _load(client, tmp_path.name, rate=1.0, seconds=2)
            assert [(r.before, r.after) for r in replanner.history] == [
                ({"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 2}),
                ({"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 1}),
            ]
            assert all(r.seconds < 120 for r in replanner.history)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{cluster.base_urls[0]}/metrics")).text
            assert "aiollm_replans 2.0" in metrics and 'aiollm_instances{kind="decode"} 1.0' in metrics
        finally:
            if loop is not None:
                loop.cancel()
            await client.close()
