"""Flash attention: the public op, its plain-jnp reference, and the dispatcher.

    out = flash_attention(q, k, v, causal=True)                     # [batch, q_len, heads, head_dim]
    out = flash_attention(q, k, v, block_mask=LocalGlobalMask(256, 256, 64))
    out = flash_attention(q, k, v, causal=True, block_mask=LocalGlobalMask(255, 0, 64),   # packed rows:
                          segment_ids=segment_ids, segment_positions=positions)          # 64 per document
    out = flash_attention(q, k, v, score="sigmoid")                 # FlashSigmoid

The Pallas kernels (forward saving the log-sum-exp, backward dq and dk/dv, tied by
``custom_vjp``) live in :mod:`ember.kernels_pallas.flash_attention_kernels` (GPU, Triton) and
:mod:`ember.kernels_pallas.flash_attention_tpu` (TPU, Mosaic TPU); this file holds the public
op and what every path shares: argument checking, the combined static mask, the reference,
and the chunked XLA path built on the reference's math.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ember.kernels_pallas.attention_math import (
    check_sm_scale,
    check_soft_cap,
    check_window,
    default_sigmoid_bias,
    reference_attention,
)
from ember.kernels_pallas.block_mask import (
    BlockMask,
    CausalMask,
    ExplicitBlockMask,
    LocalMask,
    combine_masks,
)
from ember.kernels_pallas.dispatch import (
    kernel_platform,
    pallas_interpret,
    refuse_gpu_kernel_choice_off_gpu,
    resolve_impl,
)
from ember.kernels_pallas.flash_attention_kernels import flash_attention_kernel
from ember.kernels_pallas.flash_attention_tpu import flash_attention_tpu
from ember.kernels_pallas.int_options import check_num_warps, check_positive_int, check_power_of_two
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple

SCORES: tuple[str, ...] = ("softmax", "sigmoid")
# A GPU (Triton) kernel and a TPU (Mosaic TPU) kernel.
KERNEL_BACKENDS: tuple[str, ...] = ("gpu", "tpu")
# Queries per piece of the XLA path: bounds its scores to [batch, heads, 512, kv_len].
XLA_QUERY_CHUNK = 512
# The Triton backward kernels' key tile by default (see FlashBlockSizes).
BACKWARD_BLOCK_KV = 64


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Kernel tile sizes: ``block_q`` query rows and ``block_kv`` key rows per step (the same
    tiles in the forward and, except on a GPU, the backward kernels). Powers of two, at least
    8 (GPU tiles want 16+; 8 keeps CPU interpret tests cheap). Sequences shorter than a block
    get a block of the next power of two above their length instead. The TPU kernel then
    raises each to at least 128 (the lane width).

    On a GPU, ``num_warps`` per program (default: 8, or 4 for tiles of fewer than 64 x 64
    pairs: ``flash_attention_kernels.default_num_warps``) and Triton's software-pipelining
    depth ``num_stages``; both ignored elsewhere.

    The GPU's Triton backward kernels keep ``block_q`` but take keys ``backward_block_kv`` at
    a time (None: :data:`BACKWARD_BLOCK_KV`; never more than ``block_kv``) with
    ``backward_num_warps`` (None: ``num_warps``): the dq kernel streams key blocks past its
    queries, the dk/dv kernel keeps a key block's f32 dk and dv while query blocks stream
    past. Compiled for sm_90 at 128 x 128 tiles they spilled registers (dk/dv 0.8 KB at
    head_dim 128 and 1.5 KB at 64, dq 0.4 KB at 64); at 128 x 64 with 8 warps neither
    spills (``python -m benchmarks.triton_compile``)."""

    block_q: int = 128
    block_kv: int = 128
    num_warps: int | None = None
    num_stages: int = 2
    backward_block_kv: int | None = None
    backward_num_warps: int | None = None

    def __post_init__(self):
        check_power_of_two("block_q", self.block_q, 8)
        check_power_of_two("block_kv", self.block_kv, 8)
        if self.backward_block_kv is not None:
            check_power_of_two("backward_block_kv", self.backward_block_kv, 8)
        check_num_warps("num_warps", self.num_warps, none_means="chosen by tile size")
        check_num_warps("backward_num_warps", self.backward_num_warps, none_means="the forward's num_warps")
        check_positive_int("num_stages", self.num_stages)

    def fitted(self, q_len: int, kv_len: int) -> FlashBlockSizes:
        """These sizes shrunk to the next power of two of short sequences (min 8)."""

        def fit(block: int, length: int) -> int:
            return min(block, max(8, 1 << max(0, length - 1).bit_length()))

        return dataclasses.replace(self, block_q=fit(self.block_q, q_len), block_kv=fit(self.block_kv, kv_len))

    def backward_tiles(self) -> tuple[int, int | None]:
        """``(block_kv, num_warps)`` of the Triton backward kernels (their ``block_q`` is
        ``block_q``; warps None: chosen by tile)."""
        block_kv = min(self.block_kv, self.backward_block_kv or BACKWARD_BLOCK_KV)
        return block_kv, self.backward_num_warps or self.num_warps


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """Validated static description of one flash-attention call (hashable)."""

    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    sm_scale: float
    mask: BlockMask | None
    has_segments: bool
    has_segment_positions: bool
    logits_soft_cap: float | None
    score: str
    sigmoid_bias: float

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _check_rank(name: str, x: Any, rank: int, layout: str) -> None:
    if getattr(x, "ndim", None) != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {getattr(x, 'shape', None)}")


