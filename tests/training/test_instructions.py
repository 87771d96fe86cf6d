"""Instruction data: masks, segments and positions by hand on the byte tokenizer, chat turns
(plain template and a Hugging Face chat template, against ``transformers``), a resumed
iterator repeating its batches, per-process rows, and every bad line named."""

import json

import numpy as np
import pytest

from ember.core.chat import plain_chat
from ember.core.errors import ConfigError, DataError, PathNotFoundError
from ember.core.hf_tokenizer import load_hf_tokenizer
from ember.core.tokenizer import ByteTokenizer, tokenizer_from_description
from ember.training.data.instructions import (
    InstructionBatches,
    pack_examples,
    read_instructions,
    tokenize_example,
)
from tests.training.finetune_setup import write_tokenizer

BYTES = ByteTokenizer()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% if m['role'] == 'assistant' %}"
    "{{ eos_token }} {% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def ids(text):
    return list(text.encode())


def test_prompt_completion_masks_and_packing_by_hand():
    first = tokenize_example({"prompt": "ab", "completion": "cd"}, BYTES)
    assert first.tokens.tolist() == [*ids("abcd"), 256]
    assert first.trained.tolist() == [False, False, True, True, True]
    second = tokenize_example({"prompt": "x", "completion": "y"}, BYTES)
    rows = pack_examples([first, second, first], seq_len=7)
    # Row 0: example one (4 inputs) then example two (2 inputs), one padding slot; row 1: example one.
    assert len(rows) == 2
    row = rows[0]
    assert row["tokens"].tolist() == [*ids("abcd"), *ids("xy"), 0]
    assert row["targets"].tolist() == [*ids("bcd"), 256, *ids("y"), 256, 0]
    assert row["segment_ids"].tolist() == [1, 1, 1, 1, 2, 2, 0]
    assert row["positions"].tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert row["loss_mask"].tolist() == [0, 1, 1, 1, 1, 1, 0]
    assert rows[1]["segment_ids"].tolist() == [1, 1, 1, 1, 0, 0, 0]


def test_long_examples_keep_their_start():
    long = tokenize_example({"prompt": "abcdef", "completion": "gh"}, BYTES)
    (row,) = pack_examples([long], seq_len=4)
    assert row["tokens"].tolist() == ids("abcd") and row["targets"].tolist() == ids("bcde")
    assert row["loss_mask"].tolist() == [0, 0, 0, 0]


