"""Serving on a mixed workload: Ember continuous batching with chunked prefill, Ember static
batching, and ``transformers`` ``generate`` (PyTorch CPU) on the same weights, side by side.

Requests arrive over time (Poisson), with random prompt and output lengths; every request
generates exactly its output length (EOS ignored) so all three do the same work. Reported:
output tokens/s and time-to-first-token (TTFT) / time-between-tokens (TBT) percentiles.

- continuous: the :class:`~ember.serving.engine.Engine` as is (stall-free chunked prefill,
  requests admitted as soon as a slot and pages are free).
- static: the same engine and compiled steps, but a batch of up to ``num_slots`` arrived
  requests is admitted only when the previous batch has entirely finished.
- ember serve: the same engine behind ``ember serve``'s HTTP server (in this process), each
  request a client thread's streamed completion sent at its arrival from another process; token
  times are when its server-sent events arrive (one per token: log-probabilities asked), so the
  row is what the HTTP layer and the engine's worker thread cost beside ``continuous`` (the
  clients' process shares the machine's cores).
- transformers: ``generate`` one request at a time in arrival order (greedy, KV cache).

    python -m benchmarks.serving          # CPU: tiny model; GPU: tiny and ~125M
    python -m benchmarks.serving --skip-hf --requests 96 --token-budget 32 --rate 32

The workload is the same shape on both (prompts 16-512, outputs 16-256 tokens); the rate
is high enough that requests queue (the server is saturated), so throughput measures the
server, not the arrival rate. Static batching here is the same engine admitting a new batch
only when the last has finished: it keeps chunked prefill and the ragged step, so the gap
to continuous batching is the slots static batching leaves idle while its batch's longest
request finishes (with outputs uniform in 16-256 and 8 slots, at most about 1.7x).

Also: one decode step at batch 64 (GPU; 8 on CPU) over a full context, as the bytes it
must read (weights + K/V) per second against the measured bandwidth of a large copy; and
group sampling as GRPO does it (8 prompts of 256-512 tokens, 8 samples of each, submitted at
once) and lm-evaluation-harness's multiple-choice scoring (16 contexts x 4 choices, each scored
whole), each with prefix caching and without: the same engine program, the seconds to finish and
the prompt tokens computed.

Results: ``benchmarks/results/serving-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import itertools
import json
import multiprocessing
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import on_gpu, print_table, time_fn, write_results
from ember.core.tokenizer import ByteTokenizer
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.serving.engine import Engine
from ember.serving.model_program import build_program
from ember.serving.program import DeviceProgram, batch_arrays
from ember.serving.requests import SamplingParams
from ember.serving.sampling import settings_array

TINY = ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4, mlp_dim=256, max_seq_len=1024, page_size=16)
M125 = ModelConfig(
    vocab_size=32768,
    d_model=768,
    num_layers=12,
    num_heads=12,
    mlp_dim=2048,
    max_seq_len=1024,
    page_size=16,
    precision="bf16",
)


@dataclasses.dataclass(frozen=True)
class Workload:
    arrivals: list[float]  # seconds after the start
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(
    seed: int, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], rate: float, vocab: int
) -> Workload:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    arrivals -= arrivals[0]
    prompts = [
        rng.integers(0, vocab, size=int(rng.integers(*prompt_range, endpoint=True))).tolist() for _ in range(count)
    ]
    outputs = [int(rng.integers(*output_range, endpoint=True)) for _ in range(count)]
    return Workload(arrivals.tolist(), prompts, outputs)


def summarize(name: str, workload: Workload, token_times: list[list[float]], elapsed: float) -> dict:
    """Throughput and latency percentiles from each request's token timestamps."""
    ttft = [times[0] - arrival for times, arrival in zip(token_times, workload.arrivals)]
    tbt = [b - a for times in token_times for a, b in itertools.pairwise(times)]
    tokens = sum(len(times) for times in token_times)
    row = {"system": name, "output_tok_s": tokens / elapsed, "seconds": elapsed, "tokens": tokens}
    for label, values in (("ttft", ttft), ("tbt", tbt)):
        for q in (50, 90, 99):
            row[f"{label}_p{q}_ms"] = float(np.percentile(values, q) * 1e3) if values else None
    return row


