"""Ember's LM train step against a minimal hand-written Flax + optax step, side by side.

Both train the same ``DecoderLM`` on the same batch with the same optimizer; the plain step
is the smallest correct loop a researcher would write (``value_and_grad`` + ``optax``
update under ``jax.jit``). Ember's adds logical-axis shardings, donation, token-weighted
micro-batching and the finite check. The ratio says what the framework costs.

A second table times a step with ~90% of the parameters frozen (the largest leaves, by a
trainable mask) against the full step of the same model: frozen parameters get no gradient
and no optimizer state, so the step is cheaper and the optimizer state ~10x smaller.

    python -m benchmarks.train_step            # CPU: the tiny and small models; GPU: ~125M, ~350M too
    python -m benchmarks.train_step --quick    # the tiny model only, fewer repeats (a smoke run)

Results: ``benchmarks/results/train_step-<device>.json``.
"""

from __future__ import annotations

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.harness import on_gpu, print_table, time_compile, time_fn, write_results
from ember.core.sharding import (
    DEFAULT_RULES,
    MeshConfig,
    make_mesh,
    named_sharding,
    tree_shardings,
    unbox,
    use_sharding,
)
from ember.core.system_info import peak_flops_per_device
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.training.lm.task import lm_loss
from ember.training.optimizers import OptimConfig, make_optimizer, make_schedule
from ember.training.train_step import init_state, train_step
from ember.training.trainable import map_paths, param_paths

CPU_CASES = {
    "tiny (2x64)": (
        ModelConfig(vocab_size=384, d_model=64, num_layers=2, num_heads=4, mlp_dim=256, max_seq_len=256),
        16,
        128,
    ),
    "small (4x256)": (
        ModelConfig(vocab_size=384, d_model=256, num_layers=4, num_heads=4, mlp_dim=1024, max_seq_len=256),
        8,
        256,
    ),
}
GPU_CASES = {
    "~125M (12x768)": (
        ModelConfig(
            vocab_size=32768, d_model=768, num_layers=12, num_heads=12, mlp_dim=2048, max_seq_len=2048, precision="bf16"
        ),
        32,
        1024,
    ),
    "~350M (24x1024)": (
        ModelConfig(
            vocab_size=32768,
            d_model=1024,
            num_layers=24,
            num_heads=16,
            mlp_dim=2816,
            max_seq_len=2048,
            precision="bf16",
            remat="dots",
        ),
        16,
        2048,
    ),
}


def random_batch(key, config: ModelConfig, batch: int, seq_len: int) -> dict[str, jax.Array]:
    tokens = jax.random.randint(key, (batch, seq_len + 1), 0, config.vocab_size)
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": jnp.ones((batch, seq_len), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len)),
        "loss_mask": jnp.ones((batch, seq_len), jnp.float32),
    }


