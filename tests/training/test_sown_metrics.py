"""Sown metrics: a stand-in model whose two layers sow a vector ``expert_load`` and a scalar
``router_entropy`` into ``"metrics"``. The trainer logs their mean over layers and
micro-batches every step (the vector as ``expert_load/<i>``), equal to a hand computation,
and ``ember plot`` draws the vector's entries in one panel."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.cli import main
from ember.core.errors import EmberError
from ember.core.sharding import MeshConfig, make_mesh
from ember.training.config import CheckpointConfig, LoggingConfig, LoopConfig
from ember.training.metrics import read_metrics
from ember.training.optimizers import OptimConfig, ScheduleConfig
from ember.training.plot import metric_series
from ember.training.task import LossTerms, Task, apply_model
from ember.training.train_step import TrainState, train_step
from tests.tolerances import assert_allclose

BATCH, FEATURES, EXPERTS, STEPS = 8, 4, 3, 3


class SowingModel(nn.Module):
    """Two dense layers; layer ``i`` sows ``expert_load = (i + 1) * mean(|x|, 0)[:3]`` and
    ``router_entropy = mean(x) + i`` of its input ``x``, the model's input."""

    @nn.compact
    def __call__(self, x):
        h = x
        for i in range(2):
            self.sow("metrics", "expert_load", (i + 1) * jnp.mean(jnp.abs(x), axis=0)[:EXPERTS])
            self.sow("metrics", "router_entropy", jnp.mean(x) + i)
            h = nn.Dense(FEATURES, name=f"layer_{i}")(h)
        return h


class Batches:
    def __init__(self):
        self.position = 0

    def next(self):
        rng = np.random.default_rng([11, self.position])
        self.position += 1
        return {"x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32)}

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


class SowingTask(Task):
    model = SowingModel()

    def init_params(self, rng):
        return self.model.init(rng, jnp.ones((1, FEATURES)))["params"]

    def loss(self, params, batch, *, rng, teacher):
        outputs = apply_model(self.model, params, batch["x"])
        error = jnp.sum((outputs.output - batch["x"]) ** 2)
        return LossTerms(error, jnp.float32(BATCH // 2), metrics=outputs.metrics)

    def train_data(self):
        return Batches()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from ember.training.trainer import Trainer

    directory = tmp_path_factory.mktemp("sown")
    Trainer(
        SowingTask(),
        loop=LoopConfig(steps=STEPS, log_every=1, grad_accum=2),
        optim=OptimConfig(lr=1e-2, schedule=ScheduleConfig(kind="constant")),
        checkpoint=CheckpointConfig(every=100, async_save=False),
        logging=LoggingConfig(progress=False, tensorboard=True),
        run_dir=directory,
        mesh=make_mesh(MeshConfig(data=2), jax.devices()[:2]),
    ).train()
    return directory


def test_apply_model_averages_sown_metrics_over_layers(rng):
    x = jax.random.normal(rng, (5, FEATURES))
    params = SowingModel().init(rng, x)["params"]
    outputs = apply_model(SowingModel(), params, x)
    assert outputs.aux == {} and outputs.model_state is None
    assert_allclose(outputs.metrics["expert_load"], 1.5 * jnp.mean(jnp.abs(x), axis=0)[:EXPERTS])
    assert_allclose(outputs.metrics["router_entropy"], jnp.mean(x) + 0.5)


def test_a_metric_named_like_a_trainer_metric_is_an_error(rng):
    task = SowingTask()
    params = task.init_params(rng)
    tx = optax.sgd(0.1)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), model_state={})

    def loss(params, batch, *, rng, teacher):
        return LossTerms(jnp.sum(batch["x"]), jnp.float32(BATCH), metrics={"grad_norm": jnp.float32(1)})

    mask = jax.tree.map(lambda _: True, params)
    step = functools.partial(train_step, loss_fn=loss, tx=tx, schedule=lambda _: 0.1, mask=mask)
    with pytest.raises(EmberError, match="sows metric\\(s\\) grad_norm under names the trainer's own"):
        jax.eval_shape(step, state, {"x": jnp.ones((BATCH, FEATURES))}, None)


def test_logged_metrics_equal_the_hand_computation(run_dir):
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    data = Batches()
    for step in range(1, STEPS + 1):
        x = data.next()["x"].astype(np.float64)
        # Two equal micro-batches: the mean of their means is the batch mean.
        load = 1.5 * np.abs(x).mean(axis=0)[:EXPERTS]
        logged = [records[step][f"expert_load/{i}"] for i in range(EXPERTS)]
        assert_allclose(np.float32(logged), load, err_msg=f"step {step}")
        assert_allclose(np.float32(records[step]["router_entropy"]), x.mean() + 0.5, err_msg=f"step {step}")
        assert f"expert_load/{EXPERTS}" not in records[step]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_plot_draws_a_vector_metric_in_one_panel(run_dir, tmp_path, capsys):
    assert "expert_load/2" in metric_series(run_dir)
    assert main(["plot", str(run_dir), "--metrics", "expert_load", "--out", str(tmp_path / "load.png")]) == 0
    assert "(expert_load)" in capsys.readouterr().out
    data = (tmp_path / "load.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
