"""``ember.serving.server`` through the official ``openai`` client (and raw HTTP for what a client
hides): completions equal a full-recompute greedy loop, streams give the text the whole response
gives, concurrent requests share the engine's batches, a client leaving a stream frees its slot,
and a bad request is the API's error naming the field."""

import http.client
import json
import re
import socket
import struct
import threading
import time
from types import SimpleNamespace

import jax
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember.core.chat import chat_prompt_tokens
from ember.core.tokenizer import ByteTokenizer
from ember.models.adapters import LoraConfig, adapter_leaves, add_lora, merged_weights
from ember.models.config import ModelConfig
from ember.models.hf.peft import with_adapter
from ember.serving.engine import Engine
from ember.serving.openai_api import Models
from ember.serving.server import Server
from tests.moved_adapters import moved
from tests.serving.greedy_reference import greedy_reference, log_prob_reference
from tests.serving.random_weights import random_weights
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(
    vocab_size=257, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64, page_size=4, max_seq_len=96
)
KEY = "sk-ember-test"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served():
    params = random_weights(CONFIG, seed=20261207, spread=0.3)
    lora = LoraConfig(rank=2, alpha=4, targets=("q", "v"))
    adapter = adapter_leaves(moved(add_lora(params, lora, jax.random.key(1)), 1, 0.3))
    engine = Engine.from_model(
        CONFIG, params, tokenizer=ByteTokenizer(), num_slots=4, token_buckets=(8, 16), adapters={"qv": adapter}
    )
    running = []  # requests running in each step
    step = engine.step
    engine.step = lambda *args: running.append(len(engine.scheduler.running)) or step(*args)
    server = Server([engine], Models("tiny", adapters=("qv",)), port=0, api_key=KEY)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield SimpleNamespace(
        server=server,
        engine=engine,
        client=client,
        running=running,
        greedy=greedy_reference(CONFIG, params, 96),
        log_probs=log_prob_reference(CONFIG, params, 96),
        greedy_qv=greedy_reference(CONFIG, merged_weights(with_adapter(params, adapter)), 96),
    )
    server.close()
    thread.join()


def expected_greedy(served, prompts, max_tokens, greedy=None):
    greedy = served.greedy if greedy is None else greedy
    tokens = greedy([list(ByteTokenizer().encode(p)) for p in prompts], [max_tokens] * len(prompts))
    return [ByteTokenizer().decode(t) for t in tokens]