def test_plain_chat_trains_assistant_content_and_an_eos_not_headers():
    """plain_chat writes no end of turn: without a trained EOS after each answer, a model fine-tuned
    on it ran on into the next "<|user|>" turn. A first assistant turn's header was trained."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "?"}, {"role": "assistant", "content": "ok"}]  # fmt: skip
    example = tokenize_example({"messages": messages}, BYTES)
    first, second = plain_chat(messages[:2]), plain_chat(messages)[len(plain_chat(messages[:2])) :]
    assert example.tokens.tolist() == [*ids(first), 256, *ids(second), 256]
    trained = [t for t, on in zip(example.tokens.tolist(), example.trained) if on]
    assert trained == [*ids("yo\n"), 256, *ids("ok\n"), 256]
    opening = tokenize_example({"messages": [{"role": "assistant", "content": "hi"}]}, BYTES)
    assert opening.tokens.tolist() == [*ids("<|assistant|>\nhi\n"), 256]
    assert [t for t, on in zip(opening.tokens.tolist(), opening.trained) if on] == [*ids("hi\n"), 256]


def test_hf_chat_template_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    ours = load_hf_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("what does the cow say ?", "the owl say", "a bee ? zebra"):
        assert ours.encode(text).tolist() == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False).tolist() == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode("what does the dog say ?")) == theirs.decode(
        theirs.encode("what does the dog say ?"), skip_special_tokens=True
    )
    messages = [{"role": "user", "content": "what does the cow say ?"}, {"role": "assistant", "content": "moo"}]
    expected = theirs.apply_chat_template(messages, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    example = tokenize_example({"messages": messages}, ours)
    assert example.tokens.tolist() == list(expected)
    trained = [t for t, on in zip(example.tokens.tolist(), example.trained) if on]
    # The assistant's content and the template's eos after it; not its "[assistant]" header.
    assert trained == [*ours.encode("moo", add_special_tokens=False).tolist(), ours.eos_id]


def test_a_chat_template_saved_by_transformers_is_the_one_used(tmp_path):
    """transformers (4.50 on) saves a single template as chat_template.jinja, not in
    tokenizer_config.json, and reads it back over the config's; a list of named templates
    means its "default". Both were missed: the conversation fell back to plain_chat."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    theirs.chat_template = CHAT_TEMPLATE
    theirs.save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # whatever this version saved
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'stale' }}"  # the file wins, as in transformers
    (tmp_path / "saved" / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    messages = [{"role": "user", "content": "what does the cow say ?"}, {"role": "assistant", "content": "moo"}]
    expected = theirs.apply_chat_template(messages, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    ours = load_hf_tokenizer(tmp_path / "saved")
    assert ours.chat_template == CHAT_TEMPLATE
    assert tokenize_example({"messages": messages}, ours).tokens.tolist() == expected
    (tmp_path / "saved" / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": CHAT_TEMPLATE}]
    (tmp_path / "saved" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    named_tokenizer = load_hf_tokenizer(tmp_path / "saved")
    assert named_tokenizer.chat_template == CHAT_TEMPLATE
    # The description keeps the list as saved (a quantized copy writes it back to tokenizer_config.json).
    assert named_tokenizer.describe()["config"]["chat_template"] == named
    assert tokenizer_from_description(named_tokenizer.describe()).chat_template == CHAT_TEMPLATE


def test_chat_templates_render_in_transformers_environment(tmp_path):
    """Loop controls ({% break %}) and transformers' tojson (no key sorting, no HTML or
    non-ASCII escapes), as apply_chat_template renders them."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path)
    template = (
        "{% for m in messages %}{% if m['content'] == 'stop' %}{% break %}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] | tojson }} {{ {'z': 1, 'a': m['role']} | tojson }}\n{% endfor %}"
    )
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    messages = [{"role": "user", "content": "a <b> & 'c' \u00e9"}, {"role": "assistant", "content": "stop"},
                {"role": "user", "content": "never"}]  # fmt: skip
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    expected = theirs.apply_chat_template(messages, tokenize=False)
    assert load_hf_tokenizer(tmp_path).render_chat(messages) == expected
    assert expected == 'user: "a <b> & \'c\' \u00e9" {"z": 1, "a": "user"}\n'


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer_config.json", '{"eos_token": "</s>",', "tokenizer_config.json is not JSON"),
        ("tokenizer_config.json", '["</s>"]', "tokenizer_config.json is not a JSON object"),
        ("tokenizer.json", '{"model": 3}', "tokenizer.json is not a tokenizer the tokenizers package reads"),
    ],
)
def test_a_broken_tokenizer_file_is_a_data_error_naming_it(tmp_path, name, content, message):
    # Before, JSONDecodeError, ValueError or the tokenizers package's bare Exception: tracebacks.
    write_tokenizer(tmp_path)
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message):
        load_hf_tokenizer(tmp_path)


def test_examples_too_short_to_train_on_are_a_data_error():
    # Before, pack_examples gave no rows and the first next() raised IndexError.
    empty = tokenize_example({"prompt": "", "completion": ""}, BYTES)  # the end-of-document token alone
    with pytest.raises(DataError, match="no example has two tokens"):
        InstructionBatches([empty, empty], seq_len=8, global_batch=2).next()


def test_a_batch_the_processes_cannot_share_names_train_batch_size():
    # Before, a DataError keyed nothing: "global batch 6 does not split over 4 processes".
    example = tokenize_example({"prompt": "what", "completion": " this"}, BYTES)
    with pytest.raises(ConfigError, match=r"^train\.batch_size \(6\) is not divisible by the 4 processes: .* a "
                       r"multiple of 4$") as error:  # fmt: skip
        InstructionBatches([example], seq_len=8, global_batch=6, process_count=4)
    assert error.value.key == "train.batch_size"


def test_resumed_iterator_repeats_and_processes_split_rows(tmp_path):
    lines = [{"prompt": f"p{i}", "completion": "c" * (i % 5 + 1)} for i in range(23)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    train, val = read_instructions(path, BYTES, eval_fraction=0.2, seed=1)
    assert (len(train), len(val)) == (18, 5)
    batches = InstructionBatches(train, seq_len=12, global_batch=4, seed=3)
    for _ in range(3):
        batches.next()
    saved = batches.state()
    expected = [batches.next() for _ in range(4)]  # crosses an epoch boundary
    batches.restore(saved)
    for want in expected:
        got = batches.next()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    halves = [InstructionBatches(train, seq_len=12, global_batch=4, seed=3, process_index=p, process_count=2)
              for p in (0, 1)]  # fmt: skip
    whole = InstructionBatches(train, seq_len=12, global_batch=4, seed=3).next()
    parts = [half.next() for half in halves]
    np.testing.assert_array_equal(np.concatenate([p["tokens"] for p in parts]), whole["tokens"])
    evaluation = list(InstructionBatches(val, seq_len=12, global_batch=4, shuffle=False).epoch())
    assert sum(float(b["loss_mask"].sum()) for b in evaluation) == sum(e.trained[1:].sum() for e in val)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a"}', "an example is"),
        ('{"prompt": 1, "completion": "b"}', "must be strings"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user"}]}', "needs a role and a string content"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "roles: system, user, assistant"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
        ("not json", "is not JSON"),
        ('{"prompt": "a", "completion": "b \\ud800"}', r"holds a lone surrogate U\+D800 \(an unpaired"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n")
    with pytest.raises(DataError, match=message) as error:
        read_instructions(path, BYTES)
    assert f"{path}:2" in str(error.value)


def test_lines_split_at_newlines_only(tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 unescaped in a string: they are the example's text."""
    completion = "one\u2028two\u2029three\x85four"
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "q", "completion": completion}, ensure_ascii=False) + "\n")
    (example,), _ = read_instructions(path, BYTES)
    assert example.tokens.tolist() == [*ids("q"), *ids(completion), 256]


def test_a_file_that_is_not_utf8_is_a_data_error(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "completion": "b"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl is not UTF-8 text \(byte 15: invalid continuation byte\)"):
        read_instructions(path, BYTES)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(PathNotFoundError):
        read_instructions(tmp_path / "none.jsonl", BYTES)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="has no examples"):
        read_instructions(tmp_path / "empty.jsonl", BYTES)
    with pytest.raises(PathNotFoundError, match=r"tokenizer\.json"):
        load_hf_tokenizer(tmp_path)


GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }} {{ eos_token }}{% endgeneration %} {% else %}{{ m['content'] }} {% endif %}{% endfor %}"
    "{% if not add_generation_prompt %}the end{% endif %}"  # not a growing prefix: the blocks say what trains
)


