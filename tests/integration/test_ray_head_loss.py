"""Losing the Ray head does not stop serving: `python -m aiollm serve --ray` on a two-node local Ray cluster
(ray.cluster_utils.Cluster, on loopback, in a process of its own), then the head's GCS is killed. Ray ends
every process connected to it, role actors and the deployment's Ray driver included; the instances already
running serve on with the greedy tokens of the reference, and stopping `serve` stops every node over aiollm's
own transport, leaving none behind."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import openai
import pytest

pytest.importorskip("ray")

from aiollm.model.engine import generate
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.testing.tiny_llama import write_hf_dir

PROMPTS = ["The capital of France", "Once upon a time", "def add(a, b):"]
HTTP_PORT = 18096
# the Ray processes give up on a lost GCS after this many seconds (Ray's default is 60)
RECONNECT_S = "3"

RAY_HOST = textwrap.dedent(
    """
    import json, time
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"control": 2}})
    cluster.add_node(num_cpus=2, resources={"prefill": 1, "decode": 1})
    gcs = cluster.head_node.all_processes["gcs_server"][0].process.pid
    print(json.dumps({"address": cluster.address, "gcs_pid": gcs}), flush=True)
    while True:
        time.sleep(1)
    """
)


def _node_processes() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "-a", "aiollm.node"], capture_output=True, text=True).stdout
    return sorted(int(line.split()[0]) for line in out.splitlines() if "pgrep" not in line)


def _ask_all(base_url: str, model: str, prompts: list[list[int]]) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="t", max_retries=0, timeout=120)
    texts = []
    for prompt in prompts:
        answer = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        texts.append(answer.choices[0].text)
    return texts


@pytest.mark.slow
def test_instances_serve_on_when_the_ray_head_is_lost(tmp_path):
    write_hf_dir(tmp_path / "model")
    model = load(str(tmp_path / "model"))
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    expected = [c.text for c in generate(model, prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    (tmp_path / "cluster.toml").write_text(
        textwrap.dedent(
            f"""
            [model]
            name = "{tmp_path / "model"}"
            [prefill]
            ray_resources = {{ prefill = 1 }}
            [decode]
            ray_resources = {{ decode = 1 }}
            [controller]
            ray_resources = {{ control = 1 }}
            [frontend]
            ray_resources = {{ control = 1 }}
            port = {HTTP_PORT}
            """
        )
    )
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_gcs_rpc_server_reconnect_timeout_s=RECONNECT_S)
    host = subprocess.Popen(
        [sys.executable, "-c", RAY_HOST], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    serve = None
    try:
        ray_cluster = json.loads(host.stdout.readline())
        serve = subprocess.Popen(
            [sys.executable, "-m", "aiollm", "serve", "--ray", "--ray-address", ray_cluster["address"]]
            + ["--config", str(tmp_path / "cluster.toml")],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = serve.stdout.readline()
        assert "serving" in line, line
        base_url = f"http://127.0.0.1:{HTTP_PORT}"
        assert _ask_all(base_url, "model", prompts) == expected
        nodes = _node_processes()
        assert len(nodes) == 4  # prefill, decode, controller, frontend

        os.kill(ray_cluster["gcs_pid"], signal.SIGKILL)  # the Ray head is lost
        # each node, once its actor is gone and the head does not answer, logs to a file of its own from then on
        logs = [Path(tempfile.gettempdir()) / f"aiollm-node-{pid}.log" for pid in nodes]
        deadline = time.monotonic() + 60
        while not all(log.exists() for log in logs) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ray_workers(), "Ray's role actors outlived their head"
        assert _node_processes() == nodes, "an instance ended with the Ray head"
        assert all("cluster head is lost: serving on" in log.read_text() for log in logs)
        assert _ask_all(base_url, "model", prompts) == expected
        assert serve.poll() is None

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(120) == 0
        deadline = time.monotonic() + 30
        while _node_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _node_processes()
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
        os.killpg(host.pid, signal.SIGKILL)
        host.wait()
        for pid in _node_processes():  # never leave a node behind, even when the test failed
            os.kill(pid, signal.SIGKILL)
        for log in Path(tempfile.gettempdir()).glob("aiollm-node-*.log"):
            log.unlink()


def _ray_workers() -> list[str]:
    """Ray's actor processes (their titles are `ray::ClassName`)."""
    out = subprocess.run(["pgrep", "-fa", "ray::RoleHost"], capture_output=True, text=True).stdout
    return out.splitlines()
