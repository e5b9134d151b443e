"""XLA's SPMD partitioner's reshard, followed on tile assignments.

When an array must change from one sharding to another, XLA's partitioner
(``PartitionedHlo::ReshardNoCache`` in ``spmd_partitioner.cc``) tries a fixed list of
ways, in order, and takes the first that applies:

1. the same tiles on other devices: one collective-permute;
2. dims that trade shard counts: all-to-alls (``GetReshardAllToAllSourceTargetDims``),
   then a collective-permute where the devices end in another order;
3. from a partly replicated sharding: a local slice where every device already holds
   its new tile (then a permute), or an all-to-all on the replicated copies;
4. to a partly replicated sharding: all-gathers within groups (after a permute);
5. the "complex" cases: split or merge a dim's shards, or replicate one dim first;
6. dims split alike in both: the rest resharded within each group of devices;
7. otherwise the whole array is gathered and sliced ("involuntary full
   rematerialization").

Which way applies depends on the order of the devices in each tile assignment, not only
on the shard counts: ``P("data", "model")`` and ``P("model", "data")`` on a 2x4 mesh
split the same dims 2 and 4 ways on different devices. :func:`reshard_steps` follows
that list on the devices' ids and returns the collectives it emits, each with the
device groups it runs over, so the cost stage can price the collectives the compiled
program will hold.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from autoshard.frontend import specs
from autoshard.frontend.specs import Spec


@dataclasses.dataclass(frozen=True, eq=False)
class Tiling:
    """An HLO sharding: ``devices`` holds a device id per tile, one array dim per data
    dim, plus a last dim of replicas where ``partial`` (``last_tile_dim_replicate``)."""

    devices: np.ndarray
    partial: bool

    # read hundreds of thousands of times in one plan's reshards: computed once each
    @functools.cached_property
    def rank(self) -> int:
        return self.devices.ndim - self.partial

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return self.devices.shape

    def dim(self, d: int) -> int:
        return self.shape[d]

    @functools.cached_property
    def tile_dims(self) -> tuple[int, ...]:
        return self.shape[:self.rank]

    @functools.cached_property
    def num_tiles(self) -> int:
        return math.prod(self.tile_dims)

    @functools.cached_property
    def replicated(self) -> bool:
        return self.num_tiles == 1

    def same(self, other: Tiling) -> bool:
        if self.replicated and other.replicated:
            return True
        return (self.partial == other.partial and self.devices.shape == other.devices.shape
                and bool(np.array_equal(self.devices, other.devices)))

    def __repr__(self) -> str:
        return f"Tiling({self.devices.tolist()}{', partial' if self.partial else ''})"

    @functools.cached_property
    def key(self) -> tuple:
        """Equal for equal tilings: what the caches of the pure functions below hash."""
        return self.devices.shape, self.devices.astype(np.int64, copy=False).tobytes(), self.partial

    @staticmethod
    def of_key(key: tuple) -> Tiling:
        shape, ids, partial = key
        return Tiling(np.frombuffer(ids, dtype=np.int64).reshape(shape), partial)


def tiling(spec: Spec, axis_sizes: Mapping[str, int]) -> Tiling:
    """The tile assignment JAX gives ``spec`` on a mesh of ``axis_sizes`` (in mesh order,
    devices numbered row-major): each dim's axes in order, the unused axes replicated.
    Kept per spec and mesh; its devices are read-only, as every way reads them."""
    return _tiling_on(tuple(spec), tuple(axis_sizes.items()))


@functools.lru_cache(maxsize=1 << 12)
def _tiling_on(spec: Spec, axes: tuple[tuple[str, int], ...]) -> Tiling:
    axis_sizes = dict(axes)
    names = list(axis_sizes)
    mesh = np.arange(math.prod(axis_sizes.values())).reshape([axis_sizes[a] for a in names])
    used = [a for axes in spec for a in axes]
    unused = [a for a in names if a not in used]
    order = [names.index(a) for a in used + unused]
    counts = [specs.dim_shards(axes, axis_sizes) for axes in spec]
    replicas = math.prod(axis_sizes[a] for a in unused)
    devices = mesh.transpose(order).reshape(counts + ([replicas] if replicas > 1 else []))
    devices.flags.writeable = False
    return _normal(Tiling(devices, replicas > 1))


def _normal(t: Tiling) -> Tiling:
    """A partial tiling with one replica is a plain one."""
    if t.partial and t.devices.shape[-1] == 1:
        return Tiling(t.devices.reshape(t.devices.shape[:-1]), False)
    return t


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One collective of a reshard: its kind, its device groups (``rows``: [group,
    member] device ids; ``groups``: each a tuple of them), and the bytes per device as
    ``hardware`` counts them for the kind."""

    kind: str
    rows: np.ndarray
    num_bytes: float
    gathered_dim: int | None = None      # an all-gather's dim
    local_shape: tuple[int, ...] = ()    # an all-gather's input shard
    axes: tuple[str, ...] = ()           # the mesh axes its groups span (``group_axes``)

    # most reshards are priced by their kinds, sizes and axes: the tuples only on demand
    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(map(tuple, self.rows.tolist()))

    @property
    def group_size(self) -> int:
        return self.rows.shape[1]

    def _fields(self) -> tuple:
        return (self.kind, self.rows.shape, self.rows.tobytes(), self.num_bytes,
                self.gathered_dim, self.local_shape, self.axes)

    def __eq__(self, other) -> bool:
        return isinstance(other, Step) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())