def test_generation_blocks_give_transformers_assistant_mask(tmp_path):
    """A template with {% generation %} blocks (transformers' assistant-token marker) failed with
    jinja2's TemplateSyntaxError (unknown tag 'generation'): a traceback, no training."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GENERATION_TEMPLATE}))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "a cow"}, {"role": "user", "content": "what does the cow say ?"},
                {"role": "assistant", "content": "moo"}, {"role": "user", "content": "the dog ?"},
                {"role": "assistant", "content": "woof woof"}]  # fmt: skip
    expected = theirs.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    example = tokenize_example({"messages": messages}, load_hf_tokenizer(tmp_path))
    assert example.tokens.tolist() == list(expected["input_ids"])
    assert example.trained.astype(int).tolist() == list(expected["assistant_masks"])
    assert example.trained.sum() == 5  # moo </s> woof woof </s>


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for m in messages %}{{ m['content'] | nofilter }}{% endfor %}", "TemplateAssertionError.*nofilter"),
        ("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", "TypeError"),  # its code fails on the data
    ],
)
def test_a_chat_template_that_fails_is_a_data_error_naming_the_example(tmp_path, template, message):
    write_tokenizer(tmp_path)  # before: the template's exception, a traceback
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(DataError, match=rf"{path}:1: chat template: {message}"):
        read_instructions(path, load_hf_tokenizer(tmp_path))


def test_a_conversation_is_tokenized_whole_as_apply_chat_template_does(tmp_path):
    """A SentencePiece-style tokenizer (Metaspace: a word start is '▁') marks where an encode
    call starts: the turns encoded one by one gave '▁moo' for the 'moo' right after '[/INST]' and
    a stray '▁' before the next '[INST]' (tokens the model never sees from transformers)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "\u2581", "[", "/", "]", "INST", "\u2581hi", "\u2581cow", "\u2581moo", "moo"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(prepend_scheme="first"), pre_tokenizers.Punctuation()]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = (  # Mistral's
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "chat_template": template}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "moo"},
                {"role": "user", "content": "cow"}, {"role": "assistant", "content": "moo"}]  # fmt: skip
    example = tokenize_example({"messages": messages}, load_hf_tokenizer(tmp_path))
    assert example.tokens.tolist() == list(theirs.apply_chat_template(messages, return_dict=True)["input_ids"])
    assert [words[t] for t, on in zip(example.tokens, example.trained) if on] == ["moo", "</s>", "moo", "</s>"]