def run_engine(engine: Engine, workload: Workload, *, static: bool) -> tuple[list[list[float]], float]:
    """Replays ``workload`` on ``engine``; returns each request's token times and the span."""
    token_times: list[list[float]] = [[] for _ in workload.prompts]
    owner: dict[int, int] = {}
    next_request = 0
    start = time.perf_counter()
    while next_request < len(workload.prompts) or engine.has_unfinished:
        now = time.perf_counter() - start
        # Static batching admits a new batch only into an idle engine.
        room = (0 if engine.has_unfinished else engine.program.num_slots) if static else len(workload.prompts)
        while room and next_request < len(workload.prompts) and workload.arrivals[next_request] <= now:
            params = SamplingParams(max_tokens=workload.output_lens[next_request], ignore_eos=True)
            owner[engine.add_request(workload.prompts[next_request], params)] = next_request
            next_request += 1
            room -= 1
        if not engine.has_unfinished:
            time.sleep(max(0.0, workload.arrivals[next_request] - (time.perf_counter() - start)))
            continue
        events = engine.step()
        stamp = time.perf_counter() - start
        for event in events:
            if event.token is not None:
                token_times[owner[event.request_id]].append(stamp)
            if event.finish_reason is not None:
                engine.result(event.request_id)
    return token_times, time.perf_counter() - start


