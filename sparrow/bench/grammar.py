"""Grammar mask time per token: xgrammar against llguidance, on the built-in checkpoint's
tokenizer (the Qwen3.5/3.6 vocabulary, 248,320 logits), for one JSON schema.

    python -m sparrow.bench.grammar [--out bench-out/grammar.json]

Each library compiles the schema, then walks the tokens of a document that fits it,
computing the allowed-token bitmask before each token and accepting it. Writes and prints
JSON: tokenizer set-up and compile seconds and the mask time per token (median, mean, p99,
ms) for each library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"]},
    },
    "required": ["name", "age", "active", "role", "tags", "address"],
}  # fmt: skip
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "active": True, "role": "admin",
            "tags": ["math", "engines", "notes on the analytical engine"],
            "address": {"city": "London", "zip": "W1"}}  # fmt: skip


def _summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {"median_ms": round(statistics.median(ms), 4), "mean_ms": round(statistics.mean(ms), 4),
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 4)}  # fmt: skip


def bench_xgrammar(tokenizer, vocab_size: int, stops: tuple[int, ...], ids: list[int]) -> dict:
    from sparrow.core.structured import GrammarSpec
    from sparrow.worker.grammar import Grammar, GrammarCompiler, allocate_bitmask

    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, stops)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    compile_s = time.perf_counter() - start
    grammar, mask, times = Grammar(compiled, stops), allocate_bitmask(1, vocab_size), []
    for t in ids:
        start = time.perf_counter()
        grammar.fill(mask, 0)
        times.append(time.perf_counter() - start)
        assert mask[0, t // 32] >> (t % 32) & 1, "the document's token is not allowed"
        grammar.accept(t)
    return {"tokenizer_setup_s": round(setup, 3), "compile_s": round(compile_s, 4),
            **_summary(times)}  # fmt: skip


def bench_llguidance(model_dir, vocab_size: int, stops: tuple[int, ...], ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(str(model_dir / "tokenizer.json"), n_vocab=vocab_size,
                                 eos_token=list(stops))  # fmt: skip
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                        "key_separator": ": "})
    matcher = llguidance.LLMatcher(tok, grammar)
    mask = llt.allocate_token_bitmask(1, vocab_size)
    compile_s = time.perf_counter() - start
    times = []
    for t in ids:
        start = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - start)
        assert mask[0, t // 32] >> (t % 32) & 1, matcher.get_error()
        matcher.consume_token(t)
    return {"tokenizer_setup_s": round(setup, 3), "compile_s": round(compile_s, 4),
            **_summary(times)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out/grammar.json")
    args = parser.parse_args()
    from sparrow.bench.report import write_report
    from sparrow.loader.random_checkpoint import default_checkpoint
    from sparrow.tokenizer import load_tokenizer

    model_dir = default_checkpoint()
    tokenizer = load_tokenizer(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    stops = (tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|endoftext|>"))
    ids = tokenizer.encode(json.dumps(DOCUMENT)) + [stops[0]]
    result = {"vocab_size": vocab_size, "tokens": len(ids),
              "xgrammar": bench_xgrammar(tokenizer, vocab_size, stops, ids),
              "llguidance": bench_llguidance(model_dir, vocab_size, stops, ids)}  # fmt: skip
    write_report(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
