"""What the trainer checks and says about how its mesh splits the work: a batch the processes
cannot feed (an error), and devices that hold and compute the same (warnings) because the batch
or some parameters' dimensions do not divide over a mesh axis, or an axis splits nothing.

``ember.core.sharding`` replicates a dimension over a mesh axis that does not divide it rather
than failing (a vocabulary of 50257 still loads on a tensor-parallel mesh); these say so, with
the sizes that would split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ember.core.errors import ConfigError
from ember.core.sharding import logical_to_spec, splitting_axes


def check_process_rows(
    sharding: Any, global_shape: tuple[int, ...], local_rows: int, axis: str | None, rules: Any
) -> None:
    """Each process feeds its own ``local_rows`` of a global batch, so the devices of a process
    must hold exactly that many rows. They do not when the mesh's batch axes (``axis``'s rule)
    do not divide the batch (it is then replicated over them, ``ember.core.sharding``), or when
    they divide it but do not span the processes (an axis the batch is not split over, such as
    ``tensor``, across processes: each process's devices hold other processes' rows too).

    Raises:
      ConfigError: keyed ``train.batch_size`` (the batch does not divide) or the mesh axis that
        spans processes without splitting the batch.
    """
    if jax.process_count() == 1:
        return
    rows = {
        index[0].indices(global_shape[0]) for index in sharding.addressable_devices_indices_map(global_shape).values()
    }
    held = sum(len(range(*row)) for row in rows)
    if held == local_rows:
        return
    mesh, processes = sharding.mesh, jax.process_count()
    wanted, split = batch_split(mesh, axis, rules)
    if global_shape[0] % split == 0:  # the batch divides: the layout puts other processes' rows here
        others = [name for name in mesh.axis_names if mesh.shape[name] > 1 and name not in wanted]
        split_over = " x ".join(f"mesh.{name}={mesh.shape[name]}" for name in wanted) or "no mesh axis"
        raise ConfigError(
            f"the global batch of {global_shape[0]} rows cannot be fed by {processes} processes on this mesh: each "
            f"process reads its own {local_rows} rows, but this process's devices hold {held} (the batch is split over "
            f"{split_over}; {', '.join(f'mesh.{name}={mesh.shape[name]}' for name in others) or 'the other axes'} "
            f"spans processes); the axes the batch is split over (mesh.data x mesh.fsdp x mesh.expert by default) "
            f"must span the processes, their product a multiple of {processes}, and the others stay within one "
            f"process's {jax.local_device_count()} devices",
            key=f"mesh.{others[0]}" if others else "mesh.data",
        )
    raise ConfigError(
        f"the global batch of {global_shape[0]} rows does not split over the mesh's batch axes across "
        f"{processes} processes (this process's devices hold {held} rows, it reads {local_rows}); make "
        "train.batch_size a multiple of the product of the mesh axes the batch is sharded over "
        "(mesh.data x mesh.fsdp x mesh.expert by default)",
        key="train.batch_size",
    )


def batch_split(mesh: Any, axis: str | None, rules: Any) -> tuple[list[str], int]:
    """``(the mesh axes of size > 1 the rules split logical batch axis ``axis`` over, the product
    of their sizes)``: the devices a batch the axes divide is split over."""
    wanted = list(splitting_axes(mesh, axis, rules))
    return wanted, math.prod(mesh.shape[name] for name in wanted)


def replicated_rows_message(sharding: Any, axis: str, rows: int, rules: Any, grad_accum: int = 1) -> str | None:
    """What to tell the user when the rules split logical batch ``axis`` over mesh axes that
    ``sharding`` had to drop because they do not divide ``rows`` (``ember.core.sharding``), the rows
    of a micro-batch with ``grad_accum`` > 1: those devices then compute the same rows. ``None``
    when nothing of size > 1 was dropped."""
    mesh = sharding.mesh
    kept = _entry_axes(sharding.spec[0] if len(sharding.spec) else None)
    wanted, split = batch_split(mesh, axis, rules)
    dropped = [name for name in wanted if name not in kept]
    if not dropped:
        return None
    batch = f"the batch of {rows} rows" if grad_accum == 1 else f"each micro-batch of {rows} rows"
    multiple = " x ".join([*(f"mesh.{name}" for name in wanted), *(["train.grad_accum"] if grad_accum > 1 else [])])
    return (
        f"{batch} is replicated, not split, over mesh axes "
        f"{' x '.join(f'{name}={mesh.shape[name]}' for name in dropped)} (they do not divide it): those devices "
        f"all compute the same rows; a train.batch_size that is a multiple of {split * grad_accum} "
        f"({multiple}) is split over every device"
    )


def idle_axes(mesh: Any, rules: Any, batch_axis: str | None, *shardings: Any) -> list[str]:
    """The mesh axes of size > 1 that split nothing: no parameter of ``shardings`` (the state's,
    the teacher's) is split over them (the rules map no logical axis to them, or none of those
    dimensions divides) and the batch is not (its rule does not name them; one that does but does
    not divide is :func:`replicated_rows_message`'s), so their devices hold and compute the same."""
    rules = dict(rules)
    used = {*rules.get(batch_axis, ()), *rules.get("seq", ())}  # seq: activations only
    for sharding in jax.tree.leaves(shardings):
        for entry in sharding.spec:
            used.update(_entry_axes(entry))
    return [name for name in mesh.axis_names if mesh.shape[name] > 1 and name not in used]


def idle_axes_message(mesh: Any, rules: Any, idle: list[str]) -> str | None:
    """What to tell the user of the ``idle`` mesh axes (:func:`idle_axes`); ``None`` for none."""
    if not idle:
        return None
    rules = dict(rules)
    reasons = []
    for name in idle:
        logical = [axis for axis, mesh_axes in rules.items() if name in mesh_axes]
        why = f"the rules split {', '.join(logical)} over it" if logical else "no sharding rule names it"
        reasons.append(f"mesh.{name}={mesh.shape[name]} ({why})")
    one = len(idle) == 1
    return (
        f"mesh ax{'is' if one else 'es'} {', '.join(reasons)} split{'s' if one else ''} no parameter (none has a "
        f"dimension {'it divides' if one else 'they divide'}) and not the batch: {'its' if one else 'their'} devices "
        f"all hold and compute the same; set {' and '.join(f'mesh.{name}=1' for name in idle)} and give the devices "
        "to mesh.data"
    )


def undivided_axes_message(mesh: Any, rules: Any, params: Any, skip: tuple[str, ...] = ()) -> str | None:
    """What to tell the user when a mesh axis of size > 1 that the rules give a dimension of some
    of ``params`` (boxed in ``nn.Partitioned``, as ``init`` gives them) does not divide it: that
    dimension is replicated over the axis, so its devices hold and compute the same slices of it
    (``mesh.tensor=8`` with 4 attention heads: pairs of devices compute the same heads). Axes in
    ``skip`` (the wholly idle ones, :func:`idle_axes`) are left out. ``None`` when every
    such dimension divides."""
    undivided: dict[str, dict[str, set[int]]] = {}  # mesh axis -> logical name -> its sizes
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.Partitioned)):
        if not isinstance(leaf, nn.Partitioned):
            continue
        shape = np.shape(leaf.value)
        wanted = logical_to_spec(leaf.names, rules, mesh=mesh)
        kept = logical_to_spec(leaf.names, rules, shape=shape, mesh=mesh)
        for name, size, want, keep in zip(leaf.names, shape, wanted, kept):
            for axis in _entry_axes(want) - _entry_axes(keep):
                if mesh.shape[axis] > 1 and axis not in skip:
                    undivided.setdefault(axis, {}).setdefault(name, set()).add(size)
    if not undivided:
        return None
    lines = [
        f"mesh.{axis}={mesh.shape[axis]} does not divide the parameters' {_sizes(names)}"
        for axis, names in sorted(undivided.items())
    ]
    return (
        f"{'; '.join(lines)}: those dimensions are replicated over "
        f"{'that axis' if len(lines) == 1 else 'those axes'}, whose devices hold and compute the same slices of "
        "them; a mesh axis size that divides them splits them"
    )


def _entry_axes(entry: Any) -> set[str]:
    """The mesh axes of one ``PartitionSpec`` entry (None, a name or a tuple of names)."""
    return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)


def _sizes(names: Mapping[str, set[int]]) -> str:
    return ", ".join(f"{name} ({', '.join(map(str, sorted(sizes)))})" for name, sizes in sorted(names.items()))


__all__ = [
    "batch_split",
    "check_process_rows",
    "idle_axes",
    "idle_axes_message",
    "replicated_rows_message",
    "undivided_axes_message",
]
