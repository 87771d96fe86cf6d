"""A Hugging Face model directory's own tokenizer, read with the ``tokenizers`` package.

    tokenizer = load_hf_tokenizer("path/to/hf_model")     # tokenizer.json (+ tokenizer_config.json)
    ids = tokenizer.encode("Hello")                        # as the model's tokenizer does: BOS and all
    tokenizer.encode(" world", add_special_tokens=False)   # a continuation: no BOS
    text = tokenizer.render_chat(messages)                 # the model's chat template (jinja2)

Nothing is downloaded and ``transformers`` is not needed: ``tokenizer.json`` carries the
model, normaliser, pre-tokeniser and post-processor (which adds BOS where the model's tokenizer
does); ``tokenizer_config.json`` names the special tokens and holds the ``chat_template`` (or, as
``transformers`` saves it since 4.50, ``chat_template.jinja`` beside it, which wins).
``describe()`` carries the whole ``tokenizer.json`` so an exported artifact needs no directory.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.errors import DataError, PathNotFoundError
from ember.core.jsonl import utf8_text

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A chat template's ``{% generation %}`` block (transformers' marker of the assistant's tokens)."""
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens a chat template sees (transformers' ``SPECIAL_TOKENS_ATTRIBUTES``)."""
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""The file ``transformers`` (4.50 on) saves a tokenizer's single chat template in, instead of
``tokenizer_config.json``'s ``chat_template``."""


class HFTokenizer:
    """``encode`` / ``decode`` / ``eos_id`` / ``bos_id`` / ``vocab_size`` of a HF tokenizer."""

    def __init__(self, tokenizer_json: str, config: dict[str, Any] | None = None):
        from tokenizers import Tokenizer

        self._json, self._config = tokenizer_json, dict(config or {})
        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self.bos_id = self._special_id("bos_token")
        self.eos_id = self._special_id("eos_token")
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        template = self._config.get("chat_template")
        if isinstance(template, list):  # named templates, [{"name", "template"}, ...]: transformers uses "default"
            template = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = template.get("default")
        self.chat_template: str | None = template

    def _special_id(self, name: str) -> int | None:
        token = self._config.get(name)
        if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer configs
            token = token.get("content")
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True, add_eos: bool = False) -> np.ndarray:
        """``text`` -> int32 ids, with the model's special tokens (BOS) unless
        ``add_special_tokens`` is False; ``add_eos`` appends the end-of-sequence id."""
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return np.asarray(ids, np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text, special tokens dropped."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_offsets(self, text: str, *, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, offsets)`` of ``text`` (special tokens only with ``add_special_tokens``): int32
        ``[n]`` and each token's ``[start, end)`` characters in ``text``, int64 ``[n, 2]`` (an
        added special token's is empty)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return np.asarray(encoding.ids, np.int32), np.asarray(encoding.offsets, np.int64).reshape(-1, 2)

    def render_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """``messages`` as the model's ``chat_template`` writes them (what ``transformers``'
        ``apply_chat_template(tokenize=False)`` gives).

        Raises:
          DataError: the tokenizer has no chat template, or the template fails on ``messages``.
        """
        return self.render_chat_spans(messages, add_generation_prompt=add_generation_prompt)[0]

    def render_chat_spans(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: :meth:`render_chat`'s text and the ``[start, end)`` characters of
        each ``{% generation %}`` block in it (what ``return_assistant_tokens_mask`` marks)."""
        if not self.chat_template:
            raise DataError("this tokenizer has no chat_template (tokenizer_config.json)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # transformers' environment: loop controls ({% break %}), {% generation %} blocks and a
        # tojson that neither sorts keys nor escapes HTML characters or non-ASCII text (Jinja's does).
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_blocks()]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_template_error
        # transformers' special_tokens_map: the named tokens that are set (an unset one is undefined
        # in the template, so "{{ bos_token }}" writes nothing rather than "None").
        special = {name: self._config.get(name) for name in SPECIAL_TOKENS}
        special = {k: v.get("content") if isinstance(v, dict) else v for k, v in special.items()}
        special = {k: v for k, v in special.items() if v is not None}
        blocks: list[str] = []
        environment.generation_tracking = (blocks, spans := [])
        try:
            template = environment.from_string(self.chat_template)
            values = {"messages": list(messages), "tools": None, "documents": None,  # none given, as transformers says
                      "add_generation_prompt": add_generation_prompt, **special}  # fmt: skip
            for block in template.generate(**values):
                blocks.append(block)
        except DataError:  # the template's own raise_exception
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as error:  # its code failed
            raise DataError(f"chat template: {type(error).__name__}: {error}") from None
        return "".join(blocks), spans

    def describe(self) -> dict[str, Any]:
        return {"type": "hf", "tokenizer_json": self._json, "config": self._config}


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of the Hugging Face model directory ``path``.

    Raises:
      PathNotFoundError: no ``tokenizer.json`` (Ember reads the fast-tokenizer file; a
        directory with only ``tokenizer.model`` needs converting with ``transformers`` once).
      DataError: a tokenizer file that is not UTF-8 JSON, or a ``tokenizer.json`` the
        ``tokenizers`` package cannot read.
    """
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise PathNotFoundError(
            f"no tokenizer.json in {path}; Ember reads a model's fast tokenizer file (save it with "
            "transformers' AutoTokenizer.save_pretrained)"
        )
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (path / name).is_file():
            try:
                loaded = json.loads(utf8_text(path / name))
            except json.JSONDecodeError as error:
                raise DataError(f"{path / name} is not JSON ({error})") from None
            if not isinstance(loaded, dict):
                raise DataError(f"{path / name} is not a JSON object")
            config.update(loaded)
    if (path / CHAT_TEMPLATE_FILE).is_file():  # where transformers saves it now; it wins, as there
        config["chat_template"] = utf8_text(path / CHAT_TEMPLATE_FILE)
    text = utf8_text(path / "tokenizer.json")
    try:
        return HFTokenizer(text, config)
    except DataError:
        raise
    except Exception as error:  # the tokenizers package raises a plain Exception for a file it cannot read
        raise DataError(f"{path / 'tokenizer.json'} is not a tokenizer the tokenizers package reads: {error}") from None


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
):
    """The ``tojson`` filter of transformers' chat templates: ``json.dumps`` with these defaults."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _generation_blocks() -> type:
    """The jinja2 extension class of ``{% generation %}`` (made on first use: jinja2 is imported lazily)."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        """transformers' ``{% generation %}...{% endgeneration %}``: renders its body and records
        the body's ``[start, end)`` in the output in ``environment.generation_tracking``."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track", []), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            text = caller()
            blocks, spans = self.environment.generation_tracking
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
            return text

    return GenerationBlocks


def _raise_template_error(message: str) -> None:
    raise DataError(f"chat template: {message}")


__all__ = ["HFTokenizer", "load_hf_tokenizer"]
