"""Expert parallelism: the routed experts sharded over the ``expert`` mesh axis equal a plain
per-expert loop (values and every gradient) on meshes with expert = 1, 2, 4, 8 and combined
with fsdp and tensor axes, for random and maximally skewed routing (every slot to the experts
of one rank: the dropless worst case); a tiny MoE trained 20 steps has the same loss curve
on every mesh. Under rules whose batch is whole over ``expert`` (serving's), the experts stay
split and the tokens replicated: the per-shard dispatch, one all-reduce."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.core.errors import ConfigError, EmberError
from ember.core.sharding import MeshConfig, logical_rules, make_mesh, use_sharding
from ember.models.layers import expert_parallel
from ember.models.layers.expert_parallel import expert_parallel_ranks, expert_parallel_routed_mlp
from ember.models.layers.mlp import mlp
from ember.models.layers.moe_dispatch import routed_expert_mlp_per_shard
from tests.collectives import collectives
from tests.tolerances import assert_allclose

TOKENS, EMBED, HIDDEN, EXPERTS, TOP_K = 32, 8, 12, 8, 2
MESHES = {
    "expert1": MeshConfig(data=8, expert=1),
    "expert2": MeshConfig(data=4, expert=2),
    "expert4": MeshConfig(data=2, expert=4),
    "expert8": MeshConfig(data=1, expert=8),
    "fsdp2-tensor2-expert2": MeshConfig(data=1, fsdp=2, tensor=2, expert=2),
}


def loop_reference(x, expert_ids, combine_weights, gate, up, down, activation):
    """Every expert applied to every token, kept where routed: ``sum_k w_k * expert_{id_k}(x)``."""
    out = jnp.zeros_like(x)
    for expert in range(up.shape[0]):
        weight = jnp.sum(jnp.where(expert_ids == expert, combine_weights, 0.0), axis=1, keepdims=True)
        expert_gate = None if gate is None else gate[expert]
        out = out + weight * mlp(x, up[expert], down[expert], activation, gate=expert_gate)
    return out


def random_inputs(key, skewed: bool):
    keys = jax.random.split(key, 7)
    x = jax.random.normal(keys[0], (TOKENS, EMBED))
    if skewed:  # every slot to experts 0 and 1: on every mesh, all of them to rank 0's experts
        expert_ids = jnp.stack([jnp.zeros(TOKENS, jnp.int32), jnp.ones(TOKENS, jnp.int32)], axis=1)
    else:
        expert_ids = jax.vmap(lambda k: jax.random.choice(k, EXPERTS, (TOP_K,), replace=False))(
            jax.random.split(keys[1], TOKENS)
        ).astype(jnp.int32)
    combine_weights = jax.random.uniform(keys[2], (TOKENS, TOP_K), minval=0.2, maxval=1.0)
    gate = jax.random.normal(keys[3], (EXPERTS, EMBED, HIDDEN)) / EMBED**0.5
    up = jax.random.normal(keys[4], (EXPERTS, EMBED, HIDDEN)) / EMBED**0.5
    down = jax.random.normal(keys[5], (EXPERTS, HIDDEN, EMBED)) / HIDDEN**0.5
    cotangent = jax.random.normal(keys[6], (TOKENS, EMBED))
    return (x, expert_ids, combine_weights, gate, up, down), cotangent


def value_and_grads(fn, inputs, cotangent):
    """``(fn(inputs), gradients of <fn, cotangent> w.r.t. x, combine_weights, gate, up, down)``."""
    x, expert_ids, combine_weights, gate, up, down = inputs

    def scalar(x, combine_weights, gate, up, down):
        out = fn(x, expert_ids, combine_weights, gate, up, down)
        return jnp.sum(out * cotangent), out

    grads, out = jax.grad(scalar, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, combine_weights, gate, up, down)
    return out, grads


@functools.cache
def _parallel_program():
    fn = functools.partial(expert_parallel_routed_mlp, activation="swiglu", impl="xla")
    return jax.jit(lambda inputs, cotangent: value_and_grads(fn, inputs, cotangent))


@pytest.fixture(scope="module")
def cases():
    """Random and skewed inputs with their loop-reference values and gradients (run eagerly:
    cheaper than compiling the unrolled loop)."""
    reference = functools.partial(value_and_grads, functools.partial(loop_reference, activation="swiglu"))
    found = {}
    for index, skewed in enumerate((False, True)):
        inputs, cotangent = random_inputs(jax.random.key(100 + index), skewed)
        found["skewed" if skewed else "random"] = (inputs, cotangent, reference(inputs, cotangent))
    return found


@pytest.mark.parametrize("mesh_name", [None, *MESHES])
def test_expert_parallel_equals_per_expert_loop_with_gradients(cases, mesh_name):
    for routing, (inputs, cotangent, (expected, expected_grads)) in cases.items():
        if mesh_name is None:
            out, grads = _parallel_program()(inputs, cotangent)
        else:
            with use_sharding(make_mesh(MESHES[mesh_name])):
                out, grads = _parallel_program()(inputs, cotangent)
        assert_allclose(out, expected, err_msg=f"{mesh_name} {routing}: output")
        for name, grad, want in zip(("x", "combine_weights", "gate", "up", "down"), grads, expected_grads):
            assert_allclose(grad, want, scale=4, err_msg=f"{mesh_name} {routing}: d{name}")  # sums over 32 rows


def test_ungated_activation_and_errors(cases):
    inputs, _, _ = cases["random"]
    x, expert_ids, combine_weights, _, up, down = inputs
    with use_sharding(make_mesh(MESHES["expert4"])):
        out = jax.jit(functools.partial(expert_parallel_routed_mlp, activation="gelu", impl="xla"))(
            x, expert_ids, combine_weights, None, up, down
        )
        assert_allclose(out, loop_reference(x, expert_ids, combine_weights, None, up, down, "gelu"))
        with pytest.raises(EmberError, match="do not divide over the 4 ranks"):
            expert_parallel_routed_mlp(x, expert_ids, combine_weights, None, up[:6], down[:6], activation="gelu")
        with pytest.raises(EmberError, match="needs gate weights"):
            expert_parallel_routed_mlp(x, expert_ids, combine_weights, None, up, down, activation="swiglu")


def test_what_does_not_divide_over_the_mesh_is_a_config_error_naming_the_key(cases):
    """Both errors were bare EmberErrors with no key (the token one said only "use a batch
    divisible by them"), where every other config error names the field to change."""
    inputs, _, _ = cases["random"]
    x, expert_ids, combine_weights, _, up, down = inputs
    with use_sharding(make_mesh(MESHES["expert4"])):  # tokens split over data=2 x expert=4
        with pytest.raises(
            ConfigError, match=r"28 tokens .*\(mesh\.data=2 x mesh\.expert=4\).* multiple of 8"
        ) as error:
            expert_parallel_routed_mlp(x[:28], expert_ids[:28], combine_weights[:28], None, up, down, activation="gelu")
        assert error.value.key == "train.batch_size"
        with pytest.raises(ConfigError, match="do not divide over the 4 ranks") as error:
            expert_parallel_routed_mlp(x, expert_ids, combine_weights, None, up[:6], down[:6], activation="gelu")
        assert error.value.key == "mesh.expert"


def test_out_of_range_slots_add_nothing_whatever_rows_past_the_groups_hold(cases, monkeypatch):
    """Padding, dropped and MoE++ slots (ids outside [0, E)) read rows past the groups, which
    grouped_matmul's contract leaves unspecified: with NaN there the output was NaN."""
    inputs, _, _ = cases["random"]
    x, expert_ids, combine_weights, gate, up, down = inputs
    expert_ids = expert_ids.at[::3, 1].set(EXPERTS).at[::5, 0].set(EXPERTS + 3)
    expected = loop_reference(x, expert_ids, combine_weights, gate, up, down, "swiglu")
    grouped = expert_parallel.grouped_expert_mlp

    def unspecified_past_the_groups(rows, *args, **kwargs):
        out = grouped(rows, *args, **kwargs)
        return jnp.where((jnp.arange(rows.shape[0]) < jnp.sum(args[-1]))[:, None], out, jnp.nan)

    monkeypatch.setattr(expert_parallel, "grouped_expert_mlp", unspecified_past_the_groups)
    with use_sharding(make_mesh(MESHES["expert4"])):  # a fresh partial: no compiled program is reused
        out = jax.jit(functools.partial(expert_parallel_routed_mlp, activation="swiglu", impl="xla"))(
            x, expert_ids, combine_weights, gate, up, down
        )
    assert_allclose(out, expected)


@pytest.mark.parametrize("mesh_name", ["fsdp2-tensor2-expert2", "expert8"])
def test_with_the_batch_whole_over_experts_each_device_runs_its_experts_on_every_token(cases, mesh_name):
    """Serving's rules keep a step's tokens whole on every device: there is nothing to exchange,
    so the layer takes the per-shard dispatch (no expert-parallel ranks), which keeps the experts
    split over ``expert`` (and their columns over ``tensor``), shifts the ids by each shard's
    first expert and sums every shard's partial outputs in one all-reduce: the loop's values and
    gradients, padding and MoE++ ids (>= E) included. Before, the layer exchanged tokens
    all-to-all whatever the rules (splitting the replicated tokens over ``expert``), and the
    per-shard dispatch, given split experts, read global ids as local ones and summed nothing."""
    inputs, cotangent, _ = cases["random"]
    x, expert_ids, combine_weights, gate, up, down = inputs
    expert_ids = expert_ids.at[::3, 1].set(EXPERTS).at[::5, 0].set(EXPERTS + 3)
    inputs = (x, expert_ids, combine_weights, gate, up, down)
    expected, expected_grads = value_and_grads(
        functools.partial(loop_reference, activation="swiglu"), inputs, cotangent
    )
    dispatch = functools.partial(routed_expert_mlp_per_shard, activation="swiglu", impl="xla")
    forward = jax.jit(dispatch)
    with use_sharding(make_mesh(MESHES[mesh_name]), logical_rules({"batch": ()})):
        assert expert_parallel_ranks() == 1
        compiled = forward.lower(*inputs).compile()
        out, grads = jax.jit(functools.partial(value_and_grads, dispatch))(inputs, cotangent)
    assert [op for _, op in collectives(compiled)] == ["all-reduce"]
    assert_allclose(compiled(*inputs), expected, err_msg="compiled forward")
    assert_allclose(out, expected, err_msg="output")
    for name, grad, want in zip(("x", "combine_weights", "gate", "up", "down"), grads, expected_grads):
        assert_allclose(grad, want, scale=4, err_msg=f"d{name}")


def tiny_moe_loss(params, x, y):
    """A one-layer MoE: softmax router, top-2 renormalised, the expert-parallel experts."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    top_weights, top_ids = jax.lax.top_k(probs, TOP_K)
    top_weights = top_weights / jnp.sum(top_weights, axis=-1, keepdims=True)
    out = expert_parallel_routed_mlp(
        x, top_ids.astype(jnp.int32), top_weights, params["gate"], params["up"], params["down"],
        activation="swiglu", impl="xla",
    )  # fmt: skip
    return jnp.mean((x + out - y) ** 2)


@functools.cache
def _training_program():
    tx = optax.adam(3e-2)

    def train(params, x, y):
        def step(carry, _):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(tiny_moe_loss)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        _, losses = jax.lax.scan(step, (params, tx.init(params)), None, length=20)
        return losses

    return jax.jit(train)


def test_training_loss_curve_is_the_same_on_every_expert_mesh():
    keys = jax.random.split(jax.random.key(5), 3)
    (x, _, _, gate, up, down), _ = random_inputs(keys[0], skewed=False)
    params = {"router": jax.random.normal(keys[1], (EMBED, EXPERTS)), "gate": gate, "up": up, "down": down}
    y = jnp.sin(x @ jax.random.normal(keys[2], (EMBED, EMBED)))
    curves = {}
    for name in ("expert1", "expert2", "expert4", "expert8"):
        with use_sharding(make_mesh(MESHES[name])):
            curves[name] = np.asarray(_training_program()(params, x, y))
    assert curves["expert1"][-1] < 0.7 * curves["expert1"][0]  # it learns
    for name, curve in curves.items():
        assert_allclose(curve, curves["expert1"], scale=10, err_msg=f"{name}: 20 adam steps of f32 drift")
