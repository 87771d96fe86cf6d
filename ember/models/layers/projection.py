"""``Projection``: a linear map whose kernel keeps its head structure and logical axes.

Unlike ``nn.DenseGeneral`` (which initialises a flattened 2-D kernel and reshapes it), the
kernel is created with its real shape, so its logical-axis annotation always matches its
rank (needed for eager sharding under ``nnx.bridge.ToNNX``). A low-rank adapter next to the
kernel (``kernel_lora_a`` ..., see ``ember.models.adapters``) adds its delta; a quantized
kernel (``ember.models.quantization``) is multiplied as stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.models.adapters.lowrank import adapted_matmul, read_low_rank
from ember.models.quantization.stored import read_quantized, record_input

if TYPE_CHECKING:
    from ember.models.config import ModelConfig


class Projection(nn.Module):
    """``x [..., *in_shape] -> [..., *out_shape]`` with ``kernel [*in_shape, *out_shape]``.

    ``in_dims`` trailing dimensions of ``x`` are contracted; ``kernel_axes`` names every
    kernel dimension; ``bias [*out_shape]`` (axes ``kernel_axes[in_dims:]``) when ``use_bias``.
    ``adapter_ids [*x.shape[:-in_dims]]``: each token's adapter when the kernel carries
    several stacked adapters (serving), else None. ``quantized_impl``: the ``impl`` a quantized
    kernel's ``quantized_matmul`` runs (the model's ``quantized_impl``).
    """

    out_shape: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]
    in_dims: int = 1
    use_bias: bool = False
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    quantized_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> jax.Array:
        in_shape = x.shape[x.ndim - self.in_dims :]
        shape = (*in_shape, *self.out_shape)
        if len(self.kernel_axes) != len(shape):
            raise ValueError(f"kernel_axes {self.kernel_axes} must name all {len(shape)} kernel dimensions {shape}")
        kernel = read_quantized(self, "kernel", self.kernel_axes)
        if kernel is None:
            kernel = self.param(
                "kernel",
                nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.kernel_axes),
                shape,
                self.param_dtype,
            ).astype(self.dtype)
        adapter = read_low_rank(self, "kernel")
        x = x.astype(self.dtype)
        record_input(self, "kernel", x, self.in_dims)
        y = adapted_matmul(
            self, x, kernel, adapter, in_dims=self.in_dims, adapter_ids=adapter_ids, quantized_impl=self.quantized_impl
        )
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.kernel_axes[self.in_dims :]),
                self.out_shape,
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y


def model_projection(
    config: ModelConfig,
    out_shape: tuple[int, ...],
    kernel_axes: tuple[str | None, ...],
    *,
    name: str,
    in_dims: int = 1,
    use_bias: bool = False,
) -> Projection:
    """A ``Projection`` (submodule ``name`` of the calling module) of a ``config`` model: its
    init scale, compute and parameter dtypes and quantized matmul's ``impl``."""
    policy = config.policy
    return Projection(
        out_shape,
        kernel_axes,
        in_dims=in_dims,
        use_bias=use_bias,
        init_std=config.init_std,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        quantized_impl=config.quantized_impl,
        name=name,
    )
