"""The dtype a function reads each of its inputs in, read off its jaxpr.

Under a mixed-precision policy a module keeps float32 weights and converts them to the
compute dtype at every use: a bf16 ``Dense`` traces to ``convert_element_type(kernel,
bfloat16)`` before its ``dot_general``. An input whose every use is a conversion to one
dtype is *read in* that dtype. Stored in that dtype, it gives the function's outputs bit
for bit (converting an array to the dtype it has is nothing), and no call converts it again.

    dtypes = read_dtypes(step, params, batch)   # one entry per leaf of (params, batch)
    # dtypes[i]: the dtype leaf i is read in, or None where some use reads it as it is

A use is followed through the operations that commute with a conversion (reshapes,
transposes, slices, gathers, broadcasts; the array operand only), into and back out of
nested jits, custom-derivative functions and remat, into a scan's body (for its constants
and the arrays it scans over) and into each branch of a cond. Any other use (arithmetic, a
Pallas kernel, a loop carry, an output of the function) reads the input as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core

LAYOUT_OPS = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "slice", "dynamic_slice", "gather", "rev",
    "copy", "copy_p", "sharding_constraint",
})  # fmt: skip
"""Primitives whose first operand's values reach the output unchanged, only moved or copied:
``convert(op(x)) == op(convert(x))``."""

CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call"}
)
"""Primitives that call one inner jaxpr on their operands, in order, and return its outputs."""

_AS_IT_IS = "as it is"


def read_dtypes(fn: Callable[..., Any], *args: Any) -> list[np.dtype | None]:
    """For each leaf of ``args`` (in ``jax.tree.leaves`` order; arrays or
    ``ShapeDtypeStruct``), the dtype ``fn(*args)`` converts it to at every use, or None
    where a use reads it as it is (or it is never used)."""
    closed = jax.make_jaxpr(fn)(*args)
    result = []
    for var in closed.jaxpr.invars:
        dtypes = _uses(closed.jaxpr, var)
        result.append(dtypes.pop() if len(dtypes) == 1 and _AS_IT_IS not in dtypes else None)
    return result


def _uses(jaxpr: core.Jaxpr, var: Any, outer: list[tuple[Any, core.Jaxpr]] = ()) -> set:
    """The dtypes the uses of ``var`` in ``jaxpr`` convert it to (``_AS_IT_IS`` for any other
    use). ``outer``: the enclosing call equations and their jaxprs, innermost last, through
    which an output of ``jaxpr`` leaves (a scan's or cond's output is used as it is)."""
    found: set = set()
    for index, out in enumerate(jaxpr.outvars):
        if out is var:
            if not outer:
                found.add(_AS_IT_IS)
                continue
            eqn, parent = outer[-1]
            found |= _uses(parent, eqn.outvars[index], outer[:-1])
    for eqn in jaxpr.eqns:
        for position, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            name = eqn.primitive.name
            if name == "convert_element_type":
                found.add(np.dtype(eqn.params["new_dtype"]))
            elif name in LAYOUT_OPS and position == 0:
                found |= _uses(jaxpr, eqn.outvars[0], outer)
            elif name in CALLS and (inner := _called(eqn)) is not None:
                found |= _uses(inner, inner.invars[position], (*outer, (eqn, jaxpr)))
            elif name == "scan" and not _is_carry(eqn, position):
                body = _jaxpr(eqn.params["jaxpr"])
                found |= _uses(body, body.invars[position])
            elif name == "cond" and position > 0:
                for branch in eqn.params["branches"]:
                    inner = _jaxpr(branch)
                    found |= _uses(inner, inner.invars[position - 1])
            else:
                found.add(_AS_IT_IS)
    return found


def _jaxpr(value: Any) -> core.Jaxpr:
    return value.jaxpr if isinstance(value, core.ClosedJaxpr) else value


def _called(eqn: Any) -> core.Jaxpr | None:
    """The jaxpr a call primitive runs on its operands (its parameter's name differs by primitive and JAX version)."""
    for value in eqn.params.values():
        if isinstance(value, (core.Jaxpr, core.ClosedJaxpr)):
            inner = _jaxpr(value)
            if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
                return inner
    return None


def _is_carry(eqn: Any, position: int) -> bool:
    """Whether operand ``position`` of a scan is a loop carry (after its constants, before the scanned arrays)."""
    if "num_consts" in eqn.params:  # jax 0.10
        start, count = eqn.params["num_consts"], eqn.params["num_carry"]
    else:  # jax 0.11: the operands' (constants, carry, scanned) grouping
        consts, carry, _ = eqn.params["ft_in"].unpack()
        start, count = len(list(consts)), len(list(carry))
    return start <= position < start + count


__all__ = ["CALLS", "LAYOUT_OPS", "read_dtypes"]