def run_server(engine: Engine, workload: Workload) -> tuple[list[list[float]], float]:
    """Replays ``workload`` through ``ember serve``'s server on ``engine`` (in this process),
    its clients in another process (:func:`replay_http`), as a server's clients are elsewhere;
    returns each request's token times (its events' arrivals) and the span."""
    from ember.serving.openai_api import Models
    from ember.serving.server import Server

    server = Server([engine], Models("bench"), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
            return clients.submit(replay_http, server.url.removeprefix("http://"), workload).result()
    finally:
        server.close()


def replay_http(address: str, workload: Workload) -> tuple[list[list[float]], float]:
    """One thread per request of ``workload`` posting a streamed completion to ``address`` at its
    arrival time; each request's token times and the span."""
    token_times: list[list[float]] = [[] for _ in workload.prompts]
    start = time.perf_counter()

    def client(index: int) -> None:
        time.sleep(max(0.0, workload.arrivals[index] - (time.perf_counter() - start)))
        body = {"prompt": workload.prompts[index], "max_tokens": workload.output_lens[index], "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": True}  # fmt: skip
        connection = http.client.HTTPConnection(address, timeout=3600)
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        for line in connection.getresponse():
            if line.startswith(b"data: {"):
                stamp = time.perf_counter() - start
                (choice,) = json.loads(line[len(b"data: ") :])["choices"]
                token_times[index] += [stamp] * len((choice["logprobs"] or {}).get("token_logprobs", []))
        connection.close()

    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(workload.prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return token_times, time.perf_counter() - start


def run_transformers(config: ModelConfig, params, workload: Workload) -> tuple[list[list[float]], float] | None:
    try:
        import torch
        import transformers
        from transformers.generation.streamers import BaseStreamer
    except ImportError:
        return None
    from ember.models import hf

    class TimingStreamer(BaseStreamer):
        def __init__(self, start):
            self.start, self.times, self.seen_prompt = start, [], False

        def put(self, value):
            if self.seen_prompt:
                self.times.append(time.perf_counter() - self.start)
            self.seen_prompt = True

        def end(self):
            pass

    with tempfile.TemporaryDirectory() as directory:
        hf.save(directory, config, jax.tree.map(np.asarray, params), model_type="llama", dtype=np.float32)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()  # float32, as saved
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    token_times = []
    start = time.perf_counter()
    for arrival, prompt, length in zip(workload.arrivals, workload.prompts, workload.output_lens):
        time.sleep(max(0.0, arrival - (time.perf_counter() - start)))
        streamer = TimingStreamer(start)
        with torch.no_grad():
            model.generate(
                torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length, do_sample=False, streamer=streamer
            )
        token_times.append(streamer.times)
    return token_times, time.perf_counter() - start


def bench_model(
    name: str, config: ModelConfig, workload: Workload, *, num_slots: int, token_budget: int, with_hf: bool
) -> list[dict]:
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    max_context = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    max_context = -(-max_context // config.page_size) * config.page_size
    compile_start = time.perf_counter()
    sizes = dict(num_slots=num_slots, token_budget=token_budget, max_context=max_context)
    engine = Engine.from_model(config, params, tokenizer=ByteTokenizer(), **sizes)  # ember serve needs a tokenizer
    compile_seconds = time.perf_counter() - compile_start
    warm = Workload([0.0], [workload.prompts[0][::-1]], [2])  # not a prompt of the workload: nothing of it cached
    run_engine(engine, warm, static=False)
    # Each system on a fresh engine over the same program: none finds the prompts another computed cached.
    fresh = lambda: Engine(engine.program.fresh_copy(), tokenizer=ByteTokenizer())  # noqa: E731
    rows = []
    for system, static in (("ember continuous", False), ("ember static", True)):
        token_times, elapsed = run_engine(fresh(), workload, static=static)
        rows.append(summarize(system, workload, token_times, elapsed))
    rows.append(summarize("ember serve (HTTP, streamed)", workload, *run_server(fresh(), workload)))
    if with_hf:
        measured = run_transformers(config, params, workload)
        if measured is not None:
            rows.append(summarize("transformers generate (torch cpu)", workload, *measured))
    for row in rows:
        row.update(model=name, num_slots=num_slots, token_budget=token_budget, compile_seconds=compile_seconds)
    return rows


def bench_prefix_sharing(name: str, config: ModelConfig, *, num_slots: int, token_budget: int) -> list[dict]:
    """Group sampling (8 prompts of 256-512 tokens x 8 samples at temperature 1, 32-64 tokens
    each) on engines with and without prefix caching: seconds and prompt tokens computed."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, size=int(rng.integers(256, 513))).tolist() for _ in range(8)]
    group = [prompt for prompt in prompts for _ in range(8)]
    settings = [
        SamplingParams(max_tokens=int(rng.integers(32, 65)), temperature=1.0, seed=i, ignore_eos=True)
        for i in range(len(group))
    ]
    return with_and_without_caching(name, config, group, settings, num_slots=num_slots, token_budget=token_budget)


def bench_scored_choices(name: str, config: ModelConfig, *, num_slots: int, token_budget: int) -> list[dict]:
    """lm-evaluation-harness's multiple-choice log-likelihoods through the engine: 16 contexts
    of 128-384 tokens, each followed by 4 choices of 4-24 tokens, every sequence scored whole
    (``max_tokens`` 0, ``prompt_logprobs``, one alternative: ``echo`` with ``logprobs`` 1),
    submitted at once, on engines with and without prefix caching."""
    rng = np.random.default_rng(2)
    contexts = [rng.integers(0, config.vocab_size, size=int(rng.integers(128, 385))).tolist() for _ in range(16)]
    choices = [
        c + rng.integers(0, config.vocab_size, size=int(rng.integers(4, 25))).tolist()
        for c in contexts
        for _ in range(4)
    ]
    settings = [SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=1)] * len(choices)
    return with_and_without_caching(name, config, choices, settings, num_slots=num_slots, token_budget=token_budget)


def with_and_without_caching(
    name: str, config: ModelConfig, prompts: list, settings: list, *, num_slots: int, token_budget: int
) -> list[dict]:
    """``prompts`` generated with ``settings`` on engines with and without prefix caching over
    one compiled program (prompts up to 512 tokens, outputs up to 64): seconds, tokens out and
    prompt tokens computed."""
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    program = build_program(config, params, num_slots=num_slots, token_budget=token_budget, max_context=576)
    if any(ask.prompt_logprobs or ask.top_logprobs for ask in settings):
        for bucket in program.token_buckets:  # compiled on first use: not in either engine's time
            program.scoring_steps[bucket]
    rows = []
    for caching in (True, False):
        engine = Engine(program.fresh_copy(), prefix_caching=caching)
        engine.generate(prompts[:1], settings[:1])  # warm: its pages are not in the other engine's cache
        engine = Engine(program.fresh_copy(), prefix_caching=caching)
        fed = count_fed_tokens(engine)
        start = time.perf_counter()
        results = engine.generate(prompts, settings)
        seconds = time.perf_counter() - start
        generated = sum(len(r.tokens) for r in results)
        rows.append(
            dict(
                model=name,
                prefix_caching=caching,
                seconds=seconds,
                output_tok_s=generated / seconds,
                prompt_tokens=sum(map(len, prompts)),
                tokens_fed=sum(fed),
                cached_tokens=engine.scheduler.pages.hit_tokens,
                num_slots=num_slots,
                token_budget=token_budget,
            )
        )
    return rows


def count_fed_tokens(engine: Engine) -> list[int]:
    """A list that gets the number of tokens of each step ``engine`` runs from now on."""
    fed, schedule = [], engine.scheduler.schedule

    def counted(*args):
        chunks = schedule(*args)
        fed.append(sum(len(chunk.tokens) for chunk in chunks))
        return chunks

    engine.scheduler.schedule = counted
    return fed


def decode_step_seconds(config: ModelConfig, params, rows: int, context: int) -> tuple[float, DeviceProgram]:
    """Median seconds of one serving decode step (and the program it ran): ``rows`` sequences,
    one new token each, every one ``context`` tokens into its pages (the engine's jitted
    ragged step, cache donated)."""
    program = build_program(config, params, num_slots=rows, token_buckets=(rows,), max_context=context)
    batch = batch_arrays(rows, rows, program.pages_per_seq)
    batch["tokens"][:] = np.random.default_rng(0).integers(0, config.vocab_size, size=rows)
    batch["query_starts"][:] = np.arange(rows)
    batch["query_lens"][:] = 1
    batch["kv_lens"][:] = context
    batch["page_table"][:] = np.arange(program.num_pages).reshape(rows, program.pages_per_seq)
    batch, settings = jax.device_put((batch, settings_array(rows)))
    step = program.steps[rows]

    def decode():  # threads the donated cache through repeated calls
        program.kv, tokens, _ = step(program.params, program.kv, batch, settings)
        return tokens

    return time_fn(decode, repeats=20), program


def decode_bandwidth(name: str, config: ModelConfig, *, rows: int, context: int, copy_bytes: int) -> dict:
    """One decode step of ``rows`` sequences at ``context`` tokens: bytes it must read
    (weights + every row's K/V) over its time, against the measured copy bandwidth."""
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    seconds, program = decode_step_seconds(config, params, rows, context)
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    kv_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(program.kv))  # every page holds live context
    source = jnp.ones((copy_bytes // 4,), jnp.float32)
    copy_seconds = time_fn(jax.jit(lambda x: x + 1.0), source, repeats=20)
    copy_bandwidth = 2 * source.nbytes / copy_seconds
    achieved = (weight_bytes + kv_bytes) / seconds
    return {
        "model": name,
        "rows": rows,
        "context": context,
        "step_ms": seconds * 1e3,
        "bytes_per_step": weight_bytes + kv_bytes,
        "achieved_gb_s": achieved / 1e9,
        "copy_gb_s": copy_bandwidth / 1e9,
        "fraction_of_copy": achieved / copy_bandwidth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="number of requests (default: 32 CPU, 128 GPU)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers generate")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (default: 64 CPU, 512 GPU)")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (default: 64 CPU, 32 GPU)")
    args = parser.parse_args()
    gpu = on_gpu()
    if gpu:
        cases = [("tiny", TINY, 64, args.token_budget or 512), ("~125M", M125, 64, args.token_budget or 512)]
        shape = dict(count=args.requests or 128, prompt_range=(16, 512), output_range=(16, 256), rate=args.rate or 32.0)
    else:
        print("no GPU found: tiny model only")
        cases = [("tiny", TINY, 8, args.token_budget or 64)]
        shape = dict(count=args.requests or 64, prompt_range=(16, 512), output_range=(16, 256), rate=args.rate or 64.0)
    rows = []
    for name, config, num_slots, token_budget in cases:
        workload = make_workload(0, vocab=config.vocab_size, **shape)
        rows += bench_model(
            name, config, workload, num_slots=num_slots, token_budget=token_budget, with_hf=not args.skip_hf
        )
    columns = ["model", "system", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms", "seconds"]
    print_table(rows, columns)
    for name in dict.fromkeys(row["model"] for row in rows):
        mine = {row["system"]: row for row in rows if row["model"] == name}
        continuous = mine["ember continuous"]["output_tok_s"]
        for other in ("ember static", "ember serve (HTTP, streamed)", "transformers generate (torch cpu)"):
            if other in mine:
                print(f"{name}: continuous / {other} throughput = {continuous / mine[other]['output_tok_s']:.2f}x")
    if gpu:
        bandwidth = [decode_bandwidth("~125M", M125, rows=64, context=1024, copy_bytes=2**30)]
    else:
        bandwidth = [decode_bandwidth("tiny", TINY, rows=8, context=256, copy_bytes=2**26)]
    print_table(bandwidth, ["model", "rows", "context", "step_ms", "achieved_gb_s", "copy_gb_s", "fraction_of_copy"])
    name, config, num_slots, token_budget = cases[-1]
    sharing = bench_prefix_sharing(name, config, num_slots=num_slots, token_budget=token_budget)
    print_table(sharing, ["model", "prefix_caching", "seconds", "output_tok_s", "tokens_fed", "cached_tokens"])
    speedup = sharing[1]["seconds"] / sharing[0]["seconds"]
    print(f"{name}: group sampling with / without prefix caching = {speedup:.2f}x")
    scored = bench_scored_choices(name, config, num_slots=num_slots, token_budget=token_budget)
    print_table(scored, ["model", "prefix_caching", "seconds", "prompt_tokens", "tokens_fed", "cached_tokens"])
    speedup = scored[1]["seconds"] / scored[0]["seconds"]
    print(f"{name}: scored choices (lm-evaluation-harness) with / without prefix caching = {speedup:.2f}x")
    results = {
        "workload": shape,
        "rows": rows,
        "decode_bandwidth": bandwidth,
        "prefix_sharing": sharing,
        "scored_choices": scored,
    }
    path = write_results("serving", results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