def test_completions_equal_a_greedy_loop_whole_or_streamed(served):
    prompts = ["Once upon", "The quick brown"]
    expected = expected_greedy(served, prompts, 12)
    response = served.client.completions.create(model="tiny", prompt=prompts, max_tokens=12, **GREEDY)
    assert [choice.text for choice in response.choices] == expected
    assert [choice.finish_reason for choice in response.choices] == ["length", "length"]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (9 + 15, 24)
    pieces, usages = {0: [], 1: []}, []
    stream = served.client.completions.create(
        model="tiny", prompt=prompts, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    for chunk in stream:
        usages.append(chunk.usage)
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
    assert ["".join(pieces[0]), "".join(pieces[1])] == expected
    assert usages[-1].completion_tokens == 24 and all(usage is None for usage in usages[:-1])


def test_an_adapter_is_a_model_of_its_own(served):
    """``model: "qv"`` generates with the adapter: its merged model's greedy loop, not the base's."""
    assert [model.id for model in served.client.models.list()] == ["tiny", "qv"]
    expected = expected_greedy(served, ["Once upon"], 12, served.greedy_qv)
    assert expected != expected_greedy(served, ["Once upon"], 12)
    response = served.client.completions.create(model="qv", prompt="Once upon", max_tokens=12, **GREEDY)
    assert [response.choices[0].text] == expected and response.model == "qv"


def test_a_stream_with_a_stop_string_gives_the_text_before_it(served):
    """The stop string is two characters of the greedy answer: the stream gives exactly the
    whole response's text (what precedes the stop string's first appearance), never the stop."""
    text = expected_greedy(served, ["Once upon"], 12)[0]
    stop = text[5:7]
    asked = dict(model="tiny", prompt="Once upon", max_tokens=12, stop=[stop], **GREEDY)
    whole = served.client.completions.create(**asked).choices[0]
    assert (whole.text, whole.finish_reason) == (text[: text.index(stop)], "stop")
    pieces = [chunk.choices[0].text for chunk in served.client.completions.create(**asked, stream=True)]
    assert "".join(pieces) == whole.text


def test_sampled_choices_follow_their_seeds_streamed_or_not(served):
    """``n=2`` with ``seed`` 5: the choices sample with seeds 5 and 6 (a request of its own with
    seed 6 gives choice 1), the stream gives the same text and log-probabilities."""
    asked = dict(model="tiny", prompt="Hello", max_tokens=10, temperature=0.9, seed=5, logprobs=0, n=2)
    whole = served.client.completions.create(**asked)
    texts = [choice.text for choice in whole.choices]
    assert texts[0] != texts[1]
    alone = served.client.completions.create(**{**asked, "n": 1, "seed": 6})
    assert alone.choices[0].text == texts[1]
    expected = whole.choices[1].logprobs.token_logprobs
    assert_allclose(alone.choices[0].logprobs.token_logprobs, expected, dtype=np.float32)
    pieces, logprobs = {0: [], 1: []}, {0: [], 1: []}
    for chunk in served.client.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
            logprobs[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
    for index in range(2):
        assert "".join(pieces[index]) == texts[index]
        assert_allclose(logprobs[index], whole.choices[index].logprobs.token_logprobs, dtype=np.float32)
        assert len(logprobs[index]) == 10


def test_an_echoed_prompt_is_scored_as_lm_evaluation_harness_asks(served):
    """``echo`` with ``logprobs`` (lm-evaluation-harness's log-likelihood request: token ids,
    ``max_tokens`` 1, ``logprobs`` 1, its ``top_logprobs[ctxlen:-1]`` compared with
    ``token_logprobs``): the prompt's tokens, each after the first with its log-probability and
    alternatives, then the completion's, equal to a full forward pass's ``log_softmax``; the
    stream gives the same; ``max_tokens`` 0 scores the prompt alone."""
    prompt = [int(t) for t in ByteTokenizer().encode("Once upon a time")]
    asked = dict(model="tiny", prompt=prompt, max_tokens=1, logprobs=2, echo=True, **GREEDY)
    choice = served.client.completions.create(**asked).choices[0]
    sequence = prompt + served.greedy([prompt], [1])[0]
    assert choice.text == "Once upon a time" + ByteTokenizer().decode(sequence[-1:])
    rows = served.log_probs([sequence])[0]
    logprobs = choice.logprobs
    assert logprobs.tokens == [ByteTokenizer().decode([t]) for t in sequence]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert_allclose(
        logprobs.token_logprobs[1:], [rows[p, sequence[p + 1]] for p in range(len(prompt))], dtype=np.float32
    )
    expected = []  # by text, most likely first: of two bytes that decode alike ("\ufffd"), the likelier
    for row in rows[:-1]:
        by_text = {}
        for token in np.argsort(-row)[:2].tolist():
            by_text.setdefault(ByteTokenizer().decode([token]), row[token])
        expected.append(by_text)
    assert [list(top) for top in logprobs.top_logprobs[1:]] == [list(top) for top in expected]
    assert_allclose(
        [v for top in logprobs.top_logprobs[1:] for v in top.values()],
        [v for top in expected for v in top.values()],
        dtype=np.float32,
    )
    assert logprobs.text_offset == list(np.cumsum([0, *map(len, logprobs.tokens[:-1])]))
    # The completion is greedy: its log-probability is its first alternative's.
    assert logprobs.token_logprobs[-1] == max(logprobs.top_logprobs[-1].values())
    streamed = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": []}
    for chunk in served.client.completions.create(**asked, stream=True):
        for piece in chunk.choices:
            streamed["text"] += piece.text
            for name in ("tokens", "token_logprobs", "top_logprobs"):
                streamed[name] += getattr(piece.logprobs, name) if piece.logprobs else []
    # The stream reads the first request's cached pages and their rows' scores; it computes the
    # rest in other chunks than the first request did: the same to float32's precision.
    assert (streamed["text"], streamed["tokens"]) == (choice.text, logprobs.tokens)
    assert streamed["token_logprobs"][0] is None and streamed["top_logprobs"][0] is None
    assert_allclose(streamed["token_logprobs"][1:], logprobs.token_logprobs[1:], dtype=np.float32)
    assert [list(top) for top in streamed["top_logprobs"][1:]] == [list(top) for top in logprobs.top_logprobs[1:]]
    assert_allclose(
        [v for top in streamed["top_logprobs"][1:] for v in top.values()],
        [v for top in logprobs.top_logprobs[1:] for v in top.values()],
        dtype=np.float32,
    )
    alone = served.client.completions.create(**{**asked, "max_tokens": 0, "prompt": "Once upon a time"})
    assert (alone.choices[0].text, alone.choices[0].finish_reason) == ("Once upon a time", "length")
    assert_allclose(alone.choices[0].logprobs.token_logprobs[1:], logprobs.token_logprobs[1:-1], dtype=np.float32)
    assert (alone.usage.prompt_tokens, alone.usage.completion_tokens) == (len(prompt), 0)


def test_a_stream_s_text_offsets_go_on_from_its_earlier_chunks(served, monkeypatch):
    """Each token's ``text_offset`` in a stream is where its text begins in the choice's whole text
    (the echoed prompt's, then the completion's), as in the whole response: a chunk's offsets go on
    from the chunks before, never from 0 again. Each step is slowed to 20 ms, so the completion's
    tokens come in chunks of their own."""
    asked = dict(model="tiny", prompt="Offsets, echoed", max_tokens=6, logprobs=1, echo=True, **GREEDY)
    whole = served.client.completions.create(**asked).choices[0]
    step = served.engine.step
    monkeypatch.setattr(served.engine, "step", lambda *args: time.sleep(0.02) or step(*args))
    chunks = [c.choices[0] for c in served.client.completions.create(**asked, stream=True) if c.choices]
    assert sum(bool(c.logprobs) for c in chunks) > 2
    streamed = [(t, o) for c in chunks if c.logprobs for t, o in zip(c.logprobs.tokens, c.logprobs.text_offset)]
    assert streamed == list(zip(whole.logprobs.tokens, whole.logprobs.text_offset))
    assert whole.logprobs.text_offset == list(np.cumsum([0, *map(len, whole.logprobs.tokens[:-1])]))
    assert "".join(c.text for c in chunks) == whole.text


def test_a_chat_is_the_completion_of_its_chat_prompt(served):
    """A conversation is prompted as fine-tuning tokenized it (``chat_prompt_tokens``): the chat's
    answer is the completion of those tokens, whole or streamed (the role first), content given
    as a string or as text parts alike, with each sampled token's log-probability."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = chat_prompt_tokens(messages, ByteTokenizer())
    completion = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, logprobs=0, **GREEDY)
    chat = served.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY
    )
    answer = chat.choices[0]
    # Greedy tokens: each is its first alternative, with the same log-probability.
    assert [(e.top_logprobs[0].token, e.top_logprobs[0].logprob) for e in answer.logprobs.content] == [
        (e.token, e.logprob) for e in answer.logprobs.content
    ]
    assert {len(e.top_logprobs) for e in answer.logprobs.content} == {3}
    assert (answer.message.role, answer.message.content) == ("assistant", completion.choices[0].text)
    assert_allclose(
        [entry.logprob for entry in answer.logprobs.content], completion.choices[0].logprobs.token_logprobs,
        dtype=np.float32,
    )  # fmt: skip
    assert chat.usage.prompt_tokens == len(prompt)
    parts = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    chunks = list(
        served.client.chat.completions.create(model="tiny", messages=parts, max_tokens=8, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == answer.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\] has role 'robot'"):
        served.client.chat.completions.create(model="tiny", messages=[messages[0], {"role": "robot", "content": "x"}])


def test_requests_arriving_together_share_the_engine_s_steps(served):
    prompts = [f"request {i}: " + "ab" * i for i in range(6)]
    expected = expected_greedy(served, prompts, 10)
    served.running.clear()
    texts = [None] * len(prompts)

    def ask(index):
        response = served.client.completions.create(model="tiny", prompt=prompts[index], max_tokens=10, **GREEDY)
        texts[index] = response.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert texts == expected
    assert max(served.running) > 1, served.running  # one request at a time would be 1 throughout


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_leaving_frees_its_slot(served, monkeypatch, stream):
    """The client closes the connection (after one event of a stream, or while waiting for the
    whole response): the request is aborted within a few tokens (each step slowed to 50 ms, so 40
    tokens would take 2 s), its slot and pages freed."""
    step = served.engine.step
    monkeypatch.setattr(served.engine, "step", lambda *args: time.sleep(0.05) or step(*args))
    before = served.engine.tokens_generated
    fields = {"prompt": "Go", "max_tokens": 40, "stream": stream, "ignore_eos": True}
    connection = post(served, "/v1/completions", fields)
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        response.close()  # the response holds the socket open too
    else:
        time.sleep(0.2)
    connection.close()
    deadline = time.monotonic() + 10
    while served.engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not served.engine.has_unfinished
    assert served.engine.scheduler.pages.num_free == served.engine.program.num_pages
    assert served.engine.tokens_generated - before < 20


@pytest.mark.parametrize(
    ("fields", "status", "param", "message"),
    [
        ({"prompt": "x", "max_token": 3}, 400, "max_token", "unsupported field.*max_token; supported: best_of"),
        ({"prompt": "x", "model": "big"}, 404, "model", "'big' is not served here; served: tiny, qv"),
        ({"prompt": "x" * 100}, 400, "prompt", "the prompt has 100 tokens, more than the context of 96"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported: give 0"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be a finite number >= 0"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs", r"logprobs must be an integer in \[0, 20\]"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", r"0 only with echo"),
        ({"prompt": ["x", 3]}, 400, "prompt", "prompt must be a string, a list of token ids"),
        ({"prompt": "x", "n": 0}, 400, "n", r"n must be an integer in \[1, 128\]"),
    ],
)
def test_a_bad_request_is_the_api_s_error_naming_the_field(served, fields, status, param, message):
    response = post(served, "/v1/completions", fields).getresponse()
    error = json.loads(response.read())["error"]
    assert (response.status, error["param"]) == (status, param)
    assert re.search(message, error["message"]), error["message"]


def test_the_client_sees_the_errors_and_the_routes(served):
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        served.client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="served: tiny"):
        served.client.completions.create(model="big", prompt="x")
    stranger = openai.OpenAI(base_url=served.server.url + "/v1", api_key="sk-guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="a valid API key is required"):
        stranger.completions.create(model="tiny", prompt="x")
    for method, path, key, status in (
        ("GET", "/health", None, 200),
        ("GET", "/metrics", None, 200),
        ("GET", "/v1/models", None, 401),
        ("GET", "/v2", KEY, 404),
        ("POST", "/v1/embeddings", KEY, 404),
    ):
        connection = http.client.HTTPConnection(served.server.url.removeprefix("http://"), timeout=30)
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        connection.request(method, path, body=b"{}" if method == "POST" else None, headers=headers)
        assert connection.getresponse().status == status, path
    connection = post(served, "/v1/completions", None, body=b"{not json")
    response = connection.getresponse()
    assert response.status == 400 and "not JSON" in json.loads(response.read())["error"]["message"]


def test_metrics_count_requests_tokens_and_times_and_read_the_engine(served, monkeypatch):
    """``GET /metrics`` (open without the key, as a scraper reads it), Prometheus's text format:
    a request held before its first step waits, after one step runs with pages in use; requests
    count their prompt and generated tokens, their end by reason (a stream left early: abort), a
    first-token time and a latency each, the prompt tokens found cached; once all ended, nothing
    runs or waits and no page is used."""
    steps, step = threading.Semaphore(0), served.engine.step
    monkeypatch.setattr(served.engine, "step", lambda *args: steps.acquire(timeout=30) and step(*args))
    before = scrape(served)
    # Prompts no other test sends: the prefix cache holds nothing of them before.
    asked = dict(model="tiny", prompt=["Scrape me now", "Hi!"], max_tokens=5, **GREEDY)
    answer = []
    thread = threading.Thread(target=lambda: answer.append(served.client.completions.create(**asked)))
    thread.start()
    assert wait_for(lambda: scrape(served)["ember_num_requests_waiting"] == 2)
    assert scrape(served)["ember_num_requests_running"] == 0
    steps.release()  # one step: both prompts prefilled, a first token each
    assert wait_for(lambda: scrape(served)["ember_num_requests_running"] == 2)
    assert 0 < scrape(served)["ember_kv_cache_usage_perc"] < 1
    # Slowed steps: the stream left early below is still running when the server writes to it
    # next (a fast engine was seen to finish its 60 tokens first: no abort).
    monkeypatch.setattr(served.engine, "step", lambda *args: time.sleep(0.02) or step(*args))
    steps.release(1000)
    thread.join(60)
    assert [choice.text for choice in answer[0].choices] == expected_greedy(served, asked["prompt"], 5)
    # Its first twelve tokens are the three full pages of "Scrape me now", cached: prefix caching's hit.
    stream = served.client.completions.create(
        model="tiny", prompt="Scrape me now, again", max_tokens=60, stream=True, **GREEDY
    )
    next(iter(stream))
    stream.close()
    assert wait_for(
        lambda: (
            scrape(served).get(("ember_requests_finished_total", "abort"), 0)
            > before.get(("ember_requests_finished_total", "abort"), 0)
        )
    )
    after = scrape(served)
    grown = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert grown["ember_prompt_tokens_total"] == 13 + 3 + 20
    assert grown["ember_prefix_cache_hit_tokens_total"] == 12
    assert 10 < grown["ember_generation_tokens_total"] < 10 + 60
    assert (grown[("ember_requests_finished_total", "length")], grown[("ember_requests_finished_total", "abort")]) == (
        2,
        1,
    )
    assert grown["ember_time_to_first_token_seconds_count"] == 3
    assert grown["ember_e2e_request_latency_seconds_count"] == 2 == grown["ember_time_per_output_token_seconds_count"]
    assert wait_for(lambda: not served.engine.has_unfinished)
    idle = scrape(served)
    assert (
        idle["ember_num_requests_running"],
        idle["ember_num_requests_waiting"],
        idle["ember_kv_cache_usage_perc"],
    ) == (0, 0, 0)
    assert idle["ember_engines_alive"] == 1


def scrape(served):
    """``GET /metrics`` as ``{name: value}`` (``{(name, finished_reason): value}`` for the finished
    requests), the model's samples only."""
    connection = http.client.HTTPConnection(served.server.url.removeprefix("http://"), timeout=30)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.read().decode()):
        for sample in family.samples:
            if sample.labels.get("model_name") != "tiny" or "le" in sample.labels:
                continue
            reason = sample.labels.get("finished_reason")
            samples[(sample.name, reason) if reason else sample.name] = sample.value
    return samples


def wait_for(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def post(served, path, fields, body=None):
    connection = http.client.HTTPConnection(served.server.url.removeprefix("http://"), timeout=30)
    body = json.dumps(fields).encode() if body is None else body
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    connection.request("POST", path, body=body, headers=headers)
    return connection


def test_a_client_resetting_its_connection_is_no_traceback_and_the_server_answers_on(served, capsys):
    """A client that resets its connection mid-request (here before its headers end, and after a
    request for /metrics it does not wait to read) is logged, not printed as an exception with a
    traceback on the server's stderr (socketserver's default), and the server answers the next."""
    address = served.server.url.removeprefix("http://").split(":")
    for request in (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50):
        client = socket.create_connection((address[0], int(address[1])))
        client.sendall(request)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        client.close()
    time.sleep(0.5)  # the handlers meet the reset
    connection = http.client.HTTPConnection(served.server.url.removeprefix("http://"), timeout=30)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    assert "Traceback" not in capsys.readouterr().err
