"""The task-generic trainer: a non-LM task trains, checkpoints and resumes exactly; frozen
parameters carry no optimizer state and match a hand-written optax loop; auxiliary losses
are weighted, added and logged; a frozen teacher drives a distillation loss; hooks run on
their interval."""

import json
import math
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.core.checkpoint import CheckpointManager
from ember.core.errors import ConfigError, DataError, EmberError
from ember.core.sharding import DEFAULT_RULES, MeshConfig, make_mesh
from ember.models.config import ModelConfig, SSMConfig
from ember.models.decoder import DecoderLM
from ember.training import trainer as trainer_module
from ember.training.config import CheckpointConfig, LoggingConfig, LoopConfig
from ember.training.loss_scaling import LossScaleState
from ember.training.mesh_checks import undivided_axes_message
from ember.training.optimizers import OptimConfig, ScheduleConfig, make_optimizer
from ember.training.task import LossTerms, Task, apply_with_aux
from ember.training.throughput import ThroughputWindow
from ember.training.trainable import map_paths, param_paths, select
from ember.training.trainer import NonFiniteLossError, Trainer, initialisation_compiler_options
from tests.tolerances import assert_allclose
from tests.xla_settings import xla_optimizations

WIDTH, DEPTH, BATCH = 16, 6, 8


class DeepMlp(nn.Module):
    """``x [batch, 4] -> y [batch, 2]`` through ``DEPTH`` tanh layers; sows the mean squared
    activation of its last hidden layer as the auxiliary loss ``activation_l2``."""

    @nn.compact
    def __call__(self, x):
        for i in range(DEPTH):
            x = jnp.tanh(nn.Dense(WIDTH, name=f"layer_{i}")(x))
        self.sow("losses", "activation_l2", jnp.mean(x**2))
        return nn.Dense(2, name="head")(x)


class RegressionBatches:
    """Endless ``{"x", "y"}`` batches of a fixed random linear map plus noise; batch ``i``
    is drawn from ``default_rng([seed, i])``, so the position is one integer."""

    def __init__(self, seed: int = 7):
        self.seed, self.position = seed, 0
        self.target = np.random.default_rng(seed).normal(size=(4, 2)).astype(np.float32)

    def next(self):
        rng = np.random.default_rng([self.seed, self.position])
        self.position += 1
        x = rng.normal(size=(BATCH, 4)).astype(np.float32)
        return {"x": x, "y": x @ self.target + 0.1 * rng.normal(size=(BATCH, 2)).astype(np.float32)}

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


class Regression(Task):
    """Mean squared error (summed over outputs, averaged over examples); ``frozen_layers``
    are frozen by the task's own mask; ``use_aux`` reports the sown loss."""

    model = DeepMlp()

    def __init__(self, frozen_layers=(), use_aux=False):
        self.frozen_layers, self.use_aux = frozen_layers, use_aux

    def init_params(self, rng):
        return self.model.init(rng, jnp.zeros((1, 4)))["params"]

    def loss(self, params, batch, *, rng, teacher):
        prediction, aux = apply_with_aux(self.model, params, batch["x"])
        error = jnp.sum((prediction - batch["y"]) ** 2)
        return LossTerms(error, jnp.float32(batch["x"].shape[0]), aux if self.use_aux else {})

    def train_data(self):
        return RegressionBatches()

    def trainable(self, params):
        return map_paths(lambda path, _: path.split("/")[0] not in self.frozen_layers, params)


def make_trainer(task, run_dir, *, steps=8, resume=False, optim=None, **loop):
    return Trainer(
        task,
        loop=LoopConfig(steps=steps, **{"log_every": 1, **loop}),
        optim=optim or OptimConfig(lr=1e-2, schedule=ScheduleConfig(kind="constant")),
        checkpoint=CheckpointConfig(every=2, async_save=False),
        logging=LoggingConfig(progress=False, tensorboard=False),
        run_dir=run_dir,
        mesh=make_mesh(MeshConfig(data=2), jax.devices()[:2]),
        seed=3,
        resume=resume,
    )


