"""The real SmolLM2-135M GGUF against transformers loading the same file in fp32.

transformers is loaded once for the module (it takes ~20 s); everything else reuses it.
"""

import os

import pytest
import torch

import aiollm.model
from aiollm.model.engine import generate
from aiollm.model.loader import bundled_path
from aiollm.model.sampling import SamplingParams

pytestmark = pytest.mark.slow

N_NEW = 48
CHAT = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Translate 'Good morning, how are you?' into Spanish and German.",
]
RAW = [
    "The history of the Roman Empire",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Les 3 plus grandes villes de France sont",
]
TEXTS_MORE = [
    "Explain photosynthesis to a ten-year-old in two sentences.",
    "Once upon a time, in a small village by the sea,",
]
TOKENIZER_TEXTS = (
    RAW
    + CHAT
    + TEXTS_MORE
    + [
        "naïve café — 東京タワー 🙂🚀 ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "    four spaces\ttab\n\n\nthree newlines \r\n crlf  ",
        "x = [i**2 for i in range(10)]  # comment\nif x: print(f'{x!r}')",
        "1234567890 3.14159 -42 1e-5 0xFF",
        "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
        "Ünïcödé ÀÉÎÕÜ ß ø œ ﬁ",
        "",
        " ",
        "a" * 300,
    ]
)
# Largest gap allowed between transformers' top logit and its logit for our token, per step, with a lossy
# KV cache, and how many steps of a completion may have any gap at all. Measured on these prompts (48
# tokens each): fp16 picks transformers' top token at every step; int8 at all but one, 0.009 below the top.
# int4 (one scale per token per head, 7 levels a side) is much coarser: its largest gaps are 2.2-7.3 and 4-14 of
# each completion's steps leave the top token, while the text stays on topic (France: "Paris. Paris is the largest
# city..."). A wrong or degenerate continuation costs several logits at most steps.
KV_MARGIN = {"fp16": 0.1, "int8": 0.3, "int4": 10.0}
KV_STEPS_OFF_TOP = {"fp16": 2, "int8": 4, "int4": 24}


@pytest.fixture(scope="module")
def ours():
    return aiollm.model.load("smollm2")


@pytest.fixture(scope="module")
def reference():
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(ours):
    tok = ours.tokenizer
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT]
    return chat + [tok.encode(r) for r in RAW]


def test_config_read_from_metadata(ours):
    c = ours.config
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab) == (
        30,
        576,
        9,
        3,
        64,
        1536,
        49152,
    )
    assert (c.rope_theta, c.max_context, c.tie_embeddings, c.eos_ids) == (100000.0, 8192, True, (2,))
    assert c.rms_eps == pytest.approx(1e-5)


def test_tokenizer_and_chat_template_equal_transformers(ours, reference):
    _, hf_tok = reference
    for text in TOKENIZER_TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert ours.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    conversations = [
        [{"role": "user", "content": CHAT[0]}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": CHAT[1]},
        ],
    ]
    for messages in conversations:
        for add in (True, False):
            assert ours.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add
            ) == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)


def reference_logits(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits at each step of our completion, teacher-forced ([len(tokens), vocab])."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def test_fp32_greedy_tokens_identical_to_transformers(ours, reference, prompts):
    """All prompts decoded together as one mixed-length batch. Our token at every step must be transformers'
    argmax given the same prefix, which makes the two greedy sequences identical; one prompt is also checked
    against transformers' own `generate`."""
    hf_model, _ = reference
    completions = generate(ours, prompts, SamplingParams(max_tokens=N_NEW), kv_dtype="fp32")
    for prompt, completion in zip(prompts, completions):
        tokens = completion.token_ids
        assert len(tokens) == N_NEW or tokens[-1] in ours.tokenizer.stop_ids
        argmax = reference_logits(hf_model, prompt, tokens).argmax(dim=-1).tolist()
        assert tokens == argmax, ours.tokenizer.decode(prompt)
    with torch.no_grad():
        prompt = prompts[0]
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=N_NEW,
            do_sample=False,
        )
    assert completions[0].token_ids == out[0, len(prompt) :].tolist()
    assert "Paris" in completions[0].text


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8", "int4"])
def test_lossy_kv_tokens_within_margin_of_transformers(ours, reference, prompts, kv_dtype):
    """Teacher-forced: transformers reads prompt + our tokens; each of our tokens must be near its top choice."""
    hf_model, _ = reference
    chosen = [prompts[0], prompts[1], prompts[3], prompts[4]]  # France (a 0.08-logit near-tie first), code, raw
    completions = generate(ours, chosen, SamplingParams(max_tokens=N_NEW), kv_dtype=kv_dtype)
    for prompt, completion in zip(chosen, completions):
        tokens = completion.token_ids
        logits = reference_logits(hf_model, prompt, tokens)
        gaps = logits.max(dim=-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert gaps.max().item() <= KV_MARGIN[kv_dtype], (kv_dtype, gaps.max().item(), completion.text)
        assert int((gaps > 0).sum()) <= KV_STEPS_OFF_TOP[kv_dtype], (kv_dtype, gaps.tolist())
        assert tokens[0] == int(logits[0].argmax())
    assert completions[0].text.startswith("The capital of France is Paris")
