"""Incremental detokenization for streaming generation.

Decoding one token at a time is wrong twice over: a byte-level token can hold half of a UTF-8
character (emoji, CJK are 3-4 bytes, often split across tokens), which decodes to U+FFFD, and
some decoders depend on context (SentencePiece strips the leading space of the *first* token
only). So we decode a short window of recent tokens and emit only the text that the newest token
appended, holding it back while it still ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class StreamDecoder:
    """Turns a stream of token ids into text deltas whose concatenation equals `decode(all ids)`.

    `prefix_offset..read_offset` is a window of tokens whose text was already emitted; it gives
    the decoder the left context it needs. Each `push` decodes `prefix_offset..end` and returns
    what lies beyond the window's text, unless that text ends in U+FFFD, i.e. a character whose
    remaining bytes have not arrived yet. `flush` returns whatever is still held back (a sequence
    that ends in genuinely invalid bytes), so nothing is lost at the end of generation.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any held-back text, e.g. a trailing incomplete character rendered as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(window)
        if len(text) <= len(emitted) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(emitted) :]
