"""Compiles whole programs with XLA's GPU compiler for an H100 (or H200) on a machine without
a GPU, and reports the memory each compiled program needs besides its arguments and results.

    python -m benchmarks.deviceless_compile               # decode and train steps, for an H100
    python -m benchmarks.deviceless_compile --device h200 --programs decode

Needs JAX 0.11 with the CUDA plugin wheels (``jax-cuda12-plugin``, ``jax-cuda12-pjrt``: the
Python 3.12 venv of :mod:`benchmarks.triton_compile`), and Ember's own requirements; no GPU,
driver or NVIDIA libraries. XLA compiles for a GPU it is described (a
``GpuTargetConfigProto``: compute capability, SMs, shared memory, caches, bandwidth) rather
than one it finds, through ``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=...)``. The whole XLA pipeline runs: fusion, layout assignment, scheduling,
buffer assignment, with the Pallas kernels as custom calls. So the optimized HLO and the
buffer sizes are those a device would run, where :mod:`benchmarks.triton_compile` sees one
kernel at a time.
Times need the device (``python -m benchmarks.gpu``).

Each row is one serving decode step of ``benchmarks.quantization.GPU_DECODE_MODEL`` (8 layers,
d_model 2048, bf16 compute) at batch 1 with 256 tokens of context, its weights float or
stored int8 / int4 (each stored as ``build_program`` stores it, in the dtype the step reads it
in), its layers scanned or unrolled:

- ``scratch_mb``: XLA's temporary buffers. A copy of an argument lives there.
- ``weight_copies``, ``weight_copies_mb``: int8 / uint8 arrays the step writes outside fused
  computations (``benchmarks.quantization.materialized_weight_mb``), a loop body counted once:
  packed weights copied for the quantized matmul.
- ``kv_mb`` and ``weights_mb``: the cache's pages and the weights as stored, for scale.

And the ``350m`` preset's training step as ``benchmarks.gpu`` times it (bf16, 16 x 2048 tokens),
with each ``remat`` policy: ``scratch_mb`` there is mostly the activations the scan over layers
saves for the backward pass.

What it found (2026-11-27, jax 0.11.2): a scanned int8 step copied each layer's 67 MB of packed
weights out of the stacked parameter for the kernel (a custom call), where XLA's own dot reads
its slice in place; the unrolled step copied none. The scanned float step transposed the
stacked q, k and v kernels of all layers every step; the unrolled one did not. So
``load_model`` loads models unrolled on a GPU (``ember.serving.loading.serving_overrides``).
Every step also copied every layer's KV pages twice (into the slice the
attention kernel read, and back into the stacked cache), in both layouts, until the pages
became one pool updated in place (``ember.models.cache.fold_pages``). The training step
without remat (as ``benchmarks.gpu`` timed it at 28.9% MFU) needs 56 GB of scratch, 51 GB of it
the scan's saved activations: JAX fills those stacked buffers with zeros before the loop
(``lax.empty2`` in ``jax._src.lax.control_flow.loops``, a TODO there), writes them in the
forward and reads them in the backward, about 150 GB of HBM traffic a step. ``remat="dots"``
saves 23 GB, ``"full"`` 8 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from benchmarks.harness import print_table
from benchmarks.quantization import GPU_DECODE_MODEL, materialized_weight_mb
from benchmarks.train_step import random_batch
from benchmarks.triton_lowering import pretend_gpu
from ember.core.config import load_config
from ember.core.sharding import unbox
from ember.models.cache import init_cache_layers
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.quantization import QuantizeConfig, quantize_params, weight_bytes
from ember.serving.model_program import jitted_step, program_layout, read_weight_dtypes
from ember.serving.program import narrowed_weights, step_argument_specs
from ember.training.lm.task import lm_loss
from ember.training.optimizers import OptimConfig, make_optimizer, make_schedule
from ember.training.train_step import init_state, train_step
from ember.training.trainable import map_paths

RESULTS = pathlib.Path(__file__).parent / "results"
PRESETS = pathlib.Path(__file__).parent.parent / "configs" / "models"
REMATS = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler needs to know of a device it cannot see."""

    name: str
    memory_bytes: int
    bandwidth_bytes_s: float
    sms: int = 132
    l2_bytes: int = 50 * 2**20
    clock_ghz: float = 1.98
    shared_memory_per_sm: int = 228 * 1024
    shared_memory_per_block_optin: int = 227 * 1024
    compute_capability: tuple[int, int] = (9, 0)

    def target_config(self) -> str:
        """The device as a ``stream_executor.GpuTargetConfigProto`` in text format."""
        major, minor = self.compute_capability
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024  threads_per_warp: 32  threads_per_core_limit: 2048
  shared_memory_per_block: 49152  shared_memory_per_core: {self.shared_memory_per_sm}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  core_count: {self.sms}  fpus_per_core: 128  clock_rate_ghz: {self.clock_ghz}
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth_bytes_s)}  l2_cache_size: {self.l2_bytes}
  device_memory_size: {self.memory_bytes}
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: {major} minor: {minor} }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{self.name}"
"""


DEVICES = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", memory_bytes=80 * 2**30, bandwidth_bytes_s=3.35e12),
    "h200": GpuSpec("NVIDIA H200", memory_bytes=141 * 10**9, bandwidth_bytes_s=4.8e12),
}


def compile_only_device(spec: GpuSpec) -> jax.Device:
    """A device XLA compiles for (and never runs on)."""
    topology = topologies.get_topology_desc("deviceless", "cuda", target_config=spec.target_config(), topology="1x1x1")
    return topology.devices[0]


def compile_for(device: jax.Device, function, *argument_specs):
    """``jax.jit(function)`` compiled for ``device`` at ``argument_specs`` (pytrees of
    ``ShapeDtypeStruct``), with the kernels dispatching as on a GPU."""
    placed = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=SingleDeviceSharding(device)), argument_specs
    )
    with pretend_gpu():
        return function.lower(*placed).compile()


def decode_step_row(device: jax.Device, config: ModelConfig, weights: str, context: int = 256) -> dict:
    """The compiled serving decode step (one sequence, one new token, ``context`` tokens of
    pages) of ``config`` with its projections stored in ``weights`` ("float" or a format)."""
    with pretend_gpu():
        model = DecoderLM(config)
        params = jax.eval_shape(
            lambda: nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
        )
        if weights != "float":
            params = jax.eval_shape(lambda p: quantize_params(p, QuantizeConfig(format=weights)), params)
        layout = program_layout(config, 1, context, None)
        kv = jax.eval_shape(lambda: init_cache_layers(config, 1, layout["num_pages"]))
    step = jitted_step(config)
    with pretend_gpu():  # stored as build_program stores them: each in the dtype the step reads it in
        dtypes = read_weight_dtypes(step, params, kv, 1, layout["pages_per_seq"])
        params = jax.eval_shape(lambda p: narrowed_weights(p, dtypes), params)
    specs = step_argument_specs(params, kv, 1, 1, layout["pages_per_seq"])
    start = time.perf_counter()
    compiled = compile_for(device, step, *specs)
    seconds = time.perf_counter() - start
    copies, copied_mb = materialized_weight_mb(compiled.as_text())
    return dict(
        program="decode_step",
        layers="scanned" if config.scan_layers else "unrolled",
        weights=weights,
        compile_s=round(seconds, 1),
        scratch_mb=compiled.memory_analysis().temp_size_in_bytes / 1e6,
        weight_copies=copies,
        weight_copies_mb=copied_mb,
        kv_mb=weight_bytes(kv) / 1e6,
        weights_mb=weight_bytes(params) / 1e6,
    )


def decode_rows(device: jax.Device, formats=("float", "int8", "int4")) -> list[dict]:
    return [
        decode_step_row(device, dataclasses.replace(GPU_DECODE_MODEL, scan_layers=scan), weights)
        for scan in (True, False)
        for weights in formats
    ]


def train_step_row(device: jax.Device, remat: str, preset: str = "350m", batch: int = 16, seq_len: int = 2048) -> dict:
    """The compiled training step (AdamW, every parameter trained) of ``preset`` in bf16 with
    ``remat``, at ``batch`` x ``seq_len`` tokens."""
    config = dataclasses.replace(load_config(ModelConfig, PRESETS / f"{preset}.yaml"), precision="bf16", remat=remat)
    model = DecoderLM(config)
    optim = OptimConfig(lr=1e-3)
    tx = make_optimizer(optim, 1000)
    with pretend_gpu():
        batch_specs = jax.eval_shape(lambda: random_batch(jax.random.key(0), config, batch, seq_len))

        def init_variables(rng):
            zeros = jnp.zeros((1, seq_len), jnp.int32)
            return {"params": model.init(rng, zeros, positions=zeros)["params"]}

        mask = map_paths(lambda path, _: True, jax.eval_shape(init_variables, jax.random.key(0))["params"])
        state = jax.eval_shape(
            lambda key: unbox(init_state(key, init_variables=init_variables, tx=tx, mask=mask)), jax.random.key(0)
        )
    loss = functools.partial(lm_loss, model=model)
    step = jax.jit(
        functools.partial(train_step, loss_fn=loss, tx=tx, schedule=make_schedule(optim, 1000), mask=mask),
        donate_argnums=0,
    )
    start = time.perf_counter()
    compiled = compile_for(device, step, state, batch_specs, None)
    return dict(
        program=f"train_step {preset}",
        remat=remat,
        compile_s=round(time.perf_counter() - start, 1),
        scratch_mb=compiled.memory_analysis().temp_size_in_bytes / 1e6,
        weights_mb=weight_bytes(state.params) / 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(DEVICES), default="h100")
    parser.add_argument("--programs", nargs="+", choices=("decode", "train"), default=("decode", "train"))
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    device = compile_only_device(DEVICES[args.device])
    rows = decode_rows(device) if "decode" in args.programs else []
    rows += [train_step_row(device, remat) for remat in REMATS] if "train" in args.programs else []
    columns = ["program", "layers", "remat", "weights", "compile_s", "scratch_mb", "weight_copies", "weight_copies_mb",
               "kv_mb", "weights_mb"]  # fmt: skip
    print_table(rows, [c for c in columns if any(c in row for row in rows)])
    record = {
        "device": f"{args.device} (compiled without one: XLA's deviceless GPU compile)",
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "rows": rows,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"deviceless_compile-{args.device}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
