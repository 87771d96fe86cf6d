"""Actor-critic and Q-value networks for reinforcement learning, as Flax Linen modules.

    policy = ActorCritic(action=DiscreteActions(2))
    variables = policy.init(key, obs)                 # obs [batch, obs_dim]
    dist, value = policy.apply(variables, obs)        # value [batch]
    raw = dist.sample(key)                            # what the learner stores
    env_action = dist.env_action(raw)                 # what the environment receives

Action heads return a small distribution object (a ``flax.struct`` pytree, so it crosses
``jit``/``vmap``) with ``sample``, ``log_prob``, ``entropy``, ``mode`` and ``env_action``:

- :class:`Categorical` for discrete actions;
- :class:`Gaussian` for boxes, with a state-independent log-std (a learned vector) or a
  state-dependent one (a second head), and either **clipped** actions (the Gaussian sample
  is stored and clipped to the bounds for the environment) or **tanh-squashed** actions
  (``low + (tanh(u) + 1) / 2 * (high - low)``, with the change-of-variables term in
  ``log_prob``; ``entropy`` is the pre-squash Gaussian's, the usual surrogate).

Learners store the *raw* sample ``u`` and evaluate ``log_prob(u)`` on it, which keeps the
PPO ratio exact for both clipping and squashing. Torsos are MLPs or, for image
observations ``[batch, height, width, channels]`` (MinAtar, the maze), a small CNN.
Initialisation follows the PPO implementation details (orthogonal, safe to vmap: see
``ember.models.initializers``; gain sqrt(2) in the
torso, 0.01 on the policy head and 1 on the value head).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from ember.core.errors import ConfigError
from ember.models.initializers import orthogonal

ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu, "gelu": nn.gelu, "silu": nn.silu}
TORSOS = ("mlp", "cnn")
LOG_STD_KINDS = ("state_independent", "state_dependent")
SQUASH_KINDS = ("clip", "tanh")
_LOG_STD_BOUNDS = (-20.0, 2.0)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
#: The logit of an illegal action (``Categorical.restricted``): exp(ILLEGAL_LOGIT - logit) is 0
#: in float32 for any logit a policy makes, and it is far from float32's end, where the entropy's
#: gradient (the cotangent times the log-probability) overflowed into inf * 0 = NaN.
ILLEGAL_LOGIT = -1e9


@struct.dataclass
class Categorical:
    """A categorical distribution over ``logits[..., num_actions]``."""

    logits: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        """``[...]`` int32 actions."""
        return jax.random.categorical(key, self.logits).astype(jnp.int32)

    def log_prob(self, action: jax.Array) -> jax.Array:
        log_probs = jax.nn.log_softmax(self.logits)
        return jnp.take_along_axis(log_probs, action[..., None].astype(jnp.int32), axis=-1)[..., 0]

    def entropy(self) -> jax.Array:
        log_probs = jax.nn.log_softmax(self.logits)
        return -(jnp.exp(log_probs) * log_probs).sum(axis=-1)

    def mode(self) -> jax.Array:
        return jnp.argmax(self.logits, axis=-1).astype(jnp.int32)

    def env_action(self, raw: jax.Array) -> jax.Array:
        return raw

    def restricted(self, legal: jax.Array) -> Categorical:
        """The distribution over the legal actions only (bool ``legal[..., num_actions]``): the
        illegal ones get the logit ``ILLEGAL_LOGIT``, so they are never sampled nor the mode,
        have probability exactly 0 in ``log_prob``/``entropy``, and take no gradient (where
        every action is illegal, all keep equal odds)."""
        return Categorical(jnp.where(legal, self.logits, jnp.asarray(ILLEGAL_LOGIT, self.logits.dtype)))


@struct.dataclass
class Gaussian:
    """A diagonal Gaussian over raw actions ``u`` ``[..., action_dim]``, mapped into the box
    ``[low, high]`` by clipping or by a scaled tanh (``squash``)."""

    mean: jax.Array
    log_std: jax.Array
    low: jax.Array
    high: jax.Array
    squash: str = struct.field(pytree_node=False, default="clip")

    def sample(self, key: jax.Array) -> jax.Array:
        return self.mean + jnp.exp(self.log_std) * jax.random.normal(key, self.mean.shape, self.mean.dtype)

    def log_prob(self, raw: jax.Array) -> jax.Array:
        """Log-density of the *environment* action produced from ``raw``: the Gaussian's for
        clipping (the usual PPO convention), with the tanh Jacobian for squashing."""
        z = (raw - self.mean) * jnp.exp(-self.log_std)
        log_prob = (-0.5 * jnp.square(z) - self.log_std - _HALF_LOG_2PI).sum(axis=-1)
        if self.squash == "tanh":
            half_range = 0.5 * (self.high - self.low)
            # log(1 - tanh(u)^2) = 2 * (log 2 - u - softplus(-2u)), stable for large |u|
            log_det = 2.0 * (math.log(2.0) - raw - jax.nn.softplus(-2.0 * raw)) + jnp.log(half_range)
            log_prob = log_prob - log_det.sum(axis=-1)
        return log_prob

    def entropy(self) -> jax.Array:
        """The entropy of the Gaussian over raw actions."""
        return (self.log_std + 0.5 + _HALF_LOG_2PI).sum(axis=-1)

    def mode(self) -> jax.Array:
        return self.mean

    def env_action(self, raw: jax.Array) -> jax.Array:
        if self.squash == "tanh":
            return self.low + 0.5 * (jnp.tanh(raw) + 1.0) * (self.high - self.low)
        return jnp.clip(raw, self.low, self.high)


@dataclasses.dataclass(frozen=True)
class DiscreteActions:
    """``num_actions`` discrete actions (a categorical head)."""

    num_actions: int


@dataclasses.dataclass(frozen=True)
class BoxActions:
    """Continuous actions in the box ``[low, high]`` (tuples of length ``action_dim``)."""

    low: tuple[float, ...]
    high: tuple[float, ...]
    log_std: str = "state_independent"
    squash: str = "clip"
    init_log_std: float = 0.0

    def __post_init__(self):
        if len(self.low) != len(self.high) or not self.low:
            raise ValueError(f"low and high must be non-empty and of one length, got {self.low} and {self.high}")
        if any(lo >= hi for lo, hi in zip(self.low, self.high)):
            raise ValueError(f"every low must be below its high, got low={self.low} high={self.high}")
        if self.log_std not in LOG_STD_KINDS:
            raise ValueError(f"log_std must be one of {LOG_STD_KINDS}, got {self.log_std!r}")
        if self.squash not in SQUASH_KINDS:
            raise ValueError(f"squash must be one of {SQUASH_KINDS}, got {self.squash!r}")
        if self.squash == "tanh" and not all(math.isfinite(v) for v in (*self.low, *self.high)):
            raise ConfigError(  # low + (tanh(u) + 1) / 2 * (high - low) would be NaN
                f"policy.squash 'tanh' maps actions into a bounded box; this one has low={self.low} "
                f"high={self.high}: use squash 'clip' for unbounded actions",
                key="policy.squash",
            )

    @property
    def action_dim(self) -> int:
        return len(self.low)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Network shape of an actor-critic or Q-network (the ``policy:`` section of RL configs).

    Attributes:
      torso: ``mlp`` for flat observations, ``cnn`` for ``[height, width, channels]`` images.
      hidden_sizes: widths of the MLP layers (after the convolutions for ``cnn``).
      activation: one of ``tanh``, ``relu``, ``gelu``, ``silu``.
      cnn_channels: output channels of the 3x3 convolutions (``cnn`` only).
      log_std: ``state_independent`` or ``state_dependent`` (continuous actions only).
      squash: ``clip`` or ``tanh`` (continuous actions only).
      init_log_std: initial log-std of continuous actions.
      layer_norm: a LayerNorm before every activation of the torso (PQN's stabiliser).
    """

    torso: str = "mlp"
    hidden_sizes: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    cnn_channels: tuple[int, ...] = (16,)
    log_std: str = "state_independent"
    squash: str = "clip"
    init_log_std: float = 0.0
    layer_norm: bool = False

    def __post_init__(self):
        if self.torso not in TORSOS:
            raise ConfigError(f"policy.torso must be one of {TORSOS}, got {self.torso!r}", key="policy.torso")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"policy.activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}",
                key="policy.activation",
            )
        if not self.hidden_sizes or any(int(h) < 1 for h in self.hidden_sizes):
            raise ConfigError(
                f"policy.hidden_sizes must be positive widths, got {self.hidden_sizes}", key="policy.hidden_sizes"
            )
        if any(int(c) < 1 for c in self.cnn_channels):  # 0 channels: a policy blind to its observation
            raise ConfigError(
                f"policy.cnn_channels must be positive channel counts, got {self.cnn_channels}",
                key="policy.cnn_channels",
            )
        if self.log_std not in LOG_STD_KINDS:
            raise ConfigError(
                f"policy.log_std must be one of {LOG_STD_KINDS}, got {self.log_std!r}", key="policy.log_std"
            )
        if self.squash not in SQUASH_KINDS:
            raise ConfigError(f"policy.squash must be one of {SQUASH_KINDS}, got {self.squash!r}", key="policy.squash")


