"""IPPO/MAPPO on MPE simple_spread: critic inputs, and both beating the random policy; on a
small game whose agents act under masks and end one by one."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from ember.core.config import load_config
from ember.core.errors import ConfigError
from ember.envs import EnvParams, EnvState, MultiAgentEnvironment, make_from_config
from ember.envs.spaces import Box, Dict, Discrete
from ember.envs.wrappers import MultiAgentObsStats, RunningMeanVar
from ember.models.policies import Categorical, PolicyConfig
from ember.training.rl import multi_agent_ppo
from ember.training.rl.agent_view import concatenated_observations, multi_agent_view
from ember.training.rl.config import RLConfig
from ember.training.rl.evaluate import evaluate
from ember.training.rl.experiment import ALGORITHMS
from ember.training.rl.losses import ppo_loss
from ember.training.rl.ppo import PPOConfig, PPOHyperparams, learner_envs, minibatch_loss
from tests import xla_settings
from tests.tolerances import assert_allclose

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "rl"


def test_concatenated_observations_are_every_observation_and_the_agent_id(rng):
    obs = jax.random.normal(rng, (2, 3, 4))  # [batch, agents, obs_dim]
    state = np.asarray(concatenated_observations(obs))
    assert state.shape == (2, 3, 3 * 4 + 3)
    for agent in range(3):
        np.testing.assert_array_equal(state[:, agent, :12], np.asarray(obs).reshape(2, 12))
        np.testing.assert_array_equal(state[:, agent, 12:], np.tile(np.eye(3)[agent], (2, 1)))


@struct.dataclass
class PickState(EnvState):
    legal: jax.Array  # bool [agents, actions]


class PickTheHighestLegal(MultiAgentEnvironment):
    """Two agents each see which of 4 actions are legal (a fresh random set each step, never
    empty) and earn ``action / 3`` for a legal action; the environment does not enforce the
    masks: an illegal action pays 10, a trap for a learner that ignores them. ``agent_1`` ends
    (is ``terminated``) after its 2nd step; from then on only action 0 is legal for it and it
    earns nothing. Episodes last ``max_steps_in_episode`` steps."""

    reset_noise_words = 1
    transition_noise_words = 1
    masks_actions = True

    def __init__(self):
        self.agents = ["agent_0", "agent_1"]

    @property
    def default_params(self):
        return EnvParams(max_steps_in_episode=4)

    def _draw(self, noise, time):
        bits = (noise[0] >> jnp.arange(8, dtype=jnp.uint32)).reshape(2, 4) & 1
        legal = (bits == 1) | (jnp.arange(4) == (noise[0] >> 8) % 4)
        dead = (time >= 2) & (jnp.arange(2) == 1)[:, None]
        legal = jnp.where(dead, jnp.arange(4) == 0, legal)
        obs = {agent: legal[i].astype(jnp.float32) for i, agent in enumerate(self.agents)}
        return obs, PickState(time=time, legal=legal)

    def reset_env(self, noise, params):
        return self._draw(noise, jnp.int32(0))

    def step_env(self, noise, state, actions, params):
        obs, next_state = self._draw(noise, state.time + 1)
        rewards, terminated = {}, {"__all__": jnp.bool_(False)}
        for i, agent in enumerate(self.agents):
            legal = state.legal[i, actions[agent]]
            alive = (i == 0) | (state.time < 2)
            rewards[agent] = jnp.where(legal, actions[agent] / 3.0, 10.0) * alive
            terminated[agent] = ~((i == 0) | (state.time + 1 < 2))
        return obs, next_state, rewards, terminated, {}

    def action_masks(self, state, params):
        return {agent: state.legal[i] for i, agent in enumerate(self.agents)}

    def observation_space(self, params):
        return Dict({agent: Box(0.0, 1.0, (4,)) for agent in self.agents})

    def action_space(self, params):
        return Dict({agent: Discrete(4) for agent in self.agents})


def test_the_learner_reads_each_agents_own_end():
    """``agent_1`` ends on its 2nd step: the learner's ``terminated`` is its own (it was the
    episode's for every agent, so agent_1 bootstrapped past its end)."""
    env = PickTheHighestLegal()
    params = env.default_params
    _, state = env.reset(jax.random.key(0), params)
    view = multi_agent_view(env.agents, centralised_critic=False, action_masks=True)
    ends = []
    for t in range(4):
        actions = {agent: jnp.argmax(env.action_masks(state, params)[agent]) for agent in env.agents}
        _, state, rewards, terminated, truncated, _ = env.step(jax.random.key(t), state, actions, params)
        _, learner_terminated, learner_truncated = view.step_arrays(
            *jax.tree.map(lambda x: x[None], (rewards, terminated, truncated))
        )
        ends.append((learner_terminated[0].tolist(), learner_truncated[0].tolist()))
    assert ends == [([False, False], [False, False]), ([False, True], [False, False]),
                    ([False, True], [False, False]), ([False, True], [True, True])]  # fmt: skip


