"""Ember's LM train step against a minimal hand-written Flax + optax step, side by side.

Both train the same ``DecoderLM`` on the same batch with the same optimizer; the plain step
is the smallest correct loop a researcher would write (``value_and_grad`` + ``optax``
update under ``jax.jit``). Ember's adds logical-axis shardings, donation, token-weighted
micro-batching and the finite check. The ratio says what the framework costs.

    python -m benchmarks.train_step            # CPU: the tiny model; GPU: the ~350M preset too

Results: ``benchmarks/results/train_step-<device>.json``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.harness import on_gpu, print_table, time_compile, time_fn, write_results
from ember.core.sharding import DEFAULT_RULES, MeshConfig, make_mesh, named_sharding, tree_shardings, unbox, use_sharding
from ember.core.system_info import peak_flops_per_device
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.training.lm.step import init_state, train_step
from ember.training.optimizers import OptimConfig, make_optimizer, make_schedule

CPU_CASES = {
    "tiny (2x64)": (ModelConfig(vocab_size=384, d_model=64, num_layers=2, num_heads=4, mlp_dim=256, max_seq_len=256), 16, 128),
    "small (4x256)": (ModelConfig(vocab_size=384, d_model=256, num_layers=4, num_heads=4, mlp_dim=1024, max_seq_len=256), 8, 256),
}
GPU_CASES = {
    "~125M (12x768)": (ModelConfig(vocab_size=32768, d_model=768, num_layers=12, num_heads=12, mlp_dim=2048,
                                   max_seq_len=2048, precision="bf16"), 32, 1024),
    "~350M (24x1024)": (ModelConfig(vocab_size=32768, d_model=1024, num_layers=24, num_heads=16, mlp_dim=2816,
                                    max_seq_len=2048, precision="bf16", remat="dots"), 16, 2048),
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


def measure(name: str, config: ModelConfig, batch_size: int, seq_len: int, compare_plain: bool = True) -> dict:
    """Ember's step time, tokens/s and MFU (where the device's peak is known) for one model
    and batch; with ``compare_plain``, also the plain step's time and the ratio."""
    model = DecoderLM(config)
    optim = OptimConfig(lr=1e-3)
    tx = make_optimizer(optim, 1000)
    key = jax.random.key(0)
    batch = random_batch(key, config, batch_size, seq_len)
    make_state = functools.partial(init_state, model=model, tx=tx, seq_len=seq_len)

    # Ember: the trainer's step with logical shardings on a mesh of all devices, donated state.
    mesh = make_mesh(MeshConfig(data=-1))
    boxed = jax.eval_shape(make_state, key)
    shardings = tree_shardings(mesh, nn.get_partition_spec(boxed), DEFAULT_RULES, shapes=boxed)
    batch_sharding = named_sharding(mesh, ("batch", "seq"), DEFAULT_RULES, (batch_size, seq_len))
    state = jax.jit(lambda k: unbox(make_state(k)), out_shardings=shardings)(key)
    ember_step = jax.jit(functools.partial(train_step, model=model, tx=tx, schedule=make_schedule(optim, 1000)),
                         in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None), donate_argnums=0)
    with use_sharding(mesh):
        ember_compile = time_compile(ember_step, state, batch)
        holder = {"state": state}

        def run_ember():
            holder["state"], metrics = ember_step(holder["state"], batch)
            return metrics["loss"]

        ember_seconds = time_fn(run_ember, warmup=2, repeats=10)

    tokens = batch_size * seq_len
    row = {
        "model": name, "batch": batch_size, "seq_len": seq_len,
        "ember_ms": 1e3 * ember_seconds, "ember_compile_s": ember_compile, "ember_tokens_per_s": tokens / ember_seconds,
    }
    if compare_plain:
        plain_seconds, plain_compile = _time_plain_step(model, tx, key, batch)
        row.update(plain_ms=1e3 * plain_seconds, ratio=ember_seconds / plain_seconds, plain_compile_s=plain_compile)
    peak = peak_flops_per_device()
    if peak:
        row["ember_mfu"] = flops_per_token(config, seq_len) * tokens / ember_seconds / (peak * jax.device_count())
    return row


def _time_plain_step(model, tx, key, batch) -> tuple[float, float]:
    """``(seconds per step, compile seconds)`` of the plain step: the same model and
    optimizer without the framework."""
    params = unbox(jax.jit(lambda k: model.init(k, batch["tokens"][:1])["params"])(key))
    opt_state = tx.init(params)
    step = jax.jit(functools.partial(plain_step, model=model, tx=tx), donate_argnums=(0, 1))
    plain_compile = time_compile(step, params, opt_state, batch)
    plain_holder = {"params": params, "opt": opt_state}

    def run_plain():
        plain_holder["params"], plain_holder["opt"], loss = step(plain_holder["params"], plain_holder["opt"], batch)
        return loss

    return time_fn(run_plain, warmup=2, repeats=10), plain_compile


def main() -> None:
    cases = dict(CPU_CASES, **GPU_CASES) if on_gpu() else CPU_CASES
    if not on_gpu():
        print("no GPU found: timing the CPU cases only (the ~125M / ~350M cases need a GPU)")
    rows = [measure(name, *case) for name, case in cases.items()]
    print_table(rows, ["model", "batch", "seq_len", "ember_ms", "plain_ms", "ratio", "ember_compile_s",
                       "plain_compile_s", "ember_tokens_per_s", "ember_mfu"])
    path = write_results("train_step", {"rows": rows, "note": "ratio = Ember step time / plain Flax+optax step time"})
    print(f"wrote {path}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
