"""Grammar mask time per token: xgrammar against llguidance, on the Qwen3.5/3.6 vocabulary
(248,320 logits), for one JSON schema.

    python -m sparrow.bench.grammar [--out bench-out/grammar.json]

Each library compiles the schema, then walks the tokens of a document that fits it,
computing the allowed-token bitmask before each token and accepting it. Writes and prints
JSON: tokenizer set-up and compile seconds and the mask time per token (median, mean, p99,
ms) for each library.

    python -m sparrow.bench.grammar --engine [--batch 1,32]   # GPU

`--engine`: the cost of a constraint in the engine. Full-size Qwen3.6-35B-A3B, 4-bit, random
weights: decode tok/s of `--batch` requests that follow `ENGINE_SCHEMA` (its string too long
to finish within `--decode` tokens, so both sides generate the same count) against the same
requests unconstrained, alternating, median of rounds.
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
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "active", "role", "tags", "address"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "active": True,
    "role": "admin",
    "tags": ["math", "engines", "notes on the analytical engine"],
    "address": {"city": "London", "zip": "W1"},
}


# a JSON object whose one string must run past any decode length the bench asks for
ENGINE_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 8000}},
    "required": ["text"],
}


def _summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {
        "median_ms": round(statistics.median(ms), 4),
        "mean_ms": round(statistics.mean(ms), 4),
        "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 4),
    }


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
    return {
        "tokenizer_setup_s": round(setup, 3),
        "compile_s": round(compile_s, 4),
        **_summary(times),
    }


def bench_llguidance(model_dir, vocab_size: int, stops: tuple[int, ...], ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(
        str(model_dir / "tokenizer.json"), n_vocab=vocab_size, eos_token=list(stops)
    )
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA),
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )
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
    return {
        "tokenizer_setup_s": round(setup, 3),
        "compile_s": round(compile_s, 4),
        **_summary(times),
    }


def bench_engine(batches: list[int], decode: int, rounds: int) -> dict:
    """{batch: {"free" / "json_schema": decode tok/s, "ratio": constrained / free}} on the
    GPU, the two sides alternating per round."""
    import torch

    from sparrow.bench.e2e import run_engine
    from sparrow.core.sampling_params import SamplingParams
    from sparrow.core.structured import GrammarSpec
    from sparrow.engine.llm import LLM
    from sparrow.loader.random_checkpoint import preset_dir

    llm = LLM(
        str(preset_dir("qwen3.6-35b-a3b")),
        load_format="dummy",
        quantize="4bit",
        max_num_seqs=max(batches),
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    prompt = llm.tokenizer.encode("Describe the weather as JSON.")
    sides = {
        "free": SamplingParams(max_tokens=decode, ignore_eos=True),
        "json_schema": SamplingParams(
            max_tokens=decode, ignore_eos=True, grammar=GrammarSpec.json_schema(ENGINE_SCHEMA)
        ),
    }
    result = {}
    for batch in batches:
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(rounds + 1):  # the first round compiles and captures
            for name, params in sides.items():
                _, seconds, tokens = run_engine(llm, [prompt] * batch, decode, params)
                if tokens != batch * (decode - 1):
                    raise RuntimeError(f"{name}: {tokens} tokens, not {batch * (decode - 1)}")
                if r:
                    rates[name].append(tokens / seconds)
        row = {name: round(statistics.median(v), 1) for name, v in rates.items()}
        row["ratio"] = round(row["json_schema"] / row["free"], 4)
        result[str(batch)] = row
        print(f"batch {batch}: {row}", flush=True)
    result["gpu"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out/grammar.json")
    parser.add_argument("--engine", action="store_true", help="decode tok/s on the GPU")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--decode", type=int, default=128, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from sparrow.eval.report import write_report

    if args.engine:
        batches = [int(b) for b in args.batch.split(",")]
        write_report(
            args.out,
            {
                "decode_tokens": args.decode,
                "rounds": args.rounds,
                **bench_engine(batches, args.decode, args.rounds),
            },
        )
        return
    from sparrow.loader.random_checkpoint import tiny_random_checkpoint
    from sparrow.tokenizer import load_tokenizer

    model_dir = tiny_random_checkpoint()  # the Qwen3.5/3.6 vocabulary
    tokenizer = load_tokenizer(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    stops = (tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|endoftext|>"))
    ids = tokenizer.encode(json.dumps(DOCUMENT)) + [stops[0]]
    result = {
        "vocab_size": vocab_size,
        "tokens": len(ids),
        "xgrammar": bench_xgrammar(tokenizer, vocab_size, stops, ids),
        "llguidance": bench_llguidance(model_dir, vocab_size, stops, ids),
    }
    write_report(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
