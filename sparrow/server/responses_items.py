"""A Responses request's input items, checked and put in the form the server stores (each
with an id, as `GET /v1/responses/{id}/input_items` lists them), and a conversation of such
items as the chat messages its template renders. Errors name the item at fault
(`input[3].call_id`)."""

from __future__ import annotations

import json
from typing import Any

from sparrow.server.responses_protocol import ASSISTANT_ITEMS, USER_ROLES, bad, new_id

ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
ID_PREFIXES["reasoning"] = "rs"


def input_items(value: str | list[Any]) -> list[dict]:
    """`input` (a string: one user message) as stored items; 400 for anything else than
    message, function_call, function_call_output and reasoning items."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not value:
        raise bad("input needs at least one item", "input")
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad("an input item must be an object", where)
        kind = item.get("type") or ("message" if "role" in item else None)
        read = READERS.get(kind) if isinstance(kind, str) else None  # a list is unhashable
        if read is None:
            raise bad(
                f"input item type {kind!r} is not supported: message, function_call, "
                "function_call_output or reasoning",
                f"{where}.type",
            )
        id_ = item.get("id")
        if id_ is not None and not isinstance(id_, str):
            raise bad("an item id must be a string", f"{where}.id")
        items.append({"id": id_ or new_id(ID_PREFIXES[kind]), "type": kind, **read(item, where)})
    return items


def _text(item: dict, key: str, where: str, empty: bool = True) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (empty or value):
        raise bad(f"{key} must be a {'' if empty else 'non-empty '}string", f"{where}.{key}")
    return value


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in (*USER_ROLES, "assistant"):
        raise bad(f"role must be one of user, system, developer, assistant; got {role!r}", where)
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    if not isinstance(content, list):
        raise bad("content must be a string or a list of parts", f"{where}.content")
    parts = [_part(p, role, f"{where}.content[{j}]") for j, p in enumerate(content)]
    return {"role": role, "content": parts, "status": "completed"}


def _part(part: Any, role: str, where: str) -> dict:
    """One content part: input_text / input_image (output_text and refusal in an assistant's
    message)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if role == "assistant" and kind in ("output_text", "input_text", "refusal"):
        key = "refusal" if kind == "refusal" else "text"
        return {"type": "output_text", "text": _text(part, key, where), "annotations": []}
    if kind == "input_text":
        return {"type": "input_text", "text": _text(part, "text", where)}
    if kind == "input_image" and role != "assistant":
        if part.get("file_id") is not None:
            raise bad("images by file_id are not supported: give image_url", f"{where}.file_id")
        url = _text(part, "image_url", where, empty=False)
        return {"type": "input_image", "image_url": url, "detail": part.get("detail") or "auto"}
    raise bad(f"content part type {kind!r} is not supported in a {role} message", f"{where}.type")


def _call(item: dict, where: str) -> dict:
    arguments = _text(item, "arguments", where)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad("arguments must be a JSON object's text", f"{where}.arguments")
    return {
        "call_id": _text(item, "call_id", where, empty=False),
        "name": _text(item, "name", where, empty=False),
        "arguments": arguments,
        "status": "completed",
    }


def _call_output(item: dict, where: str) -> dict:
    output = item.get("output")
    if isinstance(output, list):
        output = [_part(p, "user", f"{where}.output[{j}]") for j, p in enumerate(output)]
    elif not isinstance(output, str):
        raise bad("output must be a string or a list of parts", f"{where}.output")
    call_id = _text(item, "call_id", where, empty=False)
    return {"call_id": call_id, "output": output, "status": "completed"}


def _reasoning(item: dict, where: str) -> dict:
    """Reasoning text from `content` (reasoning_text parts) or else `summary`; an
    `encrypted_content` (another server's) is not readable here and is dropped."""
    out = {}
    for key, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or any(
            not isinstance(p, dict) or p.get("type") != kind or not isinstance(p.get("text"), str)
            for p in parts
        ):
            raise bad(f"{key} must be a list of {kind} parts", f"{where}.{key}")
        out[key] = [{"type": kind, "text": p["text"]} for p in parts]
    return out


READERS = {
    "message": _message,
    "function_call": _call,
    "function_call_output": _call_output,
    "reasoning": _reasoning,
}


def chat_messages(items: list[dict], new_from: int) -> list[dict]:
    """A conversation as chat messages: each run of assistant items (reasoning, text, calls,
    in that order) one assistant turn. `new_from`: where this request's input starts among
    `items` (errors name `input[i]` from there); 400 for a function_call_output whose call_id
    matches no function_call before it."""
    messages: list[dict] = []
    turn, phase, calls = None, -1, set()
    for i, item in enumerate(items):
        kind = item["type"]
        if kind in ASSISTANT_ITEMS and (kind != "message" or item["role"] == "assistant"):
            step = ASSISTANT_ITEMS.index(kind)
            if turn is None or step < phase or (step == phase and kind == "message"):
                turn = {"role": "assistant", "content": ""}
                messages.append(turn)
            phase = step
            _add_to_turn(turn, item)
            if kind == "function_call":
                calls.add(item["call_id"])
            continue
        turn = None
        if kind == "function_call_output":
            if item["call_id"] not in calls:
                raise bad(
                    f"no function_call with call_id {item['call_id']!r} comes before this output",
                    f"input[{max(i - new_from, 0)}].call_id",
                )
            content = _chat_content(item["output"])
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        else:
            messages.append({"role": item["role"], "content": _chat_content(item["content"])})
    return messages


def _add_to_turn(turn: dict, item: dict) -> None:
    kind = item["type"]
    if kind == "reasoning":
        parts = item["content"] or item["summary"]
        turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(
            p["text"] for p in parts
        )
    elif kind == "message":
        turn["content"] += "".join(p["text"] for p in item["content"])
    else:
        call = {"name": item["name"], "arguments": item["arguments"]}
        turn.setdefault("tool_calls", []).append(
            {"id": item["call_id"], "type": "function", "function": call}
        )


def _chat_content(content: str | list[dict]) -> str | list[dict]:
    """Input parts as chat content: text alone as a string, else text and image_url parts."""
    if isinstance(content, str):
        return content
    if all(p["type"] != "input_image" for p in content):
        return "".join(p["text"] for p in content)
    return [
        {"type": "image_url", "image_url": {"url": p["image_url"]}}
        if p["type"] == "input_image"
        else {"type": "text", "text": p["text"]}
        for p in content
    ]
