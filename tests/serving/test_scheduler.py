"""The host-side scheduler and page allocator on hand-worked schedules (no device)."""

import jax
import numpy as np
import pytest

from ember.serving.pages import PageAllocator
from ember.serving.requests import Request, SamplingParams
from ember.serving.scheduler import Scheduler, SchedulerConfig


def make_scheduler(**overrides):
    fields = dict(num_slots=3, token_budget=6, chunk_size=4, page_size=2, num_pages=16, max_context=16, eos_ids=(99,))
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def request(request_id, prompt_len, **params):
    return Request(request_id, list(range(10, 10 + prompt_len)), SamplingParams(**params))


def layout(chunks):
    return [(chunk.request.request_id, chunk.start, len(chunk.tokens)) for chunk in chunks]


def commit_all(scheduler, chunks, token=7):
    return scheduler.commit(chunks, [token] * len(chunks), [-0.5] * len(chunks))


def test_page_allocator_free_list_accounting():
    allocator = PageAllocator(5)
    first = allocator.allocate(3)
    assert first == [0, 1, 2] and allocator.num_free == 2
    with pytest.raises(MemoryError):
        allocator.allocate(3)
    assert allocator.num_free == 2  # a failed allocation takes nothing
    allocator.free([1])
    assert allocator.allocate(1) == [1]  # freed pages are reused first
    with pytest.raises(ValueError, match="twice"):
        allocator.free([4])
    with pytest.raises(ValueError, match="not in"):
        allocator.free([9])
    allocator.free([0, 1, 2])
    assert allocator.num_free == 5