def logged(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {entry["step"]: entry for entry in lines if "loss" in entry}


def test_custom_task_trains_checkpoints_and_resumes_exactly(tmp_path):
    reference = make_trainer(Regression(), tmp_path / "reference")
    seen = []
    reference.add_hook(lambda info: seen.append(info.step), every=3)
    summary = reference.train()
    assert seen == [3, 6] and summary["steps"] == 8 and summary["last_checkpoint"] == 8
    losses = [logged(tmp_path / "reference")[step]["loss"] for step in range(1, 9)]
    assert losses[-1] < 0.5 * losses[0]  # it learns the linear map

    class Crash(Exception):
        pass

    def crash(info):
        raise Crash

    interrupted = make_trainer(Regression(), tmp_path / "interrupted")
    interrupted.add_hook(crash, every=5)  # after step 5; the last checkpoint is step 4
    with pytest.raises(Crash):
        interrupted.train()
    resumed = make_trainer(Regression(), tmp_path / "interrupted", resume=True)
    assert int(resumed.state.step) == 4 and resumed.data.position == 4
    resumed.train()
    got = logged(tmp_path / "interrupted")
    assert sorted(got) == list(range(1, 9))
    assert [got[step]["loss"] for step in range(1, 9)] == losses
    for a, b in zip(jax.tree.leaves(reference.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        make_trainer(Regression(), tmp_path / "reference")


def test_a_trainer_on_cpu_devices_has_glibc_reuse_freed_host_memory(tmp_path, monkeypatch):
    """XLA:CPU's steps take their temporaries as one large block each (ember.core.host_memory)."""
    calls = []
    monkeypatch.setattr(trainer_module, "reuse_freed_host_memory", lambda: calls.append("reuse"))
    make_trainer(Regression(), tmp_path / "run")
    assert calls == ["reuse"]


def test_a_checkpoint_of_another_train_state_is_a_data_error(tmp_path):
    """Resuming with another trainable mask raised orbax's ValueError, with a traceback and a page
    of metadata per parameter; it is a one-line DataError naming where the trees differ. (A wider
    model, refused by orbax with "Requested shape: ... is not compatible with the stored shape",
    takes the same path; it is left out here: orbax leaves that failed read's coroutines to be
    collected, with warnings, during a later test.)"""
    make_trainer(Regression(), tmp_path / "run", steps=2).train()
    with pytest.raises(
        DataError, match=r"does not restore into this run's train state .*opt_state\[1\]\[0\]\.mu\.layer_0"
    ):
        make_trainer(Regression(frozen_layers=("layer_0",)), tmp_path / "run", steps=4, resume=True)


class HalfPrecisionRegression(Regression):
    """The regression computed in float16 (parameters and inputs cast), as a float16 model
    computes: ``train.loss_scale=auto`` scales its loss."""

    def compute_dtype(self):
        return jnp.dtype(jnp.float16)

    def loss(self, params, batch, *, rng, teacher):
        half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
        prediction = self.model.apply({"params": half}, batch["x"].astype(jnp.float16))
        error = jnp.sum((prediction.astype(jnp.float32) - batch["y"]) ** 2)
        return LossTerms(error, jnp.float32(batch["x"].shape[0]))


def test_a_float16_task_trains_with_a_loss_scale_that_is_checkpointed_and_resumed(tmp_path):
    """The scale and its count of finite steps travel in the optimizer state: a run resumed
    from step 4 ends where the uninterrupted one does, scale included. A resume that would
    change whether the run scales its loss is refused, naming the setting that resumes it."""
    reference = make_trainer(HalfPrecisionRegression(), tmp_path / "reference", steps=6)
    reference.train()
    log = logged(tmp_path / "reference")
    assert isinstance(reference.state.opt_state, LossScaleState)
    assert all(log[step]["loss_scale"] >= 1 for step in range(1, 7)) and log[6]["loss"] < log[1]["loss"]
    trained = sum(1 for step in range(1, 7) if not log[step]["skipped_steps"])
    assert int(reference.state.opt_state.good_steps) == trained > 0

    def crash(info):
        if info.step == 5:
            raise KeyboardInterrupt

    interrupted = make_trainer(HalfPrecisionRegression(), tmp_path / "interrupted", steps=6)
    interrupted.add_hook(crash, every=5)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    resumed = make_trainer(HalfPrecisionRegression(), tmp_path / "interrupted", steps=6, resume=True)
    resumed.train()
    for a, b in zip(jax.tree.leaves(reference.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    with pytest.raises(
        ConfigError, match=r"saved with train.loss_scale=dynamic .* resume with train.loss_scale=dynamic"
    ):
        make_trainer(HalfPrecisionRegression(), tmp_path / "reference", steps=6, resume=True, loss_scale="off")
    with pytest.raises(ConfigError, match=r"saved with train.loss_scale=dynamic"):
        make_trainer(Regression(), tmp_path / "reference", steps=6, resume=True)


class HalfParameterRegression(HalfPrecisionRegression):
    """The float16 regression with float16 parameters (a ``params=f16`` precision)."""

    def init_params(self, rng):
        return jax.tree.map(lambda p: p.astype(jnp.float16), super().init_params(rng))


def test_loss_scaling_refuses_float16_parameters(tmp_path):
    """With float16 parameters, loss scaling crashed in the step's scan (a TypeError: the float16
    gradient carry came back float32 once unscaled), a traceback at the first step; it cannot
    work, the unscaled gradients flush to zero in float16. Refused up front, naming the setting;
    train.loss_scale=off accepts them (the run's own choice)."""
    with pytest.raises(ConfigError, match=r"needs float32 master weights.*float16 \(head/bias") as error:
        make_trainer(HalfParameterRegression(), tmp_path / "scaled", steps=1)
    assert error.value.key == "train.loss_scale"
    make_trainer(HalfParameterRegression(), tmp_path / "unscaled", steps=1, loss_scale="off").train()


class Evaluated(Regression):
    def eval_data(self):
        return [RegressionBatches(seed=9).next()]


def test_a_finished_run_resumed_writes_its_complete_summary_again(tmp_path):
    """Killed after its final checkpoint, before summary.json: the resume trains and logs
    nothing, runs the end-of-run hooks that follow the checkpoint and writes the same summary."""
    first = make_trainer(Evaluated(), tmp_path / "run", steps=3)
    summary = first.train()
    log = (tmp_path / "run" / "metrics.jsonl").read_text()
    (tmp_path / "run" / "summary.json").unlink()
    resumed, seen = make_trainer(Evaluated(), tmp_path / "run", steps=3, resume=True), []
    resumed.add_hook(lambda info: seen.append((info.step, info.is_last)), every=100, on_last=True)
    again = resumed.train()
    assert seen == [(3, True)] and (tmp_path / "run" / "metrics.jsonl").read_text() == log
    assert again == summary and {"loss", "val_loss"} <= set(again)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary


def trainer_warnings(run_dir, mesh, containing, task=None, **loop):
    """The warnings holding ``containing`` of a trainer of ``task`` (default ``Regression``, 8 rows)
    on ``mesh`` (a ``MeshConfig`` of fixed sizes, on that many devices)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(
            task or Regression(),
            loop=LoopConfig(steps=1, **loop),
            logging=LoggingConfig(progress=False, tensorboard=False),
            run_dir=run_dir,
            mesh=make_mesh(mesh, jax.devices()[: math.prod(mesh.sizes().values())]),
        )
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and containing in str(w.message)]


def test_a_batch_the_mesh_does_not_divide_is_replicated_with_a_warning(tmp_path):
    # 8 rows on data=3: the data axis does not divide the batch, so each of the 3 devices computed
    # all 8 rows (by design, ember.core.sharding), and nothing said so.
    assert trainer_warnings(tmp_path / "three", MeshConfig(data=3), "replicated") == [
        "the batch of 8 rows is replicated, not split, over mesh axes data=3 (they do not divide it): those "
        "devices all compute the same rows; a train.batch_size that is a multiple of 3 (mesh.data) is split "
        "over every device"
    ]
    assert trainer_warnings(tmp_path / "two", MeshConfig(data=2), "replicated") == []  # data=2 divides 8
    # and 8 / 4
    assert trainer_warnings(tmp_path / "two-accumulated", MeshConfig(data=2), "replicated", grad_accum=4) == []
    # data=4 divides the 8 rows but not a micro-batch's 2: nothing said so.
    assert trainer_warnings(tmp_path / "four", MeshConfig(data=4), "replicated", grad_accum=4) == [
        "each micro-batch of 2 rows is replicated, not split, over mesh axes data=4 (they do not divide it): those "
        "devices all compute the same rows; a train.batch_size that is a multiple of 16 (mesh.data x "
        "train.grad_accum) is split over every device"
    ]


def test_a_mesh_axis_that_splits_nothing_is_named_in_a_warning(tmp_path):
    """mesh.tensor=2 for a model with no dimension the rules split over tensor (Regression's are
    unannotated; an LM whose heads, mlp and vocab it does not divide) left both devices of each
    pair holding and computing the same, without a word."""

    assert trainer_warnings(tmp_path / "tensor", MeshConfig(data=2, tensor=2), "splits no parameter") == [
        "mesh axis mesh.tensor=2 (the rules split mlp, heads, kv_heads, vocab over it) splits no parameter (none "
        "has a dimension it divides) and not the batch: its devices all hold and compute the same; set "
        "mesh.tensor=1 and give the devices to mesh.data"
    ]
    # fsdp splits the batch
    assert trainer_warnings(tmp_path / "batch", MeshConfig(data=2, fsdp=2), "splits no parameter") == []


class RegressionWithHeads(Regression):
    """``Regression`` plus two biases the rules split over the tensor axis: 4 ``mlp`` units and 3
    ``heads`` (added to the loss times zero, so they are parameters of the step)."""

    def init_params(self, rng):
        biases = {"mlp_bias": ("mlp", 4), "heads_bias": ("heads", 3)}
        own = {name: nn.LogicallyPartitioned(jnp.zeros(size), (axis,)) for name, (axis, size) in biases.items()}
        return {**super().init_params(rng), **own}

    def loss(self, params, batch, *, rng, teacher):
        terms = super().loss({k: v for k, v in params.items() if "bias" not in k}, batch, rng=rng, teacher=teacher)
        unused = sum(jnp.sum(params[name]) for name in ("mlp_bias", "heads_bias"))
        return terms._replace(loss_sum=terms.loss_sum + 0 * unused)


def test_a_mesh_axis_that_does_not_divide_some_dimensions_is_named_in_a_warning(tmp_path):
    """mesh.tensor=2 splits the 4 mlp units but not the 3 heads, which both of its devices then
    held and computed: only a mesh axis that split nothing at all was warned of. (An LM with 4
    heads and 2 key heads on mesh.tensor=8 is the case met in practice.)"""
    mesh = MeshConfig(data=2, tensor=2)
    assert trainer_warnings(tmp_path / "heads", mesh, "does not divide", task=RegressionWithHeads()) == [
        "mesh.tensor=2 does not divide the parameters' heads (3): those dimensions are replicated over that axis, "
        "whose devices hold and compute the same slices of them; a mesh axis size that divides them splits them"
    ]
    # tensor splits nothing of Regression: the idle axis's own warning, not this one
    assert trainer_warnings(tmp_path / "idle", mesh, "does not divide") == []
    config = ModelConfig(vocab_size=128, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=64)
    params = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    message = undivided_axes_message(make_mesh(MeshConfig(data=1, tensor=8)), DEFAULT_RULES, params)
    assert message.startswith("mesh.tensor=8 does not divide the parameters' heads (4), kv_heads (2):")


def test_a_mesh_of_ones_own_without_embers_axis_names_trains_like_embers(tmp_path):
    """``jax.make_mesh((2,), ("data",))``: the rules' other mesh axes (fsdp, expert, tensor) are as
    if of size 1. Before, placing the batch raised KeyError: 'fsdp' (and a sharding without a
    shape: 'Resource axis: fsdp ... is not found in mesh')."""
    own = Trainer(
        Regression(),
        loop=LoopConfig(steps=2, log_every=1),
        optim=OptimConfig(lr=1e-2, schedule=ScheduleConfig(kind="constant")),
        logging=LoggingConfig(progress=False, tensorboard=False),
        run_dir=tmp_path / "own",
        mesh=jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]),
        seed=3,
    ).train()
    assert own["loss"] == make_trainer(Regression(), tmp_path / "ember", steps=2).train()["loss"]


def test_frozen_layers_have_no_optimizer_state_and_match_a_hand_written_optax_loop(tmp_path):
    # Layers 0-1 frozen by the task's mask, 2-3 and the head by config patterns: 2 of 6 layers train.
    task = Regression(frozen_layers=("layer_0", "layer_1"))
    optim = OptimConfig(lr=3e-2, weight_decay=0.01)
    trainer = make_trainer(task, tmp_path / "frozen", steps=5, optim=optim, freeze=("layer_[23]/", "^head/"))
    initial = jax.tree.map(np.asarray, trainer.state.params)
    trained_layers = {path.split("/")[0] for path, on in param_paths(trainer.mask).items() if on}
    assert trained_layers == {"layer_4", "layer_5"}
    trainable_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(select(initial, trainer.mask)))
    assert trainable_bytes == 2 * (WIDTH * WIDTH + WIDTH) * 4
    # AdamW keeps two moments per trained parameter plus two int32 step counts (Adam's and the
    # learning-rate schedule's); nothing for the frozen parameters.
    moments = [leaf for leaf in jax.tree.leaves(trainer.state.opt_state) if leaf.ndim]
    assert sum(leaf.nbytes for leaf in moments) == 2 * trainable_bytes
    assert trainer.optimizer_state_bytes() == 2 * trainable_bytes + 2 * 4
    trainer.train()

    final = jax.tree.map(np.asarray, trainer.state.params)
    for path, on in param_paths(trainer.mask).items():
        before, after = param_paths(initial)[path], param_paths(final)[path]
        if on:
            assert not np.array_equal(before, after), path
        else:
            np.testing.assert_array_equal(after, before, err_msg=path)  # bit-identical

    # The same five steps by hand: optax on the trained sub-tree, frozen leaves closed over.
    tx = make_optimizer(optim, 5)
    trainable = select(initial, trainer.mask)
    opt_state = tx.init(trainable)
    frozen = {k: v for k, v in initial.items() if k not in trainable}
    data, expected = RegressionBatches(), []

    @jax.jit
    def hand_step(trainable, opt_state, batch):
        def loss_fn(t):
            prediction = task.model.apply({"params": {**frozen, **t}}, batch["x"])
            return jnp.sum((prediction - batch["y"]) ** 2) / batch["x"].shape[0]

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    for _ in range(5):
        trainable, opt_state, loss = hand_step(trainable, opt_state, data.next())
        expected.append(float(loss))
    got = logged(tmp_path / "frozen")
    assert_allclose(np.array([got[s]["loss"] for s in range(1, 6)]), np.array(expected), dtype=np.float32)
    for a, b in zip(jax.tree.leaves(select(final, trainer.mask)), jax.tree.leaves(trainable)):  # 5 Adam steps: scale 10
        assert_allclose(a, np.asarray(b), dtype=np.float32, scale=10)


def test_auxiliary_loss_is_weighted_added_and_logged_under_its_name(tmp_path):
    task = Regression(use_aux=True)
    sgd = OptimConfig(
        name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, clip_norm=0.0, schedule=ScheduleConfig(kind="constant")
    )
    trainer = make_trainer(task, tmp_path / "aux", steps=1, optim=sgd, aux_loss_weights={"activation_l2": 0.5})
    initial = jax.tree.map(np.asarray, trainer.state.params)
    trainer.train()
    batch = RegressionBatches().next()

    def objective(params):
        prediction, aux = apply_with_aux(task.model, params, batch["x"])
        main = jnp.mean(jnp.sum((prediction - batch["y"]) ** 2, axis=-1))
        return main + 0.5 * aux["activation_l2"], (main, aux["activation_l2"])

    (total, (main, aux)), grads = jax.value_and_grad(objective, has_aux=True)(initial)
    assert float(aux) > 0.01  # a real contribution, not a vanishing one
    entry = logged(tmp_path / "aux")[1]
    assert_allclose(entry["activation_l2"], float(aux), dtype=np.float32)
    assert_allclose(entry["loss"], float(main), dtype=np.float32)
    assert_allclose(entry["objective"], float(total), dtype=np.float32)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, initial, grads)  # SGD on the weighted sum
    for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(expected)):
        assert_allclose(np.asarray(a), np.asarray(b), dtype=np.float32)


def test_auxiliary_loss_weights_must_match_the_losses_the_model_returns(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("train.aux_loss_weights.activation_l2")) as error:
        make_trainer(Regression(use_aux=True), tmp_path / "unweighted", steps=1).train()
    assert error.value.key == "train.aux_loss_weights.activation_l2"
    with pytest.raises(ConfigError, match="names no auxiliary loss of the model"):
        make_trainer(Regression(), tmp_path / "typo", steps=1, aux_loss_weights={"balance": 0.1}).train()
    # Every unknown name at once (before, only the first: a second typo surfaced on the next run).
    weights = {"activation_l2": 0.5, "balance": 0.1, "router": 0.1}
    with pytest.raises(ConfigError, match=r"weights\.balance, train\.aux_loss_weights\.router name no .*activation_l2"):
        make_trainer(Regression(use_aux=True), tmp_path / "typos", steps=1, aux_loss_weights=weights).train()
    with pytest.raises(ConfigError, match=r"train.freeze\[0\] .* matches no parameter"):
        make_trainer(Regression(), tmp_path / "nothing", freeze=("^encoder/",))
    with pytest.raises(ConfigError, match="freezes every parameter"):
        make_trainer(Regression(), tmp_path / "all", freeze=(".",))


class NanSecondBatch(RegressionBatches):
    def next(self):
        batch = super().next()
        return {"x": np.full_like(batch["x"], np.nan), "y": batch["y"]} if self.position == 2 else batch


def test_a_skipped_non_finite_step_keeps_the_schedule_on_the_trainers_step(tmp_path):
    """Step 2 is NaN and skipped: step 3 applies (and logs) ``schedule(2)``, not the rate of the
    second step taken; the params are those after step 1 less ``schedule(2)`` times the gradient."""
    task = Regression()
    task.train_data = NanSecondBatch
    sgd = OptimConfig(name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, clip_norm=0.0,
                      schedule=ScheduleConfig("linear", warmup_steps=4))  # fmt: skip
    trainer = make_trainer(task, tmp_path / "skip", steps=3, optim=sgd, on_nan="skip")
    initial = jax.tree.map(np.asarray, trainer.state.params)  # step 1 applies schedule(0) = 0
    trainer.train()
    schedule = [float(trainer.schedule(step)) for step in range(3)]
    assert schedule[0] == 0 and 0 < schedule[1] < schedule[2]
    assert_allclose(np.array([logged(tmp_path / "skip")[step]["lr"] for step in (1, 2, 3)]), np.array(schedule))
    counts = [leaf for leaf in jax.tree.leaves(trainer.state.opt_state) if leaf.ndim == 0]
    assert [int(count) for count in counts] == [3]
    third = RegressionBatches()
    third.restore({"position": 2})
    batch = third.next()

    def loss_fn(params):
        return jnp.mean(jnp.sum((task.model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2, axis=-1))

    expected = jax.tree.map(lambda p, g: p - schedule[2] * g, initial, jax.grad(loss_fn)(initial))
    for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(expected)):
        assert_allclose(np.asarray(a), np.asarray(b), dtype=np.float32)


def test_skipped_steps_between_log_steps_are_counted_at_the_next_log(tmp_path):
    """Only a log step's own finiteness was looked at: a NaN step between log steps was skipped
    without a trace. Step 2 of 3 is NaN, the log is at step 3."""
    task = Regression()
    task.train_data = NanSecondBatch
    make_trainer(task, tmp_path / "skip", steps=3, on_nan="skip", log_every=3).train()
    records = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert logged(tmp_path / "skip")[3]["skipped_steps"] == 1
    assert [(r["step"], r["event"]) for r in records if "event" in r] == [
        (3, "skipped 1 non-finite step(s) since the last log")
    ]


def test_skipped_steps_before_a_checkpoint_are_counted_by_the_resumed_run(tmp_path):
    """Step 2 of 4 is NaN and skipped, the checkpoint after it is at step 2 and the log at step 4; a
    run crashed after step 3 resumes from step 2. The count lived on the device only, so the
    resumed run logged skipped_steps 0 at step 4 (the uninterrupted run 1) and no skip event."""
    task = Regression()
    task.train_data = NanSecondBatch
    make_trainer(task, tmp_path / "reference", steps=4, on_nan="skip", log_every=4).train()

    def crash(info):
        raise KeyboardInterrupt

    interrupted = make_trainer(task, tmp_path / "resumed", steps=4, on_nan="skip", log_every=4)
    interrupted.add_hook(crash, every=3)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    make_trainer(task, tmp_path / "resumed", steps=4, on_nan="skip", log_every=4, resume=True).train()
    for run in ("reference", "resumed"):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert logged(tmp_path / run)[4]["skipped_steps"] == 1, run
        assert [(r["step"], r["event"]) for r in records if "event" in r] == [
            (4, "skipped 1 non-finite step(s) since the last log")
        ], run


def test_throughput_leaves_out_hooks_that_run_every_step(tmp_path):
    """The window restarted after every step with a hook due: with a hook every step (GRPO's
    engine sync) each log's steps_per_second measured one step. On a clock that the data
    advances by the step's number of seconds and a hook by 100: steps 2-5 took 14 s."""
    clock = [0.0]

    class TimedBatches(RegressionBatches):
        def next(self):
            clock[0] += self.position + 1
            return super().next()

    task = Regression()
    task.train_data = TimedBatches
    trainer = make_trainer(task, tmp_path / "timed", steps=5, log_every=5)
    trainer._window = ThroughputWindow(lambda: clock[0])
    trainer.add_hook(lambda info: clock.__setitem__(0, clock[0] + 100), every=1)
    trainer.train()
    assert logged(tmp_path / "timed")[5]["steps_per_second"] == pytest.approx(4 / 14)


def test_a_throughput_window_counts_steps_and_their_time_less_the_hooks():
    now = [10.0]
    window = ThroughputWindow(lambda: now[0])
    window.count_step()  # before open(): the compiling first step is not counted
    window.open()
    for seconds in (1.0, 2.0):
        now[0] += seconds
        window.count_step()
        window.hooks_start()
        now[0] += 50.0
        window.hooks_end()
    now[0] += 3.0
    window.count_step()
    window.hooks_start()
    now[0] += 7.0  # a hook that runs before the log
    assert window.measure() == (3, 6.0) and window.measured
    window.open()
    assert window.measure() == (0, 0.0)


def test_non_finite_loss_error_is_an_ember_error():
    assert issubclass(NonFiniteLossError, EmberError)


class Distillation(Regression):
    """The student regresses onto a frozen teacher's outputs (a wider single-layer model)."""

    teacher = nn.Dense(2)

    def teacher_params(self):
        return self.teacher.init(jax.random.key(11), jnp.zeros((1, 4)))["params"]

    def loss(self, params, batch, *, rng, teacher):
        target = self.teacher.apply({"params": teacher}, batch["x"])
        prediction = self.model.apply({"params": params}, batch["x"])
        return LossTerms(jnp.sum((prediction - target) ** 2), jnp.float32(batch["x"].shape[0]))


def test_frozen_teacher_outputs_drive_the_loss_and_are_never_trained(tmp_path):
    task = Distillation()
    sgd = OptimConfig(
        name="sgd", lr=0.05, momentum=0.0, weight_decay=0.0, clip_norm=0.0, schedule=ScheduleConfig(kind="constant")
    )
    trainer = make_trainer(task, tmp_path / "distill", steps=1, optim=sgd)
    initial = jax.tree.map(np.asarray, trainer.state.params)
    trainer.train()
    teacher, batch = task.teacher_params(), RegressionBatches().next()

    def loss_fn(params):
        target = task.teacher.apply({"params": teacher}, batch["x"])
        return jnp.mean(jnp.sum((task.model.apply({"params": params}, batch["x"]) - target) ** 2, axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(initial)
    assert_allclose(logged(tmp_path / "distill")[1]["loss"], float(loss), dtype=np.float32)
    expected = jax.tree.map(lambda p, g: p - 0.05 * g, initial, grads)
    for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(expected)):
        assert_allclose(np.asarray(a), np.asarray(b), dtype=np.float32)
    for a, b in zip(jax.tree.leaves(trainer.teacher), jax.tree.leaves(teacher)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The checkpoint holds the student's state only.
    saved = CheckpointManager(tmp_path / "distill" / "checkpoints").state_metadata()
    assert sorted(saved) == ["model_state", "opt_state", "params", "step"]  # model_state: {} here


def test_the_initialisation_compiles_at_level_2_on_cpu_and_gives_the_same_parameters():
    """With XLA's optimizations on, a run's initial state compiles at LLVM level 2 on CPU (much
    faster than the default 3 for the many unrolled random draws), and the parameters of a small
    Mamba-2 LM are the same bit for bit as at the default level.
    Under the suite's fast compiles (level 0) the option is left out: it would raise the level."""
    mesh = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    assert initialisation_compiler_options(mesh) is None
    config = ModelConfig(  # one Mamba-2 block: normal, uniform and log-uniform draws, ones, zeros
        vocab_size=64,
        d_model=32,
        num_layers=1,
        num_heads=2,
        max_seq_len=32,
        block_pattern=("mamba2",),
        mlp_pattern=("none",),
        ssm=SSMConfig(state_size=8, head_dim=16, chunk_size=8),
    )
    init = jax.jit(lambda key: DecoderLM(config).init(key, jnp.zeros((1, 8), jnp.int32)))
    key = jax.random.key(5)
    with xla_optimizations():
        options = initialisation_compiler_options(mesh)
        assert options == {"xla_backend_optimization_level": 2}
        at_default = init.lower(key).compile()(key)
        at_level_2 = init.lower(key).compile(compiler_options=options)(key)
    assert jax.tree.structure(at_default) == jax.tree.structure(at_level_2)
    for default, level_2 in zip(jax.tree.leaves(at_default), jax.tree.leaves(at_level_2)):
        np.testing.assert_array_equal(np.asarray(level_2), np.asarray(default))
