"""Killing any process of `python -m aiollm serve` costs latency, never a request, and never changes an answer.

Each test starts a whole cluster as a user does (every role its own process), streams greedy and seeded requests
through the official openai client, SIGKILLs one role's process mid-stream, and checks that every request
completes with exactly the text of a fault-free pass over the same requests, that `serve` started the process
again, and that no process is left after.
"""

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from aiollm.testing.tiny_llama import write_hf_dir

PROMPTS = ["The capital of France", "Once upon a time", "def fibonacci(n):", "Paris is", "1, 2, 3,", "Hello"]
MAX_TOKENS = 40


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Serve:
    """`python -m aiollm serve --config F` on a free port, stopped (and its processes reaped) on exit."""

    def __init__(self, directory: Path, r_workers: int = 0, frontends: int = 1) -> None:
        config = directory / "cluster.toml"
        config.write_text(
            f'[model]\nname = "{directory}"\n'
            "[node]\nheartbeat_interval = 0.2\nheartbeat_timeout = 1.0\n"
            f"[decode]\nr_workers = {r_workers}\n"
            '[r_worker]\nkv_memory = "64MiB"\n'
            "[controller]\nresume_timeout_s = 60\n"
            f"[frontend]\nport = 0\ncount = {frontends}\n"
        )
        # the nodes' logs go to a file: a pipe nobody reads would fill and block them
        self.log = directory / f"serve-{time.monotonic_ns()}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aiollm", "serve", "--config", str(config)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        line = ""
        deadline = time.monotonic() + 180
        while "serving" not in line and time.monotonic() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline()
        if "serving" not in line:
            self.close()
            raise AssertionError(f"serve did not come up (exit {self.proc.poll()}): {self.log.read_text()[-4000:]}")
        self.base_url = line.split(" at ")[1].split()[0]
        self.base_urls = [self.base_url, *re.findall(r"\(\+ (\S+)\)", line)]
        self.model = directory.name

    def role_pid(self, role: str) -> int:
        return next(p for p in _children(self.proc.pid) if f"--role {role} " in _cmdline(p) + " ")

    def close(self) -> list[int]:
        children = _children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return [p for p in children if Path(f"/proc/{p}").exists() and _cmdline(p)]


def _ask(base_url: str, model: str, i: int, on_token=None) -> str:
    """One streamed chat request: even i greedy, odd i seeded sampling; the whole text."""
    client = openai.OpenAI(base_url=base_url, api_key="test", max_retries=0, timeout=120)
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 1000 + i}
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
        **sampling,
    )
    text = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            if on_token is not None:
                on_token()
    return "".join(text)


def _run_all(serve: Serve, n: int, on_token=None) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: _ask(serve.base_url, serve.model, i, on_token), range(n)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fault-llama")
    write_hf_dir(directory)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(("role", "r_workers"), [("decode", 0), ("prefill", 0), ("controller", 0), ("r-worker", 2)])
def test_killing_a_role_mid_stream_loses_no_request_and_changes_no_answer(model_dir, role, r_workers):
    serve = Serve(model_dir, r_workers)
    try:
        expected = _run_all(serve, 8)
        victim = serve.role_pid(role)
        killed = []
        streamed = []

        def kill_once_streaming() -> None:
            streamed.append(1)
            if not killed and len(streamed) >= 8 * 5:  # every request is a few tokens in
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic())

        got = _run_all(serve, 8, kill_once_streaming)
        assert killed, "the requests finished before the fault"
        assert got == expected
        deadline = time.monotonic() + 60  # started again at its address: the cluster serves on
        while time.monotonic() < deadline and not any(
            f"--role {role} " in _cmdline(p) + " " and p != victim for p in _children(serve.proc.pid)
        ):
            time.sleep(0.2)
        assert _run_all(serve, 2) == expected[:2]
        assert serve.proc.poll() is None
    finally:
        left = serve.close()
    assert not left


@pytest.mark.slow
def test_a_killed_frontend_loses_only_its_connections_and_serves_again(model_dir):
    serve = Serve(model_dir)
    try:
        expected = _run_all(serve, 2)
        os.kill(serve.role_pid("frontend"), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert _run_all(serve, 2) == expected
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the frontend was not started again"
                time.sleep(0.5)
        assert serve.proc.poll() is None
    finally:
        left = serve.close()
    assert not left


@pytest.mark.slow
def test_with_two_frontends_a_killed_one_costs_only_its_own_streams(model_dir):
    serve = Serve(model_dir, frontends=2)
    try:
        assert len(serve.base_urls) == 2
        other = serve.base_urls[1]
        expected = [_ask(other, serve.model, i) for i in range(4)]
        first = [p for p in _children(serve.proc.pid) if "--role frontend " in _cmdline(p) + " "]
        port = serve.base_urls[0].rsplit(":", 1)[1].split("/")[0]
        victim = next(p for p in first if f"--http-port {port}" in _cmdline(p))
        streamed = []

        def kill_once() -> None:
            streamed.append(1)
            if len(streamed) == 10:
                os.kill(victim, signal.SIGKILL)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: _ask(other, serve.model, i, kill_once), range(4)))
        assert len(streamed) > 10 and got == expected  # the other frontend's streams never noticed
        deadline = time.monotonic() + 60
        while True:  # and the killed one serves again on its port
            try:
                assert _ask(serve.base_urls[0], serve.model, 0) == expected[0]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the killed frontend was not started again"
                time.sleep(0.5)
    finally:
        left = serve.close()
    assert not left
