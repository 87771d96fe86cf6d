"""The Hopper (sm90) forward of flash attention, written for Mosaic GPU: TMA, wgmma and
warp specialisation, in the manner of FlashAttention-3.

One CTA per (query head, query tile of ``2 * block_q`` rows, batch row), three warpgroups:

- two compute warpgroups, each owning ``block_q`` of the tile's query rows: ``S = Q K^T``
  by wgmma from shared memory into registers, the online softmax in base 2 in registers,
  then ``O += P V`` by wgmma with ``P`` straight from registers;
- one memory warpgroup streaming the key and value blocks by TMA into a ring of
  ``stages`` shared-memory slots. Each load completes on its slot's barrier; a slot is
  refilled once both compute warpgroups have arrived on its "consumed" barrier.

The compute warpgroups take turns on the tensor cores through a shared two-arrival
"turn" barrier (FA3's ping-pong): while one runs its matmuls the other does its softmax.

Causal masking (top-left aligned, as everywhere in Ember) visits the key blocks up to a
warpgroup's diagonal only: blocks wholly below it run unmasked, the diagonal ones masked;
the tiles with the most blocks are launched first.
Lengths that are not block multiples are padded outside (queries to ``2 * block_q``, keys
to ``block_kv``) and the padded keys masked in the last key block.

Outputs: ``O`` and the natural-log log-sum-exp of every query row, ``[batch, heads,
q_len]`` float32: the residual the Triton backward kernels of
:mod:`ember.kernels_pallas.flash_attention_kernels` read, so training runs this forward
with that backward. :func:`hopper_supports` says what this kernel runs, or why not;
``flash_attention_kernels`` routes everything else to its Triton forward.

Written against jax 0.11's ``jax.experimental.pallas.mosaic_gpu``; it is imported lazily,
so this module imports (and :func:`hopper_supports` answers) on any backend.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ember.kernels_pallas.block_mask import CausalMask
from ember.kernels_pallas.hopper import WGMMA_DTYPES, shared_memory_reason, tma_transforms, warp_specialized
from ember.kernels_pallas.sequence_padding import pad_axis_to_multiple, round_up

HOPPER_HEAD_DIMS: tuple[int, ...] = (64, 128)  # whole 128-byte swizzle tiles; registers fit
_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)
_COMPUTE_WARPGROUPS = 2


@dataclasses.dataclass(frozen=True)
class HopperBlockSizes:
    """Tiles of the Hopper forward: each compute warpgroup owns ``block_q`` query rows (a
    CTA ``2 * block_q``), keys and values stream in blocks of ``block_kv`` rows, ``stages``
    blocks in flight. Multiples of 64 (the wgmma row count), ``stages >= 2``."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 64 or value % 64:
                raise ValueError(f"{name} must be a positive multiple of 64, got {value!r}")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"stages must be an int >= 2, got {self.stages!r}")

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Shared memory of one CTA: Q/O tiles and lse rows of both compute warpgroups,
        and the ``stages`` K and V slots."""
        tiles = _COMPUTE_WARPGROUPS * self.block_q + 2 * self.stages * self.block_kv
        return tiles * head_dim * itemsize + _COMPUTE_WARPGROUPS * self.block_q * 4


DEFAULT_HOPPER_BLOCKS = HopperBlockSizes()


def hopper_supports(
    problem, dtype, blocks: HopperBlockSizes = DEFAULT_HOPPER_BLOCKS, smem_bytes: int | None = None
) -> str | None:
    """None when the Hopper kernel computes ``problem`` (an
    :class:`ember.kernels_pallas.flash_attention.AttentionProblem`) in ``dtype`` with
    ``blocks``, else the reason it does not (the Triton kernels then run it).

    Supported: softmax scores with a positive ``sm_scale``, no mask or causal, any GQA/MQA
    ratio, bfloat16 and float16, head_dim 64 or 128, any lengths (padded and masked).
    ``smem_bytes``: the kernel's shared memory with ``blocks`` (default: this forward's)."""
    if problem.score != "softmax":
        return f"{problem.score} scores"
    if problem.logits_soft_cap is not None:
        return "logits soft cap"
    if problem.has_segments:
        return "segment ids"
    if problem.mask is not None and type(problem.mask) is not CausalMask:
        return f"mask {problem.mask!r} (only none or causal)"
    if not problem.sm_scale > 0:
        return f"sm_scale {problem.sm_scale} (the base-2 softmax folds a positive scale)"
    if jnp.dtype(dtype).name not in WGMMA_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (wgmma takes {' or '.join(WGMMA_DTYPES)})"
    if problem.head_dim not in HOPPER_HEAD_DIMS:
        return f"head_dim {problem.head_dim} (only {' or '.join(map(str, HOPPER_HEAD_DIMS))})"
    smem = blocks.smem_bytes(problem.head_dim, jnp.dtype(dtype).itemsize) if smem_bytes is None else smem_bytes
    return shared_memory_reason(blocks, smem)


@dataclasses.dataclass(frozen=True)
class HopperGeometry:
    """Static sizes of one call; lengths padded (queries to ``2 * block_q``, keys to
    ``block_kv``), ``kv_len`` the real key count."""

    group: int  # query heads per key head
    head_dim: int
    kv_len: int
    padded_kv_len: int
    causal: bool
    sm_scale: float
    dtype: jnp.dtype
    blocks: HopperBlockSizes

    @property
    def num_kv_blocks(self) -> int:
        return self.padded_kv_len // self.blocks.block_kv

    def kv_steps(self, row_end):
        """Key blocks the query rows before ``row_end`` (traced) visit, in order from 0."""
        if not self.causal:
            return self.num_kv_blocks
        return jnp.minimum(pl.cdiv(row_end, self.blocks.block_kv), self.num_kv_blocks)

    def unmasked_steps(self, row_start):
        """Leading key blocks that need no mask for rows from ``row_start``: wholly below
        the diagonal and holding no padded key."""
        whole = self.kv_len // self.blocks.block_kv
        if not self.causal:
            return whole
        return jnp.minimum(lax.div(row_start, self.blocks.block_kv), whole)

    @property
    def needs_mask(self) -> bool:
        return self.causal or self.kv_len % self.blocks.block_kv != 0


def walk_key_blocks(geo: HopperGeometry, row_start, steps, block, skip, carry):
    """A compute warpgroup's walk over the key blocks of its rows from ``row_start``:
    ``block(masked)(kv_step, carry)`` over the blocks they see (``steps[0]`` of them), first
    those needing no mask, then those that do (the causal diagonal, padded keys); then
    ``skip(kv_step)`` over the blocks only the tile's other warpgroup sees (causal, up to
    ``steps[1]``). Returns the carry."""
    steps, all_steps = steps
    unmasked = geo.unmasked_steps(row_start) if geo.needs_mask else steps
    carry = lax.fori_loop(0, unmasked, block(masked=False), carry)
    if geo.needs_mask:
        carry = lax.fori_loop(unmasked, steps, block(masked=True), carry)
    if geo.causal:
        lax.fori_loop(steps, all_steps, lambda kv_step, _: skip(kv_step), None)
    return carry


def _take_turn(turn):
    """Both compute warpgroups pass the turn barrier together (its two arrivals)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def _softmax_step(geo: HopperGeometry, scores, carry, visible):
    """The online softmax update in base 2 with ``sm_scale`` folded in: ``row_max`` is the
    running max of ``scores * sm_scale * log2(e)``, ``row_sum`` the sum of ``2 ** (that -
    row_max)``; ``acc`` is rescaled. Returns ``(probabilities [block_q, block_kv] f32,
    (acc, row_max, row_sum))``."""
    acc, row_max, row_sum = carry
    scale = geo.sm_scale * _LOG2_E  # > 0 (hopper_supports), so max commutes with it
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
    # Every row sees key 0 in the first block it visits, so the max is finite from then on.
    new_max = jnp.maximum(row_max, scores.max(axis=1) * scale)
    rescale = jnp.exp2(row_max - new_max)
    p = jnp.exp2(scores * scale - lax.broadcast_in_dim(new_max, scores.shape, [0]))
    acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
    row_sum = row_sum * rescale + p.sum(axis=1)
    return p, (acc, new_max, row_sum)


