"""Incremental decoding equals decoding everything at once, token by token, on mixed-script
text whose multi-byte characters span several tokens."""

from sparrow.core.detokenizer import IncrementalText
from sparrow.tokenizer import load_tokenizer


def test_incremental_text_matches_full_decode():
    tok = load_tokenizer(None)
    ids = tok.encode("Hello, 世界! Ünïcödé 🙂🙂 and ascii again: naïve café 数字 123")
    inc = IncrementalText(tok.decode)
    for i in range(len(ids)):
        text = inc.add(ids[i : i + 1], final=i == len(ids) - 1)
        full = tok.decode(ids[: i + 1])
        assert full.startswith(text) and (full == text or full[len(text) :].count("\ufffd"))
    assert text == tok.decode(ids)
