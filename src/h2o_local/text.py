"""Turning generated token bytes into text: UTF-8 that may split across tokens, and stop strings."""
from __future__ import annotations

import codecs
from typing import Optional, Sequence


class TextAssembler:
    """Accumulates token bytes and releases text that can no longer be part of a stop string.

    `push(piece)` returns the newly releasable text; `stopped` tells whether a stop string was found (the text is then
    cut right before it); `flush()` releases what was held back at the end of generation.
    """

    def __init__(self, stop: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._text = ""      # decoded text not yet released
        self.released = ""   # all the text released so far (what the user saw)
        self.stopped = False
        self.stop_word: Optional[str] = None  # the stop string found (the earliest in the text)

    def push(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        self._text += self._decoder.decode(piece)
        hits = [(i, n) for n, i in enumerate(self._text.find(s) for s in self._stop) if i >= 0]
        if hits:
            at, n = min(hits)
            self.stopped, self.stop_word = True, self._stop[n]
            out, self._text = self._text[:at], ""
            self.released += out
            return out
        hold = self._held_suffix()
        out = self._text[: len(self._text) - hold]
        self._text = self._text[len(self._text) - hold :]
        self.released += out
        return out

    def flush(self) -> str:
        """The text held back, at the end of generation; the bytes of a character cut short are dropped."""
        if self.stopped:
            return ""
        out = self._text
        self._text = ""
        self._decoder.reset()
        self.released += out
        return out

    def _held_suffix(self) -> int:
        """Length of the longest tail of the pending text that starts some stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best


def check_text(name: str, value: str) -> str:
    """`value` must be text that UTF-8 can carry (no lone surrogate, as a byte that is not UTF-8 becomes in a command
    line argument): the one check every string passes before it reaches llama.cpp. Raises ValueError naming `name`."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid text: character {e.start} is a lone surrogate (a byte that is not "
                         f"UTF-8, such as {value[e.start].encode('utf-8', 'surrogateescape')!r})") from None
    return value
