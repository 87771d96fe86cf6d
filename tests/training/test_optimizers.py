"""ember.training.optimizers: schedules, decay masks and each optimizer against optax's own."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.core.config import load_config
from ember.core.errors import ConfigError
from ember.core.sharding import unbox
from ember.core.tree import param_paths
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.training.lm.trainer import make_trainer
from ember.training.optimizers import (
    OPTIMIZERS,
    OptimConfig,
    ScheduleConfig,
    decay_mask,
    make_optimizer,
    make_schedule,
)
from tests.tolerances import assert_allclose
from tests.training.lm_runs import REPO, read_metrics, small_config


def test_warmup_then_cosine_and_linear_by_hand():
    cosine = make_schedule(
        OptimConfig(lr=1.0, schedule=ScheduleConfig("cosine", warmup_steps=10, min_lr_ratio=0.1)), 110
    )
    assert float(cosine(0)) == 0.0 and float(cosine(5)) == pytest.approx(0.5)
    assert float(cosine(10)) == pytest.approx(1.0)
    assert float(cosine(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # half-way down the cosine
    assert float(cosine(110)) == pytest.approx(0.1)
    linear = make_schedule(
        OptimConfig(lr=2.0, schedule=ScheduleConfig("linear", warmup_steps=0, min_lr_ratio=0.0)), 100
    )
    assert float(linear(25)) == pytest.approx(1.5)
    constant = make_schedule(OptimConfig(lr=0.3, schedule=ScheduleConfig("constant", warmup_steps=4)), 50)
    assert float(constant(2)) == pytest.approx(0.15) and float(constant(40)) == pytest.approx(0.3)


def test_decay_mask_skips_biases_and_norm_scales_even_when_stacked():
    params = {
        "layers": {
            "attn": {"kernel": jnp.ones((2, 4, 4)), "bias": jnp.ones((2, 4))},
            "pre_norm": {"scale": jnp.ones((2, 4))},
        },
        "embed": {"embedding": jnp.ones((8, 4))},
    }
    mask = decay_mask(params)
    assert mask == {
        "layers": {"attn": {"kernel": True, "bias": False}, "pre_norm": {"scale": False}},
        "embed": {"embedding": True},
    }


@pytest.mark.parametrize("scan", [False, True])
def test_decay_mask_of_a_hybrid_model_decays_its_matrices_only(scan):
    """Mamba-2 and attention layers: the biases (conv_bias, dt_bias), norm scales and the SSM's
    A_log and D never decay, stacked over layers or not; every matrix and the embedding do."""
    config = load_config(ModelConfig, REPO / "configs/models/hybrid_tiny.yaml", [f"scan_layers={str(scan).lower()}"])
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(lambda: DecoderLM(config).init(jax.random.key(0), tokens, positions=jnp.arange(8)[None]))
    decayed = param_paths(decay_mask(unbox(params["params"])))
    never = ("bias", "scale", "/A_log", "/D")
    matrices = ("kernel", "embedding", "conv_weight", "mlp/up", "mlp/gate", "mlp/down")
    assert {path for path, on in decayed.items() if not on} == {p for p in decayed if p.endswith(never)}
    assert all(p.endswith(matrices) for p in decayed if decayed[p]) and any(p.endswith("/A_log") for p in decayed)


def test_decay_mask_of_a_linearised_model_keeps_the_feature_maps_and_not_the_mix():
    """A window-linear layer's Hedgehog maps decay as matrices; its per-head ``window_factor``
    (a logit weighing window against linear part) does not."""
    config = load_config(
        ModelConfig, REPO / "configs/models/tiny.yaml", ["block_pattern=[window_linear]", "linear_feature_map=hedgehog"]
    )
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(lambda: DecoderLM(config).init(jax.random.key(0), tokens, positions=jnp.arange(8)[None]))
    decayed = param_paths(decay_mask(unbox(params["params"])))
    mixes = [p for p in decayed if p.endswith("/window_factor")]
    features = [p for p in decayed if "_features/" in p]
    assert mixes and features, sorted(decayed)
    assert not any(decayed[p] for p in mixes) and all(decayed[p] for p in features)


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "sgd"])
def test_each_optimizer_matches_optax_directly(name, rng):
    config = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, clip_norm=0.5, schedule=ScheduleConfig("constant"))
    k1, k2, k3 = jax.random.split(rng, 3)
    params = {"dense": {"kernel": jax.random.normal(k1, (4, 3)), "bias": jax.random.normal(k2, (3,))}}
    grads = jax.tree.map(lambda p: 3.0 * jax.random.normal(k3, p.shape), params)
    ours = make_optimizer(config, total_steps=10)
    mask = {"dense": {"kernel": True, "bias": False}}
    inner = {
        "adamw": optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask),
        "lion": optax.lion(1e-2, b1=0.9, b2=0.95, weight_decay=0.1, mask=mask),
        # Decay decoupled from the update and scaled by the rate (optax's adafactor adds it unscaled).
        "adafactor": optax.chain(optax.adafactor(1e-2), optax.add_decayed_weights(-1e-2 * 0.1, mask=mask)),
        "sgd": optax.chain(optax.sgd(1e-2, momentum=0.9), optax.add_decayed_weights(-1e-2 * 0.1, mask=mask)),
    }[name]
    reference = optax.chain(optax.clip_by_global_norm(0.5), inner)
    state_ours, state_ref = ours.init(params), reference.init(params)
    update_ours_fn, update_ref_fn = jax.jit(ours.update), jax.jit(reference.update)  # (op by op: each op compiled)
    for _ in range(3):
        update_ours, state_ours = update_ours_fn(grads, state_ours, params)
        update_ref, state_ref = update_ref_fn(grads, state_ref, params)
        jax.tree.map(assert_allclose, update_ours, update_ref)
        params = optax.apply_updates(params, update_ours)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weight_decay_shrinks_a_weight_by_lr_times_decay_each_step_for_every_optimizer(name):
    """Zero gradients: a decayed weight is multiplied by ``1 - lr(t) * weight_decay`` at step
    ``t`` (a decaying schedule, so the rate of each step is checked), a norm scale not at all."""
    config = OptimConfig(name=name, lr=0.5, weight_decay=0.2, galore_rank=2,
                         schedule=ScheduleConfig("linear", warmup_steps=0, min_lr_ratio=0.0))  # fmt: skip
    tx, schedule = make_optimizer(config, 4), make_schedule(config, 4)
    params = _matrix_params(stacked=False)
    state, zeros = tx.init(params), jax.tree.map(jnp.zeros_like, params)
    update = jax.jit(tx.update)  # one program (op by op: each op compiled)
    for step in range(3):
        updates, state = update(zeros, state, params)
        new = optax.apply_updates(params, updates)
        factor = 1 - float(schedule(step)) * 0.2
        layer, new_layer = params["group_0"]["block_0"], new["group_0"]["block_0"]
        for before, after in [
            (params["embed"]["embedding"], new["embed"]["embedding"]),
            (layer["mlp"]["up"], new_layer["mlp"]["up"]),
            (layer["attn"]["q"]["kernel"], new_layer["attn"]["q"]["kernel"]),
        ]:
            assert_allclose(after, factor * before, dtype=np.float32)
        np.testing.assert_array_equal(new_layer["attn_norm"]["scale"], layer["attn_norm"]["scale"])
        params = new


def test_config_errors_name_the_key():
    with pytest.raises(
        ConfigError, match=re.escape("optim.name must be one of adamw, lion, adafactor, sgd, muon, galore, got 'adam'")
    ):
        OptimConfig(name="adam")
    with pytest.raises(ConfigError) as info:
        load_config(OptimConfig, None, ["schedule.kind=step"])
    assert info.value.key == "optim.schedule.kind"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lr=.nan", "optim.lr must be a finite number > 0, got nan"),
        ("lr=.inf", "optim.lr must be a finite number > 0, got inf"),
        ("weight_decay=.nan", "optim.weight_decay must be a finite number >= 0, got nan"),
        ("clip_norm=-1", "optim.clip_norm must be a finite number >= 0 (0 turns clipping off), got -1.0"),
        ("b1=1.5", "optim.b1 must be a finite number in [0, 1), got 1.5"),
        ("b2=-3", "optim.b2 must be a finite number in [0, 1), got -3.0"),
        ("eps=-1", "optim.eps must be a finite number >= 0, got -1.0"),
        ("muon_beta=1", "optim.muon_beta must be a finite number in [0, 1), got 1.0"),
        ("momentum=1.5", "optim.momentum must be a finite number in [0, 1) (0 turns momentum off), got 1.5"),
        ("momentum=-0.5", "optim.momentum must be a finite number in [0, 1) (0 turns momentum off), got -0.5"),
    ],
)
def test_each_bad_value_is_named_with_its_own_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(OptimConfig, None, [override])
    assert str(info.value) == message and info.value.key == "optim." + override.split("=")[0]


def _matrix_params(stacked: bool):
    """A 3-D attention kernel, an MLP matrix and a norm scale, layer-stacked or not."""
    keys = iter(jax.random.split(jax.random.key(3), 4))
    lead = (2,) if stacked else ()
    layer = {
        "attn": {"q": {"kernel": jax.random.normal(next(keys), (*lead, 8, 2, 4))}},
        "mlp": {"up": jax.random.normal(next(keys), (*lead, 8, 12))},
        "attn_norm": {"scale": 1 + 0.1 * jax.random.normal(next(keys), (*lead, 8))},
    }
    return {
        "layers" if stacked else "group_0": {"block_0": layer},
        "embed": {"embedding": jax.random.normal(next(keys), (5, 8))},
    }


def _quadratic_steps(tx, params, steps=3):
    """Params after ``steps`` updates on ``sum(p**2)`` and the loss at each step."""

    @jax.jit  # one program (op by op: each op compiled)
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = tx.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return params, losses


def test_muon_orthogonalises_the_linear_maps_and_matches_optax():
    params = _matrix_params(stacked=True)
    config = OptimConfig(name="muon", lr=0.05, weight_decay=0.0, clip_norm=0.0, schedule=ScheduleConfig("constant"))
    ours, losses = _quadratic_steps(make_optimizer(config, 10), params)
    dims = optax.contrib.MuonDimensionNumbers
    layer = {"attn": {"q": {"kernel": dims((1,), (2, 3))}}, "mlp": {"up": dims((1,), (2,))}}
    layer["attn_norm"] = {"scale": None}
    expected_dims = {"layers": {"block_0": layer}, "embed": {"embedding": None}}
    theirs, _ = _quadratic_steps(
        optax.contrib.muon(
            0.05, adam_b2=0.95, weight_decay_mask=decay_mask, muon_weight_dimension_numbers=expected_dims
        ),
        params,
    )
    jax.tree.map(assert_allclose, ours, theirs)
    assert losses[-1] < losses[0]


def test_muon_takes_optim_eps_for_its_adam_part():
    """optim.eps is documented as the Adam part's for Muon; it was not passed to optax's muon."""
    params = {"embed": {"embedding": jax.random.normal(jax.random.key(0), (5, 8))}}  # an Adam-side parameter
    config = OptimConfig(name="muon", lr=0.05, eps=0.5, weight_decay=0.0, clip_norm=0.0,
                         schedule=ScheduleConfig("constant"))  # fmt: skip
    ours, _ = _quadratic_steps(make_optimizer(config, 10), params, steps=2)
    # optax's muon runs its Adam part with Nesterov momentum (its nesterov=True default).
    theirs, _ = _quadratic_steps(optax.adam(0.05, b1=0.9, b2=0.95, eps=0.5, nesterov=True), params, steps=2)
    jax.tree.map(assert_allclose, ours, theirs)


def test_galore_projects_unstacked_matrices_and_refuses_stacked_ones():
    params = _matrix_params(stacked=False)
    config = OptimConfig(name="galore", lr=0.05, weight_decay=0.0, clip_norm=0.0, galore_rank=2,
                         schedule=ScheduleConfig("constant"))  # fmt: skip
    ours, losses = _quadratic_steps(make_optimizer(config, 10), params)
    dims = optax.contrib.GaLoreDimensionNumbers
    layer = {"attn": {"q": {"kernel": dims((0,), (1, 2))}}, "mlp": {"up": dims((0,), (1,))}}
    layer["attn_norm"] = {"scale": None}
    expected_dims = {"group_0": {"block_0": layer}, "embed": {"embedding": None}}
    reference = optax.contrib.galore(0.05, rank=2, update_proj_gap=200, scale=0.25, mask=decay_mask,
                                     base_optimizer=optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                                     weight_dimension_numbers=expected_dims)  # fmt: skip
    theirs, _ = _quadratic_steps(reference, params)
    jax.tree.map(assert_allclose, ours, theirs)
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match="galore projects single matrices") as error:
        make_optimizer(config, 10).init(_matrix_params(stacked=True))
    assert error.value.key == "optim.name"


def test_every_optimizer_trains_the_smallest_lm_with_its_state_sharded(tmp_path, dataset):
    """Two steps of each registered optimizer on a 1-layer LM over a data x fsdp mesh. Optimizer
    state of a parameter's shape is sharded like it; other state (Adafactor's factored
    statistics, GaLore's projections, step counts) is replicated, never given the parameter's axes."""
    tiny = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.mlp_dim=64"]
    tiny += ["model.max_seq_len=32", "train.seq_len=16", "model.scan_layers=false", "mesh.data=4", "mesh.fsdp=2"]
    for name in OPTIMIZERS:
        config = small_config(
            tmp_path / name, dataset, *tiny, "train.steps=2", f"optim.name={name}", "optim.galore_rank=4"
        )
        trainer = make_trainer(config)
        initial = jax.tree.map(np.asarray, trainer.state.params)
        trainer.train()
        losses = [entry["loss"] for entry in read_metrics(config.run_dir).values()]
        assert len(losses) == 2 and np.all(np.isfinite(losses)), name
        moved = [
            not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(trainer.state.params))
        ]
        assert all(moved), name
        params = {(leaf.shape, leaf.sharding.spec) for leaf in jax.tree.leaves(trainer.state.params)}
        state = [(leaf.shape, leaf.sharding.spec) for leaf in jax.tree.leaves(trainer.state.opt_state)]
        sharded = [entry for entry in state if any(entry[1])]
        assert sharded and all(entry in params for entry in sharded), name  # like the parameter of its shape
