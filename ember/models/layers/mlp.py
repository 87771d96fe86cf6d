"""Feed-forward blocks: gated (SwiGLU, GeGLU) and plain (GELU, ReLU) MLPs.

Parameter names follow the Hugging Face Llama layout so import is a rename:
``gate [embed, mlp]`` (gated kinds only), ``up [embed, mlp]``, ``down [mlp, embed]``. Each may
carry a low-rank adapter (``up_lora_a`` ..., see ``ember.models.adapters``).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain
from ember.models.adapters.lowrank import adapted_matmul, read_low_rank
from ember.models.quantization.stored import CALIBRATION, QuantizedWeight, read_quantized, record_input

ACTIVATIONS = {
    "swiglu": nn.silu,
    "geglu": lambda x: nn.gelu(x, approximate=True),
    "gelu": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
}
"""The activation of each MLP kind (shared with the MoE experts)."""
GATED = ("swiglu", "geglu")


Matrix = jax.Array | Callable[[jax.Array], jax.Array]
"""A weight ``[in, out]``, or the function ``h -> h @ weight`` (an adapted weight's)."""


def mlp(x: jax.Array, up: Matrix, down: Matrix, kind: str, gate: Matrix | None = None) -> jax.Array:
    """The MLP of ``kind`` on ``x [..., embed]``: ``down(act(x @ gate) * (x @ up))`` when
    gated, else ``down(act(x @ up))``."""
    up, down, gate = (w if w is None or callable(w) else _times(w) for w in (up, down, gate))
    if kind not in ACTIVATIONS:
        raise ValueError(f"mlp kind must be one of {', '.join(ACTIVATIONS)}; got {kind!r}")
    if (kind in GATED) != (gate is not None):
        raise ValueError(f"mlp kind {kind!r} {'needs' if kind in GATED else 'takes no'} a gate matrix")
    # The hidden activations are the largest tensors of the block: keep them split over
    # the tensor-parallel axis (a no-op outside ``use_sharding``).
    hidden = constrain(up(x), ("batch", "seq", "mlp")) if x.ndim == 3 else up(x)
    if gate is not None:
        gate_hidden = constrain(gate(x), ("batch", "seq", "mlp")) if x.ndim == 3 else gate(x)
        hidden = ACTIVATIONS[kind](gate_hidden) * hidden
    else:
        hidden = ACTIVATIONS[kind](hidden)
    return down(hidden)


def _times(weight: jax.Array) -> Callable[[jax.Array], jax.Array]:
    return lambda h: h @ weight


class Mlp(nn.Module):
    """``x [batch, seq, embed] -> [batch, seq, embed]`` through ``hidden_dim`` channels;
    ``adapter_ids [batch, seq]`` picks each token's adapter among stacked ones (serving);
    ``quantized_impl``: the ``impl`` a quantized weight's ``quantized_matmul`` runs."""

    hidden_dim: int
    kind: str = "swiglu"
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    quantized_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> jax.Array:
        embed = x.shape[-1]
        init = nn.initializers.normal(self.init_std)

        def weight(name, shape, axes):
            kernel = read_quantized(self, name, axes)
            if kernel is None:
                kernel = self.param(name, nn.with_logical_partitioning(init, axes), shape, self.param_dtype)
                kernel = kernel.astype(self.dtype)
            adapter = read_low_rank(self, name)
            if (
                adapter is None
                and not isinstance(kernel, QuantizedWeight)
                and not self.is_mutable_collection(CALIBRATION)
            ):
                return kernel

            def apply(h):
                record_input(self, name, h)
                return adapted_matmul(
                    self, h, kernel, adapter, adapter_ids=adapter_ids, quantized_impl=self.quantized_impl
                )

            return apply

        gate = weight("gate", (embed, self.hidden_dim), ("embed", "mlp")) if self.kind in GATED else None
        up = weight("up", (embed, self.hidden_dim), ("embed", "mlp"))
        down = weight("down", (self.hidden_dim, embed), ("mlp", "embed"))
        return mlp(x.astype(self.dtype), up, down, self.kind, gate)
