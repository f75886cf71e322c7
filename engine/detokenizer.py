"""Incremental detokenization and stop strings (plain Python; no jax).

Decoding the whole output again at every token costs O(n^2); instead only a short window of
recent tokens is decoded. Byte-level BPE tokens can end in the middle of a UTF-8 character, which
decodes to U+FFFD: such text is held back until the character is complete. Text that could be
the start of a stop string is held back too, so a stream never shows a stop string.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.text = ""  # all text decoded so far (before any stop-string cut)
        self._prefix_offset = 0  # tokens before this are only context for the window
        self._read_offset = 0  # tokens before this are already in self.text
        self._emitted = 0  # characters of self.text already returned as deltas
        self.stopped_at: str | None = None  # the stop string that ended the text

    def add(self, token_ids: Sequence[int], finished: bool) -> str:
        """Updates with the full output token list; returns the new text to show."""
        if self.stopped_at is None:
            prefix = self.tokenizer.decode(token_ids[self._prefix_offset:self._read_offset])
            window = self.tokenizer.decode(token_ids[self._prefix_offset:])
            if len(window) > len(prefix) and (finished or not window.endswith(REPLACEMENT_CHAR)):
                self.text += window[len(prefix):]
                self._prefix_offset = self._read_offset
                self._read_offset = len(token_ids)
            self._cut_at_stop_string()
        return self._delta(finished or self.stopped_at is not None)

    def _cut_at_stop_string(self) -> None:
        if not self.stop:
            return
        search_from = max(self._emitted - max(len(s) for s in self.stop), 0)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            self.stopped_at = stop

    def _delta(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            end = max(self._emitted, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
