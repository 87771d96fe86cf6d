"""Policy networks and their action distributions against closed-form densities."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.envs.spaces import Discrete
from ember.models.policies import (
    ActorCritic,
    BoxActions,
    Categorical,
    DiscreteActions,
    Gaussian,
    PolicyConfig,
    QNetwork,
    action_head,
)
from tests.tolerances import assert_allclose


def normal_log_pdf(x, mean, std):
    return -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)


def test_categorical_log_prob_entropy_and_sampling(rng):
    logits = jax.random.normal(rng, (5, 4))
    dist = Categorical(logits)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    actions = jnp.array([0, 3, 1, 2, 3])
    assert_allclose(dist.log_prob(actions), np.log(probs[np.arange(5), actions]))
    assert_allclose(dist.entropy(), -(probs * np.log(probs)).sum(-1))
    samples = jax.vmap(dist.sample)(jax.random.split(rng, 20000))  # [20000, 5]
    frequencies = np.stack([(samples == a).mean(0) for a in range(4)], -1)
    np.testing.assert_allclose(frequencies, probs, atol=0.02)  # sampling error ~ 1/sqrt(20000)
    assert (dist.mode() == probs.argmax(-1)).all()


def test_restricted_categorical_acts_and_scores_over_the_legal_actions_only(rng):
    """Masked logits (SMAX's, Hanabi's legal actions): no illegal sample or mode, and
    log-probabilities, entropy and their gradients equal those of a categorical over the legal
    logits alone (each row's own set), computed here row by row."""
    keys = jax.random.split(rng, 4)
    rows = 16
    logits = 3.0 * jax.random.normal(keys[0], (rows, 6))
    legal = jax.random.bernoulli(keys[1], 0.5, (rows, 6)).at[:, 0].set(False)
    legal = legal.at[jnp.arange(rows), jax.random.randint(keys[2], (rows,), 1, 6)].set(True)  # one legal at least
    samples = jax.vmap(lambda k: Categorical(logits).restricted(legal).sample(k))(jax.random.split(keys[3], 2000))
    assert np.take_along_axis(np.asarray(legal), np.asarray(samples).T, axis=1).all(), "an illegal action was sampled"
    mode = np.asarray(Categorical(logits).restricted(legal).mode())
    assert np.asarray(legal)[np.arange(rows), mode].all()
    # a legal action of every row, the one sampled first
    actions = samples[0]

    def restricted_terms(logits):
        dist = Categorical(logits).restricted(legal)
        return dist.log_prob(actions), dist.entropy()

    legal_rows, action_rows = np.asarray(legal), np.asarray(actions)

    def reference_terms(logits):
        log_probs, entropies = [], []
        for row in range(rows):
            index = np.flatnonzero(legal_rows[row])
            row_log_probs = jax.nn.log_softmax(logits[row, index])
            log_probs.append(row_log_probs[np.flatnonzero(index == action_rows[row])[0]])
            entropies.append(-(jnp.exp(row_log_probs) * row_log_probs).sum())
        return jnp.stack(log_probs), jnp.stack(entropies)

    for got, expected in zip(restricted_terms(logits), jax.jit(reference_terms)(logits)):
        assert_allclose(got, expected)
    weights = jax.random.normal(keys[2], (2, rows))

    def weighted(terms):
        return lambda logits: sum((w * t).sum() for w, t in zip(weights, terms(logits)))

    grad = jax.grad(weighted(restricted_terms))(logits)
    assert_allclose(grad, jax.jit(jax.grad(weighted(reference_terms)))(logits))
    assert not np.asarray(grad)[~np.asarray(legal)].any(), "illegal logits took a gradient"


def test_clipped_gaussian_log_prob_and_env_action(rng):
    mean = jax.random.normal(rng, (3, 2))
    log_std = jax.random.normal(jax.random.fold_in(rng, 1), (3, 2)) * 0.3
    dist = Gaussian(mean, log_std, jnp.array([-1.0, -2.0]), jnp.array([1.0, 2.0]), squash="clip")
    raw = dist.sample(jax.random.fold_in(rng, 2)) * 3
    expected = normal_log_pdf(np.asarray(raw), np.asarray(mean), np.exp(log_std)).sum(-1)
    assert_allclose(dist.log_prob(raw), expected)
    assert_allclose(dist.entropy(), (np.asarray(log_std) + 0.5 * np.log(2 * np.pi * np.e)).sum(-1))
    assert_allclose(dist.env_action(raw), np.clip(raw, [-1.0, -2.0], [1.0, 2.0]))


def test_tanh_squashed_gaussian_is_a_change_of_variables(rng):
    low, high = jnp.array([-2.0]), jnp.array([2.0])
    dist = Gaussian(jnp.array([[0.3]]), jnp.array([[-0.2]]), low, high, squash="tanh")
    raw = jnp.array([[1.7]])
    action = dist.env_action(raw)
    assert_allclose(action, 2.0 * np.tanh(1.7))
    # density of a = 2 tanh(u): p(u) / |da/du|, da/du = 2 (1 - tanh(u)^2)
    expected = normal_log_pdf(1.7, 0.3, np.exp(-0.2)) - np.log(2 * (1 - np.tanh(1.7) ** 2))
    assert_allclose(dist.log_prob(raw), [expected])
    far = dist.env_action(jnp.array([[40.0]]))
    assert np.isfinite(dist.log_prob(jnp.array([[40.0]]))).all() and float(far[0, 0]) <= 2.0


@pytest.mark.parametrize("log_std", ["state_independent", "state_dependent"])
def test_actor_critic_continuous_heads(rng, log_std):
    action = BoxActions((-2.0,), (2.0,), log_std=log_std, init_log_std=-0.5)
    policy = ActorCritic(action, PolicyConfig(hidden_sizes=(32, 32)))
    obs = jax.random.normal(rng, (6, 3))
    variables = policy.init(rng, obs)
    dist, value = policy.apply(variables, obs)
    assert value.shape == (6,) and dist.mean.shape == (6, 1)
    actor = variables["params"]["actor"]
    if log_std == "state_independent":
        assert_allclose(actor["log_std"], [-0.5])
        assert_allclose(dist.log_std, np.full((6, 1), -0.5))
    else:
        assert "log_std_head" in actor and float(jnp.std(dist.log_std)) > 0  # depends on the state
    # the value head is a plain affine map of the critic torso's features
    critic = variables["params"]["critic"]
    hidden = obs
    for layer in ("Dense_0", "Dense_1"):
        hidden = np.tanh(hidden @ critic["torso"][layer]["kernel"] + critic["torso"][layer]["bias"])
    assert_allclose(value, (hidden @ critic["value"]["kernel"] + critic["value"]["bias"])[:, 0])


def test_cnn_actor_critic_and_q_network_on_images(rng):
    # NumPy observations and jitted init/apply: op by op, this test compiled ~70 programs.
    obs = np.asarray(jax.random.uniform(rng, (2, 10, 10, 4)))
    policy = ActorCritic(DiscreteActions(3), PolicyConfig(torso="cnn", hidden_sizes=(16,), activation="relu"))
    variables = jax.jit(policy.init)(rng, obs)
    apply = jax.jit(policy.apply)
    dist, value = apply(variables, obs)
    assert dist.logits.shape == (2, 3) and value.shape == (2,)
    # each example is processed independently of the others in the batch
    single, _ = apply(variables, obs[1:])
    assert_allclose(np.asarray(single.logits)[0], np.asarray(dist.logits)[1])
    q = QNetwork(5, PolicyConfig(hidden_sizes=(8,)))
    q_values = jax.jit(lambda o: q.apply(q.init(rng, o), o))(obs[:, 0, 0])
    assert q_values.shape == (2, 5) and np.isfinite(q_values).all()


def test_action_head_from_spaces_and_bad_input():
    class DiscreteSpace:
        n = 4

    class BoxSpace:
        low, high, shape = np.array([-1.0, 0.0]), np.array([1.0, 5.0]), (2,)

    assert action_head(DiscreteSpace()) == DiscreteActions(4)
    head = action_head(BoxSpace(), PolicyConfig(squash="tanh"))
    assert head.low == (-1.0, 0.0) and head.high == (1.0, 5.0) and head.squash == "tanh"
    with pytest.raises(ValueError, match=re.escape("policy.torso")):
        PolicyConfig(torso="transformer")
    for channels in ((0,), (16, -4)):  # 0 ignored the image, a negative size failed inside MLIR
        with pytest.raises(ValueError, match=re.escape("policy.cnn_channels")) as error:
            PolicyConfig(torso="cnn", cnn_channels=channels)
        assert error.value.key == "policy.cnn_channels"
    with pytest.raises(ValueError, match="every low must be below"):
        BoxActions((1.0,), (0.0,))
    with pytest.raises(ValueError, match="action_space"):
        action_head(object())
    # A head samples 0 .. n - 1; Discrete(3, start=-1) would clip those to 0, 1, 1 (-1 never taken).
    with pytest.raises(ValueError, match=re.escape("start 0), got Discrete(3, start=-1)")):
        action_head(Discrete(3, start=-1))

    class UnboundedSpace:  # a tanh-squashed action in it was NaN
        low, high, shape = np.array([-np.inf]), np.array([np.inf]), (1,)

    with pytest.raises(ValueError, match=re.escape("policy.squash 'tanh'")) as error:
        action_head(UnboundedSpace(), PolicyConfig(squash="tanh"))
    assert error.value.key == "policy.squash"
    assert action_head(UnboundedSpace()).squash == "clip"  # clipping to an unbounded box is fine
