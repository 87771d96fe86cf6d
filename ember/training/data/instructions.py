"""Instruction data: JSONL examples -> packed batches whose loss is on completion tokens only.

    train, val = read_instructions("train.jsonl", tokenizer, eval_fraction=0.1)
    batches = InstructionBatches(train, seq_len=256, global_batch=16, seed=0)
    batch = batches.next()      # tokens/targets/segment_ids/positions/loss_mask [local_batch, seq_len]

Each JSONL line is one example, either form:

- ``{"prompt": "...", "completion": "..."}``: ``encode(prompt + completion)`` (with the
  tokenizer's own special tokens, BOS where the model has one; a Hugging Face tokenizer
  encodes the text whole, as a model sees it, a byte tokenizer each part), then EOS; the
  loss is on the tokens reaching into the completion and the EOS.
- ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``: the
  conversation rendered by the tokenizer's ``chat_template`` when it has one and tokenized
  whole without added special tokens (the template writes them), as ``transformers``'
  ``apply_chat_template`` tokenizes it; the loss is on the tokens overlapping an assistant
  turn's text, found by rendering the conversation up to and including each turn (the new
  text is that turn's) and up to its generation prompt (the turn's header, not trained), as
  ``return_assistant_tokens_mask`` would. A template with ``{% generation %}`` blocks says
  itself which text is the assistant's: exactly ``return_assistant_tokens_mask``'s mask.
  Without a template, turns are written by :func:`ember.core.chat.plain_chat`, which writes
  no end of turn, so there the tokenizer's EOS follows each assistant turn, trained (as it
  follows a completion): a model fine-tuned on such conversations learns to stop after its
  answer; the text between EOS tokens is tokenized whole. Serving prompts a conversation
  with :func:`ember.core.chat.chat_prompt_tokens`, the same tokens up to an answer.

Packing: examples are taken in a seeded order (a new permutation each epoch) and placed into
rows of ``seq_len`` input tokens one after another, an example that does not fit the row's
rest starting the next row. Each example gets its own segment id (1, 2, ... in the row; 0
for padding) and positions from 0, so attention never crosses examples; a target is trained
only when it is a completion token of the same example. An example longer than ``seq_len +
1`` tokens is cut to its first ``seq_len + 1`` (the prompt's start kept; :func:`cut_counts` counts
the cut examples and those left with no trained token, which a fine-tuning run reports).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.chat import check_messages, plain_chat, plain_chat_pieces
from ember.core.errors import DataError, PathNotFoundError
from ember.core.hf_tokenizer import GENERATION_TAG
from ember.core.jsonl import jsonl_records, lone_surrogate
from ember.training.data.iterator import check_process_split
from ember.training.data.packing import empty_row


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized example: ``tokens`` int32 ``[n]`` and ``trained`` bool ``[n]`` (True
    where the token is one the loss predicts: a completion or assistant token)."""

    tokens: np.ndarray
    trained: np.ndarray


def read_instructions(
    path: str | Path,
    tokenizer: Any,
    *,
    eval_path: str | Path | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
) -> tuple[list[Example], list[Example]]:
    """``(train examples, eval examples)`` of the JSONL file ``path``: evaluation is
    ``eval_path``'s examples, else a seeded ``eval_fraction`` of ``path``'s (none when 0, else
    at least one).

    Raises:
      PathNotFoundError: a file does not exist.
      DataError: a line is not an example (naming the file, the line and what is allowed), or
        ``eval_fraction`` holds out every example.
    """
    examples = [tokenize_example(record, tokenizer, where) for record, where in read_jsonl(path)]
    if eval_path is not None:
        return examples, [tokenize_example(record, tokenizer, where) for record, where in read_jsonl(eval_path)]
    if not eval_fraction:
        return examples, []
    held_out = max(1, round(len(examples) * eval_fraction))  # asked for: at least one, never silently none
    if held_out >= len(examples):
        raise DataError(
            f"{path}: holding out data.eval_fraction {eval_fraction} of its {len(examples)} examples "
            "leaves none to train on"
        )
    order = np.random.default_rng(seed).permutation(len(examples))
    chosen = set(order[:held_out].tolist())
    return [e for i, e in enumerate(examples) if i not in chosen], [examples[i] for i in sorted(chosen)]