def _dense(features: int, gain: float, name: str | None = None) -> nn.Dense:
    return nn.Dense(features, kernel_init=orthogonal(gain), bias_init=nn.initializers.zeros, name=name)


class Torso(nn.Module):
    """Features ``[batch, hidden_sizes[-1]]`` from observations ``[batch, obs_dim]`` (MLP) or
    ``[batch, height, width, channels]`` (CNN: 3x3 convolutions, then the MLP)."""

    torso: str = "mlp"
    hidden_sizes: Sequence[int] = (64, 64)
    activation: str = "tanh"
    cnn_channels: Sequence[int] = (16,)
    layer_norm: bool = False

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        norm = (lambda h: nn.LayerNorm()(h)) if self.layer_norm else (lambda h: h)
        x = obs.astype(jnp.float32)
        if self.torso == "cnn":
            for channels in self.cnn_channels:
                x = act(norm(nn.Conv(channels, (3, 3), kernel_init=orthogonal(math.sqrt(2.0)))(x)))
            x = x.reshape(*x.shape[:-3], -1)
        for width in self.hidden_sizes:
            x = act(norm(_dense(width, math.sqrt(2.0))(x)))
        return x


class Actor(nn.Module):
    """A policy head on its own torso: observations -> :class:`Categorical` or :class:`Gaussian`."""

    action: DiscreteActions | BoxActions
    config: PolicyConfig = PolicyConfig()

    @nn.compact
    def __call__(self, obs: jax.Array) -> Categorical | Gaussian:
        c = self.config
        features = Torso(c.torso, c.hidden_sizes, c.activation, c.cnn_channels, c.layer_norm, name="torso")(obs)
        if isinstance(self.action, DiscreteActions):
            return Categorical(_dense(self.action.num_actions, 0.01, name="logits")(features))
        dim = self.action.action_dim
        mean = _dense(dim, 0.01, name="mean")(features)
        if self.action.log_std == "state_dependent":
            log_std = _dense(dim, 0.01, name="log_std_head")(features) + self.action.init_log_std
        else:
            log_std = self.param("log_std", nn.initializers.constant(self.action.init_log_std), (dim,))
            log_std = jnp.broadcast_to(log_std, mean.shape)
        log_std = jnp.clip(log_std, *_LOG_STD_BOUNDS)
        low = jnp.asarray(self.action.low, mean.dtype)
        high = jnp.asarray(self.action.high, mean.dtype)
        return Gaussian(mean, log_std, low, high, squash=self.action.squash)


