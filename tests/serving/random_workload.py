"""A random serving workload shared by the engine tests: prompts arriving mid-flight, each
step with a random token budget; and the check that two engines serve it alike."""

import numpy as np

from ember.serving.requests import SamplingParams
from tests.tolerances import assert_allclose


def random_prompts(generator, count, low=1, high=40):
    """``count`` byte-token prompts of random lengths in ``[low, high)``."""
    return [generator.integers(0, 256, size=int(generator.integers(low, high))).tolist() for _ in range(count)]


def run_random_arrivals(engine, generator, max_context, max_budget=13, *, sampled=False):
    """Serves 15 random prompts (the last ``max_context - 2`` tokens long, so it stops at the
    context) arriving at random steps, each step with a random budget in ``[1, max_budget]``;
    returns ``(prompts, max_tokens, results)``. ``sampled``: every other request samples (a
    random seed, temperature, top-k and top-p) instead of decoding greedily, and every
    request returns its log-probabilities."""
    prompts = [*random_prompts(generator, 14), generator.integers(0, 256, size=max_context - 2).tolist()]
    max_tokens = [int(generator.integers(1, 14)) for _ in prompts]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    if sampled:
        sampling = dict(temperature=0.9, top_k=50, top_p=0.9)
        params = [
            SamplingParams(max_tokens=m, ignore_eos=True, logprobs=True, **(dict(sampling, seed=seed) if i % 2 else {}))
            for i, (m, seed) in enumerate(zip(max_tokens, generator.integers(0, 2**31 - 1, size=len(max_tokens))))
        ]
    ids = [engine.add_request(p, s) for p, s in zip(prompts[:5], params[:5])]
    arriving = list(zip(prompts[5:], params[5:]))
    while engine.has_unfinished or arriving:
        if arriving and generator.random() < 0.4:
            ids.append(engine.add_request(*arriving.pop(0)))
        engine.step(token_budget=int(generator.integers(1, max_budget + 1)))
    return prompts, max_tokens, [engine.result(i) for i in ids]


def assert_serves_alike(engine, other, seed, max_context, max_budget):
    """The same random arrivals (:func:`run_random_arrivals` with ``sampled``, from a generator
    seeded ``seed``) on both engines give the same tokens and log-probabilities."""
    runs = [
        run_random_arrivals(e, np.random.default_rng(seed), max_context, max_budget, sampled=True)
        for e in (engine, other)
    ]
    (prompts, _, results), (_, _, expected) = runs
    for index, (result, want) in enumerate(zip(results, expected)):
        assert result.tokens == want.tokens, f"prompt {index} (length {len(prompts[index])})"
        assert_allclose(result.logprobs, want.logprobs, dtype=np.float32, err_msg=f"prompt {index}")