def test_stall_free_order_decodes_then_continuing_prefill_then_new():
    scheduler = make_scheduler()
    a, b = request(0, 5, max_tokens=3), request(1, 3, max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    # Budget 6, rows of at most 4: A's first chunk, then B's first 2 tokens.
    assert layout(step) == [(0, 0, 4), (1, 0, 2)]
    assert a.pages == [0, 1] and b.pages == [2]
    assert commit_all(scheduler, step) == []  # neither chunk reached a sequence's end
    step = scheduler.schedule()
    assert layout(step) == [(0, 4, 1), (1, 2, 1)]
    assert a.pages == [0, 1, 3] and b.pages == [2, 4]
    events = commit_all(scheduler, step, token=21)
    assert [(e.request_id, e.token) for e in events] == [(0, 21), (1, 21)]
    c, d = request(2, 9, max_tokens=1), request(3, 2)
    scheduler.add(c)
    scheduler.add(d)
    step = scheduler.schedule()
    # Decodes of A and B first (1 token each), then C's first chunk; D finds no slot free.
    assert layout(step) == [(0, 5, 1), (1, 3, 1), (2, 0, 4)]
    commit_all(scheduler, step, token=22)
    step = scheduler.schedule()
    # A and B decode their third token, then C's prefill continues.
    assert layout(step) == [(0, 6, 1), (1, 4, 1), (2, 4, 4)]
    events = commit_all(scheduler, step, token=23)
    assert [(e.request_id, e.finish_reason) for e in events] == [(0, "length"), (1, "length")]
    assert a.output == [21, 22, 23] and a.slot is None and a.pages == []
    step = scheduler.schedule()
    # C's last prompt token, then D is admitted into a freed slot.
    assert layout(step) == [(2, 8, 1), (3, 0, 2)]
    events = commit_all(scheduler, step, token=24)
    assert [(e.request_id, e.token, e.finish_reason) for e in events] == [(2, 24, "length"), (3, 24, None)]
    while scheduler.has_unfinished:
        commit_all(scheduler, scheduler.schedule())
    assert scheduler.pages.num_free == 16


def test_finish_on_eos_stop_sequence_and_context():
    scheduler = make_scheduler(num_slots=4, token_budget=16, max_context=6, num_pages=16)
    eos = request(0, 2, max_tokens=10)
    stop = Request(1, [1, 2], SamplingParams(max_tokens=10), stop_sequences=((5, 6),))
    ignore = request(2, 2, max_tokens=3, ignore_eos=True)
    context = request(3, 4, max_tokens=10)
    for r in (eos, stop, ignore, context):
        scheduler.add(r)
    scheduler.commit(scheduler.schedule(), [4, 5, 99, 3], [-1.0] * 4)
    scheduler.commit(scheduler.schedule(), [99, 6, 99, 3], [-2.0] * 4)
    assert (eos.output, eos.finish_reason) == ([4], "stop")  # EOS ends without being output
    assert (stop.output, stop.finish_reason) == ([], "stop")  # the stop sequence is trimmed
    assert ignore.output == [99, 99] and not ignore.finished
    # Context 6: prompt 4 + 2 generated = 6 tokens; one more could not be fed back.
    assert context.output == [3, 3] and not context.finished
    scheduler.commit(scheduler.schedule(), [99, 3], [-1.0, -1.0])
    assert ignore.finish_reason == "length" and ignore.output == [99, 99, 99]
    assert context.finish_reason == "length" and context.output == [3, 3, 3]
    assert stop.logprobs == [] and ignore.logprobs == [-1.0, -2.0, -1.0]
    assert scheduler.pages.num_free == 16 and not scheduler.has_unfinished


def test_any_of_several_eos_ids_ends_a_request_and_is_recorded():
    scheduler = make_scheduler(eos_ids=(99, 98))
    first, second, third = request(0, 2), request(1, 2), request(2, 2, ignore_eos=True)
    for r in (first, second, third):
        scheduler.add(r)
    events = scheduler.commit(scheduler.schedule(), [98, 99, 98], [-1.0] * 3)
    assert [(e.request_id, e.token, e.finish_reason) for e in events] == [
        (0, None, "stop"),
        (1, None, "stop"),
        (2, 98, None),
    ]
    assert (first.output, first.eos_token) == ([], 98) and (second.output, second.eos_token) == ([], 99)
    assert third.output == [98] and third.eos_token is None


def test_abort_drops_a_waiting_request_and_frees_a_running_ones_pages_and_slot():
    scheduler = make_scheduler(num_slots=1)
    running, waiting = request(0, 5, max_tokens=3), request(1, 3, max_tokens=2)
    scheduler.add(running)
    scheduler.add(waiting)
    commit_all(scheduler, scheduler.schedule())  # the first chunk of the running one; no slot for the other
    assert running.pages == [0, 1] and running.slot == 0 and scheduler.waiting == [waiting]
    scheduler.abort(waiting)
    scheduler.abort(running)
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert running.pages == [] and running.slot is None
    assert not scheduler.has_unfinished and scheduler.pages.num_free == 16
    # The freed slot and pages serve the next request; aborting a finished one changes nothing.
    after = request(2, 2, max_tokens=1)
    scheduler.add(after)
    step = scheduler.schedule()
    assert layout(step) == [(2, 0, 2)] and after.slot == 0
    commit_all(scheduler, step)
    scheduler.abort(after)
    assert after.finish_reason == "length" and scheduler.pages.num_free == 16


def test_preemption_by_recompute_under_a_tiny_pool():
    # 4 pages of 2 tokens = one full sequence of max_context 8; two requests must share.
    scheduler = make_scheduler(num_slots=2, token_budget=8, chunk_size=4, num_pages=4, max_context=8)
    a, b = request(0, 4, max_tokens=4), request(1, 4, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    assert layout(step) == [(0, 0, 4), (1, 0, 4)]
    commit_all(scheduler, step, token=1)  # both at 5 tokens, 2 pages each, pool empty
    step = scheduler.schedule()
    # A's decode (position 4) needs a third page: B (admitted last, not yet scheduled) is preempted.
    assert layout(step) == [(0, 4, 1)]
    assert b.num_computed == 0 and b.pages == [] and b.slot is None and b.output == [1]
    assert scheduler.waiting == [b] and scheduler.num_preemptions == 1
    commit_all(scheduler, step, token=2)
    step = scheduler.schedule()
    # A decodes; B is readmitted to recompute prompt + its generated token, as far as pages allow.
    assert layout(step) == [(0, 5, 1), (1, 0, 2)]
    assert step[1].tokens == [10, 11]
    while scheduler.has_unfinished:
        commit_all(scheduler, scheduler.schedule(), token=3)
    assert a.output == [1, 2, 3, 3] and b.output[:1] == [1] and len(b.output) == 4
    assert scheduler.pages.num_free == 4


def test_the_cache_evicts_a_finished_sequences_last_page_before_its_first():
    """A page's key chains its parents': evicting a sequence's first page would leave the rest
    unreachable. A 5-token prompt leaves two cached pages; a request needing one of them evicts
    the second, and the prompt sent again starts after the first."""
    scheduler = make_scheduler(num_pages=4, max_context=8, prefix_caching=True)

    def run(r):
        scheduler.add(r)
        while scheduler.has_unfinished:
            commit_all(scheduler, scheduler.schedule())

    run(request(0, 5, max_tokens=1))
    assert scheduler.pages.num_free == 4 and scheduler.pages.hit_tokens == 0
    run(Request(1, [90, 91, 92, 93, 94], SamplingParams(max_tokens=1)))  # 3 pages: 2 free, 1 evicted
    run(request(2, 5, max_tokens=1))
    assert scheduler.pages.hit_tokens == 2


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_workloads_keep_page_accounting(rng, prefix_caching):
    """Random budgets, chunks, page sizes and arrivals: every chunk continues its sequence in
    pages it holds, the pages held are those not free, every request finishes and every page
    comes back. With prefix caching (every prompt here begins as every other: ``10, 11, ...``)
    pages are shared, but a chunk writes only into pages no other request holds."""
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    shared_tokens = 0
    for trial in range(20):
        config = dict(
            num_slots=int(generator.integers(1, 5)),
            token_budget=int(generator.integers(1, 12)),
            chunk_size=int(generator.integers(1, 6)),
            page_size=int(generator.integers(1, 4)),
            max_context=24,
            prefix_caching=prefix_caching,
        )
        config["num_pages"] = -(-24 // config["page_size"]) + int(generator.integers(0, 6))
        scheduler = make_scheduler(**config)
        requests = [
            request(i, int(generator.integers(1, 16)), max_tokens=int(generator.integers(1, 10))) for i in range(8)
        ]
        for r in requests[:4]:
            scheduler.add(r)
        pending = requests[4:]
        for _ in range(2000):
            if not scheduler.has_unfinished and not pending:
                break
            if pending and generator.random() < 0.3:
                scheduler.add(pending.pop(0))
            chunks = scheduler.schedule()
            for chunk in chunks:
                r = chunk.request
                # The chunk continues the sequence and its pages hold it.
                assert chunk.tokens == r.tokens[chunk.start : chunk.start + len(chunk.tokens)]
                assert len(r.pages) * config["page_size"] >= chunk.start + len(chunk.tokens)
            assert sum(len(c.tokens) for c in chunks) <= config["token_budget"]
            held = [p for r in scheduler.running for p in r.pages]
            assert len(set(held)) == config["num_pages"] - scheduler.pages.num_free
            for chunk in chunks:
                size, end = config["page_size"], chunk.start + len(chunk.tokens)
                written = chunk.request.pages[chunk.start // size : -(-end // size)]
                assert all(held.count(page) == 1 for page in written), "a chunk writes into a shared page"
            if not prefix_caching:
                assert len(held) == len(set(held))
            commit_all(scheduler, chunks, token=int(generator.integers(0, 50)))
        assert not scheduler.has_unfinished and not pending, f"trial {trial} did not finish"
        assert scheduler.pages.num_free == config["num_pages"]
        shared_tokens += scheduler.pages.hit_tokens
        for r in requests:
            assert r.finished and len(r.output) == min(r.params.max_tokens, 24 + 1 - len(r.prompt))
    assert (shared_tokens > 0) == prefix_caching


def test_shared_pages_hold_what_each_reader_would_compute_through_aborts_preemptions_and_new_weights(rng):
    """Prefix caching against a shadow of the cache's contents: each position a chunk writes is
    recorded with the sequence up to it, the request's adapter and whether it was computed under
    the current weights alone (``forget`` is ``update_params``'s). Random arrivals of prompts that
    begin alike (some on an adapter, some scored with ``max_tokens`` 0), random aborts of waiting
    and running requests, preemptions and weight changes: every position a chunk reads holds its
    own sequence on its adapter; a request starting after cached pages reads only pages of the
    current weights; no chunk writes a page another request holds; nobody waits for ever on a
    page whose computing request went away; every page comes back."""
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    for trial in range(30):
        size = int(generator.integers(1, 5))
        scheduler = make_scheduler(
            num_slots=int(generator.integers(1, 5)),
            token_budget=int(generator.integers(1, 12)),
            chunk_size=int(generator.integers(1, 8)),
            page_size=size,
            num_pages=-(-24 // size) + int(generator.integers(0, 4)),
            max_context=24,
            prefix_caching=True,
        )
        beginning = generator.integers(0, 4, 24).tolist()  # 4 token values: tails collide often too
        pending = []
        for i in range(12):
            length = int(generator.integers(1, 16))
            prompt = beginning[:length] if generator.random() < 0.7 else generator.integers(0, 4, length).tolist()
            if generator.random() < 0.15:
                params = SamplingParams(max_tokens=0, prompt_logprobs=True)
            else:
                adapter = "a" if generator.random() < 0.3 else None
                params = SamplingParams(max_tokens=int(generator.integers(1, 8)), adapter=adapter, ignore_eos=True)
            pending.append(Request(i, prompt, params))
        weights = 0  # the weights' version: forget() moves it on
        shadow = {}  # (page, position in page) -> (adapter, weights version or None when mixed, sequence)
        for iteration in range(3000):
            if not scheduler.has_unfinished and not pending:
                break
            if pending and generator.random() < 0.4:
                scheduler.add(pending.pop(0))
            draw = generator.random() if iteration < 100 else 1.0  # then it drains by itself
            if draw < 0.03 and scheduler.running:
                scheduler.abort(scheduler.running[int(generator.integers(len(scheduler.running)))])
            elif draw < 0.05 and scheduler.waiting:
                scheduler.abort(scheduler.waiting[int(generator.integers(len(scheduler.waiting)))])
            elif draw < 0.1 and trial % 2:  # (forget() also ends every wait: half the trials go without)
                scheduler.pages.forget()
                weights += 1
            elif draw < 0.12 and scheduler.running:
                scheduler.preempt(scheduler.running[int(generator.integers(len(scheduler.running)))])
            running_before = {id(r) for r in scheduler.running}
            chunks = scheduler.schedule()
            held = [page for r in scheduler.running for page in r.pages]
            assert len(set(held)) == scheduler.config.num_pages - scheduler.pages.num_free
            for chunk in chunks:
                r = chunk.request
                read = [shadow.get((r.pages[p // size], p % size)) for p in range(chunk.start)]
                assert [(a, s) for a, _, s in read] == [
                    (r.params.adapter, tuple(r.tokens[: p + 1])) for p in range(chunk.start)
                ], f"trial {trial}: request {r.request_id} reads another sequence's keys and values"
                if id(r) not in running_before:  # just admitted: what it reads comes from the cache
                    assert all(v == weights for _, v, _ in read), f"trial {trial}: a page of old weights shared"
                for p in range(chunk.start, chunk.start + len(chunk.tokens)):
                    page = r.pages[p // size]
                    assert held.count(page) == 1, f"trial {trial}: a chunk writes into a shared page"
                    before = [shadow[(r.pages[q // size], q % size)][1] for q in range(p)]
                    version = weights if all(v == weights for v in before) else None
                    shadow[(page, p % size)] = (r.params.adapter, version, tuple(r.tokens[: p + 1]))
            commit_all(scheduler, chunks, token=int(generator.integers(0, 4)))
        assert not scheduler.has_unfinished and not pending, f"trial {trial} did not finish"
        assert scheduler.pages.num_free == scheduler.config.num_pages
