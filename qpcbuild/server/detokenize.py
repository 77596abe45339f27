"""Streamed text for the server: token ids in, the text that can be released out, held back
where it could still become a stop string or is an incomplete UTF-8 character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runtime.loader import Generator


class Detokenizer:
    """Incremental text with stop strings: text is released only when it cannot be the start of
    a stop string, and never in the middle of a multi-byte character. Each call costs time linear
    in the text and the stop strings (the search starts where the released text ends)."""

    def __init__(self, gen: Generator, stops: list[str]):
        self.gen, self.stops = gen, stops or []
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already released
        self.stopped = False

    def feed(self, ids: list[int], final: bool) -> str:
        self.ids += ids
        text = self.gen.tokenizer.decode(self.ids)
        # Released text never ends in a stop string's prefix, so no stop starts before `sent`.
        hits = [at for at in (text.find(s, self.sent) for s in self.stops) if at != -1]
        if hits:
            text, self.stopped, final = text[:min(hits)], True, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence
                end = len(text.rstrip("\ufffd"))
            hold = max((_prefix_at_end(text, s) for s in self.stops), default=0)
            end = min(end, len(text) - hold)
        out, self.sent = text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out


def _prefix_at_end(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with, in O(len(stop)):
    Knuth-Morris-Pratt's failure table over `stop`, then its automaton over the text's tail."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    k = 0
    for ch in text[-(len(stop) - 1):] if len(stop) > 1 else "":
        while k and ch != stop[k]:
            k = fail[k - 1]
        if ch == stop[k]:
            k += 1
    return k
