"""Several engines of one model serving one batch together (``ember.serving.replicas``), against
one of them serving it alone: the same tokens and log-probabilities in prompt order, the work
spread over both (more to an engine whose requests end sooner), each result reported once as it
finishes; a failure stops every engine."""

import queue
import time

import jax
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.core.sharding import MeshConfig
from ember.core.tokenizer import ByteTokenizer
from ember.models.config import ModelConfig
from ember.serving.mesh import replica_meshes
from ember.serving.replicas import Replicas
from ember.serving.requests import SamplingParams
from ember.serving.workers import EngineWorkers
from tests.serving.random_weights import random_weights
from tests.serving.random_workload import random_prompts
from tests.tolerances import assert_allclose

CONFIG = ModelConfig(
    vocab_size=257, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64, page_size=4, max_seq_len=32
)


@pytest.fixture(scope="module")
def replicas():
    """Two single-device engines (devices 0 and 1) of one random model, read from the host."""
    params = jax.device_get(random_weights(CONFIG, seed=20261207, spread=0.3))
    meshes = replica_meshes(MeshConfig(data=2))
    assert [list(mesh.devices.flat) for mesh in meshes] == [[device] for device in jax.devices()[:2]]
    options = dict(tokenizer=ByteTokenizer(), num_slots=3, token_buckets=(8,), max_context=32)
    return Replicas.from_model(CONFIG, params, meshes, **options)


def workload(seed):
    """12 byte prompts (one empty: an error result), every other sampled with its own seed."""
    generator = np.random.default_rng(seed)
    prompts = random_prompts(generator, 12, high=20)
    prompts[5] = []
    params = [
        SamplingParams(max_tokens=int(generator.integers(1, 9)), ignore_eos=True, logprobs=True,
                       **(dict(temperature=0.8, top_k=20, seed=int(generator.integers(2**31))) if i % 2 else {}))
        for i in range(len(prompts))
    ]  # fmt: skip
    return prompts, params


def test_replicas_serve_one_engine_s_tokens_in_prompt_order_with_the_work_spread(replicas):
    prompts, params = workload(7)
    reported = []
    before = [engine.tokens_generated for engine in replicas.engines]
    results = replicas.generate(prompts, params, on_result=lambda index, result: reported.append(index))
    assert sorted(reported) == list(range(len(prompts)))
    assert all(engine.tokens_generated > count for engine, count in zip(replicas.engines, before))
    alone = replicas.engines[1].generate(prompts, params)
    assert results[5].finish_reason == "error" and "empty" in results[5].error
    for index, (result, expected) in enumerate(zip(results, alone)):
        assert result.tokens == expected.tokens and result.error == expected.error, index
        if result.error is None:
            assert_allclose(result.logprobs, expected.logprobs, dtype=np.float32, err_msg=str(index))


def test_a_failure_in_on_result_stops_every_engine(replicas):
    """``on_result`` raising on the third result: the error reaches the caller once both engines
    stopped, with no request left queued or holding pages in either, and nothing more reported."""
    prompts, params = workload(8)
    params = [SamplingParams(max_tokens=8, ignore_eos=True) for _ in params]
    seen = []

    def fail_on_third(index, result):
        seen.append(index)
        if len(seen) == 3:
            raise RuntimeError("the caller's storage is full")

    with pytest.raises(RuntimeError, match="storage is full"):
        replicas.generate(prompts, params, on_result=fail_on_third)
    assert_idle(replicas)
    assert len(seen) == 3, seen


def test_an_engine_failing_stops_every_engine(replicas, monkeypatch):
    """Engine 0's third step raises (a device lost): ``generate`` raises that error once engine 1
    stopped too, both left with nothing queued."""
    prompts, params = workload(9)
    steps = []
    step = replicas.engines[0].step

    def failing_step(*args):
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("device lost")
        return step(*args)

    monkeypatch.setattr(replicas.engines[0], "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        replicas.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True) for _ in params])
    assert_idle(replicas)


def test_an_engine_failing_to_queue_what_it_took_ends_those_requests_too(replicas, monkeypatch):
    """One worker whose engine raises as it queues the requests it took from the shared queue:
    each ends with an error result naming the failure (unended, their submitters would wait
    forever), and the worker's failure is kept."""

    def refuse(request):
        raise RuntimeError("host memory exhausted")

    monkeypatch.setattr(replicas.engines[0], "enqueue", refuse)
    updates = queue.Queue()
    with EngineWorkers(replicas.engines[:1]) as workers:
        for index in range(2):
            workers.submit([1, 2, 3], SamplingParams(max_tokens=4), updates, tag=index)
        results = [updates.get(timeout=60).result for _ in range(2)]
    assert {r.finish_reason for r in results} == {"error"}
    assert all("engine 0 failed: RuntimeError: host memory exhausted" in r.error for r in results)
    assert [str(f) for f in workers.failures] == ["host memory exhausted"] and workers.alive == 0
    assert_idle(replicas)


def test_a_burst_smaller_than_one_engine_s_slots_is_spread_over_both(replicas, monkeypatch):
    """Two requests at once, three slots in each engine: one each (the first engine to look would
    otherwise take both, leaving the other idle)."""
    served = count_served(replicas, monkeypatch)
    prompts = workload(12)[0][:2]
    results = replicas.generate(prompts, [SamplingParams(max_tokens=3) for _ in prompts])
    assert [len(r.tokens) > 0 for r in results] == [True, True] and served == [1, 1]


def count_served(replicas, monkeypatch):
    """``[requests queued on engine 0, on engine 1]``, counted as they are."""
    served = [0, 0]
    for index, engine in enumerate(replicas.engines):
        enqueue = engine.enqueue

        def counted(request, index=index, enqueue=enqueue):
            served[index] += 1
            return enqueue(request)

        monkeypatch.setattr(engine, "enqueue", counted)
    return served


def test_an_engine_whose_requests_end_sooner_takes_more(replicas, monkeypatch):
    """Engine 0 made slow (each step 0.3 s longer): it takes one slot-full of requests at the start
    and engine 1 the other nine, instead of half each (a split made before anything ran)."""
    prompts, params = workload(10)
    params = [SamplingParams(max_tokens=6, ignore_eos=True) for _ in params]
    served = count_served(replicas, monkeypatch)
    step = replicas.engines[0].step
    monkeypatch.setattr(replicas.engines[0], "step", lambda *args: time.sleep(0.3) or step(*args))
    results = replicas.generate(prompts, params)
    assert [r.finish_reason for r in results] == ["length"] * 5 + ["error"] + ["length"] * 6
    assert served[0] <= 3 and served[1] >= 8, served


def assert_idle(replicas):
    for engine in replicas.engines:
        assert not engine.has_unfinished
        assert engine.scheduler.pages.num_free == engine.program.num_pages


def test_replica_meshes_need_the_devices_and_split_no_batch():
    with pytest.raises(ConfigError, match=r"mesh.data=5 replicas of 2 device\(s\) each need 10 devices; there are 8"):
        replica_meshes(MeshConfig(data=5, tensor=2))
    with pytest.raises(ConfigError, match=r"mesh.fsdp=2: serving splits only the model") as error:
        replica_meshes(MeshConfig(data=2, fsdp=2))
    assert error.value.key == "mesh.fsdp"
    meshes = replica_meshes(MeshConfig(data=-1, tensor=4))
    assert [list(mesh.devices.flat) for mesh in meshes] == [jax.devices()[:4], jax.devices()[4:]]
    assert all(dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 4, "expert": 1} for mesh in meshes)
