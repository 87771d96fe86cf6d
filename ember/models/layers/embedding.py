"""Token embedding and the output head (tied to the embedding table or not)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


@jax.custom_vjp
def embedding_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]`` (``table [vocab, embed]``, int ``tokens [...]`` -> ``[..., embed]``)
    whose gradient sums each row's contributions in float32, cast to ``table``'s dtype last:
    the gradient of a plain ``take`` scatter-adds in the table's dtype, and in bfloat16 the sum
    of a frequent token's contributions stops growing once it is 256 times one of them."""
    return jnp.take(table, tokens, axis=0)


def _lookup_fwd(table, tokens):
    return embedding_lookup(table, tokens), (table, tokens)


def _lookup_bwd(residuals, g):
    table, tokens = residuals
    grad = jnp.zeros(table.shape, jnp.float32).at[tokens].add(g.astype(jnp.float32))
    return grad.astype(table.dtype), None


embedding_lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embed(nn.Module):
    """``tokens [batch, seq] -> [batch, seq, embed]``; :meth:`attend` is the tied output head.

    The table is ``embedding [vocab, embed]``.
    """

    vocab_size: int
    features: int
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), ("vocab", "embed")),
            (self.vocab_size, self.features),
            self.param_dtype,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if jnp.finfo(self.embedding.dtype).bits < 32:  # bf16 / f16 table: sum its gradient in float32
            return embedding_lookup(self.embedding, tokens).astype(self.dtype)
        return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits ``[..., vocab]`` against the embedding table (tied head)."""
        return x.astype(self.dtype) @ self.embedding.astype(self.dtype).T


class OutputHead(nn.Module):
    """An untied output projection ``kernel [embed, vocab]``: ``[..., embed] -> [..., vocab]``."""

    vocab_size: int
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), ("embed", "vocab")),
            (x.shape[-1], self.vocab_size),
            self.param_dtype,
        )
        return x.astype(self.dtype) @ kernel.astype(self.dtype)
