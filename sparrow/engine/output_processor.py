"""Token outputs to text: incremental detokenisation, stop strings and logprob text.

The scheduler sees token ids only (stop tokens, length). Everything about text happens here,
on a stream of `RequestOutput`s, wherever those come from: the in-process engine's steps or,
in the gateway, token streams arriving over gRPC. Per request:

- the output text grows by decoding a short window per token (`IncrementalText`); a trailing
  incomplete UTF-8 sequence (U+FFFD) waits for the next token;
- stop strings are matched on the decoded text; text that could begin one is held back until
  the next token decides; a match ends the request with reason STOP, its text cut just
  before the stop string (which is not included), and the tokens after it dropped; the
  owner's `on_stop` hook then frees the request upstream (the scheduler never saw the
  string);
- a stop token's text is not part of the output, nor, unless the request keeps special
  tokens (`skip_special_tokens=False`), the text of the tokenizer's special tokens;
- sampled and top tokens of the logprobs get their text and bytes, and so do the prompt's
  tokens and their alternatives when prompt logprobs are asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparrow.core.request import FinishReason, RequestOutput
from sparrow.core.sampling_params import SamplingParams, TokenLogprob

Decode = Callable[[list[int]], str]


class IncrementalText:
    """The text of a growing token sequence, decoding a short window per new token.

    Decoding all of the output after every token costs O(n) each time. Byte-level BPE
    decodes piecewise, so the text only needs the tokens since the last point where the
    decoded text was complete: the window `ids[prefix:]` is decoded and compared with
    `ids[prefix:read]`; what it adds is new text, unless it ends in an incomplete UTF-8
    sequence (U+FFFD), which waits for the next token (or the end).
    """

    def __init__(self, decode: Decode):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""  # complete text so far
        self._prefix = self._read = 0

    def add(self, ids: list[int], final: bool = False) -> str:
        """Append tokens; returns the text so far. `final` also flushes an incomplete
        trailing sequence (the request is over)."""
        self.ids += ids
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


@dataclass(frozen=True)
class TokenText:
    """A token decoded alone, with its log-probability (and its rank, for prompt logprobs:
    1 + the number of tokens more likely than it)."""

    token_id: int
    text: str
    bytes: bytes  # UTF-8 of `text`
    logprob: float
    rank: int | None = None


@dataclass(frozen=True)
class LogprobEntry:
    """A sampled token with its text, where that text starts in the output (characters)
    and the top alternatives, most likely first."""

    token: TokenText
    offset: int
    top: tuple[TokenText, ...] = ()


@dataclass(frozen=True)
class PromptLogprobEntry:
    """A prompt token's logprob given the tokens before it (with its rank), and the top
    alternatives at its position, most likely first (ranks 1, 2, ...)."""

    token: TokenText
    top: tuple[TokenText, ...] = ()


@dataclass
class OutputDelta:
    """What a request gained: new tokens, the text that may be shown now, the tokens'
    logprobs when asked for, and the finish reason once it is over. The delta of its first
    token carries the prompt logprobs when asked for: one per prompt token after the first."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[PromptLogprobEntry] | None = None


def find_stop(text: str, start: int, stops: tuple[str, ...]) -> int | None:
    """The earliest position of a stop string in `text` that ends past `start` (text before
    `start` was searched already), or None."""
    found = None
    for stop in stops:
        at = text.find(stop, max(0, start - len(stop) + 1))
        if at >= 0 and (found is None or at < found):
            found = at
    return found


def partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a stop string begins with (held back)."""
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return held


class RequestText:
    """One request's output as text: decoded, stop strings applied, logprobs given text.
    `special_ids`: the tokens whose text is left out when the request skips special
    tokens."""

    def __init__(
        self,
        request_id: str,
        decode: Decode,
        params: SamplingParams,
        special_ids: frozenset[int] = frozenset(),
    ):
        self.request_id, self.decode = request_id, decode
        self.stops, self.stop_token_ids = params.stop, set(params.stop_token_ids)
        self.textless = self.stop_token_ids | (special_ids if params.skip_special_tokens else set())
        self.wants_logprobs = params.logprobs is not None
        self.decoded = IncrementalText(decode)
        self.shown = 0  # characters of the decoded text given out so far
        self._searched = 0  # characters searched for stop strings

    def add(
        self,
        token_ids: list[int],
        finish: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> OutputDelta:
        """Take the tokens a step gave (and the engine's finish reason); returns the delta.
        A stop string found here makes it the last: reason STOP, later tokens dropped."""
        kept: list[int] = []
        entries: list[LogprobEntry] = []
        end = None  # where a stop string starts
        for i, token in enumerate(token_ids):
            offset = len(self.decoded.text)
            text = self.decoded.text if token in self.textless else self.decoded.add([token])
            kept.append(token)
            if self.wants_logprobs and logprobs is not None and i < len(logprobs):
                entries.append(self._entry(logprobs[i], offset))
            end = self._search(text)
            if end is not None:
                break
        if end is None and finish is not None:
            end = self._search(self.decoded.add([], final=True))
        if end is not None:
            finish = FinishReason.STOP
        text = self.decoded.text
        if end is None:
            end = len(text) if finish is not None else len(text) - partial_stop(text, self.stops)
        delta, self.shown = text[self.shown : end], max(self.shown, end)
        lps = entries if self.wants_logprobs else None
        prompt = None
        if prompt_logprobs is not None:
            prompt = [
                PromptLogprobEntry(
                    self._token(lp.token_id, lp.logprob, lp.rank),
                    tuple(self._token(t, v, rank) for rank, (t, v) in enumerate(lp.top, 1)),
                )
                for lp in prompt_logprobs
            ]
        return OutputDelta(self.request_id, kept, delta, finish, lps, prompt)

    def _search(self, text: str) -> int | None:
        if not self.stops or len(text) == self._searched:
            return None
        at = find_stop(text, self._searched, self.stops)
        self._searched = len(text)
        return at

    def _entry(self, lp: TokenLogprob, offset: int) -> LogprobEntry:
        top = tuple(self._token(t, v) for t, v in lp.top)
        return LogprobEntry(self._token(lp.token_id, lp.logprob), offset, top)

    def _token(self, token_id: int, logprob: float, rank: int | None = None) -> TokenText:
        text = self.decode([token_id])
        return TokenText(token_id, text, text.encode(), logprob, rank)


class OutputProcessor:
    """The text side of many requests. `add` a request, feed every `RequestOutput` to
    `process`, which gives an `OutputDelta` per output of a request it knows; the delta with
    a finish reason is a request's last, after which its outputs are ignored (tokens still in
    flight). `on_stop(request_id)` is called for a request a stop string ended while the
    engine still runs it: the owner stops it there (the scheduler, or the worker over gRPC).
    `special_ids`: the tokenizer's special tokens (`Tokenizer.skipped_ids`), whose text a
    request that skips special tokens (the default) leaves out.

    Not thread-safe: one owner thread or event loop calls it."""

    def __init__(
        self,
        decode: Decode,
        on_stop: Callable[[str], None] | None = None,
        special_ids: frozenset[int] = frozenset(),
    ):
        self.decode, self.on_stop, self.special_ids = decode, on_stop, special_ids
        self._requests: dict[str, RequestText] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._requests[request_id] = RequestText(request_id, self.decode, params, self.special_ids)

    def process(self, outputs: Iterable[RequestOutput]) -> list[OutputDelta]:
        deltas = []
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            delta = state.add(
                out.new_token_ids, out.finish_reason, out.logprobs, out.prompt_logprobs
            )
            if delta.finish_reason is not None:
                del self._requests[out.request_id]
                if out.finish_reason is None and self.on_stop is not None:
                    self.on_stop(out.request_id)
            deltas.append(delta)
        return deltas

    def abort(self, request_id: str) -> OutputDelta | None:
        """Forget a request the engine aborted; its last delta (reason ABORT), None if it
        was unknown or finished."""
        if self._requests.pop(request_id, None) is None:
            return None
        return OutputDelta(request_id, [], "", FinishReason.ABORT)

    def request_ids(self) -> list[str]:
        """The requests it follows (not finished yet)."""
        return list(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)
