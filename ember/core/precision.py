"""Mixed-precision policy: the dtypes of parameters, computation and outputs.

    policy = Precision.from_string("bf16")      # f32 params, bf16 compute, f32 output
    policy = Precision.from_string("params=f32,compute=bf16,output=bf16")
    policy.compute_dtype                        # dtype('bfloat16'), for a module's ``dtype``

Named policies: ``f32`` (everything float32), ``bf16`` (float32 master weights, bfloat16
compute, float32 outputs — the usual mixed-precision training set-up), ``f16`` (the same
with float16 compute), ``pure_bf16`` (everything bfloat16).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

DTYPE_NAMES: dict[str, Any] = {
    "f32": jnp.float32,
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "half": jnp.float16,
    "f64": jnp.float64,
    "float64": jnp.float64,
}

_NAMED_POLICIES: dict[str, tuple[str, str, str]] = {
    "f32": ("f32", "f32", "f32"),
    "float32": ("f32", "f32", "f32"),
    "bf16": ("f32", "bf16", "f32"),
    "f16": ("f32", "f16", "f32"),
    "pure_bf16": ("bf16", "bf16", "bf16"),
}


def parse_dtype(name: str | Any) -> jnp.dtype:
    """A floating dtype from a name such as ``"bf16"`` or ``"float32"`` (or a dtype)."""
    if not isinstance(name, str):
        dtype = jnp.dtype(name)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"precision dtypes must be floating point, got {dtype}")
        return dtype
    key = name.strip().lower()
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype '{name}'; valid names: {', '.join(sorted(DTYPE_NAMES))}")
    return jnp.dtype(DTYPE_NAMES[key])


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtype policy. Fields hold dtype names (config-friendly); properties give dtypes."""

    params: str = "f32"
    compute: str = "f32"
    output: str = "f32"

    def __post_init__(self):
        for field in ("params", "compute", "output"):
            dtype = parse_dtype(getattr(self, field))
            if jax.dtypes.canonicalize_dtype(dtype) != dtype:  # float64 in 32-bit JAX
                raise ValueError(
                    f"precision {field}={getattr(self, field)} needs 64-bit JAX (jax.config.update('jax_enable_x64', "
                    "True) or JAX_ENABLE_X64=1); without it JAX makes every float64 array float32"
                )

    @classmethod
    def from_string(cls, spec: str) -> Precision:
        """A policy from a name (``f32``, ``bf16``, ``f16``, ``pure_bf16``) or
        ``params=...,compute=...,output=...`` (omitted parts default to ``f32``)."""
        spec = spec.strip()
        if spec in _NAMED_POLICIES:
            return cls(*_NAMED_POLICIES[spec])
        parts = {}
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in ("params", "compute", "output"):
                raise ValueError(
                    f"unknown precision policy '{spec}'; use one of {', '.join(_NAMED_POLICIES)} "
                    "or 'params=DTYPE,compute=DTYPE,output=DTYPE'"
                )
            parts[key.strip()] = value.strip()
        return cls(**parts)

    @property
    def param_dtype(self) -> jnp.dtype:
        return parse_dtype(self.params)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return parse_dtype(self.compute)

    @property
    def output_dtype(self) -> jnp.dtype:
        return parse_dtype(self.output)


__all__ = ["DTYPE_NAMES", "Precision", "parse_dtype"]
