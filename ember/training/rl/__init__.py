"""Reinforcement learning (DESIGN.md section 6): the math in top-level pure functions, and
for each algorithm a ``make_train`` that wires it into one jittable, vmappable ``train(rng)``.

- :mod:`.gae`, :mod:`.losses`: GAE over auto-resetting rollouts; PPO and Q-learning losses.
- :mod:`.optimization`: the optimizer and the minibatch epochs of the on-policy algorithms;
  :mod:`.episode_stats`: the episode statistics of a rollout (every algorithm's metrics).
- :mod:`.ppo`: PPO for discrete and continuous actions, and the update loop IPPO/MAPPO share.
- :mod:`.multi_agent_ppo`: IPPO and MAPPO with parameter sharing (multi-agent dict API).
- :mod:`.dqn`, :mod:`.replay_buffer`: DQN with a target network and an on-device replay buffer.
- :mod:`.evaluate`: N whole episodes of a policy, one compiled program per policy architecture;
  :mod:`.policy_act`: the ``act`` of a trained actor that every ``make_act`` but DQN's builds.
- :mod:`.config`, :mod:`.experiment`, :mod:`.entry`: the ``rl`` kind of ``ember train``
  (the environment comes from ``ember.envs.make_from_config``)
  (run directory with config, metrics, checkpoint, ``eval.json``); :mod:`.eval_command`:
  ``ember eval`` of an RL run.
"""
