"""On-device token sampling for a batch of requests with per-row settings.

Every row carries its own temperature, top-k, top-p, seed and sample index (the index of
the token being generated within its request). The random key of a row is
``fold_in(PRNGKey(seed), sample_index)``: a function of the request alone, so a seeded
request draws the same tokens whichever batch, slot or step it runs in.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ember.serving.requests import SamplingParams


def sample_tokens(logits: jax.Array, settings: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row.

    Args:
      logits: ``[rows, vocab]``.
      settings: ``temperature`` float32 ``[rows]`` (0 = greedy), ``top_k`` int32
        ``[rows]`` (0 = off), ``top_p`` float32 ``[rows]`` (1 = off), ``seed`` and
        ``sample_index`` int32 ``[rows]``.

    Returns:
      ``(tokens int32 [rows], logprobs float32 [rows])``: the drawn tokens and their
      log-probabilities under the unmodified model distribution ``log_softmax(logits)``.
    """
    logits = logits.astype(jnp.float32)
    temperature = settings["temperature"]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # A batch of greedy rows skips the sort over the vocabulary (a decision on device).
    tokens = jax.lax.cond(
        jnp.any(temperature > 0), lambda: jnp.where(temperature > 0, _draw(logits, settings), greedy), lambda: greedy
    )
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


def row_scores(log_probs: jax.Array, targets: jax.Array, top: int) -> dict[str, jax.Array]:
    """Each row's log-probability of its target token and its ``top`` most likely tokens.

    Args:
      log_probs: float32 ``[rows, vocab]``: ``log_softmax(logits)`` (the distribution
        ``sample_tokens`` gives log-probabilities of).
      targets: int32 ``[rows]``: the token each row is scored for (any id where none is).
      top: alternatives per row (at most the vocabulary).

    Returns:
      ``target_logprobs`` float32 ``[rows]``, ``top_tokens`` int32 ``[rows, top]`` and
      ``top_logprobs`` float32 ``[rows, top]``, most likely first.
    """
    top_logprobs, top_tokens = jax.lax.top_k(log_probs, top)
    return {
        "target_logprobs": jnp.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0],
        "top_tokens": top_tokens.astype(jnp.int32),
        "top_logprobs": top_logprobs,
    }


def _draw(logits: jax.Array, settings: dict[str, jax.Array]) -> jax.Array:
    """A random draw per row from ``logits [rows, vocab]`` at the row's temperature, within
    its top-k and top-p (meaningless for rows with temperature 0)."""
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.PRNGKey(seed), index))(
        settings["seed"], settings["sample_index"]
    )
    return jax.vmap(jax.random.categorical)(keys, candidate_logits(logits, settings)).astype(jnp.int32)


TOP_K_BY_SELECTION = 64
"""A batch whose filtering rows each keep at most this many tokens by top-k (top-p then applied
within them) finds them with ``lax.top_k`` rather than sorting its whole vocabulary: on CPU,
8 rows of a 32k vocabulary in 0.5 ms instead of 46 ms."""

TOP_P_BY_SELECTION = 256
"""A batch with rows filtering by top-p alone (or by a top-k of at most this) selects this many
tokens with ``lax.top_k`` and sorts its whole vocabulary only when, decided on device, some
row's nucleus may not end within them. On CPU at top_p 0.9 and temperature 1, 8 rows of a 32k
vocabulary whose nuclei hold 2-96 tokens in 2 ms instead of 50-60 ms (a whole draw 8-14 ms
instead of 60-70 ms), wider nuclei (800 tokens or more, or flat logits) sorted as before within
the noise (the selection is ~2 ms of 50-60); 64 rows x 384 in 1.6 ms instead of 3.0 ms, or
4.4 ms instead of 3.2 ms where a nucleus is wider. 1024 tokens took 5 ms for 8 x 32k and still
sorted for nuclei of 800-1800 tokens."""

WAYS = ("plain", "top_k", "top_p", "sort")
"""The ways ``candidate_logits`` may take, by their index on device: no filtering row; every
filtering row within a top-k of ``TOP_K_BY_SELECTION``; every one's top-k or nucleus within
the ``TOP_P_BY_SELECTION`` largest tokens; a sort of the vocabulary."""

NUCLEUS_MARGIN = 1e-4
"""How far past ``top_p`` the mass of the ``TOP_P_BY_SELECTION`` largest tokens of a row
filtering by top-p alone must reach, as a share of the row's total, for its nucleus to be known
to end within them: the sort cuts a token when the mass ranked above it, summed in float32 by
``_prefix_sums`` to within about 2 log2(vocab) roundings (a few 1e-6 of the total), reaches
top_p, and a token past the selection has at least the selection's mass above it."""


def candidate_logits(logits: jax.Array, settings: dict[str, jax.Array]) -> jax.Array:
    """``logits [rows, vocab]`` at each row's temperature, less the row's largest, every token
    outside the row's top-k and top-p at ``-inf``: what a sampled row draws from. Rows at
    temperature 0 are greedy (their draw is not used): kept whole, whatever top-k or top-p they
    carry, so that they never make their batch sort. The same whichever of ``WAYS`` the batch takes."""
    scaled, top_k, top_p, filtered = _scaled_and_filters(logits, settings)
    way, selection, total = _way(scaled, top_k, top_p, filtered)

    def within(ordered: jax.Array) -> jax.Array:
        return _within(scaled, ordered, total, top_k, top_p, filtered)

    return jax.lax.switch(
        way,
        [
            lambda: scaled,
            lambda: within(jax.lax.top_k(scaled, min(TOP_K_BY_SELECTION, scaled.shape[-1]))[0]),
            lambda: within(selection),
            lambda: within(-jnp.sort(-scaled, axis=-1)),
        ],
    )


def candidate_way(logits: jax.Array, settings: dict[str, jax.Array]) -> jax.Array:
    """The index in ``WAYS`` of the way ``candidate_logits`` takes for ``logits [rows, vocab]``
    and ``settings`` (int32, on device)."""
    return _way(*_scaled_and_filters(logits, settings))[0]


def _scaled_and_filters(
    logits: jax.Array, settings: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(scaled [rows, vocab], top_k [rows], top_p [rows], filtered [rows])``: the logits at
    each row's temperature less its largest (so each row's largest is 0), its top-k (the
    vocabulary where off), its top-p, and whether it filters by either."""
    vocab = logits.shape[-1]
    temperature = settings["temperature"]
    # Shifted by the row's largest logit first (the draw is the same): a tiny temperature then
    # sends the others to -inf, not every logit to +-inf (an overflow that drew token 0).
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    scaled = shifted / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    top_k = jnp.where(settings["top_k"] > 0, jnp.minimum(settings["top_k"], vocab), vocab)
    top_p = settings["top_p"]
    return scaled, top_k, top_p, ((top_k < vocab) | (top_p < 1)) & (temperature > 0)


def _way(
    scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, filtered: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The cheapest exact way for a batch, chosen on device (no filtering row skips every sort:
    a sort of 64 rows x 384 tokens was 3 of a 4.4 ms CPU decode step).

    Args: as ``_scaled_and_filters`` returns them.

    Returns:
      ``(way, selection, total)``: the index in ``WAYS`` (int32 ``[]``); each row's
      ``TOP_P_BY_SELECTION`` largest ``scaled`` in descending order (``[rows, n]``, zeros
      unless the way was in doubt between ``top_p`` and ``sort``); ``sum(exp(scaled))`` of each
      row (``[rows]``, zeros unless a row filters by top-p alone: its nucleus's normaliser).
    """
    rows, vocab = scaled.shape
    n = min(TOP_P_BY_SELECTION, vocab)
    index = {name: index for index, name in enumerate(WAYS)}
    nucleus_alone = filtered & (top_k == vocab)
    total = jax.lax.cond(
        jnp.any(nucleus_alone), lambda: jnp.sum(jnp.exp(scaled), axis=-1), lambda: jnp.zeros((rows,), scaled.dtype)
    )

    def top_p_or_sort() -> tuple[jax.Array, jax.Array]:
        selection = jax.lax.top_k(scaled, n)[0]
        mass = _prefix_sums(jnp.exp(selection))[:, -1]
        ends_within = (top_k <= n) | (nucleus_alone & (mass >= (top_p + NUCLEUS_MARGIN) * total))
        return jnp.where(jnp.all(~filtered | ends_within), index["top_p"], index["sort"]), selection

    def plain_or_top_k() -> tuple[jax.Array, jax.Array]:
        return jnp.where(jnp.any(filtered), index["top_k"], index["plain"]), jnp.zeros((rows, n), scaled.dtype)

    small_top_k = jnp.all(~filtered | (top_k <= TOP_K_BY_SELECTION))
    way, selection = jax.lax.cond(jnp.any(filtered) & ~small_top_k, top_p_or_sort, plain_or_top_k)
    return way, selection, total


def _prefix_sums(weights: jax.Array) -> jax.Array:
    """Running sums of ``weights [rows, n]`` along each row. ``associative_scan`` adds each
    prefix in the same order whatever ``n``, so a selection's sums are its sorted vocabulary's
    bit for bit on any backend (XLA's cumsum is a reduce-window it may rewrite by length); and
    it took 1.0 ms where cumsum took 3.1 for 8 rows x 32k on CPU."""
    return jax.lax.associative_scan(jnp.add, weights, axis=-1)


def _within(
    scaled: jax.Array,
    ordered: jax.Array,
    total: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    filtered: jax.Array,
) -> jax.Array:
    """``scaled [rows, vocab]`` with every token outside its row's ``top_k`` and ``top_p`` at
    ``-inf`` (rows not ``filtered`` kept whole), given ``ordered [rows, n]``: each row's ``n``
    largest ``scaled`` in descending order, ``n`` at least each filtering row's ``top_k`` and
    its nucleus; ``total [rows]``: ``sum(exp(scaled))`` of each row filtering by top-p alone."""
    n = ordered.shape[-1]
    weights = jnp.exp(ordered)  # at most 1: each row's largest is 0
    mass = _prefix_sums(weights)
    # The nucleus's normaliser is the mass of the row's top-k set: read from the same prefix
    # sums whatever n, or the row's total, so every way compares the same numbers.
    top_k_mass = jnp.take_along_axis(mass, jnp.minimum(top_k, n)[:, None] - 1, axis=-1)[:, 0]
    normaliser = jnp.where(top_k < scaled.shape[-1], top_k_mass, total)
    # Nucleus: keep a token while the mass of the tokens ranked above it is below top_p. At
    # top_p 1 every token stays: the float32 sums stop growing before the far tail does.
    mass_above = mass - weights
    in_top_k = jnp.arange(n)[None, :] < top_k[:, None]
    kept = in_top_k & ((mass_above < (top_p * normaliser)[:, None]) | (top_p[:, None] >= 1))
    num_kept = jnp.maximum(jnp.sum(kept, axis=-1), 1)
    threshold = jnp.take_along_axis(ordered, (num_kept - 1)[:, None], axis=-1)
    return jnp.where(scaled >= jnp.where(filtered[:, None], threshold, -jnp.inf), scaled, -jnp.inf)


def settings_array(rows: int) -> dict[str, np.ndarray]:
    """Host buffers for ``rows`` rows of settings (greedy defaults), filled per step."""
    return {
        "temperature": np.zeros((rows,), np.float32),
        "top_k": np.zeros((rows,), np.int32),
        "top_p": np.ones((rows,), np.float32),
        "seed": np.zeros((rows,), np.int32),
        "sample_index": np.zeros((rows,), np.int32),
    }


def fill_settings(settings: dict[str, np.ndarray], row: int, params: SamplingParams, sample_index: int) -> None:
    """Writes one request's ``params`` (its seed set: the engine gives a request without one its
    id) into row ``row`` of host ``settings``. A ``top_k``
    beyond int32 is stored as int32's largest value: any ``top_k`` >= the vocabulary keeps
    every token."""
    settings["temperature"][row] = params.temperature
    settings["top_k"][row] = min(params.top_k, np.iinfo(np.int32).max)
    settings["top_p"][row] = params.top_p
    settings["seed"][row] = params.seed
    settings["sample_index"][row] = sample_index


def settings_spec(rows: int) -> dict[str, Any]:
    """``jax.ShapeDtypeStruct``s of ``settings_array(rows)`` (for lowering and export)."""
    return {name: jax.ShapeDtypeStruct(array.shape, array.dtype) for name, array in settings_array(rows).items()}


__all__ = ["fill_settings", "row_scores", "sample_tokens", "settings_array", "settings_spec"]