class Critic(nn.Module):
    """A state-value head on its own torso: observations ``[batch, ...]`` -> values ``[batch]``."""

    config: PolicyConfig = PolicyConfig()

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        c = self.config
        features = Torso(c.torso, c.hidden_sizes, c.activation, c.cnn_channels, c.layer_norm, name="torso")(obs)
        return _dense(1, 1.0, name="value")(features)[..., 0]


class ActionValue(nn.Module):
    """An action-value head on its own torso (SAC's critic): observations ``[batch, obs_dim]``
    and continuous actions ``[batch, action_dim]`` -> values ``[batch]``."""

    config: PolicyConfig = PolicyConfig()

    @nn.compact
    def __call__(self, obs: jax.Array, action: jax.Array) -> jax.Array:
        c = self.config
        inputs = jnp.concatenate([obs.astype(jnp.float32), action.astype(jnp.float32)], axis=-1)
        features = Torso("mlp", c.hidden_sizes, c.activation, (), c.layer_norm, name="torso")(inputs)
        return _dense(1, 1.0, name="value")(features)[..., 0]


class ActorCritic(nn.Module):
    """Separate actor and critic networks on one observation: ``obs -> (distribution, value)``.
    ``apply(variables, obs, method="value")`` runs the critic alone."""

    action: DiscreteActions | BoxActions
    config: PolicyConfig = PolicyConfig()

    def setup(self):
        self.actor = Actor(self.action, self.config)
        self.critic = Critic(self.config)

    def __call__(self, obs: jax.Array) -> tuple[Categorical | Gaussian, jax.Array]:
        return self.actor(obs), self.critic(obs)

    def value(self, obs: jax.Array) -> jax.Array:
        return self.critic(obs)


