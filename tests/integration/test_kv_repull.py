"""KV-preserving recovery: a request whose decode instance dies before decoding a token has another decode
instance pull its KV from the prefill instance again, instead of prefilling it again, and ends with the tokens of
an undisturbed run; while no decode instance is alive it waits with its KV held, and with re-pulls off it is
prefilled again."""

import asyncio

import pytest

from aiollm.actors import Node, NodeConfig
from aiollm.model.engine import generate
from aiollm.model.sampling import SamplingParams
from aiollm.serving.backend import GenerateRequest
from aiollm.serving.distserve.client import ClusterClient
from aiollm.serving.distserve.controller import Controller, ControllerConfig, register_with
from aiollm.serving.distserve.decode import DecodeConfig, DecodeInstance
from aiollm.serving.distserve.prefill import PrefillConfig, PrefillInstance
from aiollm.testing.silent_decode import SilentDecode

SECRET = b"kv-repull-test-secret-0123456789"
PROMPT = [1, 17, 42, 99, 7, 3, 11, 5]


async def _node() -> Node:
    node = Node(NodeConfig(secret=SECRET, heartbeat_interval=0.2, heartbeat_timeout=1.0))
    await node.start(["tcp://127.0.0.1:0"])
    return node


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("repull", [True, False])
async def test_a_request_whose_decode_died_before_decoding_pulls_its_kv_again(tiny, repull):
    expected = generate(tiny, [PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    nodes = [await _node() for _ in range(5)]
    try:
        prefill = PrefillInstance(tiny, PrefillConfig(kv_blocks=64))
        prefill_url = (await nodes[0].spawn(prefill, "prefill0")).url
        hole = SilentDecode()
        hole_url = (await nodes[1].spawn(hole, "decode0")).url
        controller = Controller({"prefill0": prefill_url}, {"decode0": hole_url}, ControllerConfig(repull=repull))
        controller_url = (await nodes[2].spawn(controller, "controller")).url
        client = ClusterClient(controller_url)
        await nodes[3].spawn(client, "frontend")

        got: list[int] = []

        async def stream() -> None:
            request = GenerateRequest("r", tuple(PROMPT), SamplingParams(max_tokens=12, ignore_eos=True))
            async for delta in client.submit(request):
                got.extend(delta.token_ids)

        streaming = asyncio.create_task(stream())
        await _until(lambda: hole.got and got)  # prefilled (its first token streamed) and sent to the silent one
        await nodes[1].stop()  # the decode instance dies before pulling: the request waits for another
        await asyncio.sleep(1.5)
        assert not streaming.done()
        if repull:  # its KV waits on the prefill instance
            assert prefill.cache.used_blocks > 0

        decode = DecodeInstance(tiny, DecodeConfig(kv_blocks=128))
        ref = await nodes[4].spawn(decode, "decode1")
        await register_with(nodes[4], controller_url, "decode1", "decode", ref)
        await asyncio.wait_for(streaming, 30)
        assert got == expected
        assert controller.resumed == ({"repull": 1, "reprefill": 0} if repull else {"repull": 0, "reprefill": 1})
        await _until(lambda: prefill.cache.used_blocks == 0)  # pulled and acked: nothing left behind
    finally:
        for node in reversed(nodes):
            await node.stop()
