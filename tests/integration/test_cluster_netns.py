"""A cluster across "hosts": three network namespaces on one bridge (aiollm.testing.netns.Lan), the prefill
instance on one, a colocated decode instance and an offloaded one's R-worker on another, the controller, the
frontend and the offloaded decode instance on the third. Started role by role from the per-role CLI, and again
from one TOML spec whose sections say where each role listens; the official openai client, from this namespace,
gets the greedy tokens of the colocated generate() through both decode instances. Skipped where namespaces cannot
be made (not root); the namespaces are always deleted."""

import asyncio
import os

import openai
import pytest

from aiollm.actors import NodeConfig
from aiollm.deploy.graph import Graph
from aiollm.deploy.roles import Wiring
from aiollm.deploy.spec import ClusterSpec
from aiollm.model.engine import generate
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.testing.actor_helpers import SECRET
from aiollm.testing.netns import Lan, available
from aiollm.testing.tiny_llama import write_hf_dir

CAN, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CAN, reason=WHY)]
PROMPTS = ["The capital of France", "Once upon a time", "def add(a, b):", "Hello"]
HTTP_PORT = 18080


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("netns-llama")
    write_hf_dir(directory)
    return directory


def _expected(directory) -> list[str]:
    model = load(str(directory))
    tok = model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    return [c.text for c in generate(model, prompts, SamplingParams(max_tokens=12))]


async def _complete(base_url: str, model: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="test", max_retries=0, timeout=120)
    try:
        # at once, so the least-loaded dispatch spreads them over both decode instances
        outs = await asyncio.gather(
            *(client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0) for p in PROMPTS * 2)
        )
    finally:
        await client.close()
    return [o.choices[0].text for o in outs]


async def _wait_http(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient() as http:
        while True:
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert asyncio.get_running_loop().time() < deadline, f"{url} did not answer"
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("how", ["flags", "spec"])
async def test_a_cluster_across_namespaces_serves_the_reference_tokens(model_dir, how):
    expected = _expected(model_dir) * 2
    with Lan(f"aiollm-c{os.getpid() % 1000}{how[0]}", 3) as lan:
        a, b, c = lan.hosts
        spec = ClusterSpec.from_dict(
            {
                "model": {"name": str(model_dir)},
                "prefill": {"listen": f"tcp://{a.ip}:0"},
                "decode": {"listen": f"tcp://{b.ip}:0", "kv_blocks": 256},
                "r_worker": {"listen": f"tcp://{b.ip}:0", "kv_memory": "64MiB"},
                "controller": {"listen": f"tcp://{c.ip}:0"},
                "frontend": {"listen": f"tcp://{c.ip}:0", "host": c.ip, "port": HTTP_PORT},
            }
        )
        model = ("--model", str(model_dir))
        async with Graph(NodeConfig(secret=SECRET)) as graph:

            async def start(role, host, wiring=Wiring(), args=(), listen_on=None):
                if how == "flags":  # everything on the command line, no spec file
                    listen = f"tcp://{(listen_on or host).ip}:0"
                    return await graph.start_node(
                        role, process=True, prefix=host.exec, listen=listen, wiring=wiring, args=args
                    )
                # the spec says where each role listens; only the wiring is given
                spec_here = spec
                if listen_on is not None:
                    spec_here = spec.override({"decode.listen": f"tcp://{listen_on.ip}:0"})
                return await graph.start_node(role, process=True, prefix=host.exec, spec=spec_here, wiring=wiring)

            flags = model if how == "flags" else ()
            prefill = await start("prefill", a, Wiring(actor="prefill0"), flags)
            decode0 = await start("decode", b, Wiring(actor="decode0"), flags)
            r_args = (*model, "--kv-memory", "64MiB") if how == "flags" else ()
            r_worker = await start("r-worker", b, args=r_args)
            decode1 = await start(
                "decode", c, Wiring(actor="decode1", r_workers=(r_worker.actors["r-worker"],)), flags, listen_on=c
            )
            for handle, host in ((prefill, a), (decode0, b), (r_worker, b), (decode1, c)):
                assert handle.url.startswith(f"tcp://{host.ip}:"), handle.url
            actors = {**prefill.actors, **decode0.actors, **decode1.actors}
            wiring = Wiring(
                prefill={"prefill0": actors["prefill0"]}, decode={k: actors[k] for k in ("decode0", "decode1")}
            )
            controller = await start("controller", c, wiring)
            frontend_args = (*model, "--http-host", c.ip, "--http-port", str(HTTP_PORT)) if how == "flags" else ()
            await start("frontend", c, Wiring(controller=controller.actors["controller"]), frontend_args)
            base = f"http://{c.ip}:{HTTP_PORT}"
            await _wait_http(f"{base}/health")
            assert await _complete(f"{base}/v1", model_dir.name) == expected
