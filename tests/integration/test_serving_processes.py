"""`python -m aiollm serve` as a user runs it: every instance its own OS process, a real chat request
through the openai client, greedy tokens equal to the colocated generate(), a SIGKILLed decode instance
started again and serving, and no process left after."""

import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from aiollm.model.engine import generate
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.testing.tiny_llama import write_hf_dir


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flags", "config", "turns"])
def test_serve_command_answers_a_chat_request_and_cleans_up(tmp_path, how):
    write_hf_dir(tmp_path)
    model = load(str(tmp_path))
    tok = model.tokenizer
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    ref = generate(model, [ids], SamplingParams(max_tokens=16))[0]

    if how in ("flags", "turns"):
        spec = ["--model", str(tmp_path), "--prefill", "1", "--decode", "1"]
        # turns: every instance on every core, taking turns through lock files in $TMPDIR (the default on a host
        # with fewer than 4 cores); flags: the cores split
        spec += ["--take-turns"] if how == "turns" else ["--no-take-turns"]
    else:  # the same cluster from a spec file (the port from a flag on top)
        config = tmp_path / "cluster.toml"
        config.write_text(f'[model]\nname = "{tmp_path}"\n[prefill]\ncount = 1\n[decode]\ncount = 1\n')
        spec = ["--config", str(config)]
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiollm", "serve", *spec, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TMPDIR=str(tmpdir)),
    )
    children = []
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "serving" in line, f"server did not come up (exit {proc.poll()})"
        base_url = line.split(" at ")[1].split()[0]
        children = _children(proc.pid)
        assert len(children) == 4  # prefill, decode, controller, frontend
        client = openai.OpenAI(base_url=base_url, api_key="test", max_retries=0, timeout=60)
        out = client.chat.completions.create(model=tmp_path.name, messages=messages, max_tokens=16, temperature=0)
        assert out.choices[0].message.content == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert len(list(tmpdir.glob("aiollm-turns-*"))) == (2 if how == "turns" else 0)

        # a decode instance killed outright is started again, re-registers, and serves the same tokens
        killed = next(p for p in children if "--role decode" in _cmdline(p))
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:
            try:
                out = client.chat.completions.create(
                    model=tmp_path.name, messages=messages, max_tokens=16, temperature=0
                )
                break
            except openai.APIStatusError as exc:  # 503 until the new instance has registered
                assert exc.status_code == 503 and time.monotonic() < deadline, exc
                time.sleep(0.5)
        assert out.choices[0].message.content == ref.text
        children = _children(proc.pid)
        assert len(children) == 4 and killed not in children
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(30) == 0
            assert not list(tmpdir.glob("aiollm-turns-*"))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pid in children:  # a node the launcher failed to stop would still exist
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"node process {pid} outlived `aiollm serve`")