def test_the_ppo_loss_scores_the_stored_actions_under_their_stored_masks(rng):
    """With ``legal_actions`` in the minibatch, the loss (and its gradient) is PPO's on the
    log-probabilities and entropy of a categorical over each element's legal logits alone."""
    keys = jax.random.split(rng, 6)
    logits = 2.0 * jax.random.normal(keys[0], (16, 2, 5))  # [batch, agents, actions]
    legal = jax.random.bernoulli(keys[1], 0.6, logits.shape).at[..., 2].set(True)
    actions = jax.random.categorical(keys[2], jnp.where(legal, 0.0, -jnp.inf))  # legal ones
    minibatch = {
        "raw_action": actions,
        "log_prob": jax.random.normal(keys[3], (16, 2)) - 1.5,
        "advantages": jax.random.normal(keys[4], (16, 2)),
        "value": jnp.zeros((16, 2)),
        "returns": jax.random.normal(keys[5], (16, 2)),
        "legal_actions": legal,
    }
    hp = PPOHyperparams.from_config(PPOConfig())

    def loss(logits):
        return minibatch_loss(Categorical(logits), jnp.zeros((16, 2)), minibatch, hp, normalize_advantage=True)[0]

    def reference(logits):
        log_probs = jnp.where(legal, jax.nn.log_softmax(jnp.where(legal, logits, -jnp.inf)), 0.0)
        chosen = jnp.take_along_axis(log_probs, actions[..., None], -1)[..., 0]
        entropy = -(jnp.exp(log_probs) * log_probs * legal).sum(-1)
        return ppo_loss(chosen, minibatch["log_prob"], minibatch["advantages"], jnp.zeros((16, 2)),
                        minibatch["value"], minibatch["returns"], entropy, clip_eps=0.2, value_clip_eps=0.2,
                        value_coef=0.5, entropy_coef=0.01)[0]  # fmt: skip

    assert_allclose(loss(logits), reference(logits))
    assert_allclose(jax.grad(loss)(logits), jax.grad(reference)(logits))


@pytest.mark.parametrize("algo", ["ippo", "mappo"])
def test_ippo_and_mappo_act_under_masks_and_learn_among_the_legal_actions(algo):
    """No rollout step takes an illegal action (an episode's return per agent would exceed its
    legal maximum, (4 + 2) / 2 = 3, by 4.5 or more), and the greedy policy picks the highest
    legal action. Greedy return per agent over 256 episodes: 2.465 for IPPO and MAPPO on each of
    seeds 0-3, the return of always picking the highest legal action; a uniformly random legal
    action gets 1.524 (a margin of 0.94; asserted: 0.6)."""
    env = PickTheHighestLegal()
    params = env.default_params
    config = PPOConfig(num_envs=8, num_steps=16, total_timesteps=8 * 16 * 25, num_minibatches=2,
                       learning_rate=3e-3, entropy_coef=0.0, policy=PolicyConfig(hidden_sizes=(32,)))  # fmt: skip
    result = jax.jit(multi_agent_ppo.make_train(config, env, params, centralised_critic=algo == "mappo"))(
        jax.random.key(0)
    )
    returns = np.asarray(result["metrics"]["episode_return"])
    assert returns.max() <= 3.0 + 1e-5, "an illegal action was taken in a rollout"
    act = multi_agent_ppo.make_act(multi_agent_ppo.make_policy(config, env, params), result["params"], env.agents)
    trained, _ = evaluate(act, env, params, jax.random.key(1), 256)

    def random_legal(obs, key, legal_actions):
        keys = jax.random.split(key, 2)
        return {
            a: jax.random.categorical(k, jnp.where(legal_actions[a], 0.0, -jnp.inf)) for a, k in zip(env.agents, keys)
        }

    random, _ = evaluate(random_legal, env, params, jax.random.key(1), 256)
    assert float(trained.mean()) > float(random.mean()) + 0.6, (float(trained.mean()), float(random.mean()))
    assert float(trained.max()) <= 3.0 + 1e-5


