"""Feed-forward blocks: gated (SwiGLU, GeGLU) and plain (GELU, ReLU) MLPs.

Parameter names follow the Hugging Face Llama layout so import is a rename:
``gate [embed, mlp]`` (gated kinds only), ``up [embed, mlp]``, ``down [mlp, embed]``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ember.core.sharding import constrain

ACTIVATIONS = {
    "swiglu": nn.silu,
    "geglu": lambda x: nn.gelu(x, approximate=True),
    "gelu": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
}
"""The activation of each MLP kind (shared with the MoE experts)."""
GATED = ("swiglu", "geglu")


def mlp(x: jax.Array, up: jax.Array, down: jax.Array, kind: str, gate: jax.Array | None = None) -> jax.Array:
    """The MLP of ``kind`` on ``x [..., embed]``: ``down(act(x @ gate) * (x @ up))`` when
    gated, else ``down(act(x @ up))``."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"mlp kind must be one of {', '.join(ACTIVATIONS)}; got {kind!r}")
    if (kind in GATED) != (gate is not None):
        raise ValueError(f"mlp kind {kind!r} {'needs' if kind in GATED else 'takes no'} a gate matrix")
    # The hidden activations are the largest tensors of the block: keep them split over
    # the tensor-parallel axis (a no-op outside ``use_sharding``).
    hidden = constrain(x @ up, ("batch", "seq", "mlp")) if x.ndim == 3 else x @ up
    if gate is not None:
        gate_hidden = constrain(x @ gate, ("batch", "seq", "mlp")) if x.ndim == 3 else x @ gate
        hidden = ACTIVATIONS[kind](gate_hidden) * hidden
    else:
        hidden = ACTIVATIONS[kind](hidden)
    return hidden @ down


class Mlp(nn.Module):
    """``x [batch, seq, embed] -> [batch, seq, embed]`` through ``hidden_dim`` channels."""

    hidden_dim: int
    kind: str = "swiglu"
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        embed = x.shape[-1]
        init = nn.initializers.normal(self.init_std)

        def weight(name, shape, axes):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, self.param_dtype).astype(
                self.dtype
            )

        gate = weight("gate", (embed, self.hidden_dim), ("embed", "mlp")) if self.kind in GATED else None
        up = weight("up", (embed, self.hidden_dim), ("embed", "mlp"))
        down = weight("down", (self.hidden_dim, embed), ("mlp", "embed"))
        return mlp(x.astype(self.dtype), up, down, self.kind, gate)
