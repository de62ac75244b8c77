"""Reasoning apart from the answer: a chat completion's text split into `reasoning_content`
(between the model's think markers) and `content`, as the deltas stream in.

A completion is inside a think block from its first token when the prompt opened one (Qwen's
template ends the generation prompt with `<think>\\n` unless `enable_thinking` is false), or
when its own text starts with the start marker (after whitespace); otherwise all of it is
content. The end marker closes the block: what follows is content, its leading newlines
dropped (the templates drop them when they render the turn again). A marker split across
deltas is held back until it is whole or cannot be one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str


PARSERS = {
    "qwen3": ReasoningFormat("<think>", "</think>"),
    "minimax_m3": ReasoningFormat("<mm:think>", "</mm:think>"),
}


def prompt_opens(fmt: ReasoningFormat, prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the completion inside a think block."""
    tail = prompt_text.rstrip()
    return tail.endswith(fmt.start)


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One completion's text, delta by delta -> (reasoning, content) deltas."""

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        self.state = "inside" if inside else "start"  # start -> inside -> after, or content
        self.held = ""
        self.strip = False  # drop the newlines that follow the end marker

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        if self.state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(self.fmt.start):
                self.state, buf = "inside", stripped[len(self.fmt.start) :]
            elif self.fmt.start.startswith(stripped):
                self.held = buf  # perhaps the start marker, not whole yet
                return "", ""
            else:
                self.state = "content"
        if self.state == "inside":
            i = buf.find(self.fmt.end)
            if i < 0:
                keep = partial_marker(buf, self.fmt.end)
                self.held = buf[len(buf) - keep :]
                return buf[: len(buf) - keep], ""
            self.state, self.strip = "after", True
            return buf[:i], self._content(buf[i + len(self.fmt.end) :])
        return "", self._content(buf)

    def _content(self, text: str) -> str:
        if self.strip:
            text = text.lstrip("\n")
            self.strip = not text
        return text

    def flush(self) -> tuple[str, str]:
        """What is held back at the end: an unfinished marker is plain text."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "inside" else ("", self._content(held))