@pytest.mark.parametrize(
    ("name", "critic_features"),
    [("ippo_simple_spread", 18), ("mappo_simple_spread", 3 * 18 + 3), ("ippo_smax_3m", 75), ("mappo_smax_3m", 72 + 3)],
)
def test_algo_selects_the_critic_input(name, critic_features):
    """The launcher's ``mappo`` trains a critic on the global state and a one-hot id: on MPE
    (no global state of its own) the 3 agents' 18-dim observations, on SMAX 3m its 72-dim
    ``world_state`` (it was the 3 allies' 75-dim observations, 228 features); ``ippo`` one on
    the agent's own observation (SMAX 3m: 75). With ``normalize_observations`` (refused before)
    ``train`` returns one set of statistics for every agent's observation (SMAX 3m: 75 values,
    simple_spread: 18) and one for the global state where the environment has one (SMAX's
    72-value world_state, kept for IPPO too)."""
    config = load_config(RLConfig, CONFIGS / f"{name}.yaml", ["ppo.normalize_observations=true"])
    env, env_params = make_from_config(config.env)
    train = ALGORITHMS[config.algo].make_train(config.ppo, env, env_params, None)
    result = jax.eval_shape(train, jax.random.key(0))  # traced, not compiled or run
    first_layer = result["params"]["params"]["critic"]["torso"]["Dense_0"]["kernel"]
    assert first_layer.shape[0] == critic_features
    stats = result["obs_stats"]
    assert isinstance(stats, MultiAgentObsStats)
    obs_shape = (75,) if "smax" in name else (18,)
    assert stats.agents.mean.shape == stats.agents.var.shape == obs_shape
    if "smax" in name:
        assert stats.global_state.mean.shape == stats.global_state.var.shape == (72,)
    else:
        assert stats.global_state is None


def test_mappo_critic_reads_the_smax_world_state_of_enemies_no_ally_sees(rng):
    """On SMAX 3m, MAPPO's critic (the view ``make_train`` uses, on the learner's batched
    environments) reads JaxMARL's ``world_state`` and the agent id: its values change with the
    health of an enemy that no ally sees at the start (the allies' observations, which IPPO's
    critic and, concatenated, MAPPO's before read, stay the same)."""
    config = load_config(RLConfig, CONFIGS / "mappo_smax_3m.yaml", ["ppo.num_envs=4"])
    env, params = make_from_config(config.env)
    envs = learner_envs(config.ppo, env, config.ppo.gamma)
    policy = multi_agent_ppo.make_policy(config.ppo, env, params)
    views = {
        "mappo": multi_agent_ppo.make_view(env, centralised_critic=True),
        "ippo": multi_agent_ppo.make_view(env, centralised_critic=False),
        "concatenated": multi_agent_view(env.agents, centralised_critic=True),
    }

    @jax.jit
    def critic_values(key):
        obs, state = envs.reset(key, params)
        smax = state.env_state.env_state  # LogEnvState > JaxMARLState > HeuristicEnemySMAX's state
        health = smax.state.unit_health.at[:, 3].multiply(0.5)  # units: 3 allies, then enemy_0
        hurt_smax = smax.replace(state=smax.state.replace(unit_health=health))
        hurt = state.replace(env_state=state.env_state.replace(env_state=hurt_smax))
        hurt_obs = jax.vmap(env.jaxmarl_env.get_obs)(hurt_smax)
        out = {"obs": obs, "hurt_obs": hurt_obs, "world_state": envs.global_state(state, params)}
        for name, view in views.items():
            seen = view.observation(obs, envs, state, params)
            hurt_seen = view.observation(hurt_obs, envs, hurt, params)
            policy_params = policy.init(jax.random.key(1), *view.policy_inputs(seen))
            out[name] = [policy.apply(policy_params, *view.value_inputs(s), method="value") for s in (seen, hurt_seen)]
            out[f"{name}_input"] = view.value_inputs(seen)[0]
        return out

    out = jax.device_get(critic_values(rng))
    for agent in env.agents:  # no ally sees enemy_0
        np.testing.assert_array_equal(out["hurt_obs"][agent], out["obs"][agent])
    mappo_input = out["mappo_input"]  # [envs, agents, 72 + 3]
    np.testing.assert_array_equal(mappo_input[..., :72], np.repeat(out["world_state"][:, None], 3, axis=1))
    np.testing.assert_array_equal(mappo_input[..., 72:], np.broadcast_to(np.eye(3), (4, 3, 3)))
    assert np.all(np.abs(out["mappo"][0] - out["mappo"][1]) > 1e-6), "MAPPO's values read enemy_0's health"
    for name in ("ippo", "concatenated"):
        np.testing.assert_array_equal(out[name][0], out[name][1])


