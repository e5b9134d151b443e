"""Meshes with Auto axes, the kind with_sharding_constraint accepts."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from autoshard.errors import MeshError


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], *, devices=None) -> Mesh:
    """A mesh whose axes are all ``AxisType.Auto``.

    Example::

        mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    """
    from autoshard.frontend import validate
    axis_shapes, axis_names = validate.mesh_arguments(axis_shapes, axis_names)
    if len(axis_shapes) != len(axis_names):
        raise MeshError(f"mesh shape {axis_shapes} and axis names {axis_names} differ in length")
    devices = list(jax.devices() if devices is None else devices)
    needed = math.prod(axis_shapes)
    if needed > len(devices) or needed <= 0:
        raise MeshError(f"mesh shape {axis_shapes} needs {needed} devices; "
                        f"{len(devices)} available")
    if devices == list(jax.devices()[:needed]) or devices == list(jax.devices()):
        return jax.make_mesh(axis_shapes, axis_names, axis_types=(AxisType.Auto,) * len(axis_names),
                             devices=devices[:needed])
    return Mesh(np.asarray(devices[:needed]).reshape(axis_shapes), axis_names,
                axis_types=(AxisType.Auto,) * len(axis_names))


def as_auto_mesh(mesh, stacklevel: int = 3) -> Mesh:
    """Return ``mesh`` with Auto axes, converting Explicit/Manual ones with a warning
    (``stacklevel`` as ``warnings.warn`` takes it, counted from this function's caller
    plus one: 3 names the caller's caller)."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if all(t == AxisType.Auto for t in types):
        return mesh
    bad = [n for n, t in zip(mesh.axis_names, types) if t != AxisType.Auto]
    warnings.warn(
        f"mesh axes {bad} are not AxisType.Auto; autoshard uses a copy of the mesh with Auto "
        "axes (with_sharding_constraint is refused on Explicit axes). Build meshes with "
        "autoshard.make_mesh to silence this.", stacklevel=stacklevel)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))

