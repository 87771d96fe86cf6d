"""Chat prompts: a conversation's serving prompt is the fine-tuning example's tokens up to its
last answer (byte tokenizer, a Hugging Face one without a template, with a template, with a
``{% generation %}`` template and through an artifact's description), and every bad
conversation is a ValueError naming what is wrong."""

import json

import pytest

from ember.core.chat import ROLES, chat_prompt_tokens, check_messages, plain_chat
from ember.core.errors import DataError
from ember.core.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from ember.core.tokenizer import ByteTokenizer, tokenizer_from_description
from ember.training.data.instructions import tokenize_example
from tests.training.finetune_setup import WORDS, write_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% if m['role'] == 'assistant' %}"
    "{{ eos_token }} {% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
GENERATION_TEMPLATE = (  # transformers' marking of the assistant's text, which training then trains
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }} {{ eos_token }}{% endgeneration %} {% else %}{{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what does the cow say ?"},
     {"role": "assistant", "content": "moo"}, {"role": "user", "content": "the owl ?"},
     {"role": "assistant", "content": "hoot"}],
    [{"role": "user", "content": "a dog ?"}, {"role": "assistant", "content": "woof"},
     {"role": "assistant", "content": "it says woof"}],  # a prompt ending with an assistant turn
]  # fmt: skip


def hf_tokenizer(path, template=None):
    """The fine-tuning tests' word-level tokenizer (BOS prepended), knowing the templates' words."""
    path.mkdir(exist_ok=True)
    write_tokenizer(path, [*WORDS, "[", "]", "<|", "|>", *ROLES, "be", "brief", "says"])
    if template is not None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_hf_tokenizer(path)


@pytest.fixture(params=["bytes", "hf_plain", "hf_template", "hf_generation", "described"])
def tokenizer(request, tmp_path):
    if request.param == "bytes":
        return ByteTokenizer()
    if request.param == "hf_plain":  # a base model's: plain_chat, BOS first, EOS after each answer
        return hf_tokenizer(tmp_path)
    if request.param == "described":  # as an exported artifact carries it
        return tokenizer_from_description(hf_tokenizer(tmp_path, TEMPLATE).describe())
    return hf_tokenizer(tmp_path, TEMPLATE if request.param == "hf_template" else GENERATION_TEMPLATE)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_the_prompt_is_the_fine_tuning_example_up_to_its_last_answer(tokenizer, conversation):
    """Serving had no way to prompt a conversation: the prompt of all turns but the last answer
    is the training example's tokens before that answer's first trained token (the header is not
    trained; the earlier answers' EOS, BOS and template tokens are where training put them)."""
    example = tokenize_example({"messages": conversation}, tokenizer)
    trained = example.trained.tolist()
    answer = len(trained) - trained[::-1].index(False)  # the last answer's trained tokens run to the end
    prompt = chat_prompt_tokens(conversation[:-1], tokenizer)
    assert prompt == example.tokens[:answer].tolist()
    assert sum(trained[answer:]) == len(trained) - answer > 1  # the answer's tokens and its EOS follow
    if isinstance(tokenizer, HFTokenizer):  # every word known (no <unk>, id 0): a wrong split would show
        assert 0 not in example.tokens.tolist()


def test_plain_prompt_by_hand():
    """Byte tokenizer, no template: each answer ends with EOS (256), then the generation prompt."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = [*plain_chat(messages).encode(), 256, *b"<|assistant|>\n"]
    assert chat_prompt_tokens(messages, ByteTokenizer()) == expected
    assert chat_prompt_tokens(messages[:1], ByteTokenizer()) == [*b"<|user|>\nhi\n<|assistant|>\n"]


def test_check_messages_keeps_roles_and_contents_in_any_order():
    messages = [{"role": "assistant", "content": "hi", "name": "bot"}, {"role": "system", "content": ""}]
    assert check_messages(messages) == [{"role": "assistant", "content": "hi"}, {"role": "system", "content": ""}]


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], r"messages must be a non-empty list of \{\"role\": \.\.\., .* objects, got an empty list"),
        ({"role": "user", "content": "x"}, "non-empty list .* got dict"),
        (["hi"], r"messages\[0\] needs a role and a string content, got str"),
        ([{"role": "user"}], r"messages\[0\] needs a role and a string content, got none as content"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text"}]}],
         r"messages\[1\] needs a role and a string content, got a list as content"),
        ([{"role": "bot", "content": "x"}], r"messages\[0\] has role 'bot'; roles: system, user, assistant"),
        ([{"content": "x"}], r"messages\[0\] has role None; roles: system, user, assistant"),
        ([{"role": "user", "content": "a \ud800"}], r"messages\[0\]\.content is not valid Unicode text: .* U\+D800"),
    ],
)  # fmt: skip
def test_bad_conversations_say_what_is_wrong(messages, message):
    with pytest.raises(ValueError, match=message):
        check_messages(messages)
    with pytest.raises(ValueError, match=message):
        chat_prompt_tokens(messages, ByteTokenizer())


def test_a_prompt_needs_a_tokenizer_an_eos_and_a_template_that_renders(tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ValueError, match=r"needs a tokenizer; give token ids \(prompt_tokens\)"):
        chat_prompt_tokens(messages, None)
    no_eos = hf_tokenizer(tmp_path / "no_eos")
    no_eos.eos_id = None
    with pytest.raises(ValueError, match="neither a chat_template nor an end-of-sequence id"):
        chat_prompt_tokens(messages, no_eos)
    assert chat_prompt_tokens(messages[:1], no_eos)[0] == 1  # no answer to end: BOS, the turn, the header
    refusing = hf_tokenizer(tmp_path / "refusing", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match="chat template: roles must alternate"):
        chat_prompt_tokens(messages, refusing)
