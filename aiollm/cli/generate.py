"""Complete a prompt with a local model, in one process: `python -m aiollm.generate --model smollm2 --prompt TEXT`.

A user's first contact with aiollm and a check anyone can run: it loads the model, prefills,
decodes over the paged KV cache with the native attention kernel, and prints the completion.
"""

import argparse
import sys
import time

from aiollm import log
from aiollm.heap import keep_freed_memory
from aiollm.kv.pool import KV_DTYPES
from aiollm.model import load
from aiollm.model.engine import generate
from aiollm.model.sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m aiollm.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF directory")
    parser.add_argument(
        "--prompt", action="append", required=True, help="prompt text; repeat to complete several prompts as one batch"
    )
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights and activations")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp32", help="KV cache storage")
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log.configure(args.log_level)
    keep_freed_memory()
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = load(args.model, dtype=args.dtype)
    tokenizer = model.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt]
    prompts = [tokenizer.encode(t, add_special_tokens=not args.chat) for t in texts]
    started = time.perf_counter()
    completions = generate(model, prompts, params, kv_dtype=args.kv_dtype)
    seconds = time.perf_counter() - started
    for i, completion in enumerate(completions):
        if len(completions) > 1:
            print(f"--- [{i}] {completion.finish_reason}")
        print(completion.text)
    n_tokens = sum(len(c.token_ids) for c in completions)
    print(
        f"[{n_tokens} tokens in {seconds:.2f} s, {n_tokens / seconds:.1f} tok/s, kv {args.kv_dtype}]", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
