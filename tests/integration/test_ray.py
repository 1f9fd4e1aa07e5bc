"""Serving on Ray: a local Ray cluster of three nodes (ray.cluster_utils.Cluster, on loopback), roles placed by
custom resources (the controller and frontend on the head, the decode instance on a node of its own, the prefill
instance on a third that can also take decode work). A node is removed mid-stream: Ray restarts the decode
instance on the remaining decode-capable node, it rejoins the controller at its new address, and every request
ends with the greedy tokens of an undisturbed run. Tearing the deployment down leaves no node process. The same
for an R-worker: restarted on another Ray node at another address, its decode instance follows it there."""

import os
import signal
import subprocess
import threading
import time

import openai
import pytest

# a local Ray keeps to loopback (its node address would otherwise be this machine's interface)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from aiollm.deploy.ray import RayCluster  # noqa: E402
from aiollm.deploy.spec import ClusterSpec  # noqa: E402
from aiollm.model.engine import generate  # noqa: E402
from aiollm.model.loader import load  # noqa: E402
from aiollm.model.sampling import SamplingParams  # noqa: E402
from aiollm.testing.tiny_llama import write_hf_dir  # noqa: E402

PROMPTS = ["The capital of France", "Once upon a time", "def add(a, b):", "Hello there"]
HTTP_PORT = 18095


def _node_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-fa", "aiollm.node"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def _reference(tmp_path) -> tuple[list[list[int]], list[str]]:
    """A tiny model in tmp_path; the prompts' token ids and the greedy texts of an undisturbed run."""
    write_hf_dir(tmp_path)
    model = load(str(tmp_path))
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    return prompts, [c.text for c in generate(model, prompts, SamplingParams(max_tokens=24, ignore_eos=True))]


def _wait_until(condition, timeout_s: float, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(poll_s)


@pytest.mark.slow
def test_roles_placed_by_resource_survive_the_loss_of_their_ray_node(tmp_path):
    prompts, expected = _reference(tmp_path)
    spec = ClusterSpec.from_dict(
        {
            "model": {"name": str(tmp_path)},
            "node": {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0},
            "prefill": {"ray_resources": {"prefill": 1}},
            "decode": {"ray_resources": {"decode": 1}},
            "controller": {"ray_resources": {"control": 1}, "resume_timeout_s": 90},
            "frontend": {"ray_resources": {"control": 1}, "port": HTTP_PORT},
        }
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"control": 2}})
    decode_node = cluster.add_node(num_cpus=2, resources={"decode": 1})
    cluster.add_node(num_cpus=2, resources={"prefill": 1, "decode": 1})
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    try:
        with RayCluster(spec, cluster.address) as deployed:
            placed = deployed.where("decode0")
            assert placed["node_id"] == decode_node.node_id
            assert deployed.where("controller")["node_id"] == cluster.head_node.node_id
            client = openai.OpenAI(base_url=f"{deployed.base_url}/v1", api_key="t", max_retries=0, timeout=180)
            streamed: list = []
            results, threads = _stream_all(client, tmp_path.name, prompts, streamed)
            _wait_until(lambda: len(streamed) >= 4, 60, 0.01)
            # the decode instance's host is lost mid-stream: its node process and its Ray node with it
            os.kill(placed["pid"], signal.SIGKILL)
            cluster.remove_node(decode_node)
            for t in threads:
                t.join(240)
            assert sorted(results) == list(enumerate(expected))
            # restarted on the other decode-capable node, at a new port it registers with the controller
            _wait_until(lambda: deployed.where("decode0")["pid"] != placed["pid"], 60)
            moved = deployed.where("decode0")
            assert moved["node_id"] != decode_node.node_id and moved["pid"] != placed["pid"]
        _wait_until(lambda: not _node_processes(), 30)
        assert not _node_processes()
    finally:
        ray.shutdown()
        cluster.shutdown()


def _stream_all(client, model: str, prompts: list[list[int]], streamed: list) -> tuple[list, list]:
    """Stream every prompt from its own thread; the list that gets (index, text) of each as it ends, and the
    threads."""
    results: list = []

    def ask(i: int) -> None:
        stream = client.completions.create(
            model=model, prompt=prompts[i], max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        text = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                text.append(chunk.choices[0].text)
                streamed.append(1)
        results.append((i, "".join(text)))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return results, threads


@pytest.mark.slow
def test_a_decode_instance_follows_its_r_worker_to_another_ray_node(tmp_path):
    prompts, expected = _reference(tmp_path)
    spec = ClusterSpec.from_dict(
        {
            "model": {"name": str(tmp_path)},
            "node": {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0},
            "prefill": {"ray_resources": {"serving": 1}},
            "decode": {"ray_resources": {"serving": 1}, "r_workers": 1},
            "r_worker": {"ray_resources": {"attention": 1}},
            "controller": {"ray_resources": {"control": 1}, "resume_timeout_s": 90},
            "frontend": {"ray_resources": {"control": 1}, "port": HTTP_PORT + 1},
        }
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"control": 2}})
    cluster.add_node(num_cpus=4, resources={"serving": 2})
    first = cluster.add_node(num_cpus=2, resources={"attention": 1})
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    try:
        with RayCluster(spec, cluster.address) as deployed:
            placed = deployed.where("r-worker0.0")
            assert placed["node_id"] == first.node_id
            client = openai.OpenAI(base_url=f"{deployed.base_url}/v1", api_key="t", max_retries=0, timeout=180)
            streamed: list = []
            results, threads = _stream_all(client, tmp_path.name, prompts, streamed)
            _wait_until(lambda: len(streamed) >= 4, 60, 0.01)
            cluster.add_node(num_cpus=2, resources={"attention": 1})  # where the R-worker can go
            os.kill(placed["pid"], signal.SIGKILL)  # the R-worker's host is lost mid-stream
            cluster.remove_node(first)
            for t in threads:
                t.join(240)
            assert sorted(results) == list(enumerate(expected))
            _wait_until(lambda: deployed.where("r-worker0.0")["pid"] != placed["pid"], 60)
            moved = deployed.where("r-worker0.0")
            assert moved["node_id"] != first.node_id and moved["url"] != placed["url"]
            # the decode instance decodes through the R-worker at its new address
            later, threads = _stream_all(client, tmp_path.name, prompts, [])
            for t in threads:
                t.join(240)
            assert sorted(later) == list(enumerate(expected))
        _wait_until(lambda: not _node_processes(), 30)
        assert not _node_processes()
    finally:
        ray.shutdown()
        cluster.shutdown()
