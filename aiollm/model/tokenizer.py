"""Text <-> token ids and the chat template, with `tokenizers` and `jinja2` only (no transformers).

A GGUF carries no tokenizer.json: it stores the vocabulary, merges, token kinds and special ids
as metadata. We rebuild the byte-level BPE from them the way transformers does for a GGUF, so
the ids are the same as transformers' for any text. An HF directory carries its tokenizer.json.
"""

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from aiollm.errors import ModelFormatError

# llama.cpp token kinds (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp pre-tokenizer names whose split regex differs from GPT-2's; others use GPT-2's
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/2.5/3: Llama 3's, with digits split one by one
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the byte-level BPE alphabet)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


class Tokenizer:
    """encode/decode, special ids and the chat template of one model."""

    def __init__(
        self,
        backend: Backend,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        stop_ids: tuple[int, ...],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        # token ids that end a completion (the model's eos ids and the template's end-of-turn token)
        self.stop_ids = stop_ids
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. `<|im_start|>`) become their single id."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for a conversation ([{"role": ..., "content": ...}, ...]), as the model was trained."""
        if not self.chat_template:
            raise ValueError("apply_chat_template: this model has no chat template")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    @classmethod
    def from_gguf_fields(cls, field, path: str, eos_ids: tuple[int, ...]) -> "Tokenizer":
        """Build from a GGUF's metadata; `field(key, default)` reads one metadata value."""
        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelFormatError(f"{path}: tokenizer type {kind!r} is not supported (gpt2 byte-level BPE)")
        tokens = list(field("tokenizer.ggml.tokens"))
        kinds = list(field("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
        backend = Backend(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        split = _PRE_SPLITS.get(field("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, k in zip(tokens, kinds)
                if k == _CONTROL and set(t) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, k in zip(tokens, kinds)
                if k == _USER_DEFINED and t in vocab
            ]
        )
        bos_id = field("tokenizer.ggml.bos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        if bos is not None and field("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", special_tokens=[(bos, bos_id)]
            )
        eos = tokens[eos_ids[0]] if eos_ids else None
        return cls(backend, field("tokenizer.chat_template"), bos, eos, _stop_ids(backend, eos_ids))

    @classmethod
    def from_hf_dir(cls, directory: str | Path, eos_ids: tuple[int, ...]) -> "Tokenizer":
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) of an HF directory."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory has no tokenizer.json: {path}")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises a plain Exception on a bad file
            raise ModelFormatError(f"{path}: cannot read tokenizer ({exc})") from exc
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids = tuple(dict.fromkeys((*eos_ids, backend.token_to_id(eos))))
        return cls(backend, template, bos, eos, _stop_ids(backend, eos_ids))


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _stop_ids(backend: Backend, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The model's eos ids plus the common end-of-turn tokens its vocabulary has."""
    ids = list(eos_ids)
    for token in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>"):
        token_id = backend.token_to_id(token)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def _raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)
