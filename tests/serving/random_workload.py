"""A random serving workload shared by the engine tests: prompts arriving mid-flight, each
step with a random token budget."""

from ember.serving.requests import SamplingParams


def random_prompts(generator, count, low=1, high=40):
    """``count`` byte-token prompts of random lengths in ``[low, high)``."""
    return [generator.integers(0, 256, size=int(generator.integers(low, high))).tolist() for _ in range(count)]


def run_random_arrivals(engine, generator, max_context, max_budget=13):
    """Serves 15 random prompts (the last ``max_context - 2`` tokens long, so it stops at the
    context) arriving at random steps, each step with a random budget in ``[1, max_budget]``;
    returns ``(prompts, max_tokens, results)``."""
    prompts = [*random_prompts(generator, 14), generator.integers(0, 256, size=max_context - 2).tolist()]
    max_tokens = [int(generator.integers(1, 14)) for _ in prompts]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    ids = [engine.add_request(p, s) for p, s in zip(prompts[:5], params[:5])]
    arriving = list(zip(prompts[5:], params[5:]))
    while engine.has_unfinished or arriving:
        if arriving and generator.random() < 0.4:
            ids.append(engine.add_request(*arriving.pop(0)))
        engine.step(token_budget=int(generator.integers(1, max_budget + 1)))
    return prompts, max_tokens, [engine.result(i) for i in ids]
