"""Instance loss and take-back with real processes: the requests of a SIGKILLed decode instance wait for its
restart and end with the tokens an undisturbed run gives, a frozen prefill instance declared dead by the
heartbeat is taken back once it answers, and a request fails with a clear error when no instance comes back
within the controller's resume timeout. Every node is a `python -m aiollm.node` subprocess started through `aiollm.deploy.graph.Graph`
(stopped, or killed, when the test ends); the frontend's client actor runs in this process."""

import asyncio
import signal

import pytest

from aiollm.actors import NodeConfig
from aiollm.deploy.graph import Graph
from aiollm.model.engine import generate
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.serving.backend import GenerateRequest, Unavailable
from aiollm.serving.distserve.client import ClusterClient
from aiollm.testing.actor_helpers import SECRET
from aiollm.testing.tiny_llama import write_hf_dir

# a dead peer is noticed within HEARTBEAT_TIMEOUT; the controller probes dead instances every 0.5 s
CONFIG = NodeConfig(secret=SECRET, heartbeat_interval=0.2, heartbeat_timeout=1.0)
PROMPT = [1, 17, 42, 99, 7, 3]


async def _tokens(client: ClusterClient, rid: str, max_tokens: int) -> list[int]:
    out = []
    async for delta in client.submit(
        GenerateRequest(rid, tuple(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    ):
        out += delta.token_ids
    return out


async def _until_served(client: ClusterClient, expected: list[int], timeout: float = 20.0) -> None:
    """Retry a short request until the cluster serves it (the take-back is asynchronous)."""
    deadline = asyncio.get_running_loop().time() + timeout
    attempt = 0
    while True:
        attempt += 1
        try:
            assert await _tokens(client, f"probe-{attempt}", len(expected)) == expected
            return
        except Unavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.3)


@pytest.mark.slow
async def test_a_killed_decode_instance_costs_latency_not_the_request_and_a_frozen_prefill_comes_back(tmp_path):
    write_hf_dir(tmp_path)
    expected = generate(load(str(tmp_path)), [PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    model = ("--model", str(tmp_path))
    decode_args = ("--actor", "decode0", *model, "--kv-blocks", "128")
    async with Graph(CONFIG) as graph:
        prefill, decode = await asyncio.gather(
            graph.start_node("prefill", process=True, args=("--actor", "prefill0", *model, "--kv-blocks", "64")),
            graph.start_node("decode", process=True, args=decode_args),
        )
        controller = await graph.start_node(
            "controller",
            process=True,
            args=(
                "--prefill",
                f"prefill0={prefill.actors['prefill0']}",
                "--decode",
                f"decode0={decode.actors['decode0']}",
                "--resume-timeout",
                "20",
            ),
        )
        controller_url = controller.actors["controller"]
        client = ClusterClient(controller_url)
        await graph.driver.spawn(client, "frontend")
        assert await _tokens(client, "warm", 24) == expected

        # SIGKILL the only decode instance mid-stream: the request and one sent meanwhile wait for its restart,
        # and both end with the tokens an undisturbed run gives
        got = []
        later = None
        async for delta in client.submit(
            GenerateRequest("long", tuple(PROMPT), SamplingParams(max_tokens=24, ignore_eos=True))
        ):
            got += delta.token_ids
            if later is None and len(got) >= 3:
                decode.process.send_signal(signal.SIGKILL)
                await decode.process.wait()
                later = asyncio.create_task(_tokens(client, "while-down", 24))
                await asyncio.sleep(1.5)
                await graph.start_node("decode", process=True, args=(*decode_args, "--controller", controller_url))
        assert got == expected
        assert await later == expected

        # a frozen prefill instance: declared dead by the heartbeat, its request waits, taken back once it answers
        prefill.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(CONFIG.heartbeat_timeout + 1.0)
            waiting = asyncio.create_task(_tokens(client, "while-frozen", 24))
            await asyncio.sleep(1.0)
            assert not waiting.done()
        finally:
            prefill.process.send_signal(signal.SIGCONT)
        assert await waiting == expected
        await _until_served(client, expected)


@pytest.mark.slow
async def test_a_request_fails_clearly_when_no_decode_instance_returns_in_time(tmp_path):
    write_hf_dir(tmp_path)
    model = ("--model", str(tmp_path))
    async with Graph(CONFIG) as graph:
        prefill, decode = await asyncio.gather(
            graph.start_node("prefill", process=True, args=("--actor", "prefill0", *model, "--kv-blocks", "64")),
            graph.start_node("decode", process=True, args=("--actor", "decode0", *model, "--kv-blocks", "128")),
        )
        controller = await graph.start_node(
            "controller",
            process=True,
            args=(
                "--prefill",
                f"prefill0={prefill.actors['prefill0']}",
                "--decode",
                f"decode0={decode.actors['decode0']}",
                "--resume-timeout",
                "2",
            ),
        )
        client = ClusterClient(controller.actors["controller"])
        await graph.driver.spawn(client, "frontend")
        decode.process.send_signal(signal.SIGKILL)
        await decode.process.wait()
        await asyncio.sleep(CONFIG.heartbeat_timeout)
        with pytest.raises(Unavailable, match="no live decode instance within 2 s"):
            await _tokens(client, "while-down", 4)