class _Failed(Exception):
    """A way that cannot reach the target (allow_full_replication=false)."""


class _Partitioner:
    """One reshard followed through XLA's ways: each records the collectives it emits in
    ``steps``; ``shape`` is passed along, as a grouped or split way changes it."""

    def __init__(self, itemsize: float, axis_sizes: Mapping[str, int]):
        self.itemsize = itemsize
        self.axes = tuple(axis_sizes.items())
        self.steps: list[Step] = []

    def step(self, kind: str, groups, num_bytes: float, **fields) -> None:
        """Record a collective over ``groups`` (a [group, member] array of device ids, or
        nested tuples of them), naming the mesh axes it spans."""
        rows = _frozen_rows(groups)
        self.steps.append(Step(kind, rows, num_bytes, axes=_axes_of_rows(rows, self.axes),
                               **fields))

    def shard_bytes(self, counts: Sequence[int], shape) -> float:
        """Bytes of one shard of ``shape`` split ``counts`` ways per dim (padded)."""
        return math.prod(_shard_shape(shape, counts)) * self.itemsize

    # -- the collectives -----------------------------------------------------------------
    def permute(self, src: Tiling, dst: Tiling, shape):
        pairs = _moved_pairs(src.devices.ravel(), dst.devices.ravel())
        if len(pairs):
            self.step("collective-permute", pairs, self.shard_bytes(src.tile_dims, shape))
        return dst

    def all_to_all(self, t: Tiling, groups, shape):
        self.step("all-to-all", groups, self.shard_bytes(t.tile_dims, shape))

    def gather(self, t: Tiling, dims: Sequence[int], shape, factors=None) -> None:
        """``ReplicatePartial``: all-gathers taking ``dims`` off ``t``, the last dim first,
        each within the devices that differ only along it; with ``factors``, dim d only
        ``factors[d]``-fold (neighbouring tiles joined: a partly replicated target)."""
        current = list(t.tile_dims)
        for d in sorted(dims, reverse=True):
            f = t.dim(d) if factors is None else factors[d]
            if f == 1:
                continue
            local = _shard_shape(shape, current)
            split = list(t.devices.shape)
            split[d:d + 1] = [t.dim(d) // f, f]
            moved = np.moveaxis(t.devices.reshape(split), d + 1, -1)
            current[d] //= f
            self.step("all-gather", _unique_groups(moved.reshape(-1, f)),
                      self.shard_bytes(current, shape), gathered_dim=d, local_shape=local)

    # -- ReshardNoCache ------------------------------------------------------------------
    def reshard(self, src: Tiling, dst: Tiling, shape, full: bool = True) -> Tiling:
        if src.same(dst):
            return dst
        if _can_permute(src, dst):
            return self.permute(src, dst, shape)
        pairs = all_to_all_dims(src, dst)
        if pairs is not None:
            return self.with_all_to_all(src, dst, pairs, shape)
        if not dst.replicated and src.partial:
            for way in (self.from_partial_by_slice, self.partial_all_to_all):
                got = self.attempt(way, src, dst, shape)
                if got is not None:
                    return got
        if not src.replicated and dst.partial:
            for way in (self.to_partial_by_gather, self.partial_all_to_all):
                got = self.attempt(way, src, dst, shape)
                if got is not None:
                    return got
        if not src.replicated:
            if not dst.replicated:
                got = self.attempt(self.complex_reshard, src, dst, shape)
                if got is not None:
                    return got
                got = self.attempt(self.grouped_reshard, src, dst, shape)
                if got is not None:
                    return got
                if not full:
                    raise _Failed
            self.gather(src, range(src.rank), shape)
        return dst                                           # a local slice

    def attempt(self, way, *args):
        """``way(*args)``, or None (and no steps recorded) where it does not apply."""
        mark = len(self.steps)
        try:
            got = way(*args)
        except _Failed:
            got = None
        if got is None:
            del self.steps[mark:]
        return got

    # -- all-to-all ----------------------------------------------------------------------
    def with_all_to_all(self, src: Tiling, dst: Tiling, pairs, shape, multiple=True):
        if src.same(dst):
            return dst
        if not pairs:
            if not _can_permute(src, dst):
                raise _Failed
            return self.permute(src, dst, shape)
        if multiple:
            eligible, rest, seen = [], [], set()
            for s, t in sorted(pairs, key=lambda p: p[1]):
                if (s not in seen and t not in seen and shape[s] % src.dim(s) == 0
                        and shape[t] % dst.dim(t) == 0):
                    eligible.append((s, t))
                    seen |= {s, t}
                else:
                    rest.append((s, t))
            if len(eligible) >= 2:
                sizes = [src.dim(s) // src.dim(t) for s, t in eligible]
                temp = all_to_all_tiling(src, [s for s, _ in eligible],
                                         [t for _, t in eligible])
                self.all_to_all(src, _a2a_groups(temp, {t: g for (_, t), g in
                                                        zip(eligible, sizes)}), shape)
                return self.with_all_to_all(temp, dst, rest, shape, multiple=False)
        s, t = pairs[0]
        group = src.dim(s) // src.dim(t)
        temp = all_to_all_tiling(src, [s], [t])
        self.all_to_all(src, _a2a_groups(temp, {t: group}), shape)
        return self.with_all_to_all(temp, dst, pairs[1:], shape, multiple=False)

    # -- partial replication -------------------------------------------------------------
    def from_partial_by_slice(self, src: Tiling, dst: Tiling, shape):
        temp = compatible_partial(src, dst)
        if temp is None:
            return None
        if _can_permute(temp, dst):
            return self.permute(temp, dst, shape)
        return dst

    def to_partial_by_gather(self, src: Tiling, dst: Tiling, shape):
        temp = compatible_partial(dst, src)
        if temp is None:
            return None
        if _can_permute(src, temp):
            self.permute(src, temp, shape)
        factors = {d: temp.dim(d) // dst.dim(d) for d in range(dst.rank)}
        self.gather(temp, [d for d, f in factors.items() if f > 1], shape, factors)
        return dst

    def partial_all_to_all(self, src: Tiling, dst: Tiling, shape):
        partial, tile = (src, dst) if src.partial else (dst, src)
        if not partial.partial or tile.partial or tile.replicated:
            return None
        replicas = partial.devices.shape[-1]
        if tile.devices.ndim + 1 != partial.devices.ndim or partial.dim(0) != 1:
            return None
        to_replicate = -1
        for i in reversed(range(tile.devices.ndim)):
            if tile.dim(i) > 1 and to_replicate == -1:
                if tile.dim(i) != replicas:
                    return None
                to_replicate = i
            if tile.dim(i) != partial.dim(i + 1):
                return None
        if to_replicate == -1:
            return None
        if not np.array_equal(partial.devices.reshape(tile.devices.shape), tile.devices):
            return None
        dims = list(tile.devices.shape)
        dims[to_replicate] = 1
        temp = Tiling(tile.devices.reshape(dims + [replicas]), True)
        if src.partial:
            pairs = all_to_all_dims(src, temp)
            if pairs is None:
                return None
            got = self.with_all_to_all(src, temp, pairs, shape)
            return self.reshard(got, dst, shape)
        got = self.reshard(src, temp, shape)
        pairs = all_to_all_dims(got, dst)
        if pairs is None:
            return None
        return self.with_all_to_all(got, dst, pairs, shape)

    # -- the complex cases ---------------------------------------------------------------
    def complex_reshard(self, src: Tiling, dst: Tiling, shape):
        matched = merge_or_split(shape, src, dst)
        if matched is not None:
            before, after, i = matched
            mark = len(self.steps)
            got = self.reshard(before, after, _split_shape(shape, i, src, before), full=False)
            self.steps[mark:] = [_unsplit(step, i) for step in self.steps[mark:]]
            merged = merge_dim(got, i)
            if not merged.same(dst):
                self.reshard(merged, dst, shape, full=False)
            return dst
        middle = partially_replicate_dim(src, dst)
        if middle is not None:
            got = self.reshard(src, middle, shape)
            self.reshard(got, dst, shape, full=False)
            return dst
        if src.partial and not dst.partial:
            replicas = src.devices.shape[-1]
            first = next((i for i in range(dst.devices.ndim)
                          if dst.dim(i) != src.dim(i) and src.dim(i) == 1
                          and dst.dim(i) % replicas == 0), -1)
            if first == -1:
                return None
            perm = list(range(src.devices.ndim))
            perm[first], perm[-1] = perm[-1], perm[first]
            middle = _normal(Tiling(src.devices.transpose(perm), True))
            got = self.reshard(src, middle, shape)
            self.reshard(got, dst, shape, full=False)
            return dst
        return None

    # -- dims split alike ----------------------------------------------------------------
    def grouped_reshard(self, src: Tiling, dst: Tiling, shape):
        equal = [d for d in range(src.rank) if src.dim(d) > 1 and dst.dim(d) == src.dim(d)]
        if not equal:
            return None
        src_groups, src_inner = group_on_dims(src, equal)
        dst_groups, dst_inner = group_on_dims(dst, equal)
        # AlignGroupsWith: where the groups hold other devices, the target's inner layout
        # is read by position on the source's groups
        if any(set(a) != set(b) for a, b in zip(src_groups, dst_groups)):
            relabel = {d: s for a, b in zip(src_groups, dst_groups) for s, d in zip(a, b)}
            dst_inner = Tiling(np.vectorize(lambda x: relabel[int(x)])(dst_inner.devices),
                               dst_inner.partial)
        inner_shape = _shard_shape(shape, [src.dim(d) if d in equal else 1
                                           for d in range(len(shape))])
        mark = len(self.steps)
        self.reshard(src_inner, dst_inner, inner_shape)
        # each group runs the same collectives on its own devices
        for k in range(mark, len(self.steps)):
            self.steps[k] = _in_every_group(self.steps[k], src_groups, self.axes)
        ungrouped = ungroup(dst_inner, src_groups, src, equal)
        return self.reshard(ungrouped, dst, shape)


def _split_shape(shape, i, src: Tiling, before: Tiling):
    """The array's shape as ``SplitReshapeHelper`` cuts dim ``i``: [before's count on i,
    the rest], so that ``before`` tiles it."""
    local = math.ceil(shape[i] / src.dim(i))     # padded where the dim divides unevenly
    return tuple(shape[:i]) + (before.dim(i), local * before.dim(i + 1)) + tuple(shape[i + 1:])


def _unsplit(step: Step, i: int) -> Step:
    """A step taken on the array with dim ``i`` split in two (``_split_shape``), told on
    the array itself: the split reshapes each shard (a bitcast, row-major), so an
    all-gather of either part gathers dim ``i``, and its input shard's two parts are that
    dim's. Every step of a reshard then counts the array's dims, as the layout the next
    all-gather finds is read from the previous one's dim."""
    if step.gathered_dim is None:
        return step
    d, local = step.gathered_dim, step.local_shape
    merged = local[:i] + (local[i] * local[i + 1],) + local[i + 2:]
    return dataclasses.replace(step, gathered_dim=d - (d > i), local_shape=merged)


def _shard_shape(shape, counts) -> tuple[int, ...]:
    """One shard's shape: each dim split ``counts[d]`` ways, padded where uneven."""
    return tuple(math.ceil(n / c) for n, c in zip(shape, counts))


def _frozen_rows(groups) -> np.ndarray:
    """A collective's device groups as a read-only [group, member] int64 array (a Step's
    ``rows``, shared by the caches that hand it out)."""
    rows = np.asarray(groups, dtype=np.int64)
    rows.flags.writeable = False
    return rows


def _moved_pairs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The distinct (source, target) device pairs where ``src`` and ``dst`` differ,
    sorted ([pair, 2]): a collective-permute's."""
    moved = src != dst
    sources, targets = src[moved], dst[moved]
    if _distinct(sources):   # a tiling's: each device once, so each pair once
        order = np.argsort(sources)
        return np.stack([sources[order], targets[order]], axis=1)
    n = int(max(src.max(), dst.max())) + 1
    keys = np.unique(sources.astype(np.int64) * n + targets)
    return np.stack([keys // n, keys % n], axis=1)


def _distinct(ids: np.ndarray) -> bool:
    """Whether no device id repeats in ``ids``."""
    return ids.size == 0 or int(np.bincount(ids.ravel()).max()) == 1


def _unique_groups(rows: np.ndarray) -> np.ndarray:
    """The rows of ``rows`` (one device group each), those holding the devices of an
    earlier one dropped, in order."""
    if _distinct(rows):   # a tiling's: no two groups hold the same devices
        return rows
    _, first = np.unique(np.sort(rows, axis=1), axis=0, return_index=True)
    return rows if len(first) == len(rows) else rows[np.sort(first)]


def _in_every_group(step: Step, groups, axes: tuple[tuple[str, int], ...]) -> Step:
    """A step found for the first group's devices, run by every group: each of its device
    groups mapped onto the devices at the same positions in every group."""
    members, inner = np.asarray(groups), step.rows
    position = np.full(max(members.max(), inner.max()) + 1, -1)
    position[members[0]] = np.arange(members.shape[1])
    at = position[inner]                               # [group, member]: -1 outside
    out = np.where(at >= 0, members[:, np.maximum(at, 0)], inner)   # [groups, group, member]
    out = _frozen_rows(out.reshape(-1, inner.shape[1]))
    return dataclasses.replace(step, rows=out, axes=_axes_of_rows(out, axes))


def _can_permute(src: Tiling, dst: Tiling) -> bool:
    return (not src.replicated and not dst.replicated
            and src.devices.shape == dst.devices.shape and src.partial == dst.partial
            and not np.array_equal(src.devices, dst.devices))


def all_to_all_dims(src: Tiling, dst: Tiling) -> list[tuple[int, int]] | None:
    """``GetReshardAllToAllSourceTargetDims``: the (source dim, target dim) pairs whose
    shard counts the reshard swaps, one all-to-all each; None where counts do not pair."""
    if (src.replicated or dst.replicated or src.devices.ndim != dst.devices.ndim
            or src.num_tiles != dst.num_tiles):
        return None
    src_at: dict[int, list[int]] = {}
    dst_at: dict[int, list[int]] = {}
    for i in range(src.devices.ndim):
        if src.dim(i) == dst.dim(i):
            continue
        src_at.setdefault(src.dim(i), []).append(i)
        dst_at.setdefault(dst.dim(i), []).append(i)
    if not src_at or len(src_at) != len(dst_at):
        return None
    for size, dims in src_at.items():
        if len(dst_at.get(size, ())) != len(dims):
            return None

    def remove(size, dim, at):
        at[size] = [a for a in at[size] if a != dim]
        if not at[size]:
            del at[size]
    result = []
    while src_at:
        size = min(src_at)
        i = src_at[size][-1]
        target_size = dst.dim(i)
        if target_size == size:
            remove(size, i, src_at)
            remove(size, i, dst_at)
            continue
        candidates = src_at.get(target_size)
        if not candidates:
            return None
        k = 0
        j = candidates[0]
        if size == 1:
            while dst.dim(j) == 1 and k + 1 < len(candidates):
                k += 1
                j = candidates[k]
        elif target_size % size == 0:
            while dst.dim(j) != size and k + 1 < len(candidates):
                k += 1
                j = candidates[k]
        else:
            return None
        result.append((j, i))
        remove(target_size, i, dst_at)
        src_at[size][-1] = j
        remove(target_size, j, src_at)
    return result


def all_to_all_tiling(t: Tiling, sources, targets) -> Tiling:
    """``GetAllToAllSharding``: ``t`` after all-to-alls moving each source dim's count to
    its target dim."""
    devices = t.devices
    for s, g in zip(sources, targets):
        if devices.shape[s] % devices.shape[g]:
            raise _Failed
        dims, added_s, added_g = [], None, None
        for i, n in enumerate(devices.shape):
            if i == s:
                dims += [devices.shape[g], n // devices.shape[g]]
                added_s = len(dims) - 1
            elif i == g:
                dims += [n, 1]
                added_g = len(dims) - 1
            else:
                dims.append(n)
        perm = list(range(len(dims)))
        perm[added_s], perm[added_g] = perm[added_g], perm[added_s]
        out = list(devices.shape)
        out[s], out[g] = out[g], out[s]
        devices = devices.reshape(dims).transpose(perm).reshape(out)
    return Tiling(devices, t.partial)


def _a2a_groups(temp: Tiling, group_size_at: Mapping[int, int]):
    """The all-to-all's device groups, in ``temp``'s order: devices whose indices agree
    but for dims ``d`` of ``group_size_at`` within blocks of ``group_size_at[d]``, groups
    ordered by those indices (block numbers where grouped), members in row-major order
    ([group, member], read-only)."""
    return _a2a_groups_on(temp.key, tuple(sorted(group_size_at.items())))


@functools.lru_cache(maxsize=1 << 14)
def _a2a_groups_on(key: tuple, sizes: tuple[tuple[int, int], ...]):
    devices = Tiling.of_key(key).devices
    shape = devices.shape
    group_size_at = dict(sizes)
    index = np.indices(shape).reshape(len(shape), -1)
    gid = np.zeros(index.shape[1], dtype=np.int64)
    for d, n in enumerate(shape):
        g = group_size_at.get(d)
        gid = gid * (n // g) + index[d] // g if g else gid * n + index[d]
    order = np.argsort(gid, kind="stable")
    members = devices.ravel()[order].reshape(-1, devices.size // (gid.max() + 1))
    return _frozen_rows(members)


def compatible_partial(partial: Tiling, target: Tiling) -> Tiling | None:
    """``PartialReplicateReshardCompatibleSharding``: a tiling with ``target``'s counts
    that ``partial``'s replicas reach by slicing their copies; None if none."""
    if not partial.partial or partial.devices.size != target.devices.size:
        return None
    rank = partial.rank
    if rank != target.rank:
        return None
    expand_at, expand = [-1] * rank, []
    for d in range(rank):
        if target.dim(d) % partial.dim(d):
            return None
        if target.dim(d) > partial.dim(d):
            expand_at[d] = len(expand)
            expand.append(target.dim(d) // partial.dim(d))
    if _is_subtiling(target, partial):
        return target
    dims = list(partial.tile_dims) + expand
    perm = []
    for d in range(rank):
        perm.append(d)
        if expand_at[d] > -1:
            perm.append(expand_at[d] + rank)
    if target.partial:
        dims.append(target.devices.shape[-1])
        perm.append(len(dims) - 1)
    if math.prod(dims) != partial.devices.size:
        return None
    devices = partial.devices.reshape(dims).transpose(perm).reshape(target.devices.shape)
    return Tiling(devices, target.partial)


def _tile_of(t: Tiling) -> tuple[np.ndarray, np.ndarray]:
    """``t``'s device ids in increasing order, and the index of each one's tile ([device,
    rank]). A group's tiling holds its own devices' global ids, not 0 to N - 1."""
    ids = t.devices.ravel()
    index = np.indices(t.devices.shape).reshape(t.devices.ndim, -1)[:t.rank].T
    order = np.argsort(ids, kind="stable")
    return ids[order], index[order]


def _is_subtiling(sub: Tiling, t: Tiling) -> bool:
    """Whether each device's tile of ``sub`` lies inside its tile of ``t`` (on a shape of
    ``sub``'s counts)."""
    return _is_subtiling_on(sub.key, t.key)


@functools.lru_cache(maxsize=1 << 14)
def _is_subtiling_on(sub_key: tuple, t_key: tuple) -> bool:
    sub, t = Tiling.of_key(sub_key), Tiling.of_key(t_key)
    per = np.array([sub.dim(d) // t.dim(d) for d in range(sub.rank)], dtype=np.int64)
    (sub_ids, sub_tiles), (ids, tiles) = _tile_of(sub), _tile_of(t)
    return bool(np.array_equal(sub_ids, ids) and (sub_tiles // per == tiles[:, :sub.rank]).all())


def merge_or_split(shape, src: Tiling, dst: Tiling):
    """``PatternMatchMergeOrSplitSharding``: a dim i whose shards split as
    [..X..Y..] -> [..X*Y..1..] (or the reverse, or X*Y,Z -> X,Y*Z): (the source with dim
    i split, the target laid out like it, i); None where no pair of dims matches."""
    if src.rank != dst.rank or src.partial != dst.partial or (
            src.partial and src.devices.shape[-1] != dst.devices.shape[-1]):
        return None
    diff = [i for i in range(dst.rank) if src.dim(i) != dst.dim(i)]
    for a in range(len(diff)):
        for b in range(a + 1, len(diff)):
            i, j = diff[a], diff[b]
            ones = [src.dim(i) == 1, src.dim(j) == 1, dst.dim(i) == 1, dst.dim(j) == 1]
            if sum(ones) == 1:
                if src.dim(i) * src.dim(j) != dst.dim(i) * dst.dim(j):
                    continue
                if src.dim(i) == 1 or dst.dim(i) == 1:
                    i, j = j, i
                if dst.dim(j) == 1:
                    local = shape[i] // src.dim(i)
                    if local % src.dim(j):
                        continue
                    new = src.dim(i)
                else:
                    if shape[i] % src.dim(i):
                        continue
                    new = dst.dim(i)
            elif sum(ones) == 0:
                if src.dim(i) < dst.dim(i):
                    i, j = j, i
                if src.dim(i) != dst.dim(i) * dst.dim(j) or shape[i] % src.dim(i):
                    continue
                new = dst.dim(i)
            else:
                continue
            before = split_dim(src, i, new)
            dims = list(before.devices.shape)
            jj = j + (1 if j > i else 0)
            dims[i + 1], dims[jj] = dims[jj], dims[i + 1]
            after = Tiling(dst.devices.reshape(dims), src.partial)
            return before, after, i
    return None


def split_dim(t: Tiling, i: int, size: int) -> Tiling:
    """``SplitShardingDimension``: dim i's count n as [size, n / size]."""
    dims = list(t.devices.shape)
    dims[i:i + 1] = [size, dims[i] // size]
    return Tiling(t.devices.reshape(dims), t.partial)


def merge_dim(t: Tiling, i: int) -> Tiling:
    """``MergeShardingDimension``: dims i and i + 1 as one."""
    dims = list(t.devices.shape)
    dims[i:i + 2] = [dims[i] * dims[i + 1]]
    return Tiling(t.devices.reshape(dims), t.partial)


def partially_replicate_dim(src: Tiling, dst: Tiling) -> Tiling | None:
    """``PatternMatchPartiallyReplicateDim``: for [..X..Z..Y..] -> [..Y..Z..X] partial,
    ``src`` with the dim X replicated first."""
    if not dst.partial:
        return None
    replicas = src.devices.shape[-1] if src.partial else 1
    for i in range(src.rank):
        if src.dim(i) == 1 or src.dim(i) * replicas != dst.devices.shape[-1]:
            continue
        return replicate_dims(src, [i])
    return None


def replicate_dims(t: Tiling, dims) -> Tiling:
    """``PartiallyReplicateTiledShardingOnDims``: ``t`` with ``dims`` replicated."""
    perm = [d for d in range(t.rank) if d not in dims] + list(dims) + (
        [t.rank] if t.partial else [])
    moved = t.devices.transpose(perm)
    keep = [t.dim(d) for d in range(t.rank) if d not in dims]
    replicas = t.devices.size // max(1, math.prod(keep))
    flat = moved.reshape(keep + [replicas])
    out_dims = [1 if d in dims else t.dim(d) for d in range(t.rank)]
    return _normal(Tiling(flat.reshape(out_dims + [replicas]), True))


def group_on_dims(t: Tiling, dims):
    """``GroupShardingOnDims``: the device groups sharing an index on ``dims`` (in index
    order) and the first group's tiling, those dims of count 1 (global device ids)."""
    others = [d for d in range(t.devices.ndim) if d not in dims]
    moved = t.devices.transpose(list(dims) + others)
    lead = math.prod(t.dim(d) for d in dims)
    flat = moved.reshape([lead] + [t.dim(d) for d in others])
    groups = list(map(tuple, flat.reshape(lead, -1).tolist()))
    inner_dims = [1 if d in dims else t.dim(d) for d in range(t.devices.ndim)]
    return groups, Tiling(flat[0].reshape(inner_dims), t.partial)


def ungroup(inner: Tiling, groups, like: Tiling, dims) -> Tiling:
    """``UngroupSharding``: the grouped dims put back at ``like``'s counts, each group
    holding ``inner``'s layout on its own devices (position for position with the first
    group)."""
    members = np.asarray(groups)
    position = np.zeros(members.max() + 1, dtype=np.int64)
    position[members[0]] = np.arange(members.shape[1])
    shape = [like.dim(d) if d in dims else n for d, n in enumerate(inner.devices.shape)]
    index = np.indices(shape)
    group = np.ravel_multi_index([index[d] for d in dims], [like.dim(d) for d in dims])
    at = tuple(np.zeros_like(index[d]) if d in dims else index[d] for d in range(len(shape)))
    out = members[group, position[inner.devices[at]]].astype(inner.devices.dtype)
    return Tiling(out, inner.partial)


def reshard_steps(shape: Sequence[int], itemsize: float, src: Spec, dst: Spec,
                  axis_sizes: Mapping[str, int]) -> tuple[Step, ...]:
    """The collectives XLA's partitioner emits to take an array of ``shape`` from
    ``src`` to ``dst`` on a mesh of ``axis_sizes``."""
    p = _Partitioner(itemsize, axis_sizes)
    source = tiling(src, axis_sizes)
    try:
        p.reshard(source, tiling(dst, axis_sizes), tuple(shape))
    except _Failed:    # shard counts no way divides evenly: XLA's last resort
        p.steps.clear()
        if not source.replicated:
            p.gather(source, range(source.rank), tuple(shape))
    return tuple(p.steps)


def canonical_shape(shape: Sequence[int], axis_sizes: Mapping[str, int]
                    ) -> tuple[tuple[int, ...], float]:
    """A shape whose reshards take the same steps as ``shape``'s, and how many times more
    bytes each step of ``shape`` moves.

    The ways above read a dim's size only through divisions by tile counts: a dim's
    count in one tiling of the mesh's devices, or the product of two dims' counts in one
    tiling. Each divides the device count, as a tiling's counts times its replicas make
    the device count. A dim that the device count divides at least twice over therefore
    takes the same ways and collectives whatever its size, each of its shards holding
    two elements or more, and its bytes scale with it: it is set to twice the device
    count. Reshards of arrays alike but for such sizes (activations and weights of one
    layer's widths, at any batch or sequence length) are followed once
    (``cached_reshard_steps``). On 512 devices, a [512, 2048, 4096] activation and a
    [4096, 14336] kernel take the steps of [512, 1024, 1024] and [1024, 1024]."""
    devices = math.prod(axis_sizes.values())
    canonical = tuple(2 * devices if n % devices == 0 and n >= 2 * devices else n
                      for n in shape)
    if 0 in canonical:
        return tuple(shape), 1.0
    return canonical, math.prod(shape) / math.prod(canonical)


def canonical_reshard(shape: Sequence[int], itemsize: float, src: Spec, dst: Spec,
                      axis_sizes: Mapping[str, int]
                      ) -> tuple[tuple[int, ...], Spec, Spec, float]:
    """(shape, src, dst, scale): a reshard of one-byte elements taking the same steps as
    the given one, each moving ``scale`` times fewer bytes, dims aside.

    Its dims: ``canonical_shape``'s, with each run of size-1 dims that neither spec
    splits cut to one. One such dim is kept: the ways may move replicas onto it, or
    through it, but never need two in a row (tested on generated reshards). An
    all-gather's ``gathered_dim`` and ``local_shape`` are then the kept dims'. The
    element size enters the ways only through each step's bytes. Reshards of an
    activation and of its bf16 cast, or of [b, s, 1, 1] and [b, s, 1] masks, are
    followed once."""
    def split(spec: Spec, d: int) -> bool:
        return d < len(spec) and bool(spec[d])
    keep = [d for d, n in enumerate(shape)
            if n != 1 or split(src, d) or split(dst, d) or d == 0 or shape[d - 1] != 1
            or split(src, d - 1) or split(dst, d - 1)]
    canonical, scale = canonical_shape([shape[d] for d in keep], axis_sizes)

    def kept(spec: Spec) -> Spec:
        return tuple(spec[d] if d < len(spec) else () for d in keep)
    return canonical, kept(src), kept(dst), scale * itemsize


def relabelled(src: Spec, dst: Spec, axis_sizes: Mapping[str, int]
               ) -> tuple[Spec, Spec, dict[str, str]]:
    """(src, dst, names): the reshard with the mesh's axes renamed, each to one of its
    size, into the least such reshard, and each new name's old one.

    A renaming relabels the devices, and the ways read device ids only as labels, but
    for one thing: the axes a spec leaves unnamed replicate it in the mesh's order. A
    renaming that keeps that order within each spec's unnamed axes therefore takes the
    same steps, over the relabeled devices, each spanning the renamed axes (tested on
    generated reshards). On a mesh of equal axes, P(model, data) to P(data) and
    P(data, model) to P(model) are followed once."""
    return _relabelled_on(src, dst, tuple(axis_sizes.items()))


@functools.lru_cache(maxsize=1 << 17)
def _relabelled_on(src: Spec, dst: Spec, axis_sizes: tuple[tuple[str, int], ...]
                   ) -> tuple[Spec, Spec, dict[str, str]]:
    axes = tuple(a for a, _ in axis_sizes)
    best, back = (src, dst), dict(zip(axes, axes))
    renamings = _renamings(axis_sizes)
    if len(renamings) == 1:
        return src, dst, back
    position = {a: k for k, a in enumerate(axes)}
    unnamed = [[a for a in axes if not any(a in entry for entry in spec)]
               for spec in (src, dst)]
    for order in renamings[1:]:
        names = dict(zip(axes, order))
        if any(position[names[a]] > position[names[b]]
               for rest in unnamed for a, b in zip(rest, rest[1:])):
            continue
        found = tuple(tuple(tuple(names[a] for a in entry) for entry in spec)
                      for spec in (src, dst))
        if found < best:
            best, back = found, {new: old for old, new in names.items()}
    return best[0], best[1], back


@functools.lru_cache(maxsize=64)
def _renamings(axes: tuple[tuple[str, int], ...]) -> tuple[tuple[str, ...], ...]:
    """Each renaming of the mesh's axes that gives each a name of its size (the new name
    of each axis, in the mesh's order); none past 24."""
    names = [a for a, _ in axes]
    found = [order for order in itertools.islice(itertools.permutations(names), 24)
             if all(dict(axes)[a] == n for a, (_, n) in zip(order, axes))]
    return tuple(found)


# room for every reshard of one large plan: a LLaMA-3-8B step on 8x8x8 devices follows
# about 65,000 (at 2^14 kept, the least recently used were followed again, 10,000 times)
@functools.lru_cache(maxsize=1 << 17)
def _steps_on(shape: tuple[int, ...], itemsize: float, src: Spec, dst: Spec,
              axes: tuple[tuple[str, int], ...]) -> tuple[Step, ...]:
    return reshard_steps(shape, itemsize, src, dst, dict(axes))


def cached_reshard_steps(shape: Sequence[int], itemsize: float, src: Spec, dst: Spec,
                         axis_sizes: Mapping[str, int]) -> tuple[Step, ...]:
    """``reshard_steps``, kept per (shape, itemsize, specs, mesh) for the process: a plan
    weighs the same reshards in every setting it tries, and so do later plans."""
    return _steps_on(tuple(shape), float(itemsize), src, dst, tuple(axis_sizes.items()))


def forget() -> None:
    """Drop the reshards and tilings this process keeps."""
    for cache in (_steps_on, _tiling_on, _a2a_groups_on, _is_subtiling_on, _axes_of_bytes,
                  _relabelled_on):
        cache.cache_clear()


def group_axes(groups, axis_sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of any one group differ."""
    return _axes_of_rows(np.asarray(groups), tuple(axis_sizes.items()))


def _axes_of_rows(rows: np.ndarray, axes: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """``group_axes`` of a [group, member] array of device ids."""
    rows = np.asarray(rows, dtype=np.int64)
    return _axes_of_bytes(rows.shape, rows.tobytes(), axes)


@functools.lru_cache(maxsize=1 << 14)
def _axes_of_bytes(shape: tuple[int, ...], ids: bytes, axes: tuple[tuple[str, int], ...]
                   ) -> tuple[str, ...]:
    rows = np.frombuffer(ids, dtype=np.int64).reshape(shape)
    names, coords = _coordinates(axes)
    c = coords[rows]                                   # [group, member, axis]
    varies = (c != c[:, :1]).any(axis=(0, 1))
    return tuple(a for a, v in zip(names, varies) if v)


@functools.lru_cache(maxsize=64)
def _coordinates(axes: tuple[tuple[str, int], ...]) -> tuple[tuple[str, ...], np.ndarray]:
    """The mesh axis names, and each device's coordinate along each (row-major ids)."""
    names = tuple(a for a, _ in axes)
    sizes = [n for _, n in axes]
    return names, np.array(np.unravel_index(np.arange(math.prod(sizes)), sizes)).T
