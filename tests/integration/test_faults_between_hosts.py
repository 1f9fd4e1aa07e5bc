"""Faults between hosts: the decode instance runs in its own network namespace (a "host" joined by a veth pair),
the prefill instance and the controller in this one. A link cut for 10 s, a link with delay and loss, and the
decode process stopped for 10 s each cost latency only: every request ends with the tokens of an undisturbed run.
Skipped where namespaces cannot be made (not root), the lossy link where the kernel has no netem; the namespace
is always deleted."""

import asyncio
import contextlib
import os
import signal

import pytest

from aiollm.actors import NodeConfig
from aiollm.deploy.graph import Graph
from aiollm.model.engine import generate
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.serving.backend import GenerateRequest
from aiollm.serving.distserve.client import ClusterClient
from aiollm.testing.actor_helpers import SECRET
from aiollm.testing.netns import Host, available
from aiollm.testing.tiny_llama import write_hf_dir

CAN, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CAN, reason=WHY)]
CONFIG = NodeConfig(secret=SECRET, heartbeat_interval=0.2, heartbeat_timeout=1.0)
PROMPT = [1, 17, 42, 99, 7, 3]
MAX_TOKENS = 24


async def _stream(client: ClusterClient, rid: str, on_token=None) -> list[int]:
    out: list[int] = []
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    async for delta in client.submit(GenerateRequest(rid, tuple(PROMPT), sampling)):
        out += delta.token_ids
        if on_token is not None:
            await on_token(len(out))
    return out


@contextlib.asynccontextmanager
async def _split_cluster(directory):
    """Prefill instance and controller here, the decode instance in a namespace of its own; yields (host, the
    decode node, a ClusterClient, the expected tokens)."""
    write_hf_dir(directory)
    model = load(str(directory))
    expected = generate(model, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    flags = ("--model", str(directory))
    with Host(f"aiollm-t{os.getpid()}") as host:
        async with Graph(CONFIG) as graph:
            prefill = await graph.start_node(
                "prefill", process=True, listen=f"tcp://{host.gateway}:0", args=("--actor", "prefill0", *flags)
            )
            decode = await graph.start_node(
                "decode",
                process=True,
                prefix=host.exec,
                listen=f"tcp://{host.ip}:0",
                args=("--actor", "decode0", *flags, "--kv-blocks", "128"),
            )
            assert decode.url.startswith(f"tcp://{host.ip}:")
            wiring = ("--prefill", f"prefill0={prefill.actors['prefill0']}", "--decode")
            controller = await graph.start_node(
                "controller",
                process=True,
                listen=f"tcp://{host.gateway}:0",
                args=(*wiring, f"decode0={decode.actors['decode0']}", "--resume-timeout", "60"),
            )
            client = ClusterClient(controller.actors["controller"], resume_timeout_s=60)
            await graph.driver.spawn(client, "frontend")
            assert await _stream(client, "warm") == expected
            yield host, decode, client, expected


async def test_a_link_cut_for_10_s_mid_stream_costs_latency_only(tmp_path):
    async with _split_cluster(tmp_path) as (host, _, client, expected):

        async def cut(n: int) -> None:
            if n == 3:
                host.link(up=False)
                asyncio.get_running_loop().call_later(10.0, host.link, True)

        assert await _stream(client, "cut", cut) == expected


async def test_a_link_with_delay_and_loss_changes_no_answer(tmp_path):
    async with _split_cluster(tmp_path) as (host, _, client, expected):
        ok, why = host.netem_available()
        if not ok:
            pytest.skip(why)
        host.netem("delay 30ms loss 10%")
        try:
            assert await _stream(client, "lossy") == expected
        finally:
            host.netem(None)


async def test_a_decode_instance_stopped_for_10_s_costs_latency_only(tmp_path):
    async with _split_cluster(tmp_path) as (_, decode, client, expected):

        async def stop(n: int) -> None:
            if n == 3:
                decode.process.send_signal(signal.SIGSTOP)
                asyncio.get_running_loop().call_later(10.0, decode.process.send_signal, signal.SIGCONT)

        assert await _stream(client, "stopped", stop) == expected
