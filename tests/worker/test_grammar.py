"""Grammar-constrained sampling: the vocabulary's bytes, the masks, and generation on the
built-in random-weight model that follows JSON schemas, regexes and choices."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import pytest
import torch

from sparrow.core.sampling_params import SamplingParams
from sparrow.core.structured import GrammarSpec
from sparrow.engine.llm import LLM
from sparrow.tokenizer import load_tokenizer
from sparrow.worker.grammar import Grammar, _apply_unpacked, _unpack, apply_masks, token_bytes


@pytest.fixture(scope="module")
def llm():
    return LLM(model=None)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of string / integer / boolean / enum / array / nested object
    properties, bounded so that a random model finishes it in a few dozen tokens."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 1 else [])
    props = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            props[f"s{i}"] = {"type": "string", "maxLength": rng.randint(0, 6)}
        elif kind == "integer":
            props[f"i{i}"] = {"type": "integer", "minimum": -5, "maximum": rng.randint(0, 999)}
        elif kind == "boolean":
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == "enum":
            props[f"e{i}"] = {"enum": rng.sample(["red", "green", "blue", "a b", 'x"y'], 3)}
        elif kind == "array":
            item = rng.choice(
                [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "string", "maxLength": 3},
                ]
            )
            props[f"a{i}"] = {"type": "array", "items": item, "maxItems": 3}
        else:
            props[f"o{i}"] = random_schema(rng, depth + 1)
    required = rng.sample(sorted(props), rng.randint(len(props) - 1, len(props)))
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def validate(value, schema: dict) -> None:
    """Raise AssertionError unless `value` fits `schema` (the subset `random_schema` makes)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema["type"]
    if kind == "string":
        assert isinstance(value, str) and len(value) <= schema["maxLength"], (value, schema)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (value, schema)
        assert schema["minimum"] <= value <= schema["maximum"], (value, schema)
    elif kind == "boolean":
        assert isinstance(value, bool), value
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema["maxItems"], (value, schema)
        for item in value:
            validate(item, schema["items"])
    else:
        assert isinstance(value, dict), value
        assert set(schema["required"]) <= set(value) <= set(schema["properties"]), (value, schema)
        for key, item in value.items():
            validate(item, schema["properties"][key])


def test_schemas_are_followed_in_a_batch(llm):
    """16 random schemas and one unconstrained request in one batch: every constrained
    output parses, fits its schema and ends at an end token."""
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(16)]
    params = [SamplingParams(max_tokens=160, grammar=GrammarSpec.json_schema(s)) for s in schemas]
    prompts = [f"Record number {i}:" for i in range(len(schemas))]
    outs = llm.generate(prompts + ["free text"], params + [SamplingParams(max_tokens=7)])
    for out, schema in zip(outs, schemas, strict=False):
        assert out.finish_reason.name == "STOP", (out.text, schema)
        assert out.token_ids[-1] in llm.default_stop_ids
        validate(json.loads(out.text), schema)
    assert len(outs[-1].token_ids) == 7


def test_sampled_outputs_follow_the_schema(llm):
    """Temperature sampling with a seed per request, after a long prompt."""
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 1, "maximum": 50},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    spec = GrammarSpec.json_schema(schema)
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=s, grammar=spec) for s in range(4)
    ]
    for out in llm.generate(["word " * 300] * 4, params):
        validate(json.loads(out.text), schema)


def test_json_object_regex_and_choice(llm):
    close = [llm.tokenizer.encode(t)[0] for t in ("{}", "}")]
    bias = tuple((t, 50.0) for t in close)  # the random model takes a while to end a string
    outs = llm.generate(
        ["a", "b", "c"],
        [
            SamplingParams(max_tokens=20, grammar=GrammarSpec("json_object"), logit_bias=bias),
            SamplingParams(max_tokens=20, grammar=GrammarSpec("regex", r"[a-z]{3}-\d{2}")),
            SamplingParams(max_tokens=20, grammar=GrammarSpec.choice(["yes", "no", "maybe so"])),
        ],
    )
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"[a-z]{3}-\d{2}", outs[1].text), outs[1].text
    assert outs[2].text in ("yes", "no", "maybe so")
    assert all(o.finish_reason.name == "STOP" for o in outs)


def test_ignoring_eos_goes_on_with_end_tokens_only(llm):
    [out] = llm.generate(
        ["a"], SamplingParams(max_tokens=6, ignore_eos=True, grammar=GrammarSpec.choice(["ok"]))
    )
    # "ok" in whatever tokens the model picks ("ok" or "o" + "k"), then end tokens only
    end = next(i for i, t in enumerate(out.token_ids) if t in llm.default_stop_ids)
    assert llm.tokenizer.decode(out.token_ids[:end]) == "ok" and len(out.token_ids) == 6
    assert set(out.token_ids[end:]) <= set(llm.default_stop_ids)


def test_a_bad_schema_is_refused_at_admission(llm):
    for spec, needle in [
        (GrammarSpec("json", '{"type": "foo"}'), 'Unsupported type "foo"'),
        (GrammarSpec("regex", "(("), "parenthesis is not closed"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            llm.add_request("x", SamplingParams(grammar=spec))
    assert not llm.has_unfinished()


def test_token_bytes_round_trip(llm):
    """Each token's bytes are what decoding it gives; special tokens have none. Both
    backends: the checkpoint's tokenizer.json and the packaged tiktoken vocabulary."""
    for tok in (llm.tokenizer, load_tokenizer()):
        vocab = token_bytes(tok)
        for text in ["Hello, world!", ' {"a": [1, 2]}', "naïve 日本語 \n\t"]:
            ids = tok.encode(text)
            assert b"".join(vocab[i] for i in ids).decode() == text
        assert vocab[tok.token_id("<|im_end|>")] == b""


def test_after_a_stop_token_only_stop_tokens(llm):
    compiled = llm.grammar_compiler().compile(GrammarSpec.choice(["yes"]))
    stops = llm.default_stop_ids
    grammar = Grammar(compiled, stops)
    for t in llm.tokenizer.encode("yes") + [stops[0]]:
        grammar.accept(t)
    mask = torch.zeros(1, -(-llm.model.config.vocab_size // 32), dtype=torch.int32)
    grammar.fill(mask, 0)
    allowed = _unpack(mask, llm.model.config.vocab_size)[0].nonzero().flatten().tolist()
    assert allowed == sorted(stops)


def test_apply_masks_matches_a_loop():
    """63 tokens (a partial last word, bit 31 set), masks on rows 0 and 2 of 3."""
    torch.manual_seed(0)
    vocab = 63
    logits = torch.randn(3, vocab)
    allowed = torch.rand(3, 64) < 0.4
    allowed[:, 31] = True
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (allowed.view(3, 2, 32).long() * weights).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    want = logits.clone()
    for b in [0, 2]:
        for t in range(vocab):
            if not allowed[b, t]:
                want[b, t] = float("-inf")
    assert torch.equal(apply_masks(logits, bitmask, [0, 2]), want)
    # the path GPUs take: the mask unpacked on the device
    assert torch.equal(_apply_unpacked(logits.clone(), bitmask, [0, 2]), want)


def test_a_grammar_that_starts_after_the_think_block(llm):
    """With `after` the output is free up to the think block's end marker (here forced first
    by a logit bias) and follows the grammar from there; without it the grammar bars the
    marker, bias or not."""
    end = llm.tokenizer.token_id("</think>")
    bias = ((end, 40.0),)
    spec = GrammarSpec.choice(["yes", "no"])
    gated, plain = llm.generate(
        ["a", "a"],
        [
            SamplingParams(max_tokens=8, logit_bias=bias, grammar=replace(spec, after=end)),
            SamplingParams(max_tokens=8, logit_bias=bias, grammar=spec),
        ],
    )
    assert gated.token_ids[0] == end and gated.text in ("</think>yes", "</think>no")
    assert end not in plain.token_ids and plain.text in ("yes", "no")