def normalize_segment_ids(segment_ids: Any, batch: int, q_len: int, kv_len: int, name: str = "segment_ids"):
    """``(q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len])`` int32, or ``None``
    (also for ``segment_positions``, named by ``name`` in errors)."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"{name} must be one array or a pair (q_{name}, kv_{name})")
        q_seg, kv_seg = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(
                f"{name} as one array needs q_len == kv_len (got {q_len}, {kv_len}); pass (q_{name}, kv_{name})"
            )
        q_seg = kv_seg = segment_ids
    for side, seg, length in (("q", q_seg, q_len), ("kv", kv_seg, kv_len)):
        if getattr(seg, "shape", None) != (batch, length):
            raise ValueError(
                f"{side} {name} must have shape [batch, len] = {(batch, length)}, got {getattr(seg, 'shape', None)}"
            )
        if not jnp.issubdtype(seg.dtype, jnp.integer):
            raise ValueError(f"{side} {name} must be an integer array, got dtype {seg.dtype}")
    return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def attention_problem(
    q,
    k,
    v,
    *,
    causal=False,
    sm_scale=None,
    segment_ids=None,
    window=None,
    logits_soft_cap=None,
    score="softmax",
    block_mask=None,
    segment_positions=None,
) -> AttentionProblem:
    """Checks the arguments of :func:`flash_attention` (with its defaults) and describes the call.

    Raises:
      ValueError: naming the argument, for wrong ranks, mismatched shapes, non-float ``q``,
        ``k`` or ``v``, non-integer segment ids or positions, ``heads`` not divisible by
        ``kv_heads``, or invalid options.
    """
    _check_rank("q", q, 4, "[batch, q_len, heads, head_dim]")
    _check_rank("k", k, 4, "[batch, kv_len, kv_heads, head_dim]")
    _check_rank("v", v, 4, "[batch, kv_len, kv_heads, head_dim]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    batch, q_len, heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if k.shape[0] != batch:
        raise ValueError(f"k batch {k.shape[0]} != q batch {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k head_dim {k.shape[3]} != q head_dim {head_dim}")
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be divisible by k/v kv_heads ({kv_heads}), which must be positive")
    if head_dim == 0:
        raise ValueError(f"head_dim must be positive, got q shape {q.shape}")
    if q_len == 0 or kv_len == 0:
        raise ValueError(f"q_len and kv_len must be positive, got {q_len}, {kv_len}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    logits_soft_cap = check_soft_cap(logits_soft_cap)
    window = check_window(window)
    window_mask = None if window is None else LocalMask(*window)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise ValueError(f"block_mask must be a block_mask.BlockMask description, got {type(block_mask).__name__}")
    if isinstance(block_mask, ExplicitBlockMask):
        block_mask.check_covers(q_len, kv_len)
    mask = combine_masks(CausalMask() if causal else None, window_mask, block_mask)
    normalize_segment_ids(segment_ids, batch, q_len, kv_len)
    normalize_segment_ids(segment_positions, batch, q_len, kv_len, name="segment_positions")
    return AttentionProblem(
        batch=batch,
        q_len=q_len,
        kv_len=kv_len,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        sm_scale=check_sm_scale(sm_scale, head_dim),
        mask=mask,
        has_segments=segment_ids is not None,
        # Positions change nothing for a mask that does not read them: keep the static tables.
        has_segment_positions=segment_positions is not None and mask is not None and mask.uses_segment_positions(),
        logits_soft_cap=logits_soft_cap,
        score=score,
        sigmoid_bias=default_sigmoid_bias(kv_len),
    )


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    segment_ids=None,
    window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    score: str = "softmax",
    block_mask: BlockMask | None = None,
    segment_positions=None,
) -> jax.Array:
    """Plain-jnp attention with the semantics of :func:`flash_attention` (same arguments,
    minus the kernel options). Materializes the ``[batch, heads, q_len, kv_len]`` scores in
    float32; differentiable by autodiff. Returns ``[batch, q_len, heads, head_dim]`` in
    ``q.dtype``."""
    problem = attention_problem(
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        segment_ids=segment_ids,
        window=window,
        logits_soft_cap=logits_soft_cap,
        score=score,
        block_mask=block_mask,
        segment_positions=segment_positions,
    )
    rows = _row_arrays(problem, segment_ids, segment_positions)
    return _dense_attention(q, k, v, _query_side(rows), _key_side(rows), problem, q_offset=0)


def _row_arrays(problem: AttentionProblem, segment_ids, segment_positions):
    """``(segment ids, segment positions)``, each None or a ``(query, key)`` int32 pair;
    positions only where the mask reads them."""
    segments = normalize_segment_ids(segment_ids, problem.batch, problem.q_len, problem.kv_len)
    if not problem.has_segment_positions:
        return segments, None
    return segments, normalize_segment_ids(segment_positions, problem.batch, problem.q_len, problem.kv_len)


def _query_side(rows):
    return tuple(None if pair is None else pair[0] for pair in rows)


def _key_side(rows):
    return tuple(None if pair is None else pair[1] for pair in rows)


def _dense_attention(q, k, v, q_rows, kv_rows, problem: AttentionProblem, *, q_offset) -> jax.Array:
    """The reference math for queries ``q [batch, n, heads, head_dim]`` at positions
    ``q_offset .. q_offset + n - 1`` over all keys. ``q_rows``/``kv_rows``: the query and key
    sides ``(segment ids, segment positions)`` (each ``[batch, n or kv_len]`` or None)."""
    (q_segments, q_seg_pos), (kv_segments, kv_seg_pos) = q_rows, kv_rows
    q_len = q.shape[1]
    visible = jnp.ones((1, q_len, problem.kv_len), dtype=bool)
    q_pos, kv_pos = q_offset + jnp.arange(q_len)[:, None], jnp.arange(problem.kv_len)[None, :]
    if q_seg_pos is not None:
        visible = visible & problem.mask.visible_at(q_pos, kv_pos, q_seg_pos[:, :, None], kv_seg_pos[:, None, :])
    elif problem.mask is not None:
        visible = visible & problem.mask.visible(q_pos, kv_pos)
    if q_segments is not None:
        visible = visible & (q_segments[:, :, None] == kv_segments[:, None, :])
    out = reference_attention(
        q,
        k,
        v,
        visible,
        sm_scale=problem.sm_scale,
        logits_soft_cap=problem.logits_soft_cap,
        score=problem.score,
        sigmoid_bias=problem.sigmoid_bias,
    )
    return out.astype(q.dtype)


def _chunked_xla_attention(q, k, v, rows, problem: AttentionProblem) -> jax.Array:
    """The XLA path: the reference math over chunks of ``XLA_QUERY_CHUNK`` queries, each
    rematerialized in the backward, so memory is ``O(chunk * kv_len)`` instead of
    ``O(q_len * kv_len)``. Short queries go through in one piece. ``rows`` as from
    :func:`_row_arrays`."""
    q_rows, kv_rows = _query_side(rows), _key_side(rows)
    if problem.q_len <= XLA_QUERY_CHUNK:
        return _dense_attention(q, k, v, q_rows, kv_rows, problem, q_offset=0)
    num_chunks = -(-problem.q_len // XLA_QUERY_CHUNK)

    def chunks(x):  # [batch, q_len, ...] -> [num_chunks, batch, chunk, ...]
        x = pad_axis_to_multiple(x, 1, XLA_QUERY_CHUNK)
        return jnp.moveaxis(x.reshape(x.shape[0], num_chunks, XLA_QUERY_CHUNK, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one_chunk(args):
        q_chunk, q_rows_chunk, offset = args
        return _dense_attention(q_chunk, k, v, q_rows_chunk, kv_rows, problem, q_offset=offset)

    offsets = jnp.arange(num_chunks) * XLA_QUERY_CHUNK
    q_row_chunks = tuple(None if row is None else chunks(row) for row in q_rows)
    out = jax.lax.map(one_chunk, (chunks(q), q_row_chunks, offsets))
    out = jnp.moveaxis(out, 0, 1).reshape(problem.batch, num_chunks * XLA_QUERY_CHUNK, problem.heads, problem.head_dim)
    return out[:, : problem.q_len]


@functools.partial(
    jax.jit,
    static_argnames=(
        "causal",
        "sm_scale",
        "window",
        "logits_soft_cap",
        "score",
        "block_mask",
        "block_sizes",
        "impl",
        "backward_kernel",
    ),
)
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    segment_ids=None,
    window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    score: str = "softmax",
    block_mask: BlockMask | None = None,
    block_sizes: FlashBlockSizes | None = None,
    impl: str = "auto",
    segment_positions=None,
    backward_kernel: str = "auto",
) -> jax.Array:
    """Attention over ``[batch, seq, heads, head_dim]`` tensors, memory-efficient and
    block-sparse; differentiable (forward and backward are Pallas kernels on GPU/TPU).

    Args:
      q: ``[batch, q_len, heads, head_dim]``.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (MHA when
        equal, GQA when a divisor, MQA when ``kv_heads == 1``). Query head ``h`` reads key
        head ``h // (heads // kv_heads)``.
      causal: key ``j`` visible from query ``i`` only if ``j <= i``. Positions are aligned
        at the start of both sequences (top-left), as in ``jax.nn.dot_product_attention``.
      sm_scale: multiplies ``q.k``; default ``1 / sqrt(head_dim)``.
      segment_ids: packed documents. Either one int array ``[batch, seq]`` (needs
        ``q_len == kv_len``) or a pair ``(q_segment_ids [batch, q_len], kv_segment_ids
        [batch, kv_len])``; a query sees only keys with an equal id.
      window: ``(left, right)`` sliding window: query ``i`` sees keys
        ``i - left <= j <= i + right`` (combine with ``causal=True`` for ``right = 0``).
      logits_soft_cap: if set, scaled logits become ``cap * tanh(logits / cap)``.
      score: ``"softmax"`` or ``"sigmoid"``. Sigmoid attention (FlashSigmoid) weighs each
        visible key by ``sigmoid(logits + b)`` with ``b = default_sigmoid_bias(kv_len) =
        -log(kv_len)``, without normalizing across keys.
      block_mask: a static mask description from :mod:`ember.kernels_pallas.block_mask`
        (causal, local window, local + global, chunked-causal, explicit block grid). It is
        intersected with ``causal``, ``window`` and ``segment_ids``; the kernels visit only
        blocks with at least one visible pair.
      segment_positions: each token's position within its packed document, laid out like
        ``segment_ids`` (one array or a ``(q, kv)`` pair). A :class:`LocalGlobalMask` then
        makes each document's first ``num_global_tokens`` tokens global instead of the
        row's; its live blocks are found per batch row at run time (the blocks holding a
        document's global tokens join the local ones). Other masks ignore it.
      block_sizes: kernel tiles, :class:`FlashBlockSizes`; default 128 x 128 (shrunk for
        short sequences; the TPU kernel uses at least 128 x 128). With an
        :class:`ExplicitBlockMask` they must divide its blocks.
      impl: ``"auto"`` (the Pallas kernels on GPU and TPU, else XLA), ``"pallas"`` (the
        kernels compiled for the default backend: on an NVIDIA GPU Triton, with the Mosaic
        GPU forward on Hopper where it applies; Mosaic TPU on a TPU), ``"interpret"`` (the
        GPU kernels run by the Pallas interpreter, any backend),
        ``"interpret_tpu"`` (the TPU kernels in JAX's TPU interpret mode, any backend) or
        ``"xla"`` (the reference math in rematerialized chunks of 512 queries,
        differentiated by XLA; memory ``O(512 * kv_len)`` per head).
      backward_kernel: the GPU kernels' backward: ``"auto"`` (today Triton's),
        ``"triton"`` or ``"hopper"`` (the Mosaic GPU backward on sm90, for the problems the
        Hopper forward runs; raises naming the reason elsewhere). Anything but ``"auto"``
        needs the GPU kernels (``impl="pallas"`` on a GPU, or ``"interpret"``).

    Jitted; every argument but ``q``, ``k``, ``v``, ``segment_ids`` and ``segment_positions``
    is static (hashable: pass ``window`` as a tuple). Lengths need not be multiples of the
    block sizes. A query with no visible key returns zeros (never NaN), and its gradient is
    zero.

    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``.

    Raises:
      ValueError: naming the argument, for bad ranks/shapes or options.
    """
    problem = attention_problem(
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        segment_ids=segment_ids,
        window=window,
        logits_soft_cap=logits_soft_cap,
        score=score,
        block_mask=block_mask,
        segment_positions=segment_positions,
    )
    block_sizes = _default_block_sizes(block_mask) if block_sizes is None else block_sizes
    if not isinstance(block_sizes, FlashBlockSizes):
        raise ValueError(f"block_sizes must be a FlashBlockSizes, got {type(block_sizes).__name__}")
    resolved = resolve_impl(impl, op="flash_attention", kernel_backends=KERNEL_BACKENDS)
    rows = _row_arrays(problem, segment_ids, segment_positions)
    platform = kernel_platform(resolved)
    refuse_gpu_kernel_choice_off_gpu("backward_kernel", backward_kernel, impl=impl, platform=platform)
    if platform is None:
        return _chunked_xla_attention(q, k, v, rows, problem)
    if platform == "tpu":
        return flash_attention_tpu(
            q,
            k,
            v,
            *rows,
            problem=problem,
            block_sizes=block_sizes.fitted(problem.q_len, problem.kv_len),
            interpret=pallas_interpret(resolved),
        )
    return flash_attention_kernel(
        q,
        k,
        v,
        *rows,
        problem=problem,
        block_sizes=block_sizes.fitted(problem.q_len, problem.kv_len),
        interpret=resolved == "interpret",
        backward=backward_kernel,
    )


def _default_block_sizes(block_mask: BlockMask | None) -> FlashBlockSizes:
    """128 x 128, or for an explicit grid the largest power-of-two tiles (<= 128) dividing
    its blocks, since a kernel tile must lie inside one grid cell."""
    if not isinstance(block_mask, ExplicitBlockMask):
        return FlashBlockSizes()

    def tile(block: int) -> int:
        return min(128, max(8, block & -block))  # largest power of two dividing block

    return FlashBlockSizes(tile(block_mask.block_q), tile(block_mask.block_kv))


__all__ = [
    "SCORES",
    "FlashBlockSizes",
    "default_sigmoid_bias",
    "flash_attention",
    "flash_attention_reference",
]