def test_a_first_assistant_turn_header_is_not_trained_with_a_chat_template(tmp_path):
    # Before, a conversation opening with the assistant trained its "[assistant]" header too.
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    ours = load_hf_tokenizer(tmp_path)
    example = tokenize_example({"messages": [{"role": "assistant", "content": "moo"}]}, ours)
    assert example.tokens.tolist() == [ours.bos_id, *ours.encode("[assistant] moo", add_special_tokens=False), 2]
    assert [t for t, on in zip(example.tokens.tolist(), example.trained) if on] == [*ours.encode("moo")[1:], 2]


def test_prompt_and_completion_are_tokenized_whole(tmp_path):
    """Llama-2 and Mistral tokenizers prepend '▁' in their normaliser: the completion " moo"
    encoded on its own gave '▁' '▁moo', a stray (trained) token no whole text ever holds."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "\u2581", "\u2581what", "\u2581does", "\u2581the", "\u2581cow", "\u2581say",
             "\u2581?", "\u2581moo"]  # fmt: skip
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("\u2581"), behavior="merged_with_next")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    example = tokenize_example({"prompt": "what does the cow say ?", "completion": " moo"}, load_hf_tokenizer(tmp_path))
    assert example.tokens.tolist() == [*theirs("what does the cow say ? moo")["input_ids"], 2]
    assert [words[t] for t, on in zip(example.tokens, example.trained) if on] == ["\u2581moo", "</s>"]


def test_a_small_eval_fraction_holds_out_at_least_one_example(tmp_path):
    """eval_fraction 0.05 of 8 examples rounded to none: the run had no evaluation, silently."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": "c"}) + "\n" for i in range(8)))
    train, val = read_instructions(path, BYTES, eval_fraction=0.05)
    assert (len(train), len(val)) == (7, 1)
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(DataError, match=r"data.eval_fraction 0.6 of its 1 examples leaves none to train on"):
        read_instructions(path, BYTES, eval_fraction=0.6)


def test_a_template_that_rewrites_earlier_turns_points_at_generation_blocks(tmp_path):
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = GENERATION_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    messages = [{"role": "user", "content": "cow ?"}, {"role": "assistant", "content": "moo"}]
    with pytest.raises(DataError, match=r"messages\[1\] changes the text before it.*\{% generation %\}"):
        tokenize_example({"messages": messages}, load_hf_tokenizer(tmp_path))


