"""Conversations as a chat model's prompt: the same text and tokens in fine-tuning and serving.

    messages = check_messages([{"role": "user", "content": "Hi"}])   # raises ValueError naming what is wrong
    ids = chat_prompt_tokens(messages, tokenizer)     # the conversation, then the assistant turn's header

A conversation is a non-empty list of ``{"role": "system" | "user" | "assistant", "content": str}``
in any order (as OpenAI's chat API takes it). A tokenizer with a ``chat_template``
(:class:`ember.core.hf_tokenizer.HFTokenizer`) renders it with that template, tokenized whole
without added special tokens (the template writes them); one without (Ember's byte tokenizer, a
base model's) writes it with :func:`plain_chat`, which writes no end of turn, so the tokenizer's
EOS follows each assistant turn and the text between EOS tokens is tokenized whole, the first
piece with the tokenizer's special tokens (its BOS) (:func:`plain_chat_pieces`). This is how
``ember.training.data.instructions`` tokenizes a ``{"messages": ...}`` fine-tuning example, so a
model fine-tuned on conversations is prompted at serving time with the prefix it was trained on.

It lives in ``core`` because training (fine-tuning data) and serving (``ember generate`` request
lines, the HTTP server) both need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ember.core.jsonl import lone_surrogate

ROLES = ("system", "user", "assistant")
GENERATION_PROMPT = "<|assistant|>\n"
""":func:`plain_chat`'s generation prompt: the header of the assistant turn to be written."""


def plain_chat(messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
    """The conversation template of a tokenizer without ``chat_template``: each turn as
    ``<|role|>\\ncontent\\n``; the generation prompt is ``<|assistant|>\\n``."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + GENERATION_PROMPT if add_generation_prompt else text


def plain_chat_pieces(messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False) -> list[str]:
    """:func:`plain_chat`'s text cut after each assistant turn, where the tokenizer's EOS goes
    (``len(pieces) - 1`` assistant turns end a piece; the last piece holds the turns after the
    last answer, and the generation prompt, and may be empty)."""
    pieces, piece = [], ""
    for message in messages:
        piece += plain_chat([message])
        if message["role"] == "assistant":
            pieces.append(piece)
            piece = ""
    return [*pieces, piece + GENERATION_PROMPT if add_generation_prompt else piece]


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}, ...]`` (other keys, such as OpenAI's ``name``, are
    dropped: training and serving render the same turns). Any order of roles is a conversation,
    one ending with an assistant turn too: its prompt asks for a new assistant turn after it
    (:func:`chat_prompt_tokens` never continues the last one).

    Raises:
      ValueError: ``messages`` is not a non-empty list, or an entry is not an object with a
        ``role`` of :data:`ROLES` and a string ``content`` of Unicode text (saying which entry).
    """
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ValueError(f'messages must be a non-empty list of {{"role": ..., "content": ...}} objects, got {got}')
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] needs a role and a string content, got {type(message).__name__}")
        if not isinstance(message.get("content"), str):
            got = f"a {type(message['content']).__name__}" if "content" in message else "none"
            raise ValueError(f"messages[{index}] needs a role and a string content, got {got} as content")
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{index}] has role {message.get('role')!r}; roles: {', '.join(ROLES)}")
        surrogate = lone_surrogate(message["content"])
        if surrogate:  # a JSON "\ud800" escape: no tokenizer encodes it
            raise ValueError(
                f"messages[{index}].content is not valid Unicode text: it holds a lone surrogate {surrogate[1]} "
                f"at index {surrogate[0]}"
            )
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def chat_prompt_tokens(messages: Any, tokenizer: Any) -> list[int]:
    """Token ids of the conversation ``messages`` followed by the generation prompt (the header
    of the assistant turn the model is to write), as fine-tuning tokenizes the conversation (the
    module docstring): a model fine-tuned on it sees the prefix it was trained on before an answer.

    Raises:
      ValueError: ``messages`` is no conversation (:func:`check_messages`); there is no
        ``tokenizer``; a tokenizer without ``chat_template`` has no EOS id to end an earlier
        assistant turn with; or the chat template fails on the conversation (then a
        ``ember.core.errors.DataError``, a ``ValueError``, its message starting ``chat template:``).
    """
    messages = check_messages(messages)
    if tokenizer is None:
        raise ValueError('a conversation ("messages") needs a tokenizer; give token ids (prompt_tokens) instead')
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.render_chat(messages, add_generation_prompt=True)
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    pieces = plain_chat_pieces(messages, add_generation_prompt=True)
    if len(pieces) > 1 and tokenizer.eos_id is None:
        raise ValueError(
            "the tokenizer has neither a chat_template nor an end-of-sequence id (eos_token) to end the "
            "conversation's assistant turns with, as fine-tuning does; name one in tokenizer_config.json"
        )
    tokens: list[int] = []
    for index, piece in enumerate(pieces):
        if index:
            tokens.append(int(tokenizer.eos_id))
        tokens += [int(t) for t in tokenizer.encode(piece, add_special_tokens=not index)]
    return tokens


__all__ = ["ROLES", "chat_prompt_tokens", "check_messages", "plain_chat", "plain_chat_pieces"]
