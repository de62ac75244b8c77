"""Tool calls apart from content: a chat completion's text, delta by delta, split into the
text outside the model's tool-call markup and OpenAI `tool_calls`. One format per model
family; each is what that family's chat template renders for an assistant turn's
`tool_calls`, the form the model is trained to write, so the template is the spec:

- `qwen3` (Qwen3.5 / 3.6 `chat_template.jinja`): one `<tool_call>` block per call, holding
  qwen3-coder XML, string values raw and others as JSON,
      <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
  or, as older Qwen3 templates render it, `{"name": NAME, "arguments": {...}}` as JSON.
- `minimax_m3` (MiniMax-M3 `chat_template.jinja`): one block for all the calls of a turn,
  every tag behind the namespace token NS = `]<]minimax[>[`,
      NS<tool_call>\\nNS<invoke name="NAME">NS<ARG>{VALUE}NS</ARG>NS</invoke>\\nNS</tool_call>
  where the argument's name is the tag (so any text: `-A`, `a.b`), objects nest as named
  children, arrays as `NS<item>` children, booleans are JSON and other scalars plain text.

Values carry no types in either XML form: a parameter is kept as text when the request's
tool schema says it is a string (vLLM's qwen3_coder reads the schema so), else decoded as
JSON when it parses (numbers, booleans, objects), else kept as text. A call is reported
only once it is whole and parses; until then its text is held back, so a streamed response
carries the same calls as a whole one, and a malformed or truncated call comes back as the
text it was. Whitespace around calls is dropped: the templates write it themselves when
they render the turn again.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sparrow.server.reasoning import partial_marker

Schemas = dict[str, dict]  # tool name -> JSON schema of its parameters


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON object text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class Step(NamedTuple):
    """What a format makes of the start of a block's unparsed text: `n` characters that are
    `call`; or, with no call, markup to drop (`bad` False) or text that is no call (`bad`:
    the block's text since its last call goes back to the content). `closed`: the block
    ends after them."""

    n: int
    call: ToolCall | None = None
    closed: bool = False
    bad: bool = False


class ToolFormat:
    """A family's tool-call markup: `start` opens a block of calls, and `step` reads the
    block's text after it (None: more text is needed to say)."""

    start: str

    def step(self, body: str, schemas: Schemas) -> Step | None:
        raise NotImplementedError


def _types(schema: Any) -> set[str]:
    """The JSON types a schema allows (`type`, a list of them, or anyOf / oneOf)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind or () if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types |= _types(sub)
    return types


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: json.loads takes, JSON does not


def _scalar(text: str, schema: Any) -> Any:
    """A parameter's text as its value: the text itself when the schema allows only strings,
    else its JSON value when it is JSON, else a number the schema asks for ("007"), else the
    text."""
    types = _types(schema)
    if types - {"null"} == {"string"}:
        return text
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        pass
    for kind, number in (("integer", int), ("number", float)):
        try:
            value = number(text.strip()) if kind in types else None
        except ValueError:
            continue
        if value is not None and math.isfinite(value):
            return value
    return text


def _arguments(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


class Qwen3Format(ToolFormat):
    """Qwen3.5 / 3.6: `<tool_call>` blocks of qwen3-coder XML, or Qwen3's JSON."""

    start, end = "<tool_call>", "</tool_call>"
    function = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
    parameter = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def step(self, body: str, schemas: Schemas) -> Step | None:
        i = body.find(self.end)
        if i < 0:
            return None
        call = self.parse(body[:i].strip(), schemas)
        return Step(i + len(self.end), call, closed=True, bad=call is None)

    def parse(self, body: str, schemas: Schemas) -> ToolCall | None:
        """A block's text as its call; None when it is not one."""
        if body.startswith("{"):
            return _json_call(body)
        m = self.function.fullmatch(body)
        if m is None or not m.group(1).strip():
            return None
        name, inner, pos, args = m.group(1).strip(), m.group(2), 0, {}
        properties = (schemas.get(name) or {}).get("properties") or {}
        while p := self.parameter.match(inner, pos):
            value = p.group(2)  # the template writes "\n" + value + "\n"
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[p.group(1).strip()] = _scalar(value, properties.get(p.group(1).strip()))
            pos = p.end()
        return ToolCall(name, _arguments(args)) if not inner[pos:].strip() else None


def _json_call(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (arguments also as JSON text) as a call."""
    try:
        call = json.loads(body, parse_constant=_no_constant)
        args = call.get("arguments", call.get("parameters", {}))
        args = json.loads(args, parse_constant=_no_constant) if isinstance(args, str) else args
    except (ValueError, AttributeError):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
        return None
    return ToolCall(name.strip(), _arguments(args))


NS = "]<]minimax[>["


class MiniMaxM3Format(ToolFormat):
    """MiniMax-M3: an NS-tagged block of `<invoke>`s, each argument named by its tag."""

    start, end = NS + "<tool_call>", NS + "</tool_call>"
    invoke_start, invoke_end = NS + '<invoke name="', NS + "</invoke>"
    invoke = re.compile(
        re.escape(NS) + r'<invoke name="([^"\n]+)">(.*)' + re.escape(NS) + "</invoke>", re.S
    )

    def step(self, body: str, schemas: Schemas) -> Step | None:
        rest = body.lstrip()
        skipped = len(body) - len(rest)
        if rest.startswith(self.end):
            return Step(skipped + len(self.end), closed=True)
        if rest.startswith(self.invoke_start):
            i = rest.find(self.invoke_end)
            if i < 0:
                return None
            n = i + len(self.invoke_end)
            call = self.parse(rest[:n], schemas)
            return Step(skipped + n, call, closed=call is None, bad=call is None)
        if self.end.startswith(rest) or self.invoke_start.startswith(rest):
            return None  # perhaps a marker, not whole yet
        return Step(0, closed=True, bad=True)  # neither a call nor the block's end

    def parse(self, text: str, schemas: Schemas) -> ToolCall | None:
        """One `NS<invoke ...>...NS</invoke>` as its call; None when it is not one."""
        m = self.invoke.fullmatch(text)
        tree = _m3_tree(m.group(2)) if m else None
        if tree is None or isinstance(tree, str) and tree.strip():
            return None
        name = m.group(1).strip()
        schema = {"type": "object", **(schemas.get(name) or {})}
        return ToolCall(
            name, _arguments(_m3_object(tree if isinstance(tree, list) else [], schema))
        )


_M3_TAG = re.compile(r"<(/?)([^<>/\n][^<>\n]*)>(.*)", re.S)
Node = str | list  # an element's text, or its children as [(tag, Node)]


def _m3_tree(text: str) -> Node | None:
    """NS-tagged XML as a tree: a leaf's text, or the [(tag, node)] children; None when the
    tags do not nest or text sits beside child elements."""
    pieces = text.split(NS)  # each tag starts right after an NS
    stack: list[tuple[str, list, list[str]]] = [("", [], [pieces[0]])]
    for piece in pieces[1:]:
        m = _M3_TAG.fullmatch(piece)
        if m is None:
            return None
        closing, tag, after = m.groups()
        if closing:
            if len(stack) == 1 or stack[-1][0] != tag:
                return None
            _, children, texts = stack.pop()
            node = _m3_node(children, texts)
            if node is None:
                return None
            stack[-1][1].append((tag, node))
        else:
            stack.append((tag, [], []))
        stack[-1][2].append(after)
    return _m3_node(*stack[0][1:]) if len(stack) == 1 else None


def _m3_node(children: list, texts: list[str]) -> Node | None:
    text = "".join(texts)
    if not children:
        return text
    return children if not text.strip() else None


def _m3_value(node: Node, schema: Any) -> Any:
    """A tree node as the value the template rendered it from, typed by the schema where
    there is one: arrays from `item` children, objects from named ones."""
    types = _types(schema)
    if isinstance(node, str):
        if not node.strip() and types and types <= {"object", "array", "null"}:
            return [] if "array" in types else {}  # an empty container renders as nothing
        return _scalar(node, schema)
    if "array" in types or "object" not in types and all(tag == "item" for tag, _ in node):
        items = schema.get("items") if isinstance(schema, dict) else None
        return [_m3_value(child, items) for _, child in node]
    return _m3_object(node, schema)


def _m3_object(children: list, schema: Any) -> dict:
    """Named children as an object; a repeated name collects its values in an array."""
    schema = schema if isinstance(schema, dict) else {}
    properties = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    out: dict[str, Any] = {}
    repeated: set[str] = set()
    for tag, child in children:
        value = _m3_value(child, properties.get(tag, extra))
        if tag not in out:
            out[tag] = value
            continue
        if tag not in repeated:
            out[tag], repeated = [out[tag]], repeated | {tag}
        out[tag].append(value)
    return out


class ToolCallSplitter:
    """One completion's text, delta by delta -> (content, calls). Outside a block, trailing
    whitespace and a suffix that may begin the start marker are held back; inside one, all
    of it until the format can say what it is."""

    def __init__(self, fmt: ToolFormat, schemas: Schemas | None = None):
        self.fmt, self.schemas = fmt, schemas or {}
        self.in_block = False
        self.held = ""  # outside a block: unshown text; inside: the block's unparsed text
        self.raw = ""  # the block's text since its last call, or since the whitespace before
        # the block: content again, as written, if no call follows
        self.strip = False  # drop the whitespace that follows a call

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """A delta's text -> (the content it shows, the calls it completes)."""
        buf, self.held = self.held + text, ""
        shown: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self.in_block:
                if self.strip:
                    buf = buf.lstrip()
                    self.strip = not buf
                i = buf.find(self.fmt.start)
                if i < 0:
                    keep = partial_marker(buf, self.fmt.start)
                    shown.append(buf[: len(buf) - keep].rstrip())
                    self.held = buf[len(shown[-1]) :]
                    return "".join(shown), calls
                shown.append(buf[:i].rstrip())
                self.in_block, self.raw = True, buf[len(shown[-1]) : i] + self.fmt.start
                buf = buf[i + len(self.fmt.start) :]
                continue
            step = self.fmt.step(buf, self.schemas)
            if step is None:
                self.held = buf
                return "".join(shown), calls
            piece, buf = buf[: step.n], buf[step.n :]
            if step.call is not None:
                calls.append(step.call)
                self.raw = ""
            elif step.bad:
                shown.append(self.raw + piece)
                self.raw = ""
            else:
                self.raw += piece
            if step.closed:
                self.in_block, self.strip, self.raw = False, not step.bad, ""

    def flush(self) -> str:
        """What is held back at the end, as text: an unfinished block or marker is no call."""
        held, self.held = self.held, ""
        if self.in_block:
            held, self.raw, self.in_block = self.raw + held, "", False
            return held if held.strip() else ""
        return held.lstrip() if self.strip else held


PARSERS: dict[str, ToolFormat] = {"qwen3": Qwen3Format(), "minimax_m3": MiniMaxM3Format()}
