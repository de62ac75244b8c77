"""Structured-output requests as plain data: what each OpenAI / vLLM form becomes."""

from __future__ import annotations

import json

import pytest

from sparrow.core.sampling_params import SamplingParams
from sparrow.core.structured import GrammarSpec, from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "structured, response_format, want",
    [
        (None, None, None),
        (None, {"type": "text"}, None),
        (None, {"type": "json_object"}, GrammarSpec("json_object")),
        (
            None,
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
            GrammarSpec("json", json.dumps(SCHEMA)),
        ),
        ({"json": SCHEMA}, None, GrammarSpec("json", json.dumps(SCHEMA))),
        ({"json": json.dumps(SCHEMA)}, None, GrammarSpec("json", json.dumps(SCHEMA))),
        ({"regex": "[0-9]+"}, None, GrammarSpec("regex", "[0-9]+")),
        ({"choice": ["a", "b c"]}, None, GrammarSpec("choice", '["a", "b c"]')),
        ({"grammar": 'root ::= "x"'}, None, GrammarSpec("grammar", 'root ::= "x"')),
        ({"json_object": True}, None, GrammarSpec("json_object")),
        ({"regex": None, "choice": ["a"]}, {"type": "text"}, GrammarSpec("choice", '["a"]')),
    ],
)
def test_request_forms(structured, response_format, want):
    assert from_request(structured, response_format) == want


@pytest.mark.parametrize(
    "structured, response_format, needle",
    [
        ({"json": SCHEMA}, {"type": "json_object"}, "not both"),
        ({"json": SCHEMA, "regex": "a"}, None, "one constraint"),
        ({"choice": []}, None, "non-empty list"),
        ({"choice": "a"}, None, "list of strings"),
        ({"choice": ["a", 1]}, None, "non-empty list of strings"),
        ({"regex": 5}, None, "must be a string"),
        ({"regex": "a", "whitespace_pattern": " "}, None, "whitespace_pattern is not supported"),
        ({"json": 5}, None, "JSON schema"),
        (None, {"type": "xml"}, "response_format.type"),
        (None, {"type": "json_schema"}, "json_schema must be an object"),
        (None, {"type": "json_schema", "json_schema": {"schema": []}}, "must be a JSON schema"),
    ],
)
def test_malformed_requests_raise(structured, response_format, needle):
    with pytest.raises(ValueError, match=needle):
        from_request(structured, response_format)


def test_spec_is_validated_and_hashable():
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("yaml", "")
    with pytest.raises(ValueError, match="GrammarSpec"):
        SamplingParams(grammar={"json": SCHEMA})
    spec = GrammarSpec.json_schema(SCHEMA)
    assert SamplingParams(grammar=spec).grammar == spec
    assert len({spec, GrammarSpec.json_schema(json.dumps(SCHEMA))}) == 1