def read_jsonl(path: str | Path) -> list[tuple[dict[str, Any], str]]:
    """``(record, "file:line")`` for every non-blank line of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise PathNotFoundError(f"no JSONL file {path}")
    records = []
    for record, where in jsonl_records(path):
        surrogate = lone_surrogate(json.dumps(record, ensure_ascii=False))
        if surrogate:
            raise DataError(
                f"{where} holds a lone surrogate {surrogate[1]} (an unpaired \\ud800-\\udfff escape): not Unicode text"
            )
        records.append((record, where))
    if not records:
        raise DataError(f"{path} has no examples")
    return records


def tokenize_example(record: Any, tokenizer: Any, where: str = "example") -> Example:
    """One JSONL record as an :class:`Example` (see the module docstring for the forms)."""
    if isinstance(record, dict) and set(record) >= {"prompt", "completion"} and "messages" not in record:
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"{where}: prompt and completion must be strings")
        _check_eos(tokenizer, where, "each completion")
        tokens, trained = _marked(tokenizer, prompt + completion, [(len(prompt), len(prompt + completion))], first=True)
        if tokens.size and tokens[-1] == tokenizer.eos_id:  # the tokenizer's post-processor appends one
            trained[-1] = True
        else:
            tokens, trained = np.append(tokens, tokenizer.eos_id), np.append(trained, True)
        return Example(tokens.astype(np.int32), trained)
    if isinstance(record, dict) and "messages" in record:
        return _conversation(record["messages"], tokenizer, where)
    raise DataError(
        f'{where}: an example is {{"prompt": str, "completion": str}} or {{"messages": [{{"role", "content"}}, ...]}}'
    )


def _conversation(messages: Any, tokenizer: Any, where: str) -> Example:
    try:
        messages = check_messages(messages)
    except ValueError as error:
        raise DataError(f"{where}: {error}") from None
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn to train on")
    if getattr(tokenizer, "chat_template", None):
        return _chat_template_example(messages, tokenizer, where)
    # plain_chat writes no end of turn: the tokenizer's EOS follows each assistant turn, trained.
    _check_eos(tokenizer, where, "each assistant turn (the tokenizer has no chat_template to write one)")
    _, spans = _assistant_spans(messages, plain_chat, where)
    pieces = plain_chat_pieces(messages)  # the text to the end of each answer, then the turns after the last
    eos = np.array([tokenizer.eos_id], np.int32)
    tokens, trained, start = [], [], 0
    for index, text in enumerate(pieces):
        if index:  # the EOS after the answer ending the piece before
            tokens.append(eos)
            trained.append(np.ones(eos.size, bool))
        own = [(begin - start, end - start) for begin, end in spans if start <= begin and end <= start + len(text)]
        piece, marked = _marked(tokenizer, text, own, first=not index)
        tokens.append(piece)
        trained.append(marked)
        start += len(text)
    return Example(np.concatenate(tokens).astype(np.int32), np.concatenate(trained))


def _check_eos(tokenizer: Any, where: str, ends: str) -> None:
    """``DataError`` when ``tokenizer`` has no EOS id to end ``ends`` with: a model fine-tuned
    without one never learns to stop (and the engine has no end-of-sequence id to stop on)."""
    if tokenizer.eos_id is None:
        raise DataError(
            f"{where}: the tokenizer has no end-of-sequence id (eos_token) to end {ends} with, so the model "
            "would never learn to stop; name one as eos_token in the model directory's tokenizer_config.json"
        )


def _chat_template_example(messages: list[dict[str, str]], tokenizer: Any, where: str) -> Example:
    """A conversation rendered by the tokenizer's chat template and tokenized whole, with no
    special tokens added (the template writes them), as ``apply_chat_template`` tokenizes it;
    the tokens overlapping an assistant span (:func:`_assistant_spans`) are trained."""
    render = _where(tokenizer.render_chat_spans, where)
    if GENERATION_TAG.search(tokenizer.chat_template):
        text, spans = render(messages)
    else:
        text, spans = _assistant_spans(messages, lambda m, **kw: render(m, **kw)[0], where)
    return Example(*_marked(tokenizer, text, spans, first=False))


def _marked(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], *, first: bool) -> tuple[np.ndarray, Any]:
    """``(tokens, trained)`` of ``text`` (a sequence start with the tokenizer's special tokens),
    trained where a token overlaps one of the ``[start, end)`` character ``spans``. A Hugging Face
    tokenizer encodes ``text`` whole, as the model sees it (an encode call of its own may mark a
    word start, as SentencePiece's '▁' does); another (bytes) each piece between span bounds."""
    if hasattr(tokenizer, "encode_offsets"):
        tokens, offsets = tokenizer.encode_offsets(text, add_special_tokens=first)
        trained = np.zeros(tokens.size, bool)
        for start, end in spans:
            trained |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        return tokens, trained
    bounds = sorted({0, len(text), *(bound for span in spans for bound in span)})
    pairs = list(itertools.pairwise(bounds)) or [(0, 0)]  # an empty text: its special tokens alone
    tokens = [_encode(tokenizer, text[a:b], first=first and not a) for a, b in pairs]
    inside = [a < b and any(s <= a and b <= e for s, e in spans) for a, b in pairs]
    return np.concatenate(tokens), np.concatenate([np.full(t.size, on) for t, on in zip(tokens, inside)])


def _assistant_spans(messages: list[dict[str, str]], render: Any, where: str) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the conversation as ``render`` writes it and the ``[start, end)``
    characters of each assistant turn: the text rendering up to and including the turn adds,
    less the turn's header (what rendering up to its generation prompt adds)."""
    rendered, spans = "", []
    for index, message in enumerate(messages):
        text = render(messages[: index + 1])
        if not text.startswith(rendered):
            raise DataError(
                f"{where}: the chat template does not render turns as a growing prefix (rendering the "
                f"conversation to messages[{index}] changes the text before it), so its assistant turns cannot be "
                "found; a template that marks them with {% generation %} ... {% endgeneration %} can be trained"
            )
        if message["role"] == "assistant":
            start = len(rendered)
            try:
                header = render(messages[:index], add_generation_prompt=True)
            except DataError:  # a template may refuse an empty conversation: a first turn's header then trains
                header = rendered
            if header.startswith(rendered) and text.startswith(header):
                start = len(header)
            spans.append((start, len(text)))
        rendered = text
    return rendered, spans


def _where(render: Any, where: str) -> Any:
    """``render`` with its ``DataError`` (a chat template that fails) naming the example."""

    def named(*args, **kwargs):
        try:
            return render(*args, **kwargs)
        except DataError as error:
            raise DataError(f"{where}: {error}") from None

    return named


def _encode(tokenizer: Any, text: str, *, first: bool) -> np.ndarray:
    """``text`` as ids: a sequence start with the tokenizer's special tokens, a continuation without."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=first), np.int32)


def cut_counts(examples: Sequence[Example], seq_len: int) -> tuple[int, int]:
    """``(cut, emptied)``: how many ``examples`` :func:`pack_examples` cuts to ``seq_len + 1``
    tokens, and how many of those keep no trained target (they add nothing to the loss)."""
    long = [e for e in examples if e.tokens.size > seq_len + 1]
    return len(long), sum(not e.trained[1 : seq_len + 1].any() for e in long)


def pack_examples(examples: Sequence[Example], seq_len: int) -> list[dict[str, np.ndarray]]:
    """Rows of ``seq_len`` (see the module docstring): ``tokens``, ``targets``, ``segment_ids``,
    ``positions`` (int32) and ``loss_mask`` (float32), each ``[seq_len]``."""
    rows: list[dict[str, np.ndarray]] = []
    row, used, segment = empty_row(seq_len), 0, 0
    for example in examples:
        tokens, trained = example.tokens[: seq_len + 1], example.trained[: seq_len + 1]
        length = tokens.size - 1
        if length < 1:
            continue
        if used + length > seq_len:
            rows.append(row)
            row, used, segment = empty_row(seq_len), 0, 0
        segment += 1
        span = slice(used, used + length)
        row["tokens"][span], row["targets"][span] = tokens[:-1], tokens[1:]
        row["segment_ids"][span] = segment
        row["positions"][span] = np.arange(length)
        row["loss_mask"][span] = trained[1:]
        used += length
    if used:
        rows.append(row)
    return rows


class InstructionBatches:
    """Packed ``[local_batch, seq_len]`` batches of examples, endless and resumable.

    Epoch ``e`` packs the examples in the order ``permutation(seed, e)`` (``shuffle=False``:
    file order). The state is ``(epoch, row)``; restoring it gives the same batches again. A
    global batch is ``global_batch`` consecutive rows, of which process ``p`` takes its own
    ``global_batch / process_count``; ``batch_key`` is the config key it comes from (named when
    it does not split over the processes).
    """

    def __init__(
        self,
        examples: Sequence[Example],
        *,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        batch_key: str = "train.batch_size",
    ):
        if not examples:
            raise DataError("no examples to train on")
        if not any(example.tokens.size >= 2 for example in examples):  # packing drops shorter ones
            raise DataError("no example has two tokens (an input and a target to predict): nothing to train on")
        check_process_split(global_batch, process_count, batch_key)
        self.examples, self.seq_len, self.global_batch = list(examples), seq_len, global_batch
        self.seed, self.shuffle = seed, shuffle
        self.local_batch = global_batch // process_count
        self.first_row = process_index * self.local_batch
        self._epoch, self._row = 0, 0
        self._rows_of: tuple[int, list[dict[str, np.ndarray]]] | None = None

    def _rows(self, epoch: int) -> list[dict[str, np.ndarray]]:
        if self._rows_of is None or self._rows_of[0] != epoch:
            order = np.arange(len(self.examples))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(order)
            self._rows_of = (epoch, pack_examples([self.examples[i] for i in order], self.seq_len))
        return self._rows_of[1]

    def next(self) -> dict[str, np.ndarray]:
        rows = []
        for _ in range(self.global_batch):
            epoch_rows = self._rows(self._epoch)
            rows.append(epoch_rows[self._row])
            self._row += 1
            if self._row == len(epoch_rows):
                self._epoch, self._row = self._epoch + 1, 0
        mine = rows[self.first_row : self.first_row + self.local_batch]
        return {name: np.stack([row[name] for row in mine]) for name in mine[0]}

    def epoch(self, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The first epoch's batches in order, the last one padded with empty rows (no loss)."""
        rows = self._rows(0)
        count = -(-len(rows) // self.global_batch)
        for start in range(0, min(count, max_batches or count) * self.global_batch, self.global_batch):
            batch = rows[start : start + self.global_batch]
            batch = batch + [empty_row(self.seq_len)] * (self.global_batch - len(batch))
            mine = batch[self.first_row : self.first_row + self.local_batch]
            yield {name: np.stack([row[name] for row in mine]) for name in mine[0]}

    def state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "row": self._row}

    def restore(self, state: dict[str, Any]) -> None:
        self._epoch, self._row = int(state["epoch"]), int(state["row"])


__all__ = [
    "Example",
    "InstructionBatches",
    "cut_counts",
    "pack_examples",
    "read_instructions",
    "tokenize_example",
]
