"""A response's output items as the deltas of its chat job arrive, and each step as the
Responses API's stream events (without `sequence_number`, which the stream adds): a
`reasoning` item while the model reasons, a `message` item for its text, a `function_call`
item for each call. An item opens (`output_item.added`, `content_part.added`), grows
(`reasoning_text.delta`, `output_text.delta`, `function_call_arguments.delta`) and closes
(the `.done` events, `output_item.done`) when the next kind of output starts or the
response ends. A whole response is the same items, the events dropped, so streamed and
whole responses carry the same output.

A forced call (`tool_choice` "required" or a named function) is decoded under a grammar as
vLLM does: a named function's output is its arguments, streamed as they come; "required"
gives a JSON array of {name, parameters}, read when the output ends."""

from __future__ import annotations

import copy
import json

from sparrow.engine.output_processor import OutputDelta
from sparrow.server.jobs import Choice
from sparrow.server.responses_protocol import new_id
from sparrow.server.tool_parsers import ToolCall

PART_TYPES = {"reasoning": "reasoning_text", "message": "output_text"}


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    """The output items of one choice; `feed` each of its deltas, then `close`. `forced`:
    the request's tool_choice when it forces a call, else None."""

    def __init__(self, choice: Choice, forced: str | dict | None = None):
        self.items: list[dict] = []
        self.open: dict | None = None  # the item that grows, the last of `items`
        self.forced, self.forced_text = forced, ""
        self.reasoning_tokens = 0
        self.thinking = choice.splitter is not None and choice.splitter.state == "inside"

    def feed(self, choice: Choice, delta: OutputDelta) -> list[dict]:
        """The events of one delta of `choice` (after `choice.take`)."""
        if self.thinking:  # the tokens up to and including the end marker
            self.reasoning_tokens += len(delta.token_ids)
        self.thinking = choice.splitter is not None and choice.splitter.state == "inside"
        reasoning, text = choice.last
        events = self._grow("reasoning", reasoning) if reasoning else []
        if text and self.forced is None:
            events += self._grow("message", text)
        elif text and isinstance(self.forced, dict):  # a named function: the arguments
            events += self._grow("function_call", text)
        else:
            self.forced_text += text
        for call in choice.last_calls:
            events += self._call(call)
        return events

    def close(self, incomplete: bool) -> list[dict]:
        """The events that end the output: the open item done ("incomplete" when the
        response is), the calls of a "required" choice; an empty message when there is no
        output at all."""
        events = []
        if self.forced == "required":
            calls = _required_calls(self.forced_text)
            for call in calls or ():
                events += self._call(call)
            if calls is None and self.forced_text:
                events += self._grow("message", self.forced_text)
        if not self.items:
            events += self._grow("message", "")
        if incomplete and self.open is not None:
            self.open["status"] = "incomplete"
        return events + self._close()

    def _grow(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close() + self._add(kind)
        index, item = len(self.items) - 1, self.open
        where = {"item_id": item["id"], "output_index": index}
        if kind == "function_call":
            item["arguments"] += text
            return events + [
                {"type": "response.function_call_arguments.delta", **where} | {"delta": text}
            ]
        item["content"][0]["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        delta = {"type": f"response.{name}.delta", **where, "content_index": 0, "delta": text}
        return events + [delta | ({} if kind == "reasoning" else {"logprobs": []})]

    def _add(self, kind: str, call: ToolCall | None = None) -> list[dict]:
        """Open an item of `kind` (a function_call: `call`'s, else the forced function's)."""
        if kind == "function_call":
            name = call.name if call is not None else self.forced["name"]
            call_id = call.id if call is not None else ToolCall(name, "").id
            item = {"id": new_id("fc"), "type": "function_call", "call_id": call_id}
            item |= {"name": name, "arguments": "", "status": "in_progress"}
        elif kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            item["status"] = "in_progress"
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant"}
            item |= {"status": "in_progress", "content": []}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        added = {"type": "response.output_item.added", "output_index": index, "item": _copy(item)}
        events = [added]
        if kind != "function_call":
            item["content"].append(_part(kind, ""))
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append({"type": "response.content_part.added", **where, "part": _part(kind, "")})
        return events

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item["status"] == "in_progress":
            item["status"] = "completed"
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            done = {"type": "response.function_call_arguments.done", **where}
            events = [done | {"name": item["name"], "arguments": item["arguments"]}]
        else:
            part, where = item["content"][0], where | {"content_index": 0}
            name = PART_TYPES[item["type"]]
            events = [{"type": f"response.{name}.done", **where, "text": part["text"]}]
            if item["type"] == "message":
                events[0]["logprobs"] = []
            events.append({"type": "response.content_part.done", **where, "part": _copy(part)})
        done = {"type": "response.output_item.done", "output_index": index, "item": _copy(item)}
        return events + [done]

    def _call(self, call: ToolCall) -> list[dict]:
        """A whole call: its item opened, its arguments in one delta, closed."""
        events = self._close() + self._add("function_call", call)
        return events + self._grow("function_call", call.arguments) + self._close()


def _copy(item: dict) -> dict:
    return copy.deepcopy(item)


def _required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a "required" choice's output, [{name, parameters}, ...]; None when it is
    not such an array (cut short)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
    ):
        return None
    args = [json.dumps(c.get("parameters", {}), ensure_ascii=False) for c in calls]
    return [ToolCall(c["name"], a) for c, a in zip(calls, args, strict=True)]
