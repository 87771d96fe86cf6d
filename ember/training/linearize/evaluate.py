"""What a linearising run measures outside its two training loops: the validation loss of any
of its models (teacher, naive swap, after transfer) and each layer's attention-transfer error,
on the same fixed validation batches, with the weights placed on the run's mesh."""

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


class Evaluator:
    """The run's fixed validation batches (host LM batches), placed on ``mesh`` once; one
    compiled program per model and measure, shared by every weight set it measures."""

    def __init__(self, batches: Iterable[dict], mesh: Mesh, rules: Rules):
        self.mesh, self.rules = mesh, rules
        with use_sharding(mesh, rules):
            self.batches = [host_local_to_global(batch, mesh, BATCH_AXES, rules) for batch in batches]
        self._programs: dict[tuple[str, int], tuple[DecoderLM, Any]] = {}

    def validation_loss(self, model: DecoderLM, variables: Any) -> float:
        """Mean next-token loss of ``model`` with ``variables`` (``{"params", <state>}``, placed),
        weighted by the batches' tokens."""

        def sums(variables, batch):
            state = {k: v for k, v in variables.items() if k != "params"}
            terms = lm_loss(variables["params"], batch, model=model, model_state=state or None)
            return terms.loss_sum, terms.count

        totals = self._sum_over_batches("validation_loss", model, sums, variables)
        return float(totals[0] / max(totals[1], 1.0))

    def transfer_errors(self, model: DecoderLM, variables: Any) -> list[float]:
        """Each layer's attention-transfer error (``model`` in attention-transfer mode; softmax
        layers, which have none, are left out), the mean over the batches' tokens (padding, the
        empty rows that fill the last batch, left out); in layer order."""

        def errors(variables, batch):
            _, updated = model.apply(
                variables, batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                mutable=["losses"],
            )  # fmt: skip
            tokens = real_tokens(batch)  # each batch's mean is over these
            return _per_layer(updated.get("losses", {}), model.config.layer_period) * tokens, tokens

        sums, tokens = self._sum_over_batches("transfer_errors", model, errors, variables)
        return [float(v) / max(float(tokens), 1.0) for v in sums]

    def _sum_over_batches(self, measure: str, model: DecoderLM, fn, variables: Any) -> Any:
        key = (measure, id(model))
        if key not in self._programs:  # the model is kept with its program, so its id stays its own
            self._programs[key] = (model, jax.jit(fn))
        program = self._programs[key][1]
        total = None
        with use_sharding(self.mesh, self.rules):
            for batch in self.batches:
                values = jax.tree.map(np.asarray, jax.device_get(program(variables, batch)))
                total = values if total is None else jax.tree.map(np.add, total, values)
        return total


def real_tokens(batch: dict) -> jax.Array:
    """The tokens of an LM batch that are not padding (segment id 0: the empty rows that fill
    the last validation batch), as f32: what a batch's mean attention-transfer error is over."""
    return jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)


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


__all__ = ["Evaluator", "real_tokens"]
