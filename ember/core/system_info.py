"""What this machine offers Ember: JAX version, backend, devices, Pallas lowerings.

``system_info()`` returns it as a JSON-serialisable dict (the benchmarks record it next to
their figures); ``ember info`` (:mod:`ember.kernels_pallas.info_command`) prints it with the
table of Pallas kernels per backend.
"""

from __future__ import annotations

import importlib
import platform
from typing import Any

# Pallas lowering -> (module that provides it, device platform it targets, minimum GPU
# compute capability or None)
_PALLAS_LOWERINGS: dict[str, tuple[str, str, float | None]] = {
    "triton (GPU)": ("jax.experimental.pallas.triton", "gpu", 8.0),
    "mosaic_gpu (Hopper+)": ("jax.experimental.pallas.mosaic_gpu", "gpu", 9.0),
    "mosaic_tpu (TPU)": ("jax.experimental.pallas.tpu", "tpu", None),
}


# Dense bf16 peak FLOP/s by device kind (datasheet values; MFU is reported against these). The
# first name the kind contains wins: a variant comes before the name it extends ("l40s" holds "l4").
_PEAK_BF16_FLOPS: dict[str, float] = {
    "h100 pcie": 756e12,
    "h100": 989e12,
    "h200": 989e12,
    "h800": 989e12,
    "a100": 312e12,
    "l40s": 362e12,
    "l40": 181e12,
    "l4": 121e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v6 lite": 918e12,
}


def peak_flops_per_device(device: Any = None) -> float | None:
    """Datasheet dense bf16 FLOP/s of ``device`` (default: the first device), or ``None``
    when unknown (CPUs), in which case no MFU is reported."""
    import jax

    kind = (device or jax.devices()[0]).device_kind.lower()
    for name, flops in _PEAK_BF16_FLOPS.items():
        if name in kind:
            return flops
    return None


def _compute_capability(device: Any) -> float | None:
    value = getattr(device, "compute_capability", None)
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def system_info() -> dict[str, Any]:
    """A JSON-serialisable description of the JAX installation and devices."""
    import jax
    import jaxlib

    import ember

    devices = jax.devices()
    platforms = {d.platform for d in devices}
    capabilities = [c for c in (_compute_capability(d) for d in devices if d.platform == "gpu") if c is not None]
    pallas = {}
    for name, (module, target, min_capability) in _PALLAS_LOWERINGS.items():
        try:
            importlib.import_module(module)
            importable = True
        except Exception:  # an optional lowering may fail to import for many reasons
            importable = False
        usable = importable and target in platforms
        if usable and min_capability is not None:
            usable = any(c >= min_capability for c in capabilities)
        pallas[name] = {"importable": importable, "usable_here": usable}
    return {
        "ember": ember.__version__,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "devices": [
            {"id": d.id, "platform": d.platform, "kind": d.device_kind, "compute_capability": _compute_capability(d)}
            for d in jax.local_devices()
        ],
        "pallas": pallas,
    }


def format_info(info: dict[str, Any]) -> str:
    kinds: dict[str, int] = {}
    for device in info["devices"]:
        kinds[device["kind"]] = kinds.get(device["kind"], 0) + 1
    lines = [
        f"ember      {info['ember']}",
        f"python     {info['python']}",
        f"jax        {info['jax']} (jaxlib {info['jaxlib']})",
        f"backend    {info['backend']}",
        f"processes  {info['process_count']} (this is process {info['process_index']})",
        f"devices    {info['device_count']} global, {info['local_device_count']} local: "
        + ", ".join(f"{n} x {kind}" for kind, n in kinds.items()),
        "pallas lowerings:",
    ]
    for name, status in info["pallas"].items():
        state = (
            "usable here"
            if status["usable_here"]
            else "importable, no matching device"
            if status["importable"]
            else "not available"
        )
        lines.append(f"  {name:<22} {state}")
    if not any(s["usable_here"] for s in info["pallas"].values()):
        lines.append(
            "  (ops run their XLA path here; impl='interpret' runs the GPU kernels and "
            "impl='interpret_tpu' the TPU kernels on any backend)"
        )
    return "\n".join(lines)
