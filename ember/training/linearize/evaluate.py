"""What a linearising run measures outside its two training loops: the validation loss of any
of its models (teacher, naive swap, linearised) and each layer's attention-transfer error, on
the same fixed validation batches, with the weights placed on the run's mesh."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ember.core.sharding import Rules, host_local_to_global, use_sharding
from ember.core.tree import param_paths
from ember.models.decoder import DecoderLM
from ember.models.layers.window_linear_attention import TRANSFER_LOSS
from ember.training.lm.task import BATCH_AXES, lm_loss


def validation_loss(model: DecoderLM, variables: Any, batches: Iterable[dict], mesh: Mesh, rules: Rules) -> float:
    """Mean next-token loss of ``model`` with ``variables`` (``{"params", <state>}``, placed)
    over ``batches`` (host LM batches), weighted by their tokens."""
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    @jax.jit
    def sums(params, state, batch):
        terms = lm_loss(params, batch, model=model, model_state=state or None)
        return terms.loss_sum, terms.count

    total = count = 0.0
    with use_sharding(mesh, rules):
        for batch in batches:
            loss_sum, tokens = jax.device_get(sums(params, state, host_local_to_global(batch, mesh, BATCH_AXES, rules)))
            total, count = total + float(loss_sum), count + float(tokens)
    return total / max(count, 1.0)


def transfer_errors(model: DecoderLM, variables: Any, batches: Iterable[dict], mesh: Mesh, rules: Rules) -> list[float]:
    """Each layer's attention-transfer error (``model`` in attention-transfer mode; softmax
    layers, which have none, are left out), averaged over ``batches``; in layer order."""

    @jax.jit
    def errors(variables, batch):
        _, updated = model.apply(
            variables, batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
            mutable=["losses"],
        )  # fmt: skip
        return _per_layer(updated.get("losses", {}), model.config.layer_period)

    sums, count = None, 0
    with use_sharding(mesh, rules):
        for batch in batches:
            values = np.asarray(jax.device_get(errors(variables, host_local_to_global(batch, mesh, BATCH_AXES, rules))))
            sums, count = values if sums is None else sums + values, count + 1
    return [float(v) for v in sums / max(count, 1)]


def _per_layer(losses: dict, period: int) -> jax.Array:
    """``[layers with a transfer error]`` from the ``losses`` collection: scanned layers sow
    ``layers/block_<j>/...`` with a leading ``[groups]`` axis, unscanned ones
    ``group_<g>/block_<j>/...`` as scalars; layer ``g * period + j``."""
    found = {}
    for path, sown in param_paths(losses).items():
        parts = path.split("/")
        if parts[-1] != TRANSFER_LOSS:
            continue
        block = int(parts[1].removeprefix("block_"))
        values = jnp.atleast_1d(sown[0])
        first_group = 0 if parts[0] == "layers" else int(parts[0].removeprefix("group_"))
        for offset, value in enumerate(values):
            found[(first_group + offset) * period + block] = value
    return jnp.stack([found[layer] for layer in sorted(found)])


__all__ = ["transfer_errors", "validation_loss"]
