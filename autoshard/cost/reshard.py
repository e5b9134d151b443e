"""cost.reshard: the collectives that move an array from one spec to another, their
seconds, and the matrices of those seconds between the specs a value is written in and
the specs a reader reads it in (``ReshardPrices``, cached by shape and specs)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from autoshard import hardware as hwlib
from autoshard import specs
from autoshard.hardware import Hardware
from autoshard.specs import Spec
from autoshard.strategies import Collective
from autoshard.xla import wire_dtype

if TYPE_CHECKING:
    from autoshard.cost.graph import CostGraph

REDUCTIONS = ("all-reduce", "reduce-scatter")   # collectives that reduce a partial result


def reshard_collectives(shape: Sequence[int], dtype, src: Spec, dst: Spec,
                        axis_sizes: Mapping[str, int], hw: Hardware) -> tuple[Collective, ...]:
    """The collectives that turn an array split as ``src`` into one split as ``dst``.

    Per dim, axes past the common prefix of ``src`` and ``dst`` leave that dim. An axis
    that leaves one dim and joins another moves by all-to-all; one that leaves and joins
    none is all-gathered; one that only joins is a free local slice. An all-gather
    concatenates along one dim, so the axes leaving each dim are gathered by an
    all-gather of their own (``gather_steps``). Where the shard counts let XLA's
    partitioner send shards to other devices instead, it does (``permuted_reshard``);
    where it has no path (``rematerializes``), it gathers the whole array and slices it.
    """
    if src == dst:
        return ()
    permuted = permuted_reshard(shape, dtype, src, dst, axis_sizes, hw)
    if permuted is not None:
        return permuted
    total = specs.nbytes(shape, dtype)
    leaving, joining = [], set()
    for s, d in zip(src, dst):
        common = 0
        while common < min(len(s), len(d)) and s[common] == d[common]:
            common += 1
        leaving.append(s[common:])
        joining |= set(d[common:])
    if rematerializes(leaving, joining):
        return gather_steps(shape, dtype, src, src, axis_sizes, hw)
    src = sliced_first(src, dst, leaving)
    exchanged = exchanged_reshard(shape, dtype, src, dst, axis_sizes, hw)
    if exchanged is not None:
        return exchanged
    joins = {a: k for k, axes in enumerate(dst) for a in axes}
    gathered = [tuple(a for a in axes if a not in joining) for axes in leaving]
    # a dim an axis moves into is gathered first: the all-to-all then moves more bytes
    received = {joins[a] for axes in leaving for a in axes if a in joining}
    first = [g if k in received else () for k, g in enumerate(gathered)]
    out = list(gather_steps(shape, dtype, src, first, axis_sizes, hw))
    src = tuple(tuple(a for a in axes if a not in g) for axes, g in zip(src, first))
    current = set(specs.spec_axes(src))
    for axes in leaving:
        for _, group in itertools.groupby([a for a in axes if a in joining], key=joins.get):
            group = tuple(group)
            num_bytes = total / specs.dim_shards(tuple(current), axis_sizes)
            seconds = hwlib.all_to_all_seconds(num_bytes, specs.dim_shards(group, axis_sizes),
                                               hw.group_bandwidth(group), hw.link_latency)
            # the chunks for each peer are cut along the dim the axes join, not the major
            # one: XLA copies the buffer into peer-major order first (read and write it)
            seconds += hw.compute_seconds(0.0, 2 * num_bytes)
            out.append(Collective("all-to-all", group, num_bytes, seconds))
    rest = [() if k in received else g for k, g in enumerate(gathered)]
    return tuple(out) + gather_steps(shape, dtype, src, rest, axis_sizes, hw)


def sliced_first(src: Spec, dst: Spec, leaving: Sequence[tuple[str, ...]]) -> Spec:
    """``src`` with the axes that only join a dim no axis leaves already joined: XLA
    slices a replicated array locally before it moves or gathers the rest, so those
    move 1/size of the bytes. P("model") -> P(None, "data") on an 8x2 mesh slices dim 1
    8 ways, then gathers dim 0 over model: 1/8 of the array, not all of it. An axis that
    joins the dim another leaves joins after (P(None, "data") -> P("data", "model")
    moves data by all-to-all, then slices model)."""
    moving = {a for axes in leaving for a in axes}
    return tuple(s + (tuple(a for a in d[len(s):] if a not in moving) if not out else ())
                 for s, d, out in zip(src, dst, leaving))


def rematerializes(leaving: Sequence[tuple[str, ...]], joining: set) -> bool:
    """Whether XLA's SPMD partitioner reshards by gathering the whole array and slicing it
    (its "involuntary full rematerialization"): when axes leave a dim major to minor and
    one that moves to a dim comes before one that is gathered. An all-to-all moves a
    dim's minor shards and an all-gather takes its minor axes off, so the partitioner can
    move an axis out from under a gathered one only by gathering both; it gathers all.
    P(None, ("data", "model")) -> P("data") gathers all 16 shards of dim 1 and slices;
    P(None, ("model", "data")) -> P("data") moves data by all-to-all, gathers model.
    """
    for axes in leaving:
        moved = [a in joining for a in axes]
        if any(m and not later for i, m in enumerate(moved) for later in moved[i + 1:]):
            return True
    return False


def gather_steps(shape, dtype, src: Spec, gathered: Sequence[tuple[str, ...]],
                 axis_sizes: Mapping[str, int], hw: Hardware) -> tuple[Collective, ...]:
    """The all-gathers that take ``gathered[d]`` (axes) off each dim d of an array split as
    ``src``: one per dim, the last dim first, as XLA's partitioner emits them
    (``count_gathers``)."""
    counts = [specs.dim_shards(axes, axis_sizes) for axes in src]
    targets = [c // specs.dim_shards(g, axis_sizes) for c, g in zip(counts, gathered)]
    return count_gathers(shape, dtype, counts, targets, gathered, hw)


def count_gathers(shape, dtype, counts: Sequence[int], targets: Sequence[int],
                  axes_of: Sequence[tuple[str, ...]], hw: Hardware) -> tuple[Collective, ...]:
    """The all-gathers that take each dim d of an array split ``counts[d]`` ways to
    ``targets[d]`` ways, over groups of ``counts[d] // targets[d]`` devices along the mesh
    axes ``axes_of[d]``: one per dim, the last dim first.

    An all-gather concatenates along the major dim of its buffer, so XLA lays a buffer
    out with the gathered dim major first: a copy (read and write it) before gathering a
    dim that is not major in the buffer's layout, which is row-major to start with and
    has the gathered dim major after each gather. P(data, model) -> P() gathers 'model'
    on dim 1 (copied first), then 'data' on dim 0 (copied back first).
    """
    current = list(counts)
    total = specs.nbytes(shape, dtype)
    major = None   # the dim the buffer's layout has major: row-major to start with
    out = []
    for d in reversed(range(len(shape))):
        if current[d] == targets[d]:
            continue
        num_bytes = total / math.prod(current)
        local = [size // c for size, c in zip(shape, current)]
        first = major if major is not None else next(
            (k for k, n in enumerate(local) if n > 1), d)
        copy = 0.0 if first == d or local[first] == 1 else 2 * num_bytes
        group_size = current[d] // targets[d]
        current[d] = targets[d]
        out_bytes = total / math.prod(current)
        seconds = hwlib.all_gather_seconds(out_bytes, group_size,
                                           hw.group_bandwidth(axes_of[d]), hw.link_latency)
        out.append(Collective("all-gather", tuple(axes_of[d]), out_bytes,
                              seconds + hw.compute_seconds(0.0, copy)))
        major = d
    return tuple(out)


def shard_permute(num_bytes: float, src: Spec, dst: Spec, axis_sizes: Mapping[str, int],
                  hw: Hardware) -> Collective:
    """The collective-permute sending each device's ``num_bytes`` shard to the device that
    wants it in ``dst``; its pairs cross every mesh axis ``src`` or ``dst`` uses."""
    used = set(specs.spec_axes(src)) | set(specs.spec_axes(dst))
    axes = tuple(a for a in axis_sizes if a in used)
    return Collective("collective-permute", axes, num_bytes, hwlib.collective_permute_seconds(
        num_bytes, hw.group_bandwidth(axes), hw.link_latency))


def exchanged_reshard(shape, dtype, src: Spec, dst: Spec, axis_sizes: Mapping[str, int],
                      hw: Hardware) -> tuple[Collective, ...] | None:
    """XLA's all-to-all between two dims that splits one ``r`` times less and the other
    ``r`` times more, keeping the number of shards, when it does not simply move the
    first dim's minor axes behind the second's: the all-to-all over ``r`` devices along
    the axes leaving the first dim, then a collective-permute of every shard to the
    device ``dst`` wants it on. P("data", "model") -> P("model", "data") on an 8x2 mesh
    exchanges a quarter of each shard over groups of 4 along data, then permutes;
    P(("data", "model")) -> P(None, ("data", "model")) is one all-to-all (None here).
    """
    src_counts = [specs.dim_shards(axes, axis_sizes) for axes in src]
    dst_counts = [specs.dim_shards(axes, axis_sizes) for axes in dst]
    changed = [k for k, (a, b) in enumerate(zip(src_counts, dst_counts)) if a != b]
    if len(changed) != 2 or math.prod(src_counts) != math.prod(dst_counts):
        return None
    s, t = sorted(changed, key=lambda k: dst_counts[k] / src_counts[k])
    moved = src[s][len(dst[s]):]
    if src[s][:len(dst[s])] == dst[s] and dst[t] == src[t] + moved:
        return None
    group = tuple(a for a in src[s] if a not in dst[s]) or src[s]
    num_bytes = specs.nbytes(shape, dtype) / math.prod(src_counts)
    seconds = hwlib.all_to_all_seconds(num_bytes, src_counts[s] // dst_counts[s],
                                       hw.group_bandwidth(group), hw.link_latency)
    seconds += hw.compute_seconds(0.0, 2 * num_bytes)   # peer-major copy, as below
    return (Collective("all-to-all", group, num_bytes, seconds),
            shard_permute(num_bytes, src, dst, axis_sizes, hw))


def permuted_reshard(shape, dtype, src: Spec, dst: Spec, axis_sizes: Mapping[str, int],
                     hw: Hardware) -> tuple[Collective, ...] | None:
    """The reshards XLA's partitioner does by sending shards to other devices
    (collective-permute), judged by the shard counts per dim; None for the others.

    - The same counts per dim, axes in another order: each device receives its shard
      from the device holding it. P(("data", "model")) -> P(("model", "data")).
    - ``src`` leaves mesh axes unused (its shards are replicated) and ``dst`` splits each
      dim a multiple of ``src``'s ways: each device slices the part of its shard that
      some device wants and sends it there. P("model") -> P("data") on an 8x2 mesh sends
      the eighth of the array each device wants from a device holding its half.
    - ``dst`` leaves mesh axes unused and ``src`` splits each dim a multiple of ``dst``'s
      ways: shards are sent where the devices sharing a ``dst`` shard can all-gather it,
      over groups along the axes ``src`` uses and ``dst`` does not. P("data") ->
      P("model") sends each eighth, then gathers halves over groups of 4 along data.

    A ``dst`` that only adds minor axes to ``src``'s (a local slice) or only drops them
    (all-gathers) keeps its devices and sends nothing.
    """
    if (all(d[:len(s)] == s for s, d in zip(src, dst))
            or all(s[:len(d)] == d for s, d in zip(src, dst))):
        return None
    src_counts = [specs.dim_shards(axes, axis_sizes) for axes in src]
    dst_counts = [specs.dim_shards(axes, axis_sizes) for axes in dst]
    devices = math.prod(axis_sizes.values())
    src_shards, dst_shards = math.prod(src_counts), math.prod(dst_counts)
    total = specs.nbytes(shape, dtype)

    def permute(num_bytes):
        return shard_permute(num_bytes, src, dst, axis_sizes, hw)

    if src_counts == dst_counts:
        return (permute(total / src_shards),)
    if src_shards < devices and all(d % s == 0 for s, d in zip(src_counts, dst_counts)):
        return (permute(total / dst_shards),)
    if 1 < dst_shards < devices and all(s % d == 0 for s, d in zip(src_counts, dst_counts)):
        gathered = tuple(a for a in axis_sizes
                         if a in specs.spec_axes(src) and a not in specs.spec_axes(dst))
        return (permute(total / src_shards),) + count_gathers(
            shape, dtype, src_counts, dst_counts, [gathered] * len(shape), hw)
    return None


def reshard_seconds(shape, dtype, src: Spec, dst: Spec, axis_sizes, hw) -> float:
    return sum(c.seconds for c in reshard_collectives(shape, dtype, src, dst, axis_sizes, hw))


# reshard seconds kept across cost graphs, per Hardware (by id, the object kept alongside
# so that its id stays its own): the programs a plan weighs (its pricings of copies, its
# microbatch and remat settings) reshard arrays of the same shapes between the same specs
_KEPT_PRICES: dict[int, tuple[Hardware, dict]] = {}
KEPT_PRICES_MAX = 1 << 18   # prices kept, at most, per Hardware


def kept_prices(hw: Hardware) -> dict:
    """The reshard seconds kept for ``hw``, by (shape, dtype, src, dst, axis sizes)."""
    found = _KEPT_PRICES.get(id(hw))
    if found is None or found[0] is not hw or len(found[1]) > KEPT_PRICES_MAX:
        if len(_KEPT_PRICES) >= 8:
            _KEPT_PRICES.clear()
        found = _KEPT_PRICES[id(hw)] = (hw, {})
    return found[1]


def operand_reshard_seconds(cg: CostGraph, chosen: Sequence) -> list[list[float]]:
    """Per node, per operand that is no literal: the seconds (times the operand's weight)
    of moving it from the spec its producer writes it in to the spec the node reads it in,
    under ``chosen`` (a strategy per node, ``CostGraph.node_strategies``). Of the readers
    that share a copy (``CostGraph.shared_reads``), the first to want a spec pays for it."""
    graph, sizes, hw = cg.space.graph, cg.space.axis_sizes, cg.space.hardware
    sharing = cg.shared_reads
    made: set = set()
    prices: dict = {}
    out = []
    for node in graph.nodes:
        wants, seconds = chosen[node.id].in_specs, []
        for i, value_id in enumerate(node.operands):
            if value_id is None:
                continue
            value = graph.values[value_id]
            key = (value.shape, wire_dtype(value.dtype, cg.space.backend.collective_itemsize),
                   chosen[value.producer].out_specs[value.index], wants[i])
            copy = (sharing.get((node.id, i)), wants[i])
            if copy[0] is not None and copy in made:
                seconds.append(0.0)
                continue
            made.add(copy)
            if key not in prices:
                prices[key] = reshard_seconds(*key, sizes, hw)
            seconds.append(node.operand_weights[i] * prices[key])
        out.append(seconds)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Pairs:
    """The specs a value is written in (per strategy of its group) against those a reader
    reads it in (per strategy of the reader's group), by distinct spec on each side."""
    rows: np.ndarray        # per src strategy: its distinct spec
    cols: np.ndarray        # per dst strategy: its distinct spec
    seconds: np.ndarray     # [distinct src, distinct dst]: resharding
    same: np.ndarray        # [distinct src, distinct dst]: the same spec
    dst_bytes: np.ndarray   # per distinct dst: bytes per device


class Interner:
    """Equal items get equal numbers, in order of first appearance."""

    def __init__(self):
        self.items: list = []
        self._numbers: dict = {}

    def number(self, item) -> int:
        found = self._numbers.get(item)
        if found is None:
            found = self._numbers[item] = len(self.items)
            self.items.append(item)
        return found


class ReshardPrices:
    """Resharding prices of the builder (``graph._Builder``), which holds the program and
    the arrays, specs and lists of specs numbered (``Interner``); this room keeps the
    prices."""

    def init_reshard(self):
        self.kept_prices = kept_prices(self.hw)
        self._prices: dict = {}
        self._pairs: dict = {}
        self._reshard_matrices: dict = {}
        self._bytes: dict = {}

    # Prices are cached by shape and specs, not by value: a repeated layer's values share
    # them. Arrays (shape and dtype), specs and lists of specs are numbered, so that the
    # caches hash small ints.
    def reshard(self, value_id: int, src: Spec, dst: Spec) -> float:
        return self.reshard_by_number(self.value_array[value_id], self.specs.number(src),
                                      self.specs.number(dst))

    def reshard_by_number(self, array: int, src: int, dst: int) -> float:
        """Seconds to reshard array number ``array`` from spec number ``src`` to ``dst``."""
        key = (array, src, dst)
        seconds = self._prices.get(key)
        if seconds is None:
            shape, dtype = self.arrays.items[array]
            dtype = wire_dtype(dtype, self.space.backend.collective_itemsize)
            src_spec, dst_spec = self.specs.items[src], self.specs.items[dst]
            kept_key = (shape, dtype, src_spec, dst_spec, self.axis_items)
            seconds = self.kept_prices.get(kept_key)
            if seconds is None:
                seconds = self.kept_prices[kept_key] = reshard_seconds(
                    shape, dtype, src_spec, dst_spec, self.axis_sizes, self.hw)
            self._prices[key] = seconds
        return seconds

    def pairs(self, array: int, srcs: int, dsts: int) -> Pairs:
        key = (array, srcs, dsts)
        if key not in self._pairs:
            self._pairs[key] = self._pairs_of(array, self.spec_lists.items[srcs],
                                              self.spec_lists.items[dsts])
        return self._pairs[key]

    def _pairs_of(self, array: int, srcs: tuple, dsts: tuple) -> Pairs:
        # distinct specs in order of first appearance: the same program gives the same
        # matrices, whatever the process's hash seed
        src_keys = {s: i for i, s in enumerate(dict.fromkeys(srcs))}
        dst_keys = {d: i for i, d in enumerate(dict.fromkeys(dsts))}
        src_ids = [self.specs.number(a) for a in src_keys]
        dst_ids = [self.specs.number(b) for b in dst_keys]
        seconds = np.array([[float(self.reshard_by_number(array, a, b)) for b in dst_ids]
                            for a in src_ids])
        shape, dtype = self.arrays.items[array]
        return Pairs(np.array([src_keys[s] for s in srcs], dtype=np.intp),
                      np.array([dst_keys[d] for d in dsts], dtype=np.intp), seconds,
                      np.equal.outer(src_ids, dst_ids),
                      np.array([specs.per_device_bytes(shape, dtype, d, self.axis_sizes)
                                for d in dst_keys], dtype=float))

    def reshard_matrix(self, array: int, srcs: int, dsts: int) -> tuple[np.ndarray, np.ndarray]:
        """[src strategy, dst strategy] seconds, from the distinct specs on each side, and
        its diagonal (for a value and reader in one group)."""
        key = (array, srcs, dsts)
        if key not in self._reshard_matrices:
            pairs = self.pairs(array, srcs, dsts)
            matrix = pairs.seconds[np.ix_(pairs.rows, pairs.cols)]
            diagonal = np.diag(matrix).copy() if len(pairs.rows) == len(pairs.cols) else None
            self._reshard_matrices[key] = matrix, diagonal
        return self._reshard_matrices[key]

    def edge_matrix(self, value, node, i) -> tuple[np.ndarray, np.ndarray]:
        return self.reshard_matrix(self.value_array[value.id],
                                   self.menus[value.producer].out_lists[value.index],
                                   self.menus[node.id].in_lists[i])

    def per_device_bytes(self, array: int, spec_list: int) -> np.ndarray:
        key = (array, spec_list)
        if key not in self._bytes:
            shape, dtype = self.arrays.items[array]
            self._bytes[key] = np.array([
                specs.per_device_bytes(shape, dtype, spec, self.axis_sizes)
                for spec in self.spec_lists.items[spec_list]])
        return self._bytes[key]
