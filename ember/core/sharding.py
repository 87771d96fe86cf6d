"""Device meshes and logical-axis sharding.

Parameters and activations are annotated with *logical* axis names drawn from one
vocabulary (:data:`LOGICAL_AXES`); *rules* map each logical name to zero or more *mesh*
axes (:data:`MESH_AXES`). Changing the parallelism of a run is then a matter of mesh sizes
(``MeshConfig``) and, rarely, rule overrides — never of model code.

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = logical_rules({"vocab": []})          # default rules, vocab replicated
    shardings = tree_shardings(mesh, nn.get_partition_spec(variables), rules, shapes=variables)
    with use_sharding(mesh, rules):
        y = jax.jit(model.apply)(variables, x)    # constrain() calls inside take effect

A mesh axis that does not divide an array dimension is dropped for that dimension (the
dimension is replicated over it) rather than failing, so a vocabulary of 50257 still loads
on a tensor-parallel mesh. Works with one process and with ``jax.distributed`` multi-process
meshes (``jax.devices()`` is global).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ember.core.errors import ConfigError

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "expert")
"""Mesh axes, outermost first: data parallel, fully-sharded data parallel, tensor, expert."""

LOGICAL_AXES: tuple[str, ...] = (
    "batch",
    "seq",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "expert",
    "layers",
    "state",
)
"""The logical axis vocabulary every parameter and activation annotation draws from."""

MeshAxes = tuple[str, ...]
Rules = tuple[tuple[str, MeshAxes], ...]

DEFAULT_RULES: Rules = (
    # Batch is split over every axis that holds a replica of the computation (ZeRO-3: FSDP
    # ranks see different data; expert-parallel ranks do too, tokens are exchanged all-to-all).
    ("batch", ("data", "fsdp", "expert")),
    ("seq", ()),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("vocab", ("tensor",)),
    ("expert", ("expert",)),
    ("layers", ()),
    ("state", ()),
)
"""Default logical -> mesh rules. A mesh axis is used at most once per array: a later
logical axis that asks for a mesh axis an earlier one took is left unsharded over it."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes. ``-1`` (on at most one axis) means "the rest of the devices"."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for axis, size in sizes.items():
            if size != -1 and size < 1:
                raise ConfigError(
                    f"mesh.{axis} must be a positive size or -1 (the rest), got {size}", key=f"mesh.{axis}"
                )
        flexible = [axis for axis, size in sizes.items() if size == -1]
        if len(flexible) > 1:
            raise ConfigError(
                f"at most one mesh axis may be -1, got {', '.join('mesh.' + a for a in flexible)} "
                f"(mesh.data is -1 unless set); give all but one of them a size, e.g. mesh.{flexible[0]}=1",
                key=f"mesh.{flexible[1]}",
            )

    def sizes(self) -> dict[str, int]:
        """The configured sizes keyed by mesh axis name (``-1`` unresolved)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Concrete axis sizes for ``num_devices``; raises ``ConfigError`` naming the keys."""
        sizes = self.sizes()
        fixed = math.prod(size for size in sizes.values() if size != -1)
        flexible = [axis for axis, size in sizes.items() if size == -1]
        described = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())
        if flexible:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh {described} does not divide the {num_devices} available devices "
                    f"(the fixed axes need a multiple of {fixed}; make their product divide {num_devices})",
                    key=f"mesh.{_misfit(sizes, num_devices)}",
                )
            sizes[flexible[0]] = num_devices // fixed
        elif fixed != num_devices:
            wrong = _misfit(sizes, num_devices) or next((axis for axis, size in sizes.items() if size > 1), "data")
            raise ConfigError(
                f"mesh {described} needs {fixed} devices but {num_devices} are available; "
                f"make the product equal {num_devices}, or set one axis to -1",
                key=f"mesh.{wrong}",
            )
        return sizes


def _misfit(sizes: dict[str, int], num_devices: int) -> str | None:
    """The first fixed axis (in ``MESH_AXES`` order) at which the product of the fixed sizes so far
    stops dividing ``num_devices``: the size at fault; None when the product divides it."""
    product = 1
    for axis, size in sizes.items():
        if size != -1:
            product *= size
            if num_devices % product:
                return axis
    return None


def make_mesh(config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with axes :data:`MESH_AXES` over ``devices`` (default: all global devices).

    Axes are ``Auto``-typed so logical constraints (``nn.with_logical_constraint``) apply.
    """
    config = config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    return jax.make_mesh(
        tuple(shape[axis] for axis in MESH_AXES),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


def logical_rules(overrides: Mapping[str, str | Sequence[str] | None] | None = None) -> Rules:
    """The default rules with ``overrides`` applied (``{"vocab": []}`` replicates vocab).

    Raises:
      ConfigError: for a logical name outside :data:`LOGICAL_AXES`, a mesh axis outside
        :data:`MESH_AXES` or one named twice in a rule.
    """
    rules = dict(DEFAULT_RULES)
    for name, axes in (overrides or {}).items():
        if name not in LOGICAL_AXES:
            raise ConfigError(
                f"unknown logical axis '{name}' in sharding rules; valid: {', '.join(LOGICAL_AXES)}",
                key=f"sharding.rules.{name}",
            )
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(
                    f"sharding rule for '{name}' names mesh axis '{axis}'; valid: {', '.join(MESH_AXES)}",
                    key=f"sharding.rules.{name}",
                )
        if len(set(axes)) < len(axes):  # a PartitionSpec may name a mesh axis once
            raise ConfigError(
                f"sharding rule for '{name}' names a mesh axis twice: {list(axes)}", key=f"sharding.rules.{name}"
            )
        rules[name] = axes
    return tuple(rules.items())


def logical_to_spec(
    axes: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """The mesh ``PartitionSpec`` for logical ``axes`` (one name or ``None`` per dimension).

    With ``mesh``, the rules' mesh axes it does not have are dropped (a mesh of one's own, say
    ``jax.make_mesh((8,), ("data",))``, is as if its missing axes had size 1); with ``shape`` too,
    so are the mesh axes that do not divide their dimension.
    """
    known = dict(rules)
    for name in axes:
        if name is not None and name not in known:
            raise ValueError(f"logical axis '{name}' has no sharding rule; known axes: {', '.join(known)}")
    used: set[str] = set()
    entries = []
    for index, name in enumerate(axes):
        mesh_axes = [axis for axis in (known[name] if name else ()) if axis not in used]
        if mesh is not None:
            mesh_axes = [axis for axis in mesh_axes if axis in mesh.axis_names]
        if shape is not None and mesh is not None:
            mesh_axes = _dividing_axes(mesh_axes, shape[index], mesh)
        used.update(mesh_axes)
        entries.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    return PartitionSpec(*entries)


def splitting_axes(mesh: Any, logical: str | None, rules: Rules = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes of size > 1 that ``rules`` split logical axis ``logical`` over (its rule's
    order): the axes that divide its work between devices (axes ``mesh`` lacks have size 1)."""
    return tuple(axis for axis in dict(rules).get(logical, ()) if mesh.shape.get(axis, 1) > 1)


def named_sharding(
    mesh: Mesh, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES, shape: Sequence[int] | None = None
) -> NamedSharding:
    """A ``NamedSharding`` on ``mesh`` for an array with logical ``axes``."""
    return NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh))


