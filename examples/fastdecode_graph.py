"""FastDecode as a programmatic actor graph: one S-worker and two R-worker processes on 127.0.0.1.

    python examples/fastdecode_graph.py [--model smollm2] [--max-tokens 24] [--no-pipeline] [--sls-interval F]

Each node is `python -m aiollm.node --role ...` started by aiollm.deploy.graph (ports chosen by the OS,
one random cluster secret). The R-workers hold the KV (fp16, a 1 GiB budget each) and run the
attention; the S-worker holds the weights, prefills the prompts, streams their KV to the R-worker
it places them on, and decodes them as one batch. The script talks to the S-worker through
`ClusterClient`, the same `Backend` the HTTP frontend uses, and prints each completion.
"""

import argparse
import asyncio
import os
import sys
import time

from aiollm import log
from aiollm.deploy.graph import Graph
from aiollm.kv.pool import KV_DTYPES
from aiollm.model.gguf_file import GGUFFile
from aiollm.model.hf_dir import HFDirectory
from aiollm.model.loader import resolve
from aiollm.model.sampling import SamplingParams
from aiollm.model.tokenizer import Tokenizer
from aiollm.serving.backend import GenerateRequest
from aiollm.serving.distserve.client import ClusterClient

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Three reasons to learn Python are",
]


def tokenizer(model: str) -> Tokenizer:
    """The model's tokenizer without its weights (the S-worker process loads those)."""
    path = resolve(model)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path, HFDirectory(path).config.eos_ids)
    source = GGUFFile(path)
    return Tokenizer.from_gguf_fields(source.field, source.path, source.config.eos_ids)


async def main(args: argparse.Namespace) -> None:
    # the three processes share this machine's cores: no OpenMP thread may spin while another process waits
    os.environ["OMP_WAIT_POLICY"] = "passive"
    tok = tokenizer(args.model)
    async with Graph(startup_timeout=120.0) as graph:
        r_args = ("--model", args.model, "--kv-memory", "1GiB", "--kv-dtype", args.kv_dtype, "--threads", "1")
        r_nodes = await asyncio.gather(*(graph.start_node("r-worker", process=True, args=r_args) for _ in range(2)))
        s_args = [
            "--model",
            args.model,
            "--threads",
            "1",
            "--max-batch",
            "16",
            "--r-workers",
            ",".join(node.url for node in r_nodes),
        ]
        if args.no_pipeline:
            s_args.append("--no-pipeline")
        if args.sls_interval:
            s_args += ["--sls-interval", str(args.sls_interval), "--sls-seq-len", "128"]
        s_node = await graph.start_node("s-worker", process=True, args=tuple(s_args))
        client = ClusterClient(s_node.actors["s-worker"])
        await graph.driver.spawn(client, "client")
        params = SamplingParams(max_tokens=args.max_tokens)
        started = time.perf_counter()

        async def complete(i: int, prompt: str) -> tuple[str, int]:
            ids = []
            async for delta in client.submit(GenerateRequest(f"example-{i}", tuple(tok.encode(prompt)), params)):
                ids += delta.token_ids
            return tok.decode(ids), len(ids)

        results = await asyncio.gather(*(complete(i, p) for i, p in enumerate(PROMPTS)))
        seconds = time.perf_counter() - started
        for prompt, (text, _) in zip(PROMPTS, results):
            print(f"{prompt!r} -> {text!r}")
        print(f"{sum(n for _, n in results)} tokens in {seconds:.2f} s through 1 S-worker + 2 R-worker processes")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--kv-dtype", default="fp16", choices=KV_DTYPES)
    parser.add_argument("--no-pipeline", action="store_true")
    parser.add_argument("--sls-interval", type=int, default=0)
    log.configure("WARNING")
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)
