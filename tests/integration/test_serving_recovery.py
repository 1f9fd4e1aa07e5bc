"""Instance loss and take-back with real processes: a SIGKILLed decode instance fails its in-flight
request with a clear error when no other decode instance is left, a restarted one re-registers and
serves again, and a frozen prefill instance declared dead by the heartbeat is taken back once it
answers. Every node is a `python -m aiollm.node` subprocess started through `aiollm.deploy.graph.Graph`
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

# a dead peer is noticed within HEARTBEAT_TIMEOUT; the controller probes dead instances every 2 s
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
async def test_killed_decode_fails_clearly_restarted_one_serves_frozen_prefill_comes_back(tmp_path):
    write_hf_dir(tmp_path)
    expected = generate(load(str(tmp_path)), [PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
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
            ),
        )
        controller_url = controller.actors["controller"]
        client = ClusterClient(controller_url)
        await graph.driver.spawn(client, "frontend")
        assert await _tokens(client, "warm", 8) == expected

        # SIGKILL the only decode instance mid-stream: the request cannot fail over, so it fails and says why
        got = []
        with pytest.raises(Unavailable, match=r"decode instance decode0 lost .*no live decode instance"):
            async for delta in client.submit(
                GenerateRequest("long", tuple(PROMPT), SamplingParams(max_tokens=2000, ignore_eos=True))
            ):
                got += delta.token_ids
                if len(got) == 3:
                    decode.process.send_signal(signal.SIGKILL)
        with pytest.raises(Unavailable, match="no live decode instance"):
            await _tokens(client, "while-down", 4)

        # a restarted decode instance joins under the same name and serves the same greedy tokens
        await graph.start_node(
            "decode",
            process=True,
            args=("--actor", "decode0", *model, "--kv-blocks", "128", "--controller", controller_url),
        )
        assert await _tokens(client, "after-restart", 8) == expected

        # a frozen prefill instance: declared dead by the heartbeat, taken back by the probe once it answers
        prefill.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(CONFIG.heartbeat_timeout + 1.0)
            with pytest.raises(Unavailable, match="no live prefill instance"):
                await _tokens(client, "while-frozen", 4)
        finally:
            prefill.process.send_signal(signal.SIGCONT)
        await _until_served(client, expected)
