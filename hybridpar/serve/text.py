"""Text out of token streams: byte-level detokenizing and OpenAI-style stop strings (a tokenizer's own
streaming decoder is tokenizer.StreamDecoder)."""

from __future__ import annotations

import codecs
from typing import Sequence


class ByteDetokenizer:
    """Incremental byte-level decoding: a UTF-8 character split over tokens is emitted once complete."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._dec.decode(bytes([token if 0 <= token < 256 else 0xFF]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class NoText:
    """The decoder of a model without a tokenizer whose ids are not bytes: no text, the ids only."""

    def feed(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class StopText:
    """Cuts generated text at the first of `stops` (the stop string itself is not returned, as in
    OpenAI's API). Streaming-safe: text that could still become a stop string is held back until it
    cannot, so nothing after a stop ever reaches the client."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.hit = False  # a stop string was found: feed() and flush() return nothing more
        self._held = ""

    def feed(self, piece: str) -> str:
        """Text that is final: before any stop string, and not the start of one."""
        if self.hit:
            return ""
        text = self._held + piece
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self.hit, self._held = True, ""
            return text[: min(found)[0]]
        # Hold back the longest tail that is a proper prefix of some stop string.
        keep = max(
            (k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0
        )
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: what was held back (no stop string followed)."""
        out, self._held = ("" if self.hit else self._held), ""
        return out
