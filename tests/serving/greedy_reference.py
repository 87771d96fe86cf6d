"""The trusted peer of the engine tests: greedy decoding that recomputes the whole sequence
for every token (no cache, no batching tricks)."""

import jax
import jax.numpy as jnp
import numpy as np

from ember.models.decoder import DecoderLM


def greedy_reference(config, params, max_context):
    """``run(prompts, max_tokens) -> generated token lists``: all prompts in one batch
    padded to ``max_context`` (one compilation); a sequence stops at ``max_tokens`` or when
    its next token could not be fed back within ``max_context``."""
    model = DecoderLM(config)
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens)[0])

    def run(prompts, max_tokens):
        sequences = [list(p) for p in prompts]
        for _ in range(max(max_tokens)):
            padded = np.zeros((len(sequences), max_context), np.int32)
            for row, seq in enumerate(sequences):
                padded[row, : len(seq)] = seq[:max_context]
            logits = np.asarray(forward(jnp.asarray(padded)))
            for row, seq in enumerate(sequences):
                if len(seq) - len(prompts[row]) < max_tokens[row] and len(seq) <= max_context:
                    seq.append(int(np.argmax(logits[row, len(seq) - 1])))
        return [seq[len(p) :] for seq, p in zip(sequences, prompts)]

    return run


def log_prob_reference(config, params, max_context):
    """``run(sequences) -> [log_softmax [len(sequence), vocab] per sequence]``: each position's
    next-token distribution by a full forward pass (one batch padded to ``max_context``)."""
    model = DecoderLM(config)
    forward = jax.jit(
        lambda tokens: jax.nn.log_softmax(model.apply({"params": params}, tokens)[0].astype(jnp.float32), axis=-1)
    )

    def run(sequences):
        padded = np.zeros((len(sequences), max_context), np.int32)
        for row, seq in enumerate(sequences):
            padded[row, : len(seq)] = seq
        log_probs = np.asarray(forward(jnp.asarray(padded)))
        return [log_probs[row, : len(seq)] for row, seq in enumerate(sequences)]

    return run
