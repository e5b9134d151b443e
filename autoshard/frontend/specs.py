"""Specs: how an array's dims are split over mesh axes.

A spec is a tuple with one entry per array dim; each entry is a tuple of mesh axis
names (major to minor), empty when the dim is not split. ``(("data",), ())`` is
``PartitionSpec("data", None)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from jax.sharding import PartitionSpec

Spec = tuple[tuple[str, ...], ...]


def replicated(rank: int) -> Spec:
    return ((),) * rank


def to_partition_spec(spec: Spec) -> PartitionSpec:
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec | Sequence, rank: int) -> Spec:
    entries = list(pspec) + [None] * (rank - len(pspec))
    if len(entries) > rank:
        raise ValueError(f"spec {pspec} has more entries than the array's {rank} dims")
    out = []
    for e in entries:
        if e is None:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        else:
            out.append(tuple(e))
    return tuple(out)


def spec_axes(spec: Spec) -> tuple[str, ...]:
    return tuple(a for axes in spec for a in axes)


def num_shards(spec: Spec, axis_sizes: Mapping[str, int]) -> int:
    return math.prod(axis_sizes[a] for a in spec_axes(spec))


def dim_shards(axes: Sequence[str], axis_sizes: Mapping[str, int]) -> int:
    return math.prod(axis_sizes[a] for a in axes)


def itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys
        return 8


def nbytes(shape: Sequence[int], dtype) -> int:
    return math.prod(shape) * itemsize(dtype)


def per_device_bytes(shape: Sequence[int], dtype, spec: Spec,
                     axis_sizes: Mapping[str, int]) -> float:
    return nbytes(shape, dtype) / num_shards(spec, axis_sizes)


def local_shape(shape: Sequence[int], spec: Spec, axis_sizes: Mapping[str, int]
                ) -> tuple[int, ...]:
    """Each device's block of an array of ``shape`` split as ``spec``."""
    return tuple(-(-size // dim_shards(axes, axis_sizes)) for size, axes in zip(shape, spec))


def is_valid(shape: Sequence[int], spec: Spec, axis_sizes: Mapping[str, int]) -> bool:
    """Each dim divisible by its shard count, and no axis used twice."""
    used = spec_axes(spec)
    if len(set(used)) != len(used) or len(spec) != len(shape):
        return False
    return all(size % dim_shards(axes, axis_sizes) == 0 for size, axes in zip(shape, spec))


def spec_str(spec: Spec) -> str:
    parts = ["None" if not axes else axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"
             for axes in spec]
    return "P(" + ", ".join(parts) + ")"


def enumerate_specs(shape: Sequence[int], axis_sizes: Mapping[str, int],
                    every_order: bool = False) -> Iterator[Spec]:
    """Every valid spec of an array: each mesh axis on one dim or on none.

    Axes that share a dim are ordered as in the mesh, so each split appears once; with
    ``every_order``, in every order (the same split, its tiles on other devices).
    """
    names = [a for a, n in axis_sizes.items() if n > 1]
    rank = len(shape)
    orders = itertools.permutations(names) if every_order else [names]
    seen = set()
    for order in orders:
        for choice in itertools.product(range(-1, rank), repeat=len(names)):
            dim_of = dict(zip(names, choice))
            spec = tuple(tuple(a for a in order if dim_of[a] == d) for d in range(rank))
            if spec not in seen and is_valid(shape, spec, axis_sizes):
                seen.add(spec)
                yield spec