def test_reward_normalisation_is_refused_for_multi_agent_training():
    """Refused when the config loads (keyed by the full path), and by ``make_train`` itself."""
    with pytest.raises(ConfigError, match=r"ppo\.normalize_rewards is not supported for multi-agent") as info:
        load_config(RLConfig, CONFIGS / "ippo_simple_spread.yaml", ["ppo.normalize_rewards=true"])
    assert info.value.key == "ppo.normalize_rewards"
    config = load_config(RLConfig, CONFIGS / "ippo_simple_spread.yaml")
    env, env_params = make_from_config(config.env)
    with pytest.raises(ConfigError, match="normalize_rewards is not supported for multi-agent"):
        multi_agent_ppo.make_train(dataclasses.replace(config.ppo, normalize_rewards=True), env, env_params)


def test_make_act_normalises_every_agents_observation_with_the_frozen_statistics(rng):
    """``make_act(..., obs_stats=...)`` acts as the plain policy on observations normalised by
    hand with the agents' statistics (the global state's are the critic's, not the actor's)."""
    config = load_config(RLConfig, CONFIGS / "mappo_simple_spread.yaml", ["ppo.policy.hidden_sizes=[16]"])
    env, env_params = make_from_config(config.env)
    policy = multi_agent_ppo.make_policy(config.ppo, env, env_params)
    keys = jax.random.split(rng, 6)
    obs = {agent: 3.0 + 2.0 * jax.random.normal(k, (64, 18)) for agent, k in zip(env.agents, keys)}
    stacked = jnp.stack([obs[agent] for agent in env.agents], axis=1)
    params = policy.init(keys[3], stacked, concatenated_observations(stacked))
    agent_stats = RunningMeanVar(
        3.0 + jax.random.normal(keys[4], (18,)), jax.random.uniform(keys[5], (18,), minval=1.0, maxval=8.0), 1e4
    )

    @jax.jit
    def actions(obs, params, agent_stats):
        stats = MultiAgentObsStats(agent_stats, RunningMeanVar.create((7,)))
        act = multi_agent_ppo.make_act(policy, params, env.agents, obs_stats=stats)
        plain = multi_agent_ppo.make_act(policy, params, env.agents)
        scale = jnp.sqrt(agent_stats.var + 1e-8)
        by_hand = plain({agent: (o - agent_stats.mean) / scale for agent, o in obs.items()}, rng)
        return act(obs, rng), by_hand, plain(obs, rng)

    actions, by_hand, raw_actions = actions(obs, params, agent_stats)
    for agent in env.agents:
        np.testing.assert_array_equal(actions[agent], by_hand[agent])
    assert any(np.any(actions[a] != raw_actions[a]) for a in env.agents), "the statistics change some action"
    with pytest.raises(ValueError, match="MultiAgentObsStats"):
        multi_agent_ppo.make_act(policy, params, env.agents, obs_stats=agent_stats)