def test_unset_special_tokens_render_as_transformers_renders_them(tmp_path):
    """A tokenizer without a BOS (Qwen2's "bos_token": null) rendered "{{ bos_token }}" as the text
    "None"; sep/cls/mask tokens, which transformers passes too, were undefined."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = "{{ bos_token }}|{{ sep_token }}|{% for m in messages %}{{ m['content'] }} {{ eos_token }}{% endfor %}"
    config = {**config, "bos_token": None, "sep_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "cow"}, {"role": "assistant", "content": "moo"}]
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert load_hf_tokenizer(tmp_path).render_chat(messages) == expected == "|</s>|cow </s>moo </s>"


def test_templates_see_no_tools_and_no_documents_as_none(tmp_path):
    """transformers renders with tools=None and documents=None; undefined here, Mistral-style
    "{% if tools is not none %}" took the tools branch (and '{{ tools | tojson }}' raised TypeError)."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = (
        "{% if tools is not none %}[tools] {{ tools | tojson }} {% endif %}{% if documents is not none %}[docs] "
        "{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    messages = [{"role": "user", "content": "cow"}, {"role": "assistant", "content": "moo"}]
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert load_hf_tokenizer(tmp_path).render_chat(messages) == expected == "cow moo "


def test_plain_chat_with_a_hugging_face_tokenizer_is_tokenized_as_whole_text(tmp_path):
    """A base model without a chat template (Llama-2, Mistral) gets plain_chat. Each turn and
    header was encoded on its own, and their normaliser prepends '▁' to every encode call:
    '▁<|assistant|>' '▁moo' where the whole text (what generation from a plain_chat prompt
    sees) holds '<|assistant|>' 'moo'."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "\n", "\u2581<|user|>", "<|assistant|>", "\u2581<|assistant|>", "what",
             "\u2581does", "\u2581the", "\u2581cow", "\u2581say", "\u2581?", "moo", "\u2581moo"]  # fmt: skip
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex("\u2581"), "merged_with_next"), pre_tokenizers.Split("\n", "isolated")]
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    messages = [{"role": "user", "content": "what does the cow say ?"}, {"role": "assistant", "content": "moo"}]
    example = tokenize_example({"messages": messages}, load_hf_tokenizer(tmp_path))
    assert example.tokens.tolist() == [*tokenizer.encode(plain_chat(messages)).ids, 2]
    assert [words[t] for t, on in zip(example.tokens, example.trained) if on] == ["moo", "\n", "</s>"]


def test_a_tokenizer_that_appends_eos_itself_ends_a_completion_with_one_trained_eos(tmp_path):
    """A post-processor '<s> $A </s>' (tokenizers saved with add_eos_token): the example ended
    '</s>' (untrained) '</s>': the model learned an EOS after an EOS, never after its answer
    (before the whole-text commit, that '</s>' even sat between prompt and completion)."""
    from tokenizers import processors

    write_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["post_processor"] = json.loads(
        processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]).__getstate__()
    )
    path.write_text(json.dumps(tokenizer))
    ours = load_hf_tokenizer(tmp_path)
    example = tokenize_example({"prompt": "what does the cow say ?", "completion": " moo"}, ours)
    assert example.tokens.tolist() == [
        1,
        *ours.encode("what does the cow say ? moo", add_special_tokens=False).tolist(),
        2,
    ]
    assert [t for t, on in zip(example.tokens.tolist(), example.trained) if on] == [ours.encode("moo")[1], 2]


def test_a_tokenizer_without_an_eos_id_is_refused_where_an_example_needs_one():
    """A completion or a plain-chat answer ended with nothing: the fine-tuned model never learned
    to stop, without a word (token files already refuse such a tokenizer)."""

    class NoEos(ByteTokenizer):
        eos_id = None

    examples = [
        ({"prompt": "a", "completion": "b"}, "each completion"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "assistant turn"),
    ]
    for record, ends in examples:
        with pytest.raises(DataError, match=f"train.jsonl:3: the tokenizer has no end-of-sequence id .*{ends}"):
            tokenize_example(record, NoEos(), "train.jsonl:3")
