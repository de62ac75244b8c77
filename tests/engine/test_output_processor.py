"""The output processor on hand-made token streams: a fake vocabulary of text pieces, a
byte-level one whose characters split across tokens, and the real tokenizer."""

import pytest

from sparrow.core.request import FinishReason, RequestOutput
from sparrow.core.sampling_params import SamplingParams, TokenLogprob
from sparrow.engine.output_processor import (
    IncrementalText,
    OutputProcessor,
    find_stop,
    partial_stop,
)
from sparrow.tokenizer import load_tokenizer

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " and", 7: " more", 8: "<end>"}


def piece_decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


# Byte-level: each token is some bytes; a character may need several tokens.
BYTES = {
    1: b"caf",
    2: b"\xc3",
    3: b"\xa9",
    4: b" ",
    5: b"\xf0\x9f",
    6: b"\x99",
    7: b"\x82",
    8: b"ok",
    9: b"\xe4\xb8\x96\xe7",
    10: b"\x95\x8c",
}


def byte_decode(ids: list[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def run(tokens, decode=piece_decode, finish=FinishReason.LENGTH, per_step=1, **params):
    """Feed `tokens` `per_step` at a time, the last output with `finish`. Returns the deltas
    and the ids `on_stop` was called with."""
    stopped = []
    processor = OutputProcessor(decode, on_stop=stopped.append)
    processor.add("r", SamplingParams(max_tokens=64, **params))
    deltas = []
    for i in range(0, len(tokens), per_step):
        last = i + per_step >= len(tokens)
        out = RequestOutput("r", tokens[i : i + per_step], finish if last else None)
        deltas += processor.process([out])
    return deltas, stopped


def text_of(deltas) -> str:
    return "".join(d.text for d in deltas)


def test_no_stops_gives_the_whole_text_token_by_token():
    deltas, stopped = run([1, 2, 3, 4, 5])
    assert [d.text for d in deltas] == ["Hel", "lo", " wor", "ld", "!"]
    assert deltas[-1].finish_reason is FinishReason.LENGTH and not stopped


def test_stop_string_inside_one_token_cuts_before_it():
    deltas, stopped = run([1, 2, 3, 4, 5, 6], stop=("or",))
    assert text_of(deltas) == "Hello w" and deltas[-1].finish_reason is FinishReason.STOP
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3]  # the token with the stop
    assert stopped == ["r"]


def test_stop_string_spanning_two_tokens_is_held_back_then_cut():
    deltas, stopped = run([1, 2, 3, 4, 5], stop=("lo w",))
    # "l", then "lo" could begin the stop: held until " wor" completes the match
    assert [d.text for d in deltas] == ["He", "l", ""]
    assert deltas[-1].finish_reason is FinishReason.STOP and stopped == ["r"]


def test_held_back_text_is_released_when_no_stop_follows():
    deltas, stopped = run([1, 2, 3, 4], stop=("lox", "ld!"))
    assert [d.text for d in deltas] == ["He", "l", "lo wor", "ld"]  # "l", "lo", "ld" held
    assert deltas[-1].finish_reason is FinishReason.LENGTH and not stopped  # the end flushes
    deltas, _ = run([1, 2, 3, 4], stop=("lox", "ld!"), finish=None)
    assert text_of(deltas) == "Hello wor"


def test_the_earliest_of_several_stops_wins_and_later_tokens_drop():
    deltas, stopped = run([1, 2, 3, 4, 5, 6, 7], per_step=7, stop=(" more", "ld"))
    assert len(deltas) == 1 and deltas[0].text == "Hello wor"
    assert deltas[0].token_ids == [1, 2, 3, 4] and deltas[0].finish_reason is FinishReason.STOP


def test_outputs_after_a_stop_are_ignored_and_the_engine_is_told_once():
    stopped = []
    processor = OutputProcessor(piece_decode, on_stop=stopped.append)
    processor.add("a", SamplingParams(stop=("wor",)))
    processor.add("b", SamplingParams())
    outs = processor.process([RequestOutput("a", [1, 2, 3], None), RequestOutput("b", [5], None)])
    assert [(d.request_id, d.text, d.finish_reason) for d in outs] == [
        ("a", "Hello ", FinishReason.STOP),
        ("b", "!", None),
    ]
    assert processor.process([RequestOutput("a", [4], None)]) == [] and stopped == ["a"]
    assert "a" not in processor and len(processor) == 1
    # the engine's own finish (stop token, length) needs no stop call
    processor.process([RequestOutput("b", [6], FinishReason.LENGTH)])
    assert stopped == ["a"] and len(processor) == 0


def test_stop_token_text_is_not_output():
    deltas, stopped = run([1, 2, 8], finish=FinishReason.STOP, stop_token_ids=(8,))
    assert text_of(deltas) == "Hello" and deltas[-1].token_ids == [8] and not stopped


def test_special_tokens_text_is_output_only_when_kept():
    """Token 5 ("!") and 8 ("<end>") special: left out by default, kept on request; the stop
    token's text is left out either way, and stop strings see the text as shown."""
    tokens = [1, 2, 5, 3, 8, 4]
    special = frozenset({5, 8})
    for keep, text in ((False, "Hello world"), (True, "Hello! wor<end>ld")):
        processor = OutputProcessor(piece_decode, special_ids=special)
        processor.add("r", SamplingParams(skip_special_tokens=not keep))
        deltas = [processor.process([RequestOutput("r", [t], None)])[0] for t in tokens]
        assert text_of(deltas) == text
    processor = OutputProcessor(piece_decode, special_ids=special)
    processor.add("r", SamplingParams(skip_special_tokens=False, stop_token_ids=(8,), stop=("o!",)))
    deltas = processor.process([RequestOutput("r", tokens[:2], None)])
    deltas += processor.process([RequestOutput("r", [5], None)])
    assert text_of(deltas) == "Hell" and deltas[-1].finish_reason is FinishReason.STOP
    processor.add("s", SamplingParams(skip_special_tokens=False, stop_token_ids=(8,)))
    deltas = processor.process([RequestOutput("s", [1, 5, 8], FinishReason.STOP)])
    assert text_of(deltas) == "Hel!"


def test_prompt_logprobs_get_text_and_ranks():
    processor = OutputProcessor(piece_decode)
    processor.add("r", SamplingParams(prompt_logprobs=2))
    prompt = [TokenLogprob(2, -1.0, ((3, -0.5), (2, -1.0)), 2), TokenLogprob(5, -4.0, (), 9)]
    first = processor.process([RequestOutput("r", [1], None, None, prompt)])[0]
    (a, b) = first.prompt_logprobs
    assert (a.token.token_id, a.token.text, a.token.logprob, a.token.rank) == (2, "lo", -1.0, 2)
    assert [(t.token_id, t.text, t.rank) for t in a.top] == [(3, " wor", 1), (2, "lo", 2)]
    assert (b.token.text, b.token.rank, b.top) == ("!", 9, ())
    later = processor.process([RequestOutput("r", [2], FinishReason.LENGTH)])[0]
    assert later.prompt_logprobs is None


def test_utf8_split_across_tokens_is_held_back():
    tokens = [1, 2, 3, 4, 5, 6, 7, 4, 9, 10, 8]
    deltas, _ = run(tokens, decode=byte_decode)
    assert all("\ufffd" not in d.text for d in deltas)
    assert text_of(deltas) == "café 🙂 世界ok" == byte_decode(tokens)
    assert [d.text for d in deltas][:3] == ["caf", "", "é"]


def test_incomplete_utf8_at_the_end_is_flushed():
    deltas, _ = run([1, 2], decode=byte_decode)
    assert text_of(deltas) == "caf\ufffd"


def test_stop_string_with_a_character_split_across_tokens():
    deltas, stopped = run([1, 2, 3, 4, 5, 6, 7, 4, 8], decode=byte_decode, stop=("é 🙂",))
    assert text_of(deltas) == "caf" and stopped == ["r"]
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3, 4, 5, 6, 7]


