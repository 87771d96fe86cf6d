"""The math of policy-gradient training for language models: group-relative advantages and
the GRPO / REINFORCE objectives, as pure functions of arrays.

GRPO (DeepSeekMath, Shao et al. 2024) samples a group of ``G`` completions per prompt and
scores each against its own group: ``A_i = (r_i - mean(r)) / (std(r) + eps)``, the same for
every token of completion ``i``. Each completion token ``t`` contributes

    min(ratio_t * A, clip(ratio_t, 1 - clip_eps, 1 + clip_eps) * A) - kl_coef * kl_t
    ratio_t = exp(logp_t - old_logp_t)
    kl_t    = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1      (the "k3" estimator)

and the objective is the mean over a completion's tokens, then over completions. REINFORCE
with a baseline uses ``A_i = r_i - mean(r)`` and ``logp_t * A`` (no ratio, no clipping). A
group whose rewards are all equal has advantage 0 (never NaN): it teaches nothing.

``logp``, ``old_logp`` and ``ref_logp`` are all the training forward's
``log_softmax(logits / temperature)`` over the whole vocabulary (:func:`token_logprobs`), as
TRL's and verl's GRPO compute them; rollouts sample from that distribution truncated to
``grpo.top_k`` / ``grpo.top_p`` and renormalised. Since ``old_logp`` is recomputed by the
same forward (not taken from the engine), the ratio compares one distribution at two
parameter values: it is 1 (up to rounding) on the first pass over a rollout and carries no factor of
the kept probability mass (the bias of a ratio against a sampler's truncated log-probs).
What truncation does change is the estimand: the gradient is ``E_q[A grad log p]`` for the
full-vocabulary policy ``p``, not the sampling policy's ``E_q[A grad log q] = E_q[A (grad
log p - grad log Z)]``, ``Z`` each position's kept mass -- a bias of order ``1 - Z``, none
at ``top_k=0, top_p=1`` (the defaults). Replaying the truncation in the training forward
(NeMo-RL, prime-rl) removes it, at the cost of a sort over the vocabulary at every position
and a rule for sampled tokens that fall outside the recomputed set; it is not done here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ALGORITHMS = ("grpo", "reinforce")


def group_advantages(rewards: jax.Array, *, algorithm: str = "grpo", eps: float = 1e-4) -> jax.Array:
    """Advantages of ``rewards [prompts, group]`` within each prompt's group (same shape):
    ``grpo`` divides by the group's standard deviation plus ``eps``, ``reinforce`` only
    subtracts the group mean."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    rewards = rewards.astype(jnp.float32)
    centred = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    if algorithm == "reinforce":
        return centred
    return centred / (jnp.std(rewards, axis=-1, keepdims=True) + eps)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log p(targets)`` in float32 ``[batch, seq]`` under ``softmax(logits / temperature)``
    for ``logits [batch, seq, vocab]`` and int ``targets [batch, seq]``."""
    scaled = logits.astype(jnp.float32) / temperature
    return jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), targets[..., None], axis=-1)[..., 0]


class PolicyLoss(NamedTuple):
    """``loss_sum / count`` is the loss (count: completions with at least one token);
    the rest are means over completion tokens (``kl``: ``None`` without reference log-probs)."""

    loss_sum: jax.Array
    count: jax.Array
    kl: jax.Array | None
    clip_fraction: jax.Array
    ratio: jax.Array


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    ref_logprobs: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    algorithm: str = "grpo",
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
) -> PolicyLoss:
    """The negated objective of the module docstring for completions ``[batch, seq]``
    (``logprobs`` under the policy being trained, ``old_logprobs`` under the policy that
    sampled them, ``ref_logprobs`` under the frozen reference, ``None`` when ``kl_coef`` is 0),
    ``advantages [batch]`` and ``mask [batch, seq]`` (1 on completion tokens)."""
    mask = mask.astype(jnp.float32)
    advantage = advantages.astype(jnp.float32)[:, None]
    ratio = jnp.exp(logprobs - old_logprobs)
    if algorithm == "grpo":
        clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
        objective = jnp.minimum(ratio * advantage, clipped * advantage)
        clip_active = ((advantage > 0) & (ratio > 1 + clip_eps)) | ((advantage < 0) & (ratio < 1 - clip_eps))
    elif algorithm == "reinforce":
        objective = logprobs * advantage
        clip_active = jnp.zeros_like(mask, dtype=bool)
    else:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if ref_logprobs is not None:
        log_ratio = ref_logprobs - logprobs
        kl = jnp.exp(log_ratio) - log_ratio - 1.0
    else:
        kl = jnp.zeros_like(objective)
    per_token = -(objective - kl_coef * kl)
    lengths = jnp.sum(mask, axis=-1)
    per_completion = jnp.sum(per_token * mask, axis=-1) / jnp.maximum(lengths, 1.0)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    return PolicyLoss(
        loss_sum=jnp.sum(per_completion),
        count=jnp.sum(lengths > 0).astype(jnp.float32),
        kl=None if ref_logprobs is None else jnp.sum(kl * mask) / tokens,
        clip_fraction=jnp.sum(clip_active * mask) / tokens,
        ratio=jnp.sum(ratio * mask) / tokens,
    )


__all__ = ["ALGORITHMS", "PolicyLoss", "group_advantages", "policy_loss", "token_logprobs"]