def visible_tile(geo: HopperGeometry, row_start, kv_step):
    """Bool ``[block_q, block_kv]`` of the masked steps: causal and not a padded key."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shape = (geo.blocks.block_q, geo.blocks.block_kv)
    rows = row_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    cols = kv_step * geo.blocks.block_kv + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    visible = cols <= rows if geo.causal else None
    if geo.kv_len % geo.blocks.block_kv:
        in_range = cols < geo.kv_len
        visible = in_range if visible is None else visible & in_range
    return visible


class _Shared(NamedTuple):
    """A CTA's shared memory and barriers (see :func:`_scratch`)."""

    qo: object  # [2, block_q, head_dim]: each compute warpgroup's Q tile, then its O tile
    k: object  # [stages, block_kv, head_dim], the ring of key blocks
    v: object  # [stages, block_kv, head_dim]
    lse: object  # [2, block_q] f32
    q_loaded: object  # [2] barriers
    k_loaded: object  # [stages] barriers: a slot's block has landed
    v_loaded: object
    k_consumed: object  # [stages] barriers of two arrivals: both warpgroups are done with it
    v_consumed: object
    turn: object  # two arrivals: the compute warpgroups' turns on the tensor cores


def _attend_block(geo: HopperGeometry, shared: _Shared, wg, row_start, steps, kv_step, carry, masked: bool):
    """One key block for one compute warpgroup: ``S = Q K^T``, the softmax update, then
    ``acc += P V``, taking turns with the other warpgroup and releasing the slot."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq, bkv, stages = geo.blocks.block_q, geo.blocks.block_kv, geo.blocks.stages
    slot = lax.rem(kv_step, jnp.int32(stages))

    def scores_of(acc_ref):
        plgpu.wgmma(acc_ref, shared.qo.at[wg], shared.k.at[slot].transpose((1, 0)))
        _take_turn(shared.turn)  # hand the tensor cores over while this matmul drains
        return acc_ref[...]

    scores = pl.run_scoped(scores_of, plgpu.ACC((bq, bkv), jnp.float32))
    plgpu.barrier_arrive(shared.k_consumed.at[slot])
    visible = visible_tile(geo, row_start, kv_step) if masked else None
    p, (acc, row_max, row_sum) = _softmax_step(geo, scores, carry, visible)
    p = p.astype(geo.dtype)
    # Keep the softmax ahead of the turn barrier (else the compiler sinks it past the wait).
    acc, row_max, row_sum, p = lax.optimization_barrier((acc, row_max, row_sum, p))
    plgpu.barrier_arrive(shared.turn)  # softmax done
    plgpu.barrier_wait(shared.v_loaded.at[slot])
    plgpu.barrier_wait(shared.turn)  # the tensor cores are ours again

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, p, shared.v.at[slot])
        # While P V runs, wait for the next key block's arrival.
        next_step = kv_step + 1

        @pl.when(next_step < steps)
        def _():
            plgpu.barrier_wait(shared.k_loaded.at[lax.rem(next_step, jnp.int32(stages))])

    acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(shared.v_consumed.at[slot])
    return acc, row_max, row_sum


def _skip_block(geo: HopperGeometry, shared: _Shared, kv_step):
    """A key block only the other compute warpgroup visits (causal): release its slot and
    keep the turn barrier's arrivals in step with the other warpgroup. (Waiting for the
    loads keeps this warpgroup's view of the load barriers' phases exact.)"""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    slot = lax.rem(kv_step, jnp.int32(geo.blocks.stages))
    plgpu.barrier_wait(shared.k_loaded.at[slot])
    plgpu.barrier_arrive(shared.k_consumed.at[slot])
    plgpu.barrier_wait(shared.v_loaded.at[slot])
    plgpu.barrier_arrive(shared.v_consumed.at[slot])
    _take_turn(shared.turn)
    _take_turn(shared.turn)


def _compute_warpgroup(geo: HopperGeometry, shared: _Shared, wg, tile, q_ref, out_ref, lse_ref):
    """One compute warpgroup: its ``block_q`` rows of the tile against every key block they
    see, then ``O`` and the lse rows stored by TMA."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq = geo.blocks.block_q
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    plgpu.set_max_registers(232, action="increase")  # the memory warpgroup gives its registers up
    row_start = tile * (2 * bq) + wg * bq
    steps, all_steps = geo.kv_steps(row_start + bq), geo.kv_steps((tile + 1) * (2 * bq))
    q_smem, lse_smem = shared.qo.at[wg], shared.lse.at[wg]

    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row_start, bq), head], q_smem, shared.q_loaded.at[wg])
    plgpu.barrier_wait(shared.q_loaded.at[wg])
    carry = (
        plgpu.layout_cast(jnp.zeros((bq, geo.head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    plgpu.barrier_wait(shared.k_loaded.at[0])  # every warpgroup visits key block 0

    def blocks(masked: bool):
        return lambda kv_step, carry: _attend_block(geo, shared, wg, row_start, steps, kv_step, carry, masked)

    # Warpgroup 1 starts one turn behind, so the two alternate on the tensor cores.
    pl.when(wg == 1)(lambda: _take_turn(shared.turn))
    skip = functools.partial(_skip_block, geo, shared)
    carry = walk_key_blocks(geo, row_start, (steps, all_steps), blocks, skip, carry)
    pl.when(wg == 0)(lambda: _take_turn(shared.turn))

    acc, row_max, row_sum = carry
    q_smem[...] = (acc / lax.broadcast_in_dim(row_sum, acc.shape, [0])).astype(geo.dtype)
    lse_smem[...] = row_max * _LN_2 + jnp.log(row_sum)  # ln(2 ** row_max * row_sum)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, pl.ds(row_start, bq), head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(row_start, bq)])
    plgpu.wait_smem_to_gmem(0)


def _memory_warpgroup(geo: HopperGeometry, shared: _Shared, tile, k_ref, v_ref):
    """The TMA producer: fills the K/V ring with the tile's key blocks, reusing a slot once
    both compute warpgroups have consumed it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq, bkv, stages = geo.blocks.block_q, geo.blocks.block_kv, geo.blocks.stages
    plgpu.set_max_registers(40, action="decrease")
    batch = lax.axis_index("batch")
    kv_head = lax.div(lax.axis_index("heads"), jnp.int32(geo.group))
    all_steps = geo.kv_steps((tile + 1) * (2 * bq))

    def load(src_ref, ring, loaded, kv_step, slot):
        rows = (batch, pl.ds(kv_step * bkv, bkv), kv_head)
        plgpu.copy_gmem_to_smem(src_ref.at[rows], ring.at[slot], loaded.at[slot])

    for slot in range(min(stages, geo.num_kv_blocks)):

        @pl.when(slot < all_steps)  # a short causal tile may need fewer blocks than slots
        def _(slot=slot):
            load(k_ref, shared.k, shared.k_loaded, slot, slot)
            load(v_ref, shared.v, shared.v_loaded, slot, slot)

    @pl.loop(stages, all_steps)
    def _(kv_step):
        slot = lax.rem(kv_step, jnp.int32(stages))
        plgpu.barrier_wait(shared.k_consumed.at[slot])
        load(k_ref, shared.k, shared.k_loaded, kv_step, slot)
        plgpu.barrier_wait(shared.v_consumed.at[slot])
        load(v_ref, shared.v, shared.v_loaded, kv_step, slot)

    # Wait out the last blocks too, so that no barrier phase is left unobserved at exit.
    @pl.loop(jnp.maximum(all_steps - stages, 0), all_steps)
    def _(kv_step):
        slot = lax.rem(kv_step, jnp.int32(stages))
        plgpu.barrier_wait(shared.k_consumed.at[slot])
        plgpu.barrier_wait(shared.v_consumed.at[slot])


def _kernel(
    q_ref, k_ref, v_ref, out_ref, lse_ref, smem, loaded, consumed, turn, *, geo: HopperGeometry, num_tiles: int
):
    shared = _Shared(*smem, *loaded, *consumed, turn)
    tile = lax.axis_index("q_tiles")
    if geo.causal:  # the longest tiles first: a shorter tail of the grid
        tile = num_tiles - 1 - tile
    warp_specialized(
        lambda wg: _compute_warpgroup(geo, shared, wg, tile, q_ref, out_ref, lse_ref),
        lambda: _memory_warpgroup(geo, shared, tile, k_ref, v_ref),
        _COMPUTE_WARPGROUPS,
    )


def _scratch(geo: HopperGeometry):
    """Shared memory and barriers: ``(smem, loaded, consumed, turn)``, the fields of
    :class:`_Shared` in order."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bq, bkv, stages, d = geo.blocks.block_q, geo.blocks.block_kv, geo.blocks.stages, geo.head_dim
    transforms = tma_transforms()
    smem = (
        plgpu.SMEM((_COMPUTE_WARPGROUPS, bq, d), geo.dtype, transforms=transforms),  # Q, then O
        plgpu.SMEM((stages, bkv, d), geo.dtype, transforms=transforms),
        plgpu.SMEM((stages, bkv, d), geo.dtype, transforms=transforms),
        plgpu.SMEM((_COMPUTE_WARPGROUPS, bq), jnp.float32),  # lse rows
    )
    loaded = (
        plgpu.Barrier(num_barriers=_COMPUTE_WARPGROUPS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    )
    consumed = (plgpu.Barrier(num_arrivals=_COMPUTE_WARPGROUPS, num_barriers=stages),) * 2
    turn = plgpu.Barrier(num_arrivals=_COMPUTE_WARPGROUPS)
    return smem, loaded, consumed, turn


def hopper_forward(q, k, v, *, causal: bool, sm_scale: float, blocks: HopperBlockSizes = DEFAULT_HOPPER_BLOCKS):
    """Softmax attention forward on an sm90 GPU (callers check :func:`hopper_supports`).

    Args:
      q: ``[batch, q_len, heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads,
        head_dim]``, all one dtype; ``heads % kv_heads == 0``.
      causal: top-left aligned causal mask.
      sm_scale: multiplies ``q.k`` (> 0).

    Returns:
      ``(out [batch, q_len, heads, head_dim] in q.dtype, lse [batch, heads, q_len] f32)``,
      ``lse`` the natural log of each row's softmax denominator (of the scaled logits).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    bq, bkv = blocks.block_q, blocks.block_kv
    geo = HopperGeometry(
        group=heads // kv_heads,
        head_dim=head_dim,
        kv_len=kv_len,
        padded_kv_len=round_up(kv_len, bkv),
        causal=causal,
        sm_scale=float(sm_scale),
        dtype=jnp.dtype(q.dtype),
        blocks=blocks,
    )
    qp = pad_axis_to_multiple(q, 1, _COMPUTE_WARPGROUPS * bq)
    kp, vp = (pad_axis_to_multiple(x, 1, bkv) for x in (k, v))
    num_tiles = qp.shape[1] // (_COMPUTE_WARPGROUPS * bq)
    out, lse = plgpu.kernel(
        functools.partial(_kernel, geo=geo, num_tiles=num_tiles),
        out_type=(
            jax.ShapeDtypeStruct(qp.shape, q.dtype),
            # Rows on the minor axis: each warpgroup's lse rows are one contiguous TMA store.
            jax.ShapeDtypeStruct((batch, heads, qp.shape[1]), jnp.float32),
        ),
        scratch_types=_scratch(geo),
        grid=(heads, num_tiles, batch),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=_COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name="flash_attention_forward_hopper",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(qp, kp, vp)
    return out[:, :q_len], lse[:, :, :q_len]
