"""RL training benchmark: wall-clock for Ember PPO to solve CartPole (compile reported
separately), on Ember's CartPole and on gymnax's CartPole through ``GymnaxEnv``, side by
side, and for PQN (``configs/rl/pqn_cartpole.yaml``, 200k env steps) on Ember's;
aggregate env-steps/s of the PPO training loop for 1 and 8 vmapped seeds; and training
env-steps/s in the published MinAtar settings' batch shapes: PQN as
``configs/rl/pqn_minatar.yaml`` (the PQN paper's 128 environments x 32 steps) on every
MinAtar game, and PPO as ``configs/rl/ppo_breakout_minatar.yaml`` (PureJaxRL's MinAtar
64 x 128) on Breakout, each over a shortened run of ``MINATAR_TIMESTEPS``. The papers' own
figures were measured on GPUs; a CPU row is not comparable to them, so the JSON says which
device measured it.

"Solved" is the issue's bar: greedy mean return >= 475 over 100 evaluation episodes after
the run of ``configs/rl/ppo_cartpole.yaml`` (150k env steps). Compile time is measured by
lowering and compiling ``jax.jit(train)``; train time is one call of the compiled program.

    python -m benchmarks.rl          # writes benchmarks/results/rl-<device>.json

The sizes are the same on CPU and GPU (CartPole PPO is latency-bound; a GPU run measures
the same program).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.harness import on_gpu, print_table, write_results
from ember.core.config import load_config
from ember.envs import EnvConfig, make_from_config
from ember.training.rl.config import RLConfig
from ember.training.rl.evaluate import evaluate
from ember.training.rl.experiment import ALGORITHMS

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "rl" / "ppo_cartpole.yaml"
PQN_CONFIG = CONFIG.with_name("pqn_cartpole.yaml")
MINATAR_GAMES = ("Asterix-MinAtar", "Breakout-MinAtar", "Freeway-MinAtar", "Seaquest-MinAtar", "SpaceInvaders-MinAtar")
MINATAR_RUNS = [(CONFIG.with_name("pqn_minatar.yaml"), game) for game in MINATAR_GAMES]
MINATAR_RUNS.append((CONFIG.with_name("ppo_breakout_minatar.yaml"), "Breakout-MinAtar"))
MINATAR_TIMESTEPS = 65_536
SOLVED_RETURN = 475.0


def solve_cartpole(source: str, config: RLConfig) -> dict:
    """Compile seconds, train seconds and the 100-episode greedy mean return of one run of
    ``config.algo``."""
    env, env_params = make_from_config(EnvConfig(id="CartPole-v1", source=source))
    algorithm = ALGORITHMS[config.algo]
    section = algorithm.section(config)
    train = jax.jit(algorithm.make_train(section, env, env_params, None))
    rng = jax.random.key(config.seed)
    start = time.perf_counter()
    compiled = train.lower(rng).compile()  # compiled once, reused for the timed run
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    result = jax.block_until_ready(compiled(rng))
    train_s = time.perf_counter() - start
    act = algorithm.make_act(section, env, env_params, result["params"], True, None)
    returns, _ = evaluate(act, env, env_params, jax.random.key(1), num_episodes=100)
    mean_return = float(np.mean(returns))
    return {
        "algo": config.algo,
        "env": f"{source}:CartPole-v1",
        "compile_s": compile_s,
        "train_s": train_s,
        "total_s": compile_s + train_s,
        "env_steps": algorithm.num_updates(section) * algorithm.steps_per_update(section),
        "eval_mean_return": mean_return,
        "solved": mean_return >= SOLVED_RETURN,
    }


def steps_per_second(config: RLConfig, num_seeds: int) -> dict:
    """Aggregate env-steps/s of ``num_seeds`` vmapped training runs of ``config.algo``
    (compile and a warm-up run excluded)."""
    env, env_params = make_from_config(config.env)
    algorithm = ALGORITHMS[config.algo]
    section = algorithm.section(config)
    train = jax.jit(jax.vmap(algorithm.make_train(section, env, env_params, None)))
    keys = jax.random.split(jax.random.key(0), num_seeds)
    compiled = train.lower(keys).compile()
    jax.block_until_ready(compiled(keys))  # warm-up
    start = time.perf_counter()
    jax.block_until_ready(compiled(keys))
    seconds = time.perf_counter() - start
    steps = num_seeds * algorithm.num_updates(section) * algorithm.steps_per_update(section)
    return {
        "algo": config.algo,
        "env": config.env.id,
        "seeds": num_seeds,
        "env_steps": steps,
        "seconds": seconds,
        "env_steps_per_s": steps / seconds,
    }


def minatar_throughput(path: Path, game: str) -> dict:
    """``steps_per_second`` of one seed of ``path``'s algorithm on ``game``, shortened to
    ``MINATAR_TIMESTEPS`` env steps in the config's own batch shape."""
    algo = load_config(RLConfig, path).algo
    config = load_config(RLConfig, path, [f"env.id={game}", f"{algo}.total_timesteps={MINATAR_TIMESTEPS}"])
    section = ALGORITHMS[algo].section(config)
    shape = {"num_envs": section.num_envs, "num_steps": section.num_steps}
    return {"config": str(path.relative_to(path.parents[2])), **shape, **steps_per_second(config, 1)}


def main() -> None:
    config = load_config(RLConfig, CONFIG)
    if not on_gpu():
        print("no GPU found: measuring on CPU")
    solve_rows = [solve_cartpole("ember", config)]
    try:
        import gymnax  # noqa: F401

        solve_rows.append(solve_cartpole("gymnax", config))
    except ImportError:
        print("gymnax is not installed: skipping the gymnax CartPole column")
    solve_rows.append(solve_cartpole("ember", load_config(RLConfig, PQN_CONFIG)))
    columns = ["algo", "env", "compile_s", "train_s", "total_s", "env_steps", "eval_mean_return", "solved"]
    print_table(solve_rows, columns)
    gymnax_row = next((r for r in solve_rows if r["env"].startswith("gymnax")), None)
    if gymnax_row is not None:
        print(f"gymnax total / ember total = {gymnax_row['total_s'] / solve_rows[0]['total_s']:.2f}")
    print(f"PQN total / PPO total = {solve_rows[-1]['total_s'] / solve_rows[0]['total_s']:.2f}")
    throughput_rows = [steps_per_second(config, seeds) for seeds in (1, 8)]
    print_table(throughput_rows, ["algo", "env", "seeds", "env_steps", "seconds", "env_steps_per_s"])
    minatar_rows = [minatar_throughput(path, game) for path, game in MINATAR_RUNS]
    print_table(minatar_rows, ["algo", "env", "num_envs", "num_steps", "env_steps", "seconds", "env_steps_per_s"])
    path = write_results(
        "rl",
        {
            "config": str(CONFIG.relative_to(CONFIG.parents[2])),
            "solve_cartpole": solve_rows,
            "training_throughput": throughput_rows,
            "minatar_training_throughput": minatar_rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
