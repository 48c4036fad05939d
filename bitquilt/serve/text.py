"""The text of a growing list of new token ids, released as it becomes final, and cut at the first stop string."""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder shows for a token that ends inside a UTF-8 character


class TextStream:
    """Push token ids, get the new text each one makes final. The ids are decoded whole each time (a token may end
    inside a character); text is held back while it ends in a partial character or in what could begin a stop
    string. `stopped` once a stop string appears: the text ends just before it (OpenAI's rule)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` released
        self.stopped = False

    def push(self, token: int) -> str:
        """The text `token` makes final (may be empty)."""
        self.ids.append(token)
        self.text = self.decode(self.ids)
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._release(min(found))
        if self.text.endswith(REPLACEMENT):
            return ""
        held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._release(len(self.text) - held)

    def finish(self) -> str:
        """What is still held back when the run ends without a stop string."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out
