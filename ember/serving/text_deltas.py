"""A request's text given out in pieces as its tokens arrive, never taking a piece back.

    deltas = TextDeltas(tokenizer, stop=("\\n\\n",))
    for event in events: send(deltas.add(event.token))
    send(deltas.finish(result.text))

The text grows by what a token adds to the decoding of the few tokens before it (decoding
the whole output again for every token would cost its length squared; decoding a token alone
would lose what a tokenizer writes across tokens: SentencePiece's leading space, a character
whose bytes two tokens hold), once that no longer ends in U+FFFD (a character whose bytes have
not all arrived). A piece is that text past what was given out, short of the last
``len(longest stop string) - 1`` characters while the request has stop strings (they may begin
a stop string, which the final text leaves out). :meth:`TextDeltas.finish` gives the rest of the
final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"
"""What a decoder writes for bytes that are not yet a whole UTF-8 character."""


class TextDeltas:
    """The pieces of one request's text (module docstring)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        """``tokenizer``: has ``decode(ids) -> str``; ``stop``: the request's stop strings."""
        self._tokenizer = tokenizer
        self._held = max((len(s) for s in stop), default=1) - 1
        self._tokens: list[int] = []
        self._context = self._read = 0  # tokens[context:read] were decoded into text; the rest not yet
        self.text = ""
        """The text of the tokens so far, as far as it is known."""
        self.sent = ""
        """The text given out so far."""

    def add(self, token: int) -> str:
        """The piece of text ``token`` completes (often empty)."""
        self._tokens.append(token)
        before = self._tokenizer.decode(self._tokens[self._context : self._read])
        after = self._tokenizer.decode(self._tokens[self._context :])
        if len(after) > len(before) and after.startswith(before) and not after.endswith(INCOMPLETE):
            self.text += after[len(before) :]
            self._context, self._read = self._read, len(self._tokens)
        end = len(self.text) - self._held
        if end <= len(self.sent):
            return ""
        piece = self.text[len(self.sent) : end]
        self.sent = self.text[:end]
        return piece

    def finish(self, text: str) -> str:
        """The rest of the request's final ``text`` (its result's: a stop string and what follows
        it cut off). Empty when ``text`` does not go on from what was given out: a stop string that
        began inside a token whose first characters were already sent."""
        return text[len(self.sent) :] if text.startswith(self.sent) else ""


__all__ = ["TextDeltas"]