def tree_shardings(mesh: Mesh, logical_tree: Any, rules: Rules = DEFAULT_RULES, shapes: Any = None) -> Any:
    """``NamedSharding``s for a tree of logical ``PartitionSpec``s (``nn.get_partition_spec``).

    Args:
      mesh: the device mesh.
      logical_tree: a pytree whose leaves are ``PartitionSpec``s of logical names (or
        ``None`` for replicated leaves).
      rules: logical -> mesh rules.
      shapes: optional pytree of the same structure with arrays / ``ShapeDtypeStruct``s;
        when given, mesh axes that do not divide a dimension are dropped for it.
    """
    is_spec = lambda leaf: isinstance(leaf, PartitionSpec) or leaf is None  # noqa: E731
    if shapes is None:
        return jax.tree.map(lambda spec: named_sharding(mesh, tuple(spec or ()), rules), logical_tree, is_leaf=is_spec)
    shapes = unbox(shapes)

    def one(spec, leaf):
        spec = tuple(spec or ())
        return named_sharding(mesh, spec + (None,) * (np.ndim(leaf) - len(spec)), rules, np.shape(leaf))

    return jax.tree.map(one, logical_tree, shapes, is_leaf=is_spec)


def unbox(tree: Any) -> Any:
    """``tree`` with its ``nn.Partitioned`` boxes replaced by their values. Unlike
    ``nn.meta.unbox`` it applies no sharding constraint, so it is safe inside ``jit`` whatever
    the current mesh (placement comes from ``out_shardings``)."""
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, tree, is_leaf=is_box)


def drop_empty_boxes(tree: Any) -> Any:
    """``tree`` without the ``nn.Partitioned`` boxes that hold no array (optax's placeholder
    ``MaskedNode`` for a masked-out parameter, boxed like the parameter by ``init``), whose
    logical spec would otherwise have no array to shard."""
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    return jax.tree.map(lambda x: x if not is_box(x) or jax.tree.leaves(x.value) else x.value, tree, is_leaf=is_box)


def box_like(tree: Any, like: Any) -> Any:
    """``tree``'s leaves wrapped in the ``nn.Partitioned`` boxes of ``like`` (same structure,
    e.g. an ``eval_shape`` of ``model.init``) where ``like`` has one: pretrained weights
    given the logical axes their shardings come from."""
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    return jax.tree.map(lambda box, x: box.replace_boxed(x) if is_box(box) else x, like, tree, is_leaf=is_box)


def shard_variables(variables: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Places boxed Flax variables (``nn.Partitioned`` leaves) on ``mesh``; returns them unboxed."""
    shardings = tree_shardings(mesh, nn.get_partition_spec(variables), rules, shapes=variables)
    return jax.device_put(unbox(variables), shardings)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Constrains activation ``x`` to the sharding of logical ``axes`` (inside ``use_sharding``).

    A no-op outside a :func:`use_sharding` context, so layers can always call it.
    """
    mesh = _current_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh is None or not rules:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: got {len(axes)} logical axes {tuple(axes)} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, tuple(rules), shape=x.shape, mesh=mesh))