def plain_step(params, opt_state, batch, *, model, tx):
    """The minimal hand-written step: mean token cross-entropy, grad, optax update."""

    def loss_fn(p):
        logits, _ = model.apply({"params": p}, batch["tokens"], positions=batch["positions"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def frozen_mask(params, fraction: float):
    """A trainable mask freezing the largest parameter leaves until ``fraction`` of all
    parameters are frozen; also returns the fraction actually frozen."""
    sizes = {path: int(np.prod(leaf.shape)) for path, leaf in param_paths(params).items()}
    total, frozen, frozen_paths = sum(sizes.values()), 0, set()
    for path in sorted(sizes, key=sizes.get, reverse=True):
        if frozen >= fraction * total:
            break
        frozen_paths.add(path)
        frozen += sizes[path]
    return map_paths(lambda path, _: path not in frozen_paths, params), frozen / total


def ember_step_timing(model, config: ModelConfig, batch, mask, repeats: int) -> dict:
    """The trainer's step with logical shardings on a mesh of all devices, donated state:
    ``(seconds per step, compile seconds, optimizer-state bytes)``."""
    optim = OptimConfig(lr=1e-3)
    tx = make_optimizer(optim, 1000)
    key = jax.random.key(0)

    def init_params(rng):
        return model.init(rng, batch["tokens"][:1], positions=batch["positions"][:1])["params"]

    if mask is None:
        mask = map_paths(lambda path, _: True, jax.eval_shape(init_params, key))
    make_state = functools.partial(
        init_state, init_variables=lambda rng: {"params": init_params(rng)}, tx=tx, mask=mask
    )
    mesh = make_mesh(MeshConfig(data=-1))
    boxed = jax.eval_shape(make_state, key)
    shardings = tree_shardings(mesh, nn.get_partition_spec(boxed), DEFAULT_RULES, shapes=boxed)
    batch_sharding = named_sharding(mesh, ("batch", "seq"), DEFAULT_RULES, batch["tokens"].shape)
    state = jax.jit(lambda k: unbox(make_state(k)), out_shardings=shardings)(key)
    step = jax.jit(
        functools.partial(
            train_step,
            loss_fn=functools.partial(lm_loss, model=model),
            tx=tx,
            schedule=make_schedule(optim, 1000),
            mask=mask,
        ),
        in_shardings=(shardings, batch_sharding, None),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    opt_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state.opt_state))
    with use_sharding(mesh):
        compile_seconds = time_compile(step, state, batch, None)
        holder = {"state": state}

        def run():
            holder["state"], metrics = step(holder["state"], batch, None)
            return metrics["loss"]

        seconds = time_fn(run, warmup=2, repeats=repeats)
    return {"seconds": seconds, "compile": compile_seconds, "opt_bytes": opt_bytes}


def measure(
    name: str, config: ModelConfig, batch_size: int, seq_len: int, repeats: int = 10, compare_plain: bool = True
) -> dict:
    """Ember's step time, tokens/s and MFU (where the device's peak is known) for one model
    and batch; with ``compare_plain``, also the plain step's time and the ratio."""
    model = DecoderLM(config)
    key = jax.random.key(0)
    batch = random_batch(key, config, batch_size, seq_len)
    ember = ember_step_timing(model, config, batch, None, repeats)
    tokens = batch_size * seq_len
    row = {
        "model": name,
        "batch": batch_size,
        "seq_len": seq_len,
        "ember_ms": 1e3 * ember["seconds"],
        "ember_compile_s": ember["compile"],
        "ember_tokens_per_s": tokens / ember["seconds"],
    }
    if compare_plain:
        plain_seconds, plain_compile = _time_plain_step(model, key, batch, repeats)
        row.update(plain_ms=1e3 * plain_seconds, ratio=ember["seconds"] / plain_seconds, plain_compile_s=plain_compile)
    peak = peak_flops_per_device()
    if peak:
        row["ember_mfu"] = flops_per_token(config, seq_len) * tokens / ember["seconds"] / (peak * jax.device_count())
    return row


def _time_plain_step(model, key, batch, repeats: int) -> tuple[float, float]:
    """``(seconds per step, compile seconds)`` of the plain step: the same model and
    optimizer without the framework."""
    tx = make_optimizer(OptimConfig(lr=1e-3), 1000)
    params = unbox(jax.jit(lambda k: model.init(k, batch["tokens"][:1])["params"])(key))
    opt_state = tx.init(params)
    step = jax.jit(functools.partial(plain_step, model=model, tx=tx), donate_argnums=(0, 1))
    plain_compile = time_compile(step, params, opt_state, batch)
    holder = {"params": params, "opt": opt_state}

    def run_plain():
        holder["params"], holder["opt"], loss = step(holder["params"], holder["opt"], batch)
        return loss

    return time_fn(run_plain, warmup=2, repeats=repeats), plain_compile


def measure_frozen(
    name: str, config: ModelConfig, batch_size: int, seq_len: int, repeats: int = 10, fraction: float = 0.9
) -> dict:
    """The step with ``fraction`` of the parameters frozen against the full step."""
    model = DecoderLM(config)
    batch = random_batch(jax.random.key(0), config, batch_size, seq_len)
    abstract = unbox(jax.eval_shape(lambda k: model.init(k, batch["tokens"][:1])["params"], jax.random.key(0)))
    mask, frozen = frozen_mask(abstract, fraction)
    full = ember_step_timing(model, config, batch, None, repeats)
    partial = ember_step_timing(model, config, batch, mask, repeats)
    return {
        "model": name,
        "frozen_fraction": frozen,
        "full_ms": 1e3 * full["seconds"],
        "frozen_ms": 1e3 * partial["seconds"],
        "time_ratio": partial["seconds"] / full["seconds"],
        "full_opt_mib": full["opt_bytes"] / 2**20,
        "frozen_opt_mib": partial["opt_bytes"] / 2**20,
        "opt_bytes_ratio": partial["opt_bytes"] / full["opt_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 3 repeats; writes no results")
    args = parser.parse_args()
    cases = dict(CPU_CASES, **GPU_CASES) if on_gpu() else CPU_CASES
    if args.quick:
        cases = dict(list(CPU_CASES.items())[:1])
    elif not on_gpu():
        print("no GPU found: timing the CPU cases only (the ~125M / ~350M cases need a GPU)")
    repeats = 3 if args.quick else 10
    rows = [measure(name, *case, repeats=repeats) for name, case in cases.items()]
    print_table(
        rows,
        [
            "model",
            "batch",
            "seq_len",
            "ember_ms",
            "plain_ms",
            "ratio",
            "ember_compile_s",
            "plain_compile_s",
            "ember_tokens_per_s",
            "ember_mfu",
        ],
    )
    frozen_rows = [measure_frozen(name, *case, repeats=repeats) for name, case in cases.items()]
    print_table(
        frozen_rows,
        [
            "model",
            "frozen_fraction",
            "full_ms",
            "frozen_ms",
            "time_ratio",
            "full_opt_mib",
            "frozen_opt_mib",
            "opt_bytes_ratio",
        ],
    )
    if args.quick:
        return
    path = write_results(
        "train_step",
        {
            "rows": rows,
            "frozen_rows": frozen_rows,
            "note": "ratio = Ember step time / plain Flax+optax step time; frozen rows: "
            "a step with ~90% of parameters frozen against the full step",
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