def test_logprobs_get_token_text_bytes_and_offsets():
    processor = OutputProcessor(byte_decode)
    processor.add("r", SamplingParams(logprobs=2))
    entries = []
    for token in (1, 2, 3, 8):
        lp = TokenLogprob(token, -0.5, ((token, -0.5), (4, -1.5)))
        entries += processor.process([RequestOutput("r", [token], None, [lp])])[0].logprobs
    assert [e.token.text for e in entries] == ["caf", "\ufffd", "\ufffd", "ok"]
    assert [e.offset for e in entries] == [0, 3, 3, 4]  # characters before each token
    assert entries[0].token.bytes == b"caf" and entries[0].token.logprob == -0.5
    assert [(t.token_id, t.text, t.logprob) for t in entries[3].top] == [
        (8, "ok", -0.5),
        (4, " ", -1.5),
    ]
    processor.add("none", SamplingParams())  # not asked for: no logprobs in the deltas
    lp = TokenLogprob(1, -0.1)
    assert processor.process([RequestOutput("none", [1], None, [lp])])[0].logprobs is None


def test_abort_forgets_the_request():
    processor = OutputProcessor(piece_decode)
    processor.add("r", SamplingParams())
    with pytest.raises(ValueError, match="duplicate"):
        processor.add("r", SamplingParams())
    assert processor.abort("r").finish_reason is FinishReason.ABORT
    assert processor.abort("r") is None and processor.process([RequestOutput("r", [1], None)]) == []


def test_stop_helpers():
    assert find_stop("abcabc", 0, ("bc",)) == 1 and find_stop("abcabc", 4, ("bc",)) == 4
    assert find_stop("abcabc", 6, ("bc",)) is None and find_stop("xyz", 0, ("q", "z", "y")) == 1
    assert partial_stop("hello wo", ("world", "o w")) == 2 and partial_stop("hello", ("x",)) == 0


def test_real_tokenizer_stream_equals_decoding_and_cutting_at_once():
    tok = load_tokenizer(None)
    text = "Hello, 世界! Ünïcödé 🙂🙂 and ascii again: naïve café 数字 123 — the end"
    ids = tok.encode(text)
    for stop in ("🙂 and", "数字", "d again", "never there"):
        deltas, _ = run(ids, decode=tok.decode, stop=(stop,))
        assert text_of(deltas) == text.split(stop)[0]
        assert all("\ufffd" not in d.text for d in deltas)


def test_incremental_text_matches_full_decode():
    tok = load_tokenizer(None)
    ids = tok.encode("Hello, 世界! Ünïcödé 🙂🙂 and ascii again: naïve café 数字 123")
    inc = IncrementalText(tok.decode)
    for i in range(len(ids)):
        text = inc.add(ids[i : i + 1], final=i == len(ids) - 1)
        full = tok.decode(ids[: i + 1])
        assert full.startswith(text) and (full == text or full[len(text) :].count("\ufffd"))
    assert text == tok.decode(ids)
