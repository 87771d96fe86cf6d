"""Reinforcement learning: the PPO family (PPO, IPPO, MAPPO) and DQN, each a ``make_train``
that wires the pure functions of :mod:`.gae` and :mod:`.losses` into one jittable
``train(rng)`` (DESIGN.md section 6)."""