@pytest.mark.parametrize(("name", "section"), [("ippo_simple_spread.yaml", "ppo"), ("mappo_simple_spread.yaml", "ppo"),
                                             ("isac_simple_spread_continuous.yaml", "sac")])  # fmt: skip
def test_a_cnn_torso_for_flat_agent_observations_is_a_config_error(name, section):
    """As for one agent: refused when the config loads, not an IndexError when training traces."""
    with pytest.raises(
        ConfigError, match=r"torso 'cnn' takes observations of 3 dimension\(s\).* gives \(18,\)"
    ) as info:
        load_config(RLConfig, CONFIGS / name, [f"{section}.policy.torso=cnn"])
    assert info.value.key == f"{section}.policy.torso"


@pytest.mark.slow
@pytest.mark.xla_optimized  # whole training runs: run time outweighs compile time
@pytest.mark.parametrize(
    ("config_name", "min_margin", "overrides"),
    [
        # measured on CPU, greedy return per agent over 100 episodes (std error of each mean ~0.4):
        # IPPO -17.5 to -18.7 over seeds 0-9, through JaxMARL -19.0 to -19.8 (seeds 0-2), random -26.4
        ("ippo_simple_spread.yaml", 5.0, []),
        ("ippo_simple_spread_jaxmarl.yaml", 5.0, []),
        # MAPPO -18.5 (seed 0), -17.5 to -18.7 over seeds 0-15 (see the config), random -26.4
        ("mappo_simple_spread.yaml", 5.0, []),
        # continuous actions (a Gaussian policy): IPPO -19.4 / -19.1 / -18.6 (seeds 0-2), random -24.8
        ("ippo_simple_spread_continuous.yaml", 3.0, []),
        # independent SAC with a shared actor, here with 32 environments (half the gradient
        # steps of the shipped 16): -18.9 / -18.6 / -20.2 (seeds 0-2), random -24.8
        ("isac_simple_spread_continuous.yaml", 3.0, ["sac.num_envs=32"]),
        # IPPO on simple_reference (goals told by the other agent): -18.0 / -18.8 / -17.7, random -28.0
        ("ippo_simple_reference.yaml", 6.0, []),
    ],
)
def test_shipped_multi_agent_config_beats_random_on_mpe(config_name, min_margin, overrides):
    """IPPO on Ember's simple_spread and on JaxMARL's own through the adapter (same settings),
    MAPPO on Ember's, IPPO and ISAC with continuous actions; trained through the launcher's
    algorithm table (``algo`` selects the centralised critic, or SAC)."""
    config = load_config(RLConfig, CONFIGS / config_name, overrides)
    algorithm = ALGORITHMS[config.algo]
    section = algorithm.section(config)
    env, env_params = make_from_config(config.env)
    result = jax.jit(algorithm.make_train(section, env, env_params, None))(jax.random.key(config.seed))
    act = algorithm.make_act(section, env, env_params, result["params"], True, None)

    spaces = env.action_space(env_params).spaces

    def random_actions(obs, key):
        keys = jax.random.split(key, len(env.agents))
        return {agent: jax.vmap(spaces[agent].sample)(jax.random.split(k, 100)) for agent, k in zip(env.agents, keys)}

    with xla_settings.fast_compiles():  # 25-step evaluations: compiling them optimized cost seconds
        trained, _ = evaluate(act, env, env_params, jax.random.key(1), 100)
        random, _ = evaluate(random_actions, env, env_params, jax.random.key(1), 100)
    margin = float(trained.mean()) - float(random.mean())
    assert margin > min_margin, f"{config.algo} {float(trained.mean()):.2f} vs random {float(random.mean()):.2f}"
    losses = [np.asarray(v) for k, v in result["metrics"].items() if k.endswith("loss")]  # PPO's; SAC's two
    assert losses and all(np.isfinite(loss[~np.isnan(loss)]).all() for loss in losses)
    assert jnp.all(result["metrics"]["episodes"] > 0)
