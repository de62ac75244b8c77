"""Structured output requests: the grammar a request's output must follow, as plain data.

`GrammarSpec` travels in `SamplingParams`; the engine compiles it (`sparrow.worker.grammar`)
and masks each step's logits with it. Kinds follow vLLM's `structured_outputs` and
`response_format`: a JSON schema (`json`, its text), any JSON object (`json_object`), a
regular expression (`regex`), one of some strings (`choice`, their JSON list) and a
context-free grammar in EBNF/GBNF (`grammar`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """kind: one of `KINDS`; value: the schema as JSON text, the regex, the choices as a
    JSON list or the grammar text ('' for json_object). after: a token id (a reasoning
    block's end marker, e.g. `</think>`): the output is free up to and including its first
    occurrence, and follows the grammar from there (vLLM's structured output with a
    reasoning parser); None: from the first token. Hashable: compiled grammars are cached
    by (kind, value)."""

    kind: str
    value: str = ""
    after: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured output value must be a string, got {self.value!r}")
        if self.kind == "choice":
            choices = json.loads(self.value)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> GrammarSpec:
        """A JSON schema given as a dict (or bool) or as its text."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)))


def from_request(
    structured_outputs: dict[str, Any] | None, response_format: dict[str, Any] | None
) -> GrammarSpec | None:
    """The grammar of an OpenAI request: vLLM's `structured_outputs` ({"json": schema},
    {"regex": ...}, {"choice": [...]}, {"grammar": ...}, {"json_object": true}) or
    `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}); None if neither asks. ValueError when both ask or one
    is malformed."""
    spec = _from_structured(structured_outputs or {})
    fmt = _from_response_format(response_format)
    if spec is not None and fmt is not None:
        raise ValueError("give structured_outputs or response_format, not both")
    return spec or fmt


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_structured(so: dict[str, Any]) -> GrammarSpec | None:
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
    if unknown:  # vLLM's structural_tag, whitespace_pattern, ...: refused, not ignored
        raise ValueError(f"structured_outputs.{unknown[0]} is not supported")
    asked = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(asked) > 1:
        raise ValueError(f"structured_outputs takes one constraint, got {asked}")
    if not asked:
        return None
    kind, value = asked[0], so[asked[0]]
    if kind == "json":
        if not isinstance(value, dict | bool | str):
            raise ValueError("structured_outputs.json must be a JSON schema")
        return GrammarSpec.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list):
            raise ValueError("structured_outputs.choice must be a list of strings")
        return GrammarSpec.choice(value)
    if kind == "json_object":
        return GrammarSpec("json_object")
    if not isinstance(value, str):
        raise ValueError(f"structured_outputs.{kind} must be a string")
    return GrammarSpec(kind, value)


def _from_response_format(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise ValueError("response_format.json_schema must be an object with a schema")
        schema = inner.get("schema", {})  # OpenAI: the schema is optional; any JSON then
        if not isinstance(schema, dict | bool):
            raise ValueError("response_format.json_schema.schema must be a JSON schema")
        return GrammarSpec.json_schema(schema)
    raise ValueError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )
