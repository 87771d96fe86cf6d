"""Ragged paged attention: the serving loop's mixed prefill + decode step in one call.

Several sequences each contribute a run of new query tokens to one flat token budget
``q [num_tokens, heads, head_dim]``: a prefill chunk (many tokens) or a decode step (one
token). Each new token attends causally to its sequence's cached prefix and to the new
tokens before it, all read through the page table of the paged KV cache:
``k_pages``/``v_pages`` ``[num_pages, page_size, kv_heads, head_dim]`` shared by all
sequences, sequence ``s`` owning the pages ``page_table[s, :cdiv(kv_lens[s], page_size)]``
in order, so its token ``t`` lives at ``k_pages[page_table[s, t // page_size], t % page_size]``.
A serving step of decodes only is the case of one query per sequence.

Every softmax-family attention layer of a model runs through it: full causal attention,
a sliding ``window``, a window plus ``global_tokens`` (Longformer-style local + global),
and sigmoid scores (``score="sigmoid"``, FlashSigmoid) with any of these.

The Pallas kernels: :mod:`ember.kernels_pallas.ragged_paged_attention_kernel` (GPU, Triton)
and :mod:`ember.kernels_pallas.ragged_paged_attention_tpu` (TPU, Mosaic TPU: pages gathered by
double-buffered DMAs from the cache in HBM).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ember.kernels_pallas.attention_math import check_sm_scale, check_soft_cap, check_window, reference_attention
from ember.kernels_pallas.dispatch import kernel_platform, pallas_interpret, resolve_impl
from ember.kernels_pallas.flash_attention import SCORES
from ember.kernels_pallas.int_options import check_non_negative_int, check_positive_int
from ember.kernels_pallas.ragged_paged_attention_kernel import (
    DEFAULT_BLOCK_Q,
    gpu_block_q,
    items_to_tokens,
    ragged_paged_attention_kernel,
    work_items,
)
from ember.kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu

# A GPU (Triton) kernel and a TPU (Mosaic TPU) kernel.
KERNEL_BACKENDS: tuple[str, ...] = ("gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class PagedCacheShape:
    """Validated sizes of a paged KV cache and its page table."""

    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    max_pages_per_seq: int

    @property
    def max_len(self) -> int:
        return self.max_pages_per_seq * self.page_size


def check_paged_cache(k_pages, v_pages, page_table, *, num_seqs: int, heads: int, head_dim: int) -> PagedCacheShape:
    """Checks the cache arrays against the query; raises ``ValueError`` naming the argument."""
    if getattr(k_pages, "ndim", None) != 4:
        raise ValueError(
            "k_pages must have rank 4 [num_pages, page_size, kv_heads, head_dim], "
            f"got shape {getattr(k_pages, 'shape', None)}"
        )
    if getattr(v_pages, "shape", None) != k_pages.shape:
        raise ValueError(
            f"v_pages must have the shape of k_pages {k_pages.shape}, got {getattr(v_pages, 'shape', None)}"
        )
    if not jnp.issubdtype(k_pages.dtype, jnp.floating) or not jnp.issubdtype(v_pages.dtype, jnp.floating):
        raise ValueError(
            f"k_pages and v_pages must be floating-point caches (no quantized KV cache here), "
            f"got {k_pages.dtype} and {v_pages.dtype}"
        )
    num_pages, page_size, kv_heads, page_head_dim = k_pages.shape
    if page_head_dim != head_dim:
        raise ValueError(f"k_pages head_dim {page_head_dim} != q head_dim {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"q heads ({heads}) must be divisible by k_pages kv_heads ({kv_heads}), which must be positive"
        )
    if head_dim == 0:
        raise ValueError(f"head_dim must be positive, got k_pages shape {k_pages.shape}")
    if getattr(page_table, "ndim", None) != 2 or page_table.shape[0] != num_seqs:
        raise ValueError(
            f"page_table must have shape [{num_seqs}, max_pages_per_seq], got {getattr(page_table, 'shape', None)}"
        )
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be an integer array, got dtype {page_table.dtype}")
    return PagedCacheShape(num_pages, page_size, kv_heads, head_dim, page_table.shape[1])


def check_lengths(name: str, lengths, num_seqs: int) -> None:
    if getattr(lengths, "shape", None) != (num_seqs,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an integer array of shape [{num_seqs}], got {getattr(lengths, 'shape', None)}"
        )


def gather_sequence_kv(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Each sequence's cache as one contiguous array:
    ``[num_seqs, max_pages_per_seq * page_size, kv_heads, head_dim]``."""
    per_page = pages[page_table]  # [num_seqs, max_pages_per_seq, page_size, kv_heads, head_dim]
    num_seqs, max_pages, page_size = per_page.shape[:3]
    return per_page.reshape(num_seqs, max_pages * page_size, *pages.shape[2:])


def token_owners(query_starts: jax.Array, query_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """For each token of the budget: ``(owner [num_tokens] int32, position [num_tokens]
    int32, covered [num_tokens] bool)`` — the sequence it belongs to, its position in that
    sequence, and whether any sequence owns it (uncovered tokens are padding)."""
    token = jnp.arange(num_tokens)[:, None]
    inside = (token >= query_starts[None, :]) & (token < (query_starts + query_lens)[None, :])
    covered = jnp.any(inside, axis=1)
    owner = jnp.argmax(inside, axis=1).astype(jnp.int32)
    offset = jnp.arange(num_tokens) - query_starts[owner]
    position = (kv_lens[owner] - query_lens[owner] + offset).astype(jnp.int32)
    return owner, position, covered


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    query_starts: jax.Array,
    query_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: tuple[int, int] | None = None,
    score: str = "softmax",
    sigmoid_bias: float | None = None,
    global_tokens: int = 0,
) -> jax.Array:
    """Plain-jnp :func:`ragged_paged_attention` (same arguments, minus the kernel options):
    gathers every token's sequence cache and attends densely in float32. Memory grows as
    ``num_tokens * max_pages_per_seq * page_size`` (the ``"xla"`` path gathers per block
    of queries instead). Returns ``[num_tokens, heads, head_dim]``
    in ``q.dtype``."""
    _, sm_scale, logits_soft_cap, window, sigmoid_bias = _check_call(
        q,
        k_pages,
        v_pages,
        page_table,
        query_starts,
        query_lens,
        kv_lens,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window=window,
        score=score,
        sigmoid_bias=sigmoid_bias,
        global_tokens=global_tokens,
    )
    owner, position, covered = token_owners(query_starts, query_lens, kv_lens, q.shape[0])
    keys = gather_sequence_kv(k_pages, page_table[owner])  # [T, max_len, kv_heads, d]
    values = gather_sequence_kv(v_pages, page_table[owner])
    out = _attend_rows(
        q[:, None],
        keys,
        values,
        position[:, None],
        covered[:, None],
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window=window,
        score=score,
        sigmoid_bias=sigmoid_bias,
        global_tokens=global_tokens,
    )
    return out[:, 0].astype(q.dtype)


def _attend_rows(
    q, keys, values, q_positions, rows_valid, *, sm_scale, logits_soft_cap, window, score, sigmoid_bias, global_tokens
):
    """The attention math, in float32, of ``n`` groups of ``r`` query rows that each see one
    sequence's cache: ``q [n, r, heads, d]``, ``keys``/``values [n, max_len, kv_heads, d]``
    (cache position ``t`` at index ``t``), ``q_positions``/``rows_valid [n, r]`` ->
    ``[n, r, heads, d]`` (zeros for rows that are not valid)."""
    max_len = keys.shape[1]
    kv_pos = jnp.arange(max_len)[None, None, :]
    position = q_positions[:, :, None]
    visible = (kv_pos <= position) & rows_valid[:, :, None]
    # Cache positions past every row's own (a reused page's unwritten tail, unused table
    # slots) may hold NaN, which would reach the output through p @ v even with p = 0.
    last = jnp.max(jnp.where(rows_valid, q_positions, -1), axis=1)[:, None, None, None]
    values = jnp.where(jnp.arange(max_len)[None, :, None, None] <= last, values, 0)
    if window is not None:
        visible = visible & ((kv_pos >= position - window[0]) | (kv_pos < global_tokens))
    return reference_attention(
        q,
        keys,
        values,
        visible,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        score=score,
        sigmoid_bias=sigmoid_bias,
    )


def _blocked_xla(q, k_pages, v_pages, page_table, query_starts, query_lens, kv_lens, *, block_q, **options):
    """The XLA path: the reference math over work items of up to ``block_q`` rows of one
    sequence (the kernel's work list), so each sequence's cache is gathered once per
    block of its queries rather than once per query token. Blocks shrink to the budget's
    mean run length (a budget of decodes gets blocks of one row): on CPU, unlike in the
    kernel, every padding row of a block costs as much as a real one."""
    num_tokens, num_seqs = q.shape[0], page_table.shape[0]
    block_q = max(1, min(block_q, num_tokens // num_seqs))
    if block_q == 1:  # blocks of one row are the tokens themselves: no padding blocks
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, page_table, query_starts, query_lens, kv_lens, **options
        )
    table, offsets = work_items(query_starts, query_lens, kv_lens, num_tokens=num_tokens, block_q=block_q)
    seq, token_start, rows, first_pos = (table[:, column] for column in range(4))
    row = jnp.arange(block_q)[None, :]
    q_rows = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))[token_start[:, None] + row]  # [items, block_q, heads, d]
    keys = gather_sequence_kv(k_pages, page_table[seq])  # [items, max_len, kv_heads, d]
    values = gather_sequence_kv(v_pages, page_table[seq])
    out_items = _attend_rows(q_rows, keys, values, first_pos[:, None] + row, row < rows[:, None], **options)
    owner, _, covered = token_owners(query_starts, query_lens, kv_lens, num_tokens)
    return items_to_tokens(out_items, offsets, query_starts, owner, covered).astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "logits_soft_cap",
        "window",
        "score",
        "sigmoid_bias",
        "global_tokens",
        "block_q",
        "pages_per_block",
        "kv_splits",
        "impl",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    query_starts: jax.Array,
    query_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    window: tuple[int, int] | None = None,
    score: str = "softmax",
    sigmoid_bias: float | None = None,
    global_tokens: int = 0,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    kv_splits: int | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Attention for a mixed batch of prefill chunks and decode tokens over a paged cache.

    Sequence ``s`` owns the query rows ``q[query_starts[s] : query_starts[s] +
    query_lens[s]]``: its ``query_lens[s]`` newest tokens, at positions
    ``kv_lens[s] - query_lens[s] .. kv_lens[s] - 1`` of the sequence. The new tokens' keys
    and values must already be written into the pages (the model layer writes them before
    calling), so ``kv_lens`` counts them. Row ``i`` of the run (position ``p``) sees cache
    positions ``t <= p`` (causal) with ``t >= p - window[0]`` or ``t < global_tokens`` if
    ``window`` is given.

    Args:
      q: ``[num_tokens, heads, head_dim]``, the step's token budget. Rows owned by no
        sequence are padding and return zeros.
      k_pages, v_pages: ``[num_pages, page_size, kv_heads, head_dim]``;
        ``heads % kv_heads == 0``.
      page_table: int32 ``[num_seqs, max_pages_per_seq]``; entry ``[s, i]`` is the page holding
        sequence ``s``'s tokens ``i*page_size .. (i+1)*page_size - 1``; entries past
        ``cdiv(kv_lens[s], page_size)`` are never read (any in-range value, e.g. 0).
      query_starts: int32 ``[num_seqs]``, first row of each sequence's run in ``q``.
        Runs must not overlap and must lie inside ``[0, num_tokens)``.
      query_lens: int32 ``[num_seqs]``, new tokens per sequence (1 for a decode, the chunk
        length for prefill, 0 for an unused slot); ``query_lens[s] <= kv_lens[s]``.
      kv_lens: int32 ``[num_seqs]``, total cached tokens of each sequence including the new
        ones; ``<= max_pages_per_seq * page_size``. The cache positions past it (the tail of
        the last page: a reused page's old keys and values) may hold anything, NaN included.
      sm_scale: multiplies ``q.k``; default ``1 / sqrt(head_dim)``.
      logits_soft_cap: if set, scaled logits become ``cap * tanh(logits / cap)``.
      window: ``(left, right)`` as in :func:`flash_attention`; the query at position ``p``
        sees keys ``p - left .. p`` (``right`` has no effect: attention here is causal).
      score: ``"softmax"`` or ``"sigmoid"`` (:data:`ember.kernels_pallas.flash_attention.SCORES`).
        Sigmoid attention (FlashSigmoid) weighs each visible key by
        ``sigmoid(logits + sigmoid_bias)`` (logits scaled and soft-capped) and does not
        normalize: the output is the weighted sum of values.
      sigmoid_bias: the bias ``b`` of ``score="sigmoid"``, required there and only there
        (a model passes its training-length ``-log(max_seq_len)``, see
        :func:`~ember.kernels_pallas.attention_math.default_sigmoid_bias`: the cache length
        changes every step, the bias must not).
      global_tokens: with ``window``, the first ``global_tokens`` positions of every
        sequence stay visible to all later queries (Longformer-style local + global); the
        kernel reads their pages and the window's, not the pages between. Without a window
        every earlier position is visible anyway.
      block_q: query positions per kernel step; a step serves them for every query head of
        one key head, ``block_q * heads // kv_heads`` rows (on a GPU the group is padded to
        a power of two and the rows should be at least 16; on a TPU they make one MXU tile,
        best a multiple of 8 for float32 and 16 for bfloat16); a run is split into
        ``cdiv(query_lens[s], block_q)`` blocks. None: 16, except that the GPU kernel
        shrinks it for batches of short runs, down to 16 rows for a decode step
        (:func:`~ember.kernels_pallas.ragged_paged_attention_kernel.gpu_block_q`).
      pages_per_block: pages read per kernel step (default: enough for 128 tokens); on a
        TPU the pages of one step are copied while the previous step computes.
      kv_splits: GPU kernel only (the XLA path and the TPU kernel ignore it): programs that
        share each work item's visible blocks of ``pages_per_block`` pages (flash-decoding),
        their partial results merged after the kernel; splits past a sequence's
        blocks read nothing. None: enough splits for about 4 programs per SM of a 132-SM
        GPU, at most the blocks a sequence can have, 1 when the work items alone are that
        many (:func:`~ember.kernels_pallas.ragged_paged_attention_kernel.gpu_kv_splits`).
      impl: ``"auto"`` (the Pallas kernel on GPU and TPU, else XLA), ``"pallas"`` (the
        kernel compiled for the default backend: Triton on an NVIDIA GPU, Mosaic TPU on a
        TPU), ``"interpret"`` (the GPU kernel in the Pallas interpreter, any backend),
        ``"interpret_tpu"`` (the TPU kernel in JAX's TPU interpret mode, any backend) or
        ``"xla"`` (the reference's math over the kernel's blocks of ``block_q`` queries).
        The TPU kernel takes float32 or bfloat16 caches and casts ``q`` to the cache's dtype.

    The metadata is data, not static: one compiled step serves every mix of sequences.
    Its consistency (no overlapping runs, lengths in range) is the caller's contract and is
    not checked on device.

    Jitted; the keyword options are static, the page table and metadata arrays are data.

    Returns:
      ``[num_tokens, heads, head_dim]`` in ``q.dtype``.

    Raises:
      ValueError: naming the argument, for bad ranks, shapes or dtypes (``q`` and the caches
        must be floating point, the page table and metadata integer), or bad options
        (an unknown ``score``, ``sigmoid_bias`` missing with ``"sigmoid"`` or given with
        ``"softmax"``, a negative ``global_tokens``, a ``block_q``, ``pages_per_block`` or
        ``kv_splits`` that is not a positive int or None, on every path); for the TPU kernel, caches that are
        not both float32 or both bfloat16.
    """
    cache, sm_scale, logits_soft_cap, window, sigmoid_bias = _check_call(
        q,
        k_pages,
        v_pages,
        page_table,
        query_starts,
        query_lens,
        kv_lens,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window=window,
        score=score,
        sigmoid_bias=sigmoid_bias,
        global_tokens=global_tokens,
    )
    num_tokens = q.shape[0]
    check_positive_int("block_q", block_q, none_means="chosen per backend")
    check_positive_int("kv_splits", kv_splits, none_means="chosen by the GPU kernel")
    check_positive_int("pages_per_block", pages_per_block, none_means="enough for 128 tokens")
    resolved = resolve_impl(impl, op="ragged_paged_attention", kernel_backends=KERNEL_BACKENDS)
    platform = kernel_platform(resolved)
    if block_q is None and platform == "gpu":
        block_q = gpu_block_q(num_tokens, query_lens.shape[0], q.shape[1], cache.kv_heads)
    elif block_q is None:
        block_q = DEFAULT_BLOCK_Q
    if platform is None:
        return _blocked_xla(
            q,
            k_pages,
            v_pages,
            page_table,
            query_starts.astype(jnp.int32),
            query_lens.astype(jnp.int32),
            kv_lens.astype(jnp.int32),
            block_q=block_q,
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            window=window,
            score=score,
            sigmoid_bias=sigmoid_bias,
            global_tokens=global_tokens,
        )
    owner, _, covered = token_owners(query_starts, query_lens, kv_lens, num_tokens)
    if platform == "tpu":
        kernel = ragged_paged_attention_tpu
    else:
        kernel = functools.partial(ragged_paged_attention_kernel, kv_splits=kv_splits)
    return kernel(
        q,
        k_pages,
        v_pages,
        page_table,
        query_starts,
        query_lens,
        kv_lens,
        owner=owner,
        covered=covered,
        cache=cache,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window=window,
        score=score,
        sigmoid_bias=sigmoid_bias,
        global_tokens=int(global_tokens),
        block_q=block_q,
        pages_per_block=pages_per_block,
        interpret=pallas_interpret(resolved),
    )


def check_score(score, sigmoid_bias) -> float | None:
    """Validates ``score`` (one of ``SCORES``) and its ``sigmoid_bias`` (a finite number
    with ``"sigmoid"``, ``None`` with ``"softmax"``); returns the bias as a float or None."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if score == "softmax":
        if sigmoid_bias is not None:
            raise ValueError(f"sigmoid_bias is only for score='sigmoid', got {sigmoid_bias!r} with score='softmax'")
        return None
    if (
        not isinstance(sigmoid_bias, (int, float, np.integer, np.floating))
        or isinstance(sigmoid_bias, bool)
        or not math.isfinite(sigmoid_bias)
    ):
        raise ValueError(
            f"sigmoid_bias must be a finite number with score='sigmoid' (e.g. -log(max_seq_len)), got {sigmoid_bias!r}"
        )
    return float(sigmoid_bias)


def _check_call(
    q,
    k_pages,
    v_pages,
    page_table,
    query_starts,
    query_lens,
    kv_lens,
    *,
    sm_scale,
    logits_soft_cap,
    window,
    score,
    sigmoid_bias,
    global_tokens,
):
    """Validates the arguments the op and its reference share; returns ``(cache shape,
    sm_scale, logits_soft_cap, window, sigmoid_bias)`` in their checked forms (``sm_scale``
    with its default)."""
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must have rank 3 [num_tokens, heads, head_dim], got shape {getattr(q, 'shape', None)}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a floating-point array, got dtype {q.dtype}")
    if getattr(page_table, "ndim", None) != 2:
        raise ValueError(
            f"page_table must have rank 2 [num_seqs, max_pages_per_seq], got shape {getattr(page_table, 'shape', None)}"
        )
    num_seqs = page_table.shape[0]
    check_lengths("query_starts", query_starts, num_seqs)
    check_lengths("query_lens", query_lens, num_seqs)
    check_lengths("kv_lens", kv_lens, num_seqs)
    _, heads, head_dim = q.shape
    cache = check_paged_cache(k_pages, v_pages, page_table, num_seqs=num_seqs, heads=heads, head_dim=head_dim)
    check_non_negative_int("global_tokens", global_tokens)
    checked = (check_soft_cap(logits_soft_cap), check_window(window), check_score(score, sigmoid_bias))
    return cache, check_sm_scale(sm_scale, head_dim), *checked
