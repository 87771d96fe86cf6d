"""``ember.serving.openai_api.parse_call``: what each request field becomes (no server)."""

import json

import pytest

from ember.core.chat import chat_prompt_tokens
from ember.core.tokenizer import ByteTokenizer
from ember.serving.openai_api import ApiError, Models, parse_call

MODELS = Models("base", adapters=("sql",))


def parsed(fields, chat=False):
    return parse_call(json.dumps(fields).encode(), chat=chat, models=MODELS, tokenizer=ByteTokenizer(), max_context=64)


def test_null_fields_take_openai_s_defaults():
    params = parsed({"prompt": "x", "temperature": None, "top_p": None, "max_tokens": None, "n": None}).params
    assert [(p.temperature, p.top_p, p.max_tokens) for p in params] == [(1.0, 1.0, 16)]


def test_choices_are_prompt_by_prompt_and_seeded_seed_plus_their_index():
    call = parsed({"prompt": ["a", [5, 6]], "n": 2, "seed": 2**31 - 1, "model": "sql", "stop": "\n"})
    assert call.prompts == ["a", "a", [5, 6], [5, 6]]
    assert [p.seed for p in call.params] == [2**31 - 1, 0, 2**31 - 1, 0]
    assert {(p.adapter, p.stop) for p in call.params} == {("sql", ("\n",))}


def test_a_chat_is_its_chat_prompt_and_may_run_to_the_context():
    messages = [{"role": "user", "content": "Hi", "name": "ann"}]
    call = parsed({"messages": messages, "max_completion_tokens": None}, chat=True)
    assert call.prompts == [chat_prompt_tokens([{"role": "user", "content": "Hi"}], ByteTokenizer())]
    assert call.params[0].max_tokens == 64 and call.chat and call.response_id.startswith("chatcmpl-")
    with pytest.raises(ApiError, match="max_tokens or max_completion_tokens, not both"):
        parsed({"messages": messages, "max_tokens": 3, "max_completion_tokens": 4}, chat=True)
    with pytest.raises(ApiError, match="only text parts") as error:
        parsed({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat=True)
    assert (error.value.status, error.value.param) == (400, "messages")