class CentralisedActorCritic(nn.Module):
    """An actor on each agent's own observation and a critic on a separate input: the global
    state for MAPPO's centralised critic, or the agent's observation again for IPPO.
    ``(obs [..., obs_dim], critic_input [..., state_dim]) -> (distribution, value [...])``;
    ``method="value"`` runs the critic alone. Applied to ``[batch, agents, ...]`` inputs
    the weights are shared by all agents."""

    action: DiscreteActions | BoxActions
    config: PolicyConfig = PolicyConfig()

    def setup(self):
        self.actor = Actor(self.action, self.config)
        self.critic = Critic(self.config)

    def __call__(self, obs: jax.Array, critic_input: jax.Array) -> tuple[Categorical | Gaussian, jax.Array]:
        return self.actor(obs), self.critic(critic_input)

    def value(self, critic_input: jax.Array) -> jax.Array:
        return self.critic(critic_input)


class QNetwork(nn.Module):
    """Action values ``[batch, num_actions]`` from observations (for DQN)."""

    num_actions: int
    config: PolicyConfig = PolicyConfig(activation="relu")

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:
        c = self.config
        features = Torso(c.torso, c.hidden_sizes, c.activation, c.cnn_channels, c.layer_norm, name="torso")(obs)
        return _dense(self.num_actions, 1.0, name="q")(features)


def action_head(action_space: Any, config: PolicyConfig = PolicyConfig()) -> DiscreteActions | BoxActions:
    """The action head for an environment's action space: a ``Discrete`` space (attribute
    ``n``) gives :class:`DiscreteActions`; a ``Box`` (``low``, ``high``, ``shape`` of one
    axis) gives :class:`BoxActions` with the config's log-std and squashing choices."""
    if hasattr(action_space, "n"):
        if getattr(action_space, "start", 0) != 0:  # the head's actions are 0 .. n - 1; the env would clip them
            raise ValueError(
                f"action_space must be a Discrete space of actions 0 .. n - 1 (start 0), got {action_space!r}; "
                "wrap the environment to shift its actions to start at 0"
            )
        return DiscreteActions(int(action_space.n))
    if hasattr(action_space, "low") and hasattr(action_space, "high"):
        shape = tuple(getattr(action_space, "shape", ()))
        if len(shape) > 1:
            raise ValueError(f"action_space must be a Discrete space or a Box of one axis, got shape {shape}")
        size = shape[0] if shape else 1
        low = tuple(float(v) for v in jnp.broadcast_to(jnp.asarray(action_space.low, jnp.float32), (size,)))
        high = tuple(float(v) for v in jnp.broadcast_to(jnp.asarray(action_space.high, jnp.float32), (size,)))
        return BoxActions(low, high, log_std=config.log_std, squash=config.squash, init_log_std=config.init_log_std)
    raise ValueError(f"action_space must be a Discrete space (with n) or a Box (with low/high), got {action_space!r}")


__all__ = [
    "ACTIVATIONS",
    "ActionValue",
    "Actor",
    "ActorCritic",
    "BoxActions",
    "Categorical",
    "CentralisedActorCritic",
    "Critic",
    "DiscreteActions",
    "Gaussian",
    "PolicyConfig",
    "QNetwork",
    "Torso",
    "action_head",
]
