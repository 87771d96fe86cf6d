"""The byte-level tokenizer: token ids 0-255 are UTF-8 bytes, 256 is end-of-document.

It lives in ``core`` because training (data preparation) and serving (text prompts,
exported artifacts) both need it. ``describe()`` gives a JSON description that
``tokenizer_from_description`` turns back into a tokenizer, so an exported model carries
its tokenizer without code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

BYTE_VOCAB = 256
EOS_TOKEN = "<|endoftext|>"
"""The end-of-document token's text in the Hugging Face files of :meth:`ByteTokenizer.hf_files`."""


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

    def hf_files(self) -> dict[str, str]:
        """``{file name: text}`` of this tokenizer as a Hugging Face model directory holds it
        (``tokenizer.json``, ``tokenizer_config.json``: what ``tokenizers``, ``transformers``'
        ``AutoTokenizer`` and Ember's ``load_hf_tokenizer`` read): GPT-2's byte-level BPE without
        merges, so each UTF-8 byte is one token whose id is the byte, and ``EOS_TOKEN`` special
        at ``eos_id``. It encodes and decodes as this tokenizer does, but for text that holds
        ``EOS_TOKEN`` itself, which it reads as the special token (as Hugging Face tokenizers
        read their special tokens in text)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])  # the next id: eos_id
        # No clean-up: transformers' would remove the spaces before punctuation that the bytes hold.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
                  "clean_up_tokenization_spaces": False}  # fmt: skip
        return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def _byte_level_chars() -> list[str]:
    """The character byte-level BPE writes each byte as (GPT-2's ``bytes_to_unicode``): printable
    Latin-1 bytes as themselves, the other bytes as the characters from U+0100 on, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    others = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(BYTE_VOCAB)]


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


__all__ = ["BYTE_VOCAB", "EOS_TOKEN", "ByteTokenizer", "tokenizer_from_description"]
