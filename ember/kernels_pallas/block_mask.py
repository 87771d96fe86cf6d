"""Static attention-mask descriptions and the live-block enumeration kernels iterate.

A mask description says which (query position, key position) pairs may attend. It is a
small frozen dataclass (hashable, so it can be a static argument of a jitted function),
not an array: the dense ``[q_len, kv_len]`` mask is derived from it on demand, and so is
the ``[num_q_blocks, num_kv_blocks]`` grid of blocks that have at least one visible pair.
The flash-attention kernel visits only those live blocks, so its cost grows with their
number rather than with ``q_len * kv_len``.

Positions are 0-based and aligned at the start of both sequences (query ``i`` and key
``i`` are the same token), as in ``jax.nn.dot_product_attention``.

Kinds:

- :class:`CausalMask`: key ``j`` visible from query ``i`` iff ``j <= i``.
- :class:`LocalMask`: sliding window, ``i - left <= j <= i + right``.
- :class:`LocalGlobalMask`: a sliding window plus the first ``num_global_tokens`` tokens,
  which see every token and are seen by every token (Longformer / BigBird global tokens).
  Given *segment positions* (each token's position within its packed document), the
  global tokens are each document's first ``num_global_tokens`` tokens instead.
- :class:`ChunkedCausalMask`: causal within consecutive chunks of ``chunk_size`` tokens,
  nothing across chunks (Llama-4-style chunked attention).
- :class:`ExplicitBlockMask`: any boolean grid of ``block_q x block_kv`` blocks.
- :class:`MaskIntersection`: pairs visible under every one of several masks (how
  ``causal=True`` and ``window=`` combine with a ``block_mask``).

Every ``visible`` method works elementwise with broadcasting on NumPy and on JAX arrays, so
one definition serves the reference, the block enumeration and the kernel's in-block mask.

Masks that read segment positions (:meth:`BlockMask.uses_segment_positions`) have live
blocks that depend on the data: :func:`document_live_grid` finds them at run time, inside a
static bound (:func:`document_live_bound`), so a row holding one document visits the blocks
the index-based mask would, and each further document start adds its block's column.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from ember.kernels_pallas.int_options import check_non_negative_int

# Rows of query positions evaluated at a time when reducing a token mask to blocks; bounds
# host memory to _ROWS_PER_CHUNK * kv_len booleans for 16k x 16k masks.
_ROWS_PER_CHUNK = 512


class BlockMask:
    """Base class of the mask descriptions. Subclasses define :meth:`visible`."""

    def visible(self, q_pos: Any, kv_pos: Any) -> Any:
        """Boolean, ``True`` where key position ``kv_pos`` is visible from query position
        ``q_pos``; broadcasts like ``q_pos < kv_pos`` on NumPy or JAX integer arrays."""
        raise NotImplementedError

    def visible_at(self, q_pos: Any, kv_pos: Any, q_segment_pos: Any, kv_segment_pos: Any) -> Any:
        """:meth:`visible` given also each token's position within its packed document
        (same broadcasting). Only masks whose :meth:`uses_segment_positions` is True read them."""
        return self.visible(q_pos, kv_pos)

    def uses_segment_positions(self) -> bool:
        """Whether :meth:`visible_at` depends on the segment positions."""
        return False

    def in_block_predicate_needed(self) -> bool:
        """Whether a live ``block_q x block_kv`` kernel block can still hold masked pairs
        (so the kernel must evaluate :meth:`visible` inside it)."""
        return True

    def validate_block_sizes(self, block_q: int, block_kv: int) -> None:
        """Raises ``ValueError`` if the kernel cannot use these block sizes with this mask."""

    def dense(self, q_len: int, kv_len: int) -> np.ndarray:
        """The token mask, NumPy bool ``[q_len, kv_len]``."""
        q_pos = np.arange(q_len)[:, None]
        kv_pos = np.arange(kv_len)[None, :]
        return np.broadcast_to(np.asarray(self.visible(q_pos, kv_pos), dtype=bool), (q_len, kv_len))


@dataclasses.dataclass(frozen=True)
class CausalMask(BlockMask):
    """Key ``j`` is visible from query ``i`` iff ``j <= i``."""

    def visible(self, q_pos, kv_pos):
        return kv_pos <= q_pos


@dataclasses.dataclass(frozen=True)
class LocalMask(BlockMask):
    """Sliding window: key ``j`` is visible from query ``i`` iff ``i - left <= j <= i + right``.

    ``LocalMask(left, 0)`` is causal sliding-window attention over the ``left`` previous
    tokens plus the token itself.
    """

    left: int
    right: int

    def __post_init__(self):
        check_non_negative_int("left", self.left)
        check_non_negative_int("right", self.right)

    def visible(self, q_pos, kv_pos):
        return (kv_pos >= q_pos - self.left) & (kv_pos <= q_pos + self.right)


@dataclasses.dataclass(frozen=True)
class LocalGlobalMask(BlockMask):
    """Longformer / BigBird: a sliding window ``i - left <= j <= i + right`` plus global
    tokens. The first ``num_global_tokens`` positions are global: every query sees them, and
    they see every key. With segment positions (:meth:`visible_at`), a token is global when
    its position within its document is below ``num_global_tokens``: each packed document
    keeps its own global tokens (segment ids keep documents apart)."""

    left: int
    right: int
    num_global_tokens: int

    def __post_init__(self):
        check_non_negative_int("left", self.left)
        check_non_negative_int("right", self.right)
        check_non_negative_int("num_global_tokens", self.num_global_tokens)

    def visible(self, q_pos, kv_pos):
        return self.visible_at(q_pos, kv_pos, q_pos, kv_pos)

    def visible_at(self, q_pos, kv_pos, q_segment_pos, kv_segment_pos):
        local = (kv_pos >= q_pos - self.left) & (kv_pos <= q_pos + self.right)
        return local | (q_segment_pos < self.num_global_tokens) | (kv_segment_pos < self.num_global_tokens)

    def uses_segment_positions(self) -> bool:
        return self.num_global_tokens > 0


@dataclasses.dataclass(frozen=True)
class ChunkedCausalMask(BlockMask):
    """Causal attention inside consecutive chunks of ``chunk_size`` tokens: key ``j`` is
    visible from query ``i`` iff ``j <= i`` and ``j // chunk_size == i // chunk_size``."""

    chunk_size: int

    def __post_init__(self):
        check_non_negative_int("chunk_size", self.chunk_size)
        if self.chunk_size == 0:
            raise ValueError("chunk_size must be positive, got 0")

    def visible(self, q_pos, kv_pos):
        return (kv_pos <= q_pos) & (kv_pos // self.chunk_size == q_pos // self.chunk_size)


@dataclasses.dataclass(frozen=True)
class ExplicitBlockMask(BlockMask):
    """An arbitrary boolean grid of blocks: ``blocks[a][b]`` says whether queries
    ``[a*block_q, (a+1)*block_q)`` see keys ``[b*block_kv, (b+1)*block_kv)``.

    ``blocks`` is a tuple of tuples of bools (hashable); nested lists or a 2-D array are
    converted to one (as :meth:`from_array` does). The grid must cover the sequences it is
    used with. The kernel's block sizes must divide ``block_q`` and ``block_kv`` so that every
    kernel block lies inside one grid cell (then no in-block masking is needed).
    """

    blocks: tuple[tuple[bool, ...], ...]
    block_q: int
    block_kv: int

    def __post_init__(self):
        check_non_negative_int("block_q", self.block_q)
        check_non_negative_int("block_kv", self.block_kv)
        if self.block_q == 0 or self.block_kv == 0:
            raise ValueError(f"block_q and block_kv must be positive, got {self.block_q}, {self.block_kv}")
        try:  # lists or an array would make the mask unhashable, so no static argument
            blocks = tuple(tuple(bool(b) for b in row) for row in self.blocks)
        except TypeError:
            blocks = ()
        widths = {len(row) for row in blocks}
        if not blocks or len(widths) != 1 or 0 in widths:
            raise ValueError(
                f"blocks must be a non-empty rectangular tuple of tuples of bools, got {type(self.blocks).__name__}"
            )
        object.__setattr__(self, "blocks", blocks)

    @classmethod
    def from_array(cls, blocks: Any, block_q: int, block_kv: int) -> ExplicitBlockMask:
        """From a boolean array-like ``[num_q_blocks, num_kv_blocks]``."""
        grid = np.asarray(blocks, dtype=bool)
        if grid.ndim != 2:
            raise ValueError(f"blocks must be 2-D [num_q_blocks, num_kv_blocks], got shape {grid.shape}")
        return cls(tuple(tuple(bool(b) for b in row) for row in grid), block_q, block_kv)

    @property
    def grid(self) -> np.ndarray:
        """The block grid, NumPy bool ``[num_q_blocks, num_kv_blocks]``."""
        return np.asarray(self.blocks, dtype=bool)

    def visible(self, q_pos, kv_pos):
        on_host = isinstance(q_pos, np.ndarray) and isinstance(kv_pos, np.ndarray)
        xp = np if on_host else jnp
        grid = xp.asarray(self.grid)
        q_block = xp.minimum(q_pos // self.block_q, grid.shape[0] - 1)
        kv_block = xp.minimum(kv_pos // self.block_kv, grid.shape[1] - 1)
        return grid[q_block, kv_block]

    def in_block_predicate_needed(self) -> bool:
        return False

    def validate_block_sizes(self, block_q: int, block_kv: int) -> None:
        if self.block_q % block_q or self.block_kv % block_kv:
            raise ValueError(
                f"block_sizes ({block_q}, {block_kv}) must divide the ExplicitBlockMask block "
                f"({self.block_q}, {self.block_kv})"
            )

    def check_covers(self, q_len: int, kv_len: int) -> None:
        """Raises ``ValueError`` if the grid is smaller than ``q_len x kv_len`` tokens."""
        rows, cols = self.grid.shape
        if rows * self.block_q < q_len or cols * self.block_kv < kv_len:
            raise ValueError(
                f"block_mask grid {rows}x{cols} of {self.block_q}x{self.block_kv} blocks does not "
                f"cover q_len={q_len}, kv_len={kv_len}"
            )


@dataclasses.dataclass(frozen=True)
class MaskIntersection(BlockMask):
    """Pairs visible under every mask in ``masks``."""

    masks: tuple[BlockMask, ...]

    def visible(self, q_pos, kv_pos):
        result = self.masks[0].visible(q_pos, kv_pos)
        for mask in self.masks[1:]:
            result = result & mask.visible(q_pos, kv_pos)
        return result

    def visible_at(self, q_pos, kv_pos, q_segment_pos, kv_segment_pos):
        result = self.masks[0].visible_at(q_pos, kv_pos, q_segment_pos, kv_segment_pos)
        for mask in self.masks[1:]:
            result = result & mask.visible_at(q_pos, kv_pos, q_segment_pos, kv_segment_pos)
        return result

    def uses_segment_positions(self) -> bool:
        return any(m.uses_segment_positions() for m in self.masks)

    def in_block_predicate_needed(self) -> bool:
        return any(m.in_block_predicate_needed() for m in self.masks)

    def validate_block_sizes(self, block_q: int, block_kv: int) -> None:
        for mask in self.masks:
            mask.validate_block_sizes(block_q, block_kv)

    def kernel_masks(self) -> tuple[BlockMask, ...]:
        """The parts whose :meth:`visible` the kernel must evaluate inside live blocks."""
        return tuple(m for m in self.masks if m.in_block_predicate_needed())


def combine_masks(*masks: BlockMask | None) -> BlockMask | None:
    """The intersection of the given masks (``None`` entries ignored); ``None`` if none."""
    parts: list[BlockMask] = []
    for mask in masks:
        if mask is None:
            continue
        if not isinstance(mask, BlockMask):
            raise ValueError(f"block_mask must be a BlockMask description, got {type(mask).__name__}")
        parts.extend(mask.masks if isinstance(mask, MaskIntersection) else (mask,))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else MaskIntersection(tuple(parts))


def live_block_grid(mask: BlockMask | None, q_len: int, kv_len: int, block_q: int, block_kv: int) -> np.ndarray:
    """Which kernel blocks hold at least one visible pair: NumPy bool
    ``[cdiv(q_len, block_q), cdiv(kv_len, block_kv)]``. Positions past ``q_len``/``kv_len``
    (block padding) count as masked."""
    num_q_blocks, num_kv_blocks = math.ceil(q_len / block_q), math.ceil(kv_len / block_kv)
    if mask is None:
        return np.ones((num_q_blocks, num_kv_blocks), dtype=bool)
    padded_kv = num_kv_blocks * block_kv
    kv_pos = np.arange(kv_len)[None, :]
    live = np.zeros((num_q_blocks, num_kv_blocks), dtype=bool)
    rows_per_chunk = max(block_q, _ROWS_PER_CHUNK // block_q * block_q)
    for start in range(0, q_len, rows_per_chunk):
        stop = min(start + rows_per_chunk, q_len)
        token = np.zeros((rows_per_chunk, padded_kv), dtype=bool)
        token[: stop - start, :kv_len] = np.asarray(mask.visible(np.arange(start, stop)[:, None], kv_pos), dtype=bool)
        blocks = token.reshape(rows_per_chunk // block_q, block_q, num_kv_blocks, block_kv).any(axis=(1, 3))
        first = start // block_q
        live[first : first + blocks.shape[0]] |= blocks[: num_q_blocks - first]
    return live


def _split_global_parts(mask: BlockMask) -> tuple[BlockMask | None, BlockMask | None, int]:
    """``(rest, local, num_global)`` of a mask whose parts may include
    :class:`LocalGlobalMask`: ``rest`` intersects the other parts, ``local`` also the global
    masks' windows, ``num_global`` is the largest global count. For any segment positions,
    ``visible_at`` implies ``local | (rest & (query or key position < num_global))``."""
    parts = mask.masks if isinstance(mask, MaskIntersection) else (mask,)
    global_parts = [m for m in parts if isinstance(m, LocalGlobalMask)]
    others = [m for m in parts if not isinstance(m, LocalGlobalMask)]
    local = combine_masks(*others, *(LocalMask(m.left, m.right) for m in global_parts))
    return combine_masks(*others), local, max((m.num_global_tokens for m in global_parts), default=0)


def document_live_bound(mask: BlockMask, q_len: int, kv_len: int, block_q: int, block_kv: int) -> np.ndarray:
    """The blocks :func:`document_live_grid` can mark live for some segment positions: NumPy
    bool ``[num_q_blocks, num_kv_blocks]`` (what the kernel tables are sized for)."""
    rest, _, _ = _split_global_parts(mask)
    return live_block_grid(rest, q_len, kv_len, block_q, block_kv)


def document_live_grid(
    mask: BlockMask, block_q: int, block_kv: int, q_segment_pos, kv_segment_pos, segment_ids=None
) -> Any:
    """Which kernel blocks may hold a visible pair of a mask that reads segment positions,
    given them (``q_segment_pos [batch, q_len]``, ``kv_segment_pos [batch, kv_len]``) and
    the ``(q, kv)`` segment ids (or None): traced bool ``[batch, num_q_blocks,
    num_kv_blocks]``. Live are the blocks live without global tokens, plus, among the
    blocks ``rest`` allows, those where a global query or key can meet a token of its own
    segment: the segment-id ranges of the block's global tokens and of the other block
    overlap. A superset of the exact grid (exactness comes from the in-block mask); for
    documents packed back to back it adds, per document, the blocks between its first
    tokens and its end."""
    q_len, kv_len = q_segment_pos.shape[1], kv_segment_pos.shape[1]
    rest, local, num_global = _split_global_parts(mask)
    local_live = live_block_grid(local, q_len, kv_len, block_q, block_kv)
    rest_live = live_block_grid(rest, q_len, kv_len, block_q, block_kv)
    if segment_ids is None:  # one document per row, as far as the blocks can tell
        segment_ids = (jnp.zeros_like(q_segment_pos), jnp.zeros_like(kv_segment_pos))
    q_segments, kv_segments = segment_ids
    q_global, q_all = _segment_ranges(q_segments, q_segment_pos < num_global, block_q)
    kv_global, kv_all = _segment_ranges(kv_segments, kv_segment_pos < num_global, block_kv)

    def overlap(q_range, kv_range):  # [batch, num_q_blocks, num_kv_blocks]
        (q_low, q_high), (kv_low, kv_high) = q_range, kv_range
        return (q_low[:, :, None] <= kv_high[:, None, :]) & (kv_low[:, None, :] <= q_high[:, :, None])

    return local_live | (rest_live & (overlap(q_global, kv_all) | overlap(q_all, kv_global)))


def _segment_ranges(segments, is_global, block: int):
    """Per block of ``block`` tokens, the ``(low, high)`` segment ids ``[batch, num_blocks]``
    of its global tokens and of all its tokens (an empty range has ``low > high``)."""
    pad = -segments.shape[1] % block
    segments = jnp.pad(segments, ((0, 0), (0, pad))).reshape(segments.shape[0], -1, block)
    present = jnp.pad(jnp.ones(is_global.shape, bool), ((0, 0), (0, pad))).reshape(segments.shape)
    is_global = jnp.pad(is_global, ((0, 0), (0, pad))).reshape(segments.shape)
    big = jnp.iinfo(jnp.int32).max

    def span(flags):
        return jnp.where(flags, segments, big).min(axis=-1), jnp.where(flags, segments, -big).max(axis=-1)

    return span(is_global), span(present)


@dataclasses.dataclass(frozen=True)
class LiveBlocks:
    """The live-block lists a kernel iterates, for one block grid ``live [nq, nk]``.

    Attributes:
      kv_indices: int32 ``[nq, max(1, max_kv)]``: for query block ``a``, the live key-block
        indices in increasing order, then padding (repeats of the last live index, so a
        pipelined prefetch of a padded slot fetches nothing new).
      kv_counts: int32 ``[nq]``: how many entries of ``kv_indices[a]`` are live.
      q_indices: int32 ``[nk, max(1, max_q)]``, ``q_counts`` int32 ``[nk]``: the same, per
        key block (the backward dk/dv kernel iterates query blocks).
      num_live: total live blocks.
    """

    kv_indices: np.ndarray
    kv_counts: np.ndarray
    q_indices: np.ndarray
    q_counts: np.ndarray
    num_live: int

    @classmethod
    def from_grid(cls, live: np.ndarray) -> LiveBlocks:
        kv_indices, kv_counts = _row_lists(live)
        q_indices, q_counts = _row_lists(live.T)
        return cls(kv_indices, kv_counts, q_indices, q_counts, int(live.sum()))


def traced_live_lists(live, slots: int):
    """The lists of :class:`LiveBlocks` for a traced grid ``live [batch, rows, cols]`` (bool;
    :func:`document_live_grid`): ``(indices [batch, rows, slots], counts [batch, rows])``
    int32, per row its live columns in increasing order, then repeats of the last one.
    ``slots`` is at least the most live blocks of any row; slots past ``cols`` are padding."""
    counts = live.sum(axis=-1, dtype=jnp.int32)
    # A stable sort of "dead" flags lists the live columns first, in increasing order.
    order = jnp.argsort(~live, axis=-1, stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    slot = jnp.arange(slots)
    return jnp.where(slot < counts[..., None], order[..., jnp.minimum(slot, live.shape[-1] - 1)], last), counts


def _row_lists(live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    counts = live.sum(axis=1).astype(np.int32)
    width = max(1, int(counts.max(initial=0)))
    indices = np.zeros((live.shape[0], width), dtype=np.int32)
    for row, flags in enumerate(live):
        cols = np.flatnonzero(flags)
        if cols.size:
            indices[row, : cols.size] = cols
            indices[row, cols.size :] = cols[-1]
    return indices, counts
