"""Generated pieces to streamed text, per sequence: whole UTF-8 characters only, and stop strings never emitted.

A token's piece can be part of a multi-byte character (emoji, CJK split over two tokens) and a stop string can
span several tokens, so text is held back until it is safe: bytes until they decode, and any tail that could be
the start of a stop string until the next piece settles it. Each sequence of a batch has its own ``TextStream``.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    """Feed pieces in order; each ``feed`` returns the text safe to emit now and whether a stop string ended it."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet emitted: never holds a whole stop string

    def feed(self, piece: bytes | str) -> tuple[str, bool]:
        """Add one piece; return (text to emit now, True when a stop string was reached: the text ends before it)."""
        self._pending += self._decoder.decode(piece) if isinstance(piece, bytes) else piece
        cut = find_stop(self._pending, self.stops)
        if cut is not None:
            text, self._pending = self._pending[:cut], ""
            return text, True
        safe = len(self._pending) - held_back(self._pending, self.stops)
        text, self._pending = self._pending[:safe], self._pending[safe:]
        return text, False

    def flush(self) -> str:
        """The end of the sequence: everything held back but an unfinished character, whose bytes are dropped (a
        generation cut by ``max_tokens`` inside a character ends before it, as llama-cpp-python's completions did:
        text is always whole text; the token's logprobs keep its bytes)."""
        text, self._pending = self._pending, ""
        self._decoder.reset()
        return text


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string in ``text`` starts, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string: that text must wait,
    because the next piece could complete the stop string, and stop text is never emitted."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
