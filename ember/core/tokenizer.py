"""The byte-level tokenizer: token ids 0-255 are UTF-8 bytes, 256 is end-of-document.

It lives in ``core`` because training (data preparation) and serving (text prompts,
exported artifacts) both need it. ``describe()`` gives a JSON description that
``tokenizer_from_description`` turns back into a tokenizer, so an exported model carries
its tokenizer without code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens plus one end-of-document token (``eos_id`` = 256)."""

    eos_id: int = BYTE_VOCAB
    vocab_size: int = BYTE_VOCAB + 1

    def encode(self, text: str, *, add_special_tokens: bool = True, add_eos: bool = False) -> np.ndarray:
        """``text`` -> ``[len(utf8 bytes) (+1)]`` uint16 token ids. ``add_special_tokens`` is
        accepted as ``HFTokenizer.encode`` takes it and changes nothing: this tokenizer adds no
        BOS; ``add_eos`` appends the end-of-document id."""
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
        return np.append(ids, np.uint16(self.eos_id)) if add_eos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text. Special ids are dropped; invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB)
        return data.decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"type": "bytes", "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def tokenizer_from_description(description: dict[str, Any]) -> Any:
    """The tokenizer ``describe()`` produced (``bytes``, or ``hf``: a Hugging Face tokenizer,
    see ``ember.core.hf_tokenizer``); raises ``ValueError`` for unknown types."""
    kind = description.get("type")
    if kind == "hf":
        from ember.core.hf_tokenizer import HFTokenizer

        return HFTokenizer(description["tokenizer_json"], description.get("config"))
    if kind != "bytes":
        raise ValueError(f"unknown tokenizer type {kind!r}; supported: 'bytes', 'hf'")
    return ByteTokenizer()


__all__ = ["BYTE_VOCAB", "ByteTokenizer", "tokenizer_from_description"]
