"""Pallas kernels, one file per op: the public op, its plain-jnp ``*_reference`` and a
dispatcher over ``impl`` in {"auto", "pallas", "interpret", "xla"} (DESIGN.md section 4)."""