def per_shard(
    fn: Callable[..., Any],
    in_axes: Sequence[Sequence[str | None]],
    out_axes: Sequence[str | None],
    *,
    sum_over: str | Sequence[str | None] | None = None,
):
    """``fn`` run on each device's shard of its arguments under the current mesh (``jax.shard_map``,
    specs from the logical axes and rules, a mesh axis that does not divide a dimension dropped for
    it); ``fn`` itself outside :func:`use_sharding` or on one device.

    Why: a Pallas kernel is a custom call that XLA's partitioner cannot split. Called under ``jit``
    on a mesh it has its operands gathered whole onto every device, and every device computes the
    whole batch (flash attention on a ``data=8`` mesh: 12 all-gathers). ``fn`` must compute the same
    on any shard the specs give, as attention does on the batch rows and key heads it holds.

    Args:
      fn: a function of array pytrees (None leaves pass through) returning one array.
      in_axes: logical axes per argument, applied to each array of that argument.
      out_axes: logical axes of the result.
      sum_over: a logical axis ``fn`` contracts (a matmul's ``k``), or several (an MoE's
        experts and their hidden columns; None entries ignored): split where it names a
        dimension, ``fn``'s results are summed over its mesh axes (one ``psum`` over all of
        them, as XLA's own row-parallel matmul). Where the dimensions one axis names would not
        all split the same way (an axis that divides one and not another), none of them is split.
    """
    mesh = _current_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh is None or not rules or mesh.size == 1:
        return fn

    def mapped(*args):
        if len(args) != len(in_axes):
            raise ValueError(f"per_shard: {len(in_axes)} argument axes for {len(args)} arguments")

        def spec(axes, leaf):
            return logical_to_spec(axes, tuple(rules), shape=leaf.shape, mesh=mesh)

        def specs(axes_of):
            return tuple(jax.tree.map(functools.partial(spec, axes), arg) for axes, arg in zip(axes_of, args))

        in_specs, summed, whole = specs(in_axes), [], set()
        for contracted in (sum_over,) if sum_over is None or isinstance(sum_over, str) else sum_over:
            if contracted is None:
                continue
            splits = {
                entry
                for axes, arg_specs in zip(in_axes, in_specs)
                for leaf_spec in jax.tree.leaves(arg_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
                for name, entry in zip(axes, leaf_spec)
                if name == contracted
            }
            entry = next(iter(splits)) if len(splits) == 1 else None
            if entry is None:  # not split, or not alike: every argument whole along it
                whole.add(contracted)
            else:
                summed += [entry] if isinstance(entry, str) else entry
        if whole:
            in_specs = specs([[None if name in whole else name for name in axes] for axes in in_axes])
        # A size-1 axis has nothing to sum (a psum over it would still be an all-reduce).
        summed = tuple(axis for axis in dict.fromkeys(summed) if mesh.shape[axis] > 1)
        out_spec = spec(out_axes, jax.eval_shape(fn, *args))
        body = fn if not summed else lambda *shards: jax.lax.psum(fn(*shards), summed)
        return jax.shard_map(body, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)

    return mapped


@contextlib.contextmanager
def use_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Makes ``mesh`` the current mesh and ``rules`` the current logical rules."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def host_local_to_global(local: Any, mesh: Mesh, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> Any:
    """Assembles each process's slice of a batch into global arrays sharded by logical ``axes``.

    Every leaf of ``local`` is this process's ``[local_batch, ...]`` slice; the result has
    ``[local_batch * process_count, ...]`` global leaves. With one process it is ``device_put``.
    """

    def one(leaf):
        leaf = np.asarray(leaf)
        global_shape = (leaf.shape[0] * jax.process_count(), *leaf.shape[1:])
        padded_axes = tuple(axes) + (None,) * (leaf.ndim - len(axes))
        sharding = named_sharding(mesh, padded_axes[: leaf.ndim], rules, global_shape)
        return jax.make_array_from_process_local_data(sharding, leaf, global_shape)

    return jax.tree.map(one, local)


def addressable_here(tree: Any) -> Any:
    """``tree`` with each array sharded over several processes gathered whole onto every process
    (host NumPy arrays; ``multihost_utils.process_allgather``, a collective: every process must call
    it); fully addressable arrays (all of a single-process run's) as they are."""
    from jax.experimental import multihost_utils

    return jax.tree.map(
        lambda x: (
            multihost_utils.process_allgather(x, tiled=True)
            if isinstance(x, jax.Array) and not x.is_fully_addressable
            else x
        ),
        tree,
    )


def _dividing_axes(mesh_axes: Sequence[str], dim: int, mesh: Mesh) -> list[str]:
    kept: list[str] = []
    for axis in mesh_axes:
        if dim % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]) == 0:
            kept.append(axis)
    return kept


def _current_mesh() -> Mesh | None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    return mesh


__all__ = [
    "DEFAULT_RULES",
    "LOGICAL_AXES",
    "MESH_AXES",
    "MeshConfig",
    "Rules",
    "addressable_here",
    "box_like",
    "constrain",
    "drop_empty_boxes",
    "host_local_to_global",
    "logical_rules",
    "logical_to_spec",
    "make_mesh",
    "named_sharding",
    "per_shard",
    "shard_variables",
    "splitting_axes",
    "tree_shardings",
    "unbox",
    "use_sharding",
]
