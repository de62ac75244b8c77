"""The text of a growing token sequence, decoding a short window per new token.

Decoding all of a request's output after every token costs O(n) each time (O(n^2) per
request). Byte-level BPE decodes piecewise, so the text only needs the tokens since the
last point where the decoded text was complete: the window `ids[prefix:]` is decoded and
compared with `ids[prefix:read]`; what it adds is new text, unless it ends in an incomplete
UTF-8 sequence (U+FFFD), which waits for the next token (or the end).
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""  # complete text so far
        self._prefix = self._read = 0

    def add(self, ids: list[int], final: bool = False) -> str:
        """Append tokens; returns the text so far. `final` also flushes an incomplete
        trailing sequence (the request is over)."""
        self.ids += ids
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text
