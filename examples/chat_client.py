"""Send a real chat request to an aiollm server through the official openai client.

    python -m aiollm serve --prefill 1 --decode 1 &      # wait for "aiollm: serving smollm2 at ..."
    python examples/chat_client.py "What is the capital of France?"

    python examples/chat_client.py --serve               # start a local cluster, ask, stop it again
    python examples/chat_client.py --serve --config examples/cluster.toml   # the same, from a cluster spec

Streams the answer as it is generated, then prints the token counts and the time to first token.
"""

import argparse
import contextlib
import signal
import subprocess
import sys
import time

import openai


@contextlib.contextmanager
def local_cluster(model: str, config: str | None):
    """`python -m aiollm serve` (the cluster spec `config`, else 1 prefill + 1 decode instance of `model`) on a
    free port for the duration; yields its API base URL."""
    spec = ["--config", config] if config else ["--model", model, "--prefill", "1", "--decode", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiollm", "serve", *spec, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        while "serving" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise SystemExit(f"aiollm serve exited with status {proc.returncode}")
        print(line.strip(), flush=True)
        yield line.split(" at ")[1].split()[0]
    finally:
        proc.send_signal(signal.SIGINT)  # it stops every node it started
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--serve", action="store_true", help="start a local cluster (1 prefill + 1 decode) first")
    parser.add_argument(
        "--config", help="with --serve: start the cluster this spec describes (e.g. examples/cluster.toml)"
    )
    args = parser.parse_args()
    if args.serve:
        with local_cluster(args.model, args.config) as base_url:
            chat(args, base_url)
    else:
        chat(args, args.base_url)


def chat(args: argparse.Namespace, base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed")
    start = time.perf_counter()
    first = None
    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    total = time.perf_counter() - start
    ttft = f"{(first - start) * 1e3:.0f} ms" if first else "n/a"
    print(
        f"\n[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens, "
        f"first token after {ttft}, {total:.2f} s in all]"
    )


if __name__ == "__main__":
    main()
