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


def test_logprobs_ask_for_alternatives_and_echo_for_the_prompt_s_scores():
    (scored,) = parsed({"prompt": "x", "logprobs": 3, "echo": True}).params
    assert (scored.logprobs, scored.top_logprobs, scored.prompt_logprobs) == (True, 3, True)
    (echoed,) = parsed({"prompt": "x", "echo": True}).params  # the text only: nothing scored
    assert (echoed.logprobs, echoed.prompt_logprobs) == (False, False)
    (alone,) = parsed({"prompt": "x", "echo": True, "max_tokens": 0}).params
    assert (alone.max_tokens, alone.prompt_logprobs) == (0, True)
    (chat,) = parsed(
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2}, True
    ).params
    assert (chat.logprobs, chat.top_logprobs, chat.prompt_logprobs) == (True, 2, False)
    with pytest.raises(ApiError, match="top_logprobs needs logprobs: true"):
        parsed({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, chat=True)
    with pytest.raises(
        ApiError, match=r"logprobs must be an integer in \[0, 20\] \(alternatives per token\), got True"
    ):
        parsed({"prompt": "x", "logprobs": True})
