"""Token ids → text deltas for streaming, with OpenAI stop strings.

Decoding only a short window of recent ids per round (the prefix/read offsets vLLM uses) keeps
the cost per round constant instead of re-decoding the whole output; a delta that ends in an
incomplete UTF-8 sequence ("\ufffd") is held back until the next ids complete it. Stop strings
are matched on the text, so the last ``max(len(stop)) - 1`` characters are held back as well:
they may be the start of a stop string that the next round completes, and OpenAI never returns
any part of the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]


class TextStream:
    """Feed each round's ids to :meth:`push`; it returns the text that is safe to send. After a
    stop string matched, :attr:`stopped` is True and nothing more is returned; :meth:`flush`
    returns what was held back once the request has finished."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were decoded into text already (context for the next)
        self._read = 0
        self.text = ""  # everything decoded so far (up to a stop string)
        self._sent = 0  # characters of text returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def _emit(self, final: bool) -> str:
        if self.stop:
            start = max(self._sent - self._hold, 0)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(len(self.text) - self._hold, self._sent)
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._advance(final=False)
        return self._emit(final=False)

    def flush(self) -> str:
        """The held-back text, once no more ids will come."""
        if self.stopped:
            return ""
        if self._read < len(self.ids):
            self._advance(final=True)
        return self._emit(final=True)
