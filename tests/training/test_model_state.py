"""Model state in the trainer: a stand-in model keeps a running count, an input EMA and a
per-expert vector (sharded over ``expert``) in collection ``"stats"``. After N steps with
gradient accumulation they equal a hand computation (micro-batches applied in sequence);
the optimizer holds no state for them; a resumed run equals an uninterrupted one;
evaluation reads them; serving loads them with the parameters."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from ember.core.checkpoint import CheckpointManager
from ember.core.config import to_yaml
from ember.core.sharding import MeshConfig, make_mesh
from ember.models.config import ModelConfig
from ember.models.variables import as_variables, serving_weights, split_variables
from ember.serving.loading import load_model
from ember.training.config import CheckpointConfig, LoggingConfig, LoopConfig
from ember.training.optimizers import OptimConfig, ScheduleConfig
from ember.training.task import LossTerms, Task, apply_model
from tests.tolerances import assert_allclose

BATCH, FEATURES, SLOTS, DECAY, STEPS, ACCUM = 8, 4, 4, 0.8, 4, 2


class StatefulRegressor(nn.Module):
    """``x [batch, 4] -> [batch, 2]``: a dense layer on ``x`` plus the stored EMA of the inputs'
    batch means (so the state changes the output). Keeps ``stats/count`` (passes), ``stats/ema [4]`` and
    ``stats/slot_load [4]`` (the batch-summed ``|x|``, logical axis ``expert``)."""

    @nn.compact
    def __call__(self, x):
        count = self.variable("stats", "count", lambda: jnp.zeros((), jnp.float32))
        ema = self.variable("stats", "ema", lambda: jnp.zeros((FEATURES,), jnp.float32))
        load = self.variable(
            "stats", "slot_load", nn.with_logical_partitioning(lambda: jnp.zeros((SLOTS,), jnp.float32), ("expert",))
        )
        out = nn.Dense(2)(x + ema.value)  # the stored EMA; this pass's update comes after
        if self.is_mutable_collection("stats") and not self.is_initializing():
            count.value = count.value + 1
            ema.value = DECAY * ema.value + (1 - DECAY) * jnp.mean(x, axis=0)
            load.value = load.value + jnp.sum(jnp.abs(x), axis=0)
        return out


class Batches:
    """Endless random ``{"x", "y"}`` batches; batch ``i`` from ``default_rng([3, i])``."""

    def __init__(self):
        self.position = 0

    def next(self):
        rng = np.random.default_rng([3, self.position])
        self.position += 1
        return {"x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32) + 1.0,
                "y": rng.normal(size=(BATCH, 2)).astype(np.float32)}  # fmt: skip

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


class StatefulTask(Task):
    model = StatefulRegressor()

    def init_variables(self, rng):
        return self.model.init(rng, jnp.ones((1, FEATURES)))

    def init_params(self, rng):
        return self.init_variables(rng)["params"]

    def loss(self, params, batch, *, rng, teacher, model_state):
        outputs = apply_model(self.model, params, batch["x"], model_state=model_state)
        error = jnp.sum((outputs.output - batch["y"]) ** 2)
        return LossTerms(error, jnp.float32(batch["x"].shape[0]), model_state=outputs.model_state)

    def train_data(self):
        return Batches()

    def eval_data(self):
        data = Batches()
        data.restore({"position": 1000})
        return [data.next()]


def make_trainer(run_dir, *, steps=STEPS, resume=False):
    from ember.training.trainer import Trainer

    return Trainer(
        StatefulTask(),
        loop=LoopConfig(steps=steps, log_every=1, grad_accum=ACCUM, eval_every=100),
        optim=OptimConfig(lr=1e-2, schedule=ScheduleConfig(kind="constant")),
        checkpoint=CheckpointConfig(every=2, async_save=False),
        logging=LoggingConfig(progress=False, tensorboard=False),
        run_dir=run_dir,
        mesh=make_mesh(MeshConfig(data=2, expert=2), jax.devices()[:4]),
        seed=3,
        resume=resume,
    )


def hand_state(steps):
    """The stats after ``steps`` steps: micro-batch ``a`` of a batch is rows ``a, a + ACCUM, ...``,
    applied in order."""
    data, count, ema, load = Batches(), 0.0, np.zeros(FEATURES), np.zeros(SLOTS)
    for _ in range(steps):
        x = data.next()["x"].astype(np.float64)
        for micro in range(ACCUM):
            rows = x[micro::ACCUM]
            count, ema, load = count + 1, DECAY * ema + (1 - DECAY) * rows.mean(axis=0), load + np.abs(rows).sum(0)
    return {"count": count, "ema": ema, "slot_load": load}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("uninterrupted"))
    trainer.train()
    return trainer


def test_state_after_steps_equals_hand_computation_and_has_no_optimizer_state(uninterrupted):
    stats = uninterrupted.state.model_state["stats"]
    for name, expected in hand_state(STEPS).items():
        assert_allclose(stats[name], expected, err_msg=name)
    assert stats["slot_load"].sharding.spec == PartitionSpec("expert")
    assert stats["count"].sharding.is_fully_replicated
    # The optimizer state is exactly that of the params alone: nothing for "stats".
    params_only = uninterrupted.tx.init(uninterrupted.state.params)
    assert jax.tree.structure(uninterrupted.state.opt_state) == jax.tree.structure(params_only)
    assert uninterrupted.optimizer_state_bytes() == sum(leaf.nbytes for leaf in jax.tree.leaves(params_only))


def test_resume_equals_uninterrupted(uninterrupted, tmp_path):
    make_trainer(tmp_path, steps=2).train()
    resumed = make_trainer(tmp_path, resume=True)
    assert int(resumed.state.step) == 2
    assert_allclose(resumed.state.model_state["stats"]["ema"], hand_state(2)["ema"])
    resumed.train()
    for got, want in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(uninterrupted.state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_evaluation_reads_the_model_state(uninterrupted):
    params, stats = jax.device_get((uninterrupted.state.params, uninterrupted.state.model_state["stats"]))
    batch = StatefulTask().eval_data()[0]
    prediction = batch["x"] @ params["Dense_0"]["kernel"] + stats["ema"] @ params["Dense_0"]["kernel"]
    expected = np.mean(np.sum((prediction + params["Dense_0"]["bias"] - batch["y"]) ** 2, axis=1))
    assert_allclose(uninterrupted.evaluate(uninterrupted.state.params), expected, dtype=np.float32)
    zero_state = jax.tree.map(jnp.zeros_like, uninterrupted.state.model_state)
    assert abs(uninterrupted.evaluate(uninterrupted.state.params, zero_state) - expected) > 1e-2


def test_evaluation_takes_weights_placed_elsewhere(uninterrupted):
    """Weights read back from a checkpoint sit on one device (CheckpointManager restores there
    without a target): evaluate places them on the run's mesh. It raised jit's ValueError
    "Sharding passed to jit does not match the sharding on the respective arg"."""
    manager = CheckpointManager(uninterrupted.run_dir / "checkpoints", read_only=True)
    params = manager.restore_part("params")
    model_state = manager.restore_part("model_state")
    manager.close()
    assert len(jax.tree.leaves(params)[0].devices()) == 1
    expected = uninterrupted.evaluate(uninterrupted.state.params)
    assert uninterrupted.evaluate(params, model_state) == expected
    assert uninterrupted.evaluate(jax.device_get(params)) == expected  # host arrays too


def test_split_and_serving_weights():
    variables = StatefulRegressor().init(jax.random.key(0), jnp.ones((1, FEATURES)))
    params, state = split_variables({**variables, "losses": {}, "metrics": {}})
    assert set(state) == {"stats"} and params is variables["params"]
    assert serving_weights(params, {}) is params and as_variables(params) == {"params": params}
    assert as_variables(serving_weights(params, state)) == {"params": params, "stats": state["stats"]}


LM = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_seq_len=16, attention_impl="xla")


def test_serving_loads_the_model_state_with_the_params(tmp_path, rng):
    """A run's checkpoint with model state: ``load_model`` returns it with the params, as the
    ``{"params", <state>}`` weights serving's step applies (through ``as_variables``)."""
    keys = jax.random.split(rng, 3)
    params = {  # the loader reads a tree, it does not build the model: a small one in the scanned layout
        "embed": {"embedding": jax.random.normal(keys[0], (LM.vocab_size, LM.d_model))},
        "layers": {"block_0": {"scale": jax.random.normal(keys[2], (LM.num_layers, LM.d_model))}},
    }
    balance = {"layers": {"bias": jax.random.normal(keys[1], (LM.num_layers, 4))}}
    (tmp_path / "config.yaml").write_text("model:\n" + textwrap.indent(to_yaml(LM), "  "))
    with CheckpointManager(tmp_path / "checkpoints", async_save=False) as manager:
        manager.save(3, {"step": jnp.int32(3), "params": params, "model_state": {"balance": balance}})
    loaded = load_model(tmp_path)
    variables = as_variables(loaded.params)
    assert set(variables) == {"params", "balance"}
    np.testing.assert_array_equal(variables["balance"]["layers"]["bias"], balance["layers"]["bias"])
    np.testing.assert_array_equal(variables["params"]["embed"]["embedding"], params["embed"]["embedding"])
