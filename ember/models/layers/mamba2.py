"""The Mamba-2 mixer (``mamba2`` layers), as Hugging Face's ``Mamba2Mixer`` and
``mamba_ssm``'s ``Mamba2`` define it (Dao & Gu, 2024, "Transformers are SSMs").

For ``x [batch, seq, embed]`` with ``H`` heads of ``P`` channels, ``G`` groups of state
size ``N``::

    z, xBC, dt = in_proj(x)                      # gate [H, P]; x [H, P] + B, C [G, N]; dt [H]
    xBC = silu(causal_depthwise_conv(xBC))       # ember.kernels_pallas.short_conv
    dt  = clamp(softplus(dt + dt_bias), *time_step_limit);  A = -exp(A_log)
    y   = ssd(x, dt, A, B, C) + D x              # ember.kernels_pallas.ssd
    out = out_proj(rms_norm_per_group(y * silu(z)) * norm_scale)

The gated norm normalises each of the ``G`` groups of ``H * P / G`` channels separately, as
``mamba_ssm``'s ``RMSNormGated(group_size=inner / ngroups, norm_before_gate=False)`` and
transformers >= 4.48's ``MambaRMSNormGated``; older transformers releases normalised the
whole inner width at once in their torch path (identical when ``n_groups == 1``).

The in-projection is stored as one kernel per part (``z``, ``x``, ``B``, ``C``, ``dt``), so
each keeps its head axis for sharding; the convolution runs over ``x, B, C`` concatenated
(depthwise, so this equals Hugging Face's single ``conv1d``).

Cache (see ``ember.models.cache``): per sequence slot, ``conv_state [conv_kernel - 1,
conv_dim]`` (the last pre-convolution inputs) and float32 ``ssm_state [H, P, N]``. In a
step's flat token budget each token's convolution window comes from its own run, else from
its sequence's slot; the scan runs every run at once from its slot's state
(:func:`ragged_ssd`). A run starting at position 0 starts from empty state.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.kernels_pallas.short_conv import short_conv
from ember.kernels_pallas.ssd import KERNEL_BACKENDS as SSD_KERNEL_BACKENDS
from ember.kernels_pallas.ssd import ssd
from ember.models.cache import Paging, run_history
from ember.models.config import ModelConfig
from ember.models.layers.kernel_shards import per_head_group_shard, runs_per_shard
from ember.models.layers.projection import model_projection

DT_INIT_RANGE: tuple[float, float] = (0.001, 0.1)
"""Initial step sizes are drawn log-uniformly from this range (Mamba's ``dt_min``/``dt_max``)."""
DT_INIT_FLOOR = 1e-4


def time_steps(dt: jax.Array, dt_bias: jax.Array, limit: tuple[float, float]) -> jax.Array:
    """``clamp(softplus(dt + dt_bias), *limit)`` in float32; dt ``[..., heads]``, dt_bias ``[heads]``."""
    dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jnp.clip(dt, limit[0], limit[1])


def gated_rms_norm(y: jax.Array, z: jax.Array, scale: jax.Array, groups: int, eps: float) -> jax.Array:
    """``rms_norm(y * silu(z)) * scale``, normalised per group of heads (float32 statistics).

    y, z: ``[..., heads, head_dim]``; scale ``[heads, head_dim]``; ``groups`` divides heads.
    Returns ``[..., heads, head_dim]`` in y's dtype.
    """
    gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    *lead, heads, head_dim = gated.shape
    grouped = gated.reshape(*lead, groups, heads // groups * head_dim)
    normed = grouped * jax.lax.rsqrt(jnp.mean(jnp.square(grouped), axis=-1, keepdims=True) + eps)
    return (normed.reshape(gated.shape) * scale.astype(jnp.float32)).astype(y.dtype)


def segmented_cumsum(values: jax.Array, starts: jax.Array) -> jax.Array:
    """Inclusive cumulative sum of ``values [tokens, ...]`` along axis 0 that restarts at
    every token where ``starts [tokens]`` is True (exact per segment, however long the
    whole array: no difference of large prefix sums)."""
    flags = jnp.broadcast_to(starts.reshape(-1, *(1,) * (values.ndim - 1)), values.shape)

    def combine(left, right):
        (left_sum, left_flag), (right_sum, right_flag) = left, right
        return jnp.where(right_flag, right_sum, left_sum + right_sum), left_flag | right_flag

    return jax.lax.associative_scan(combine, (values, flags))[0]


def ragged_ssd(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    states: jax.Array,
    paging: Paging,
    valid: jax.Array,
    *,
    chunk_size: int,
    impl: str,
) -> tuple[jax.Array, jax.Array]:
    """The SSD scan over one flat token budget of sequence runs, each from its slot's state.

    Args:
      x: ``[num_tokens, heads, head_dim]``; dt: float32 ``[num_tokens, heads]`` effective step
        sizes (softplus and clamp applied); A, D: ``[heads]``; B, C: ``[num_tokens, groups, state]``.
      states: float32 ``[seqs, heads, head_dim, state]``, each sequence's state before its run
        (ignored for a fresh sequence).
      paging: the runs; valid: bool ``[num_tokens]`` (False: padding, which changes nothing).
      chunk_size, impl: ``ssd``'s.

    Returns:
      ``(y [num_tokens, heads, head_dim] in x's dtype, states after the runs)``. With ``L_t``
      the summed ``dt A`` of a run up to token ``t``: ``y_t`` is the run's own scan (state
      reset at run boundaries) plus ``exp(L_t) C_t . state[owner]``; a run's new state is
      ``exp(L_last) state + sum_t exp(L_last - L_t) dt_t x_t B_t^T``.
    """
    f32 = jnp.float32
    heads, num_seqs = x.shape[1], paging.page_table.shape[0]
    dt = jnp.where(valid[:, None], dt, 0.0)
    runs = jnp.where(valid, paging.owner, num_seqs)
    scan = dict(D=D, dt_softplus=False, segment_ids=runs[None], chunk_size=chunk_size, impl=impl)
    within = ssd(x[None], dt[None], A, B[None], C[None], **scan)[0]
    cumulative = segmented_cumsum(dt * A.astype(f32), (paging.run_offsets() == 0) | ~valid)  # [T, H]
    states = jnp.where(paging.fresh()[:, None, None, None], 0.0, states.astype(f32))
    B_heads = jnp.repeat(B, heads // B.shape[1], axis=1).astype(f32)
    C_heads = jnp.repeat(C, heads // C.shape[1], axis=1).astype(f32)
    carried = jnp.einsum("thpn,thn->thp", states[paging.owner], C_heads)
    y = within.astype(f32) + jnp.exp(cumulative)[..., None] * carried
    last = jnp.clip(paging.query_starts + paging.query_lens - 1, 0, x.shape[0] - 1)
    total = jnp.where((paging.query_lens > 0)[:, None], cumulative[last], 0.0)  # [seqs, H]
    member = ((paging.owner[:, None] == jnp.arange(num_seqs)[None, :]) & valid[:, None]).astype(f32)
    weights = jnp.exp(total[paging.owner] - cumulative) * dt  # [T, H]; exponent <= 0
    added = jnp.einsum("ts,th,thp,thn->shpn", member, weights, x.astype(f32), B_heads)
    return y.astype(x.dtype), jnp.exp(total)[:, :, None, None] * states + added


def ragged_conv(
    xbc: jax.Array, conv_state: jax.Array, weight: jax.Array, bias: jax.Array | None, paging: Paging
) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise convolution over a flat budget ``xbc [num_tokens, channels]``:
    each token convolves the ``width`` inputs of its sequence ending at it (from its run, else
    from ``conv_state [seqs, width - 1, channels]``, zeros for a fresh sequence).

    Returns ``(y [num_tokens, channels], conv_state after the runs)`` (a sequence that sits
    the step out keeps its state).
    """
    width = weight.shape[0]
    windows = run_history(xbc, conv_state, paging, paging.owner, paging.run_offsets() + 1, width)
    y = short_conv(windows, weight, bias)[:, -1]
    if width == 1:
        return y, conv_state
    seqs = jnp.arange(paging.page_table.shape[0])
    new_state = run_history(xbc, conv_state, paging, seqs, paging.query_lens, width - 1)
    return y, new_state.astype(conv_state.dtype)


def _dt_bias_init(key, shape, dtype):
    """Inverse softplus of step sizes drawn log-uniformly from :data:`DT_INIT_RANGE`."""
    low, high = (math.log(v) for v in DT_INIT_RANGE)
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape) * (high - low) + low), DT_INIT_FLOOR)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _conv_init(key, shape, dtype):
    """PyTorch's ``Conv1d`` default (Kaiming uniform over the ``width`` taps of a channel)."""
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class Mamba2Mixer(nn.Module):
    """``x [batch, seq, embed] -> [batch, seq, embed]`` (see the module docstring); the cache
    entry is ``{"conv_state": [slots, conv_kernel - 1, conv_dim], "ssm_state": [slots, heads,
    head_dim, state_size]}``; with a cache ``batch`` is 1 (one flat token budget).

    Parameters: ``z/kernel``, ``x/kernel [embed, heads, head_dim]``, ``B/kernel``,
    ``C/kernel [embed, groups, state]``, ``dt/kernel [embed, heads]``, ``conv_weight [width,
    conv_dim]`` (+ ``conv_bias``), ``dt_bias``, ``A_log``, ``D [heads]``, ``norm_scale
    [heads, head_dim]``, ``o/kernel [heads, head_dim, embed]``.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, cache=None, paging=None, valid=None):
        del positions  # order enters through the convolution and the scan
        config, ssm = self.config, self.config.ssm
        heads, head_dim, groups, state = ssm.heads(config.d_model), ssm.head_dim, ssm.n_groups, ssm.state_size
        ids = None if paging is None else paging.token_adapters(valid)
        z = self._project(x, "z", (heads, head_dim), ("heads", "head_dim"), adapter_ids=ids)
        xs = self._project(x, "x", (heads, head_dim), ("heads", "head_dim"), adapter_ids=ids)
        B = self._project(x, "B", (groups, state), (None, "state"), adapter_ids=ids)
        C = self._project(x, "C", (groups, state), (None, "state"), adapter_ids=ids)
        dt = self._project(x, "dt", (heads,), ("heads",), adapter_ids=ids)
        weight, bias, dt_bias, A_log, D, norm_scale = self._mixer_params(heads, head_dim)

        lead = x.shape[:2]
        xbc = jnp.concatenate([xs.reshape(*lead, -1), B.reshape(*lead, -1), C.reshape(*lead, -1)], axis=-1)
        weight = weight.astype(xbc.dtype)
        bias = None if bias is None else bias.astype(xbc.dtype)
        if cache is None:
            xbc = short_conv(xbc, weight, bias, segment_ids=segment_ids)
        else:
            xbc, conv_state = ragged_conv(xbc[0], cache["conv_state"].astype(xbc.dtype), weight, bias, paging)
            xbc = xbc[None]
        xbc = jax.nn.silu(xbc)
        inner = heads * head_dim
        xs = constrain(xbc[..., :inner].reshape(*lead, heads, head_dim), ("batch", "seq", "heads", "head_dim"))
        B = xbc[..., inner : inner + groups * state].reshape(*lead, groups, state)
        C = xbc[..., inner + groups * state :].reshape(*lead, groups, state)
        dt = time_steps(dt, dt_bias, ssm.time_step_limit)
        A = -jnp.exp(A_log.astype(jnp.float32))
        scan = dict(chunk_size=ssm.chunk_size, impl=config.attention_impl)
        if cache is None:
            kernel = runs_per_shard(scan["impl"], op="ssd", kernel_backends=SSD_KERNEL_BACKENDS)
            y = per_head_group_shard(
                lambda xs, dt, A, B, C, D, segment_ids: ssd(
                    xs, dt, A, B, C, D=D, dt_softplus=False, segment_ids=segment_ids, **scan
                ),
                (xs, dt, A, B, C, D, segment_ids),
                ("bsh.", "bsh", "h", "bsh.", "bsh.", "h", "bs"),
                out_layout="bsh.",
                groups=groups,
                kernel=kernel,
            )
        else:
            y, ssm_state = ragged_ssd(xs[0], dt[0], A, B[0], C[0], D, cache["ssm_state"], paging, valid[0], **scan)
            y = y[None]
            cache = {"conv_state": conv_state.astype(cache["conv_state"].dtype), "ssm_state": ssm_state}
        y = gated_rms_norm(y, z, norm_scale, groups, config.norm_eps)
        out = self._project(y, "o", (x.shape[-1],), ("heads", "head_dim", "embed"), in_dims=2, adapter_ids=ids)
        return out, cache

    def _project(self, x, name, shape, axes, in_dims=1, adapter_ids=None):
        kernel_axes = ("embed", *axes) if in_dims == 1 else axes
        return model_projection(self.config, shape, kernel_axes, in_dims=in_dims, name=name)(x, adapter_ids)

    def _mixer_params(self, heads, head_dim):
        """``(conv_weight, conv_bias or None, dt_bias, A_log, D, norm_scale)``, initialised as
        Hugging Face's ``Mamba2Mixer`` (``A = 1..heads``, ``D = 1``, log-uniform step sizes)."""
        ssm, param_dtype = self.config.ssm, self.config.policy.param_dtype
        conv_dim = ssm.conv_dim(self.config.d_model)

        def param(name, init, shape, axes):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, param_dtype)

        def a_log_init(key, shape, dtype):
            return jnp.log(jnp.arange(1, shape[0] + 1, dtype=dtype))

        return (
            param("conv_weight", _conv_init, (ssm.conv_kernel, conv_dim), (None, None)),
            param("conv_bias", nn.initializers.zeros, (conv_dim,), (None,)) if ssm.use_conv_bias else None,
            param("dt_bias", _dt_bias_init, (heads,), ("heads",)),
            param("A_log", a_log_init, (heads,), ("heads",)),
            param("D", nn.initializers.ones, (heads,), ("heads",)),
            param("norm_scale", nn.initializers.ones, (heads, head_dim), ("heads", "head_dim")),
        )
