"""cost.reshard: the collectives that move an array from one spec to another, their
seconds, and the matrices of those seconds between the specs a value is written in and
the specs a reader reads it in (``ReshardPrices``, cached by shape and specs); with them,
each group's seconds and the edges between groups (``price_groups``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from autoshard.cost import kept, partitioner
from autoshard.cost.strategies import Collective
from autoshard.frontend import specs
from autoshard.frontend.specs import Spec
from autoshard.solver.request import Edge
from autoshard.target import hardware as hwlib
from autoshard.target.hardware import Hardware
from autoshard.target.xla import independent_gather, wire_dtype

if TYPE_CHECKING:
    from autoshard.cost.graph import CostGraph
    from autoshard.cost.grouping import Groups

REDUCTIONS = ("all-reduce", "reduce-scatter")   # collectives that reduce a partial result


def reshard_collectives(shape: Sequence[int], dtype, src: Spec, dst: Spec,
                        axis_sizes: Mapping[str, int], hw: Hardware) -> tuple[Collective, ...]:
    """The collectives that turn an array split as ``src`` into one split as ``dst``: those
    XLA's partitioner emits (:func:`partitioner.reshard_steps`, followed once per
    canonical reshard), priced on ``hw``.

    Beside each collective's own time, two copies XLA makes are priced: an all-to-all's
    buffer is first copied into peer-major order (read and write it), and an all-gather
    concatenates along the major dim of its buffer, so a buffer whose major dim (with
    more than one element) is another one is copied first. The layout is row-major to
    start with, after an all-to-all or a permute, and has the gathered dim major after
    each all-gather: P(data, model) -> P() gathers 'model' on dim 1 (copied first), then
    'data' on dim 0 (copied back first).
    """
    if src == dst:
        return ()
    canonical, src, dst, scale = partitioner.canonical_reshard(
        shape, specs.itemsize(dtype), src, dst, axis_sizes)
    src, dst, names = partitioner.relabelled(src, dst, axis_sizes)
    steps = partitioner.cached_reshard_steps(canonical, 1, src, dst, axis_sizes)
    out, major = [], None
    for step in steps:   # followed on the canonical reshard: bytes scaled, axes renamed back
        spanned = {names[a] for a in step.axes}
        axes = tuple(a for a in axis_sizes if a in spanned)
        bandwidth, size = hw.group_bandwidth(axes), step.group_size
        num_bytes = step.num_bytes * scale
        if step.kind == "all-gather":
            dim, local = step.gathered_dim, step.local_shape
            first = major if major is not None else next(
                (k for k, n in enumerate(local) if n > 1), dim)
            copy = 0.0 if first == dim or local[first] == 1 else 2 * num_bytes / size
            seconds = hwlib.all_gather_seconds(num_bytes, size, bandwidth, hw.link_latency)
            seconds += hw.compute_seconds(0.0, copy)
            major = dim
        elif step.kind == "all-to-all":
            seconds = hwlib.all_to_all_seconds(num_bytes, size, bandwidth, hw.link_latency)
            seconds += hw.compute_seconds(0.0, 2 * num_bytes)
            major = None
        else:
            seconds = hwlib.collective_permute_seconds(num_bytes, bandwidth, hw.link_latency)
            major = None
        out.append(Collective(step.kind, axes, num_bytes, seconds))
    return tuple(out)


def reshard_seconds(shape, dtype, src: Spec, dst: Spec, axis_sizes, hw,
                    gathers_combined: bool = False) -> float:
    """Seconds of ``reshard_collectives``; with ``gathers_combined``, less the latency of
    its all-gathers: they join one the combiner merges, whose latency is paid aside
    (``shared.combined_gather_latencies``)."""
    found = reshard_collectives(shape, dtype, src, dst, axis_sizes, hw)
    seconds = sum(c.seconds for c in found)
    if gathers_combined:
        seconds -= hw.link_latency * sum(c.kind == "all-gather" for c in found)
    return seconds


def reshard_gathers(shape, dtype, src: Spec, dst: Spec, axis_sizes, hw) -> frozenset:
    """The mesh axes of each all-gather resharding from ``src`` to ``dst`` (empty: none).
    The combiner merges only all-gathers over the same devices."""
    return frozenset(c.axes for c in reshard_collectives(shape, dtype, src, dst, axis_sizes, hw)
                     if c.kind == "all-gather")


KEPT_PRICES_MAX = 1 << 18   # reshard seconds kept, at most, per Hardware


def kept_prices(hw: Hardware) -> dict:
    """The reshard seconds kept for ``hw``, by (shape, dtype, src, dst, axis sizes)."""
    return kept.kept("reshard seconds", hw, KEPT_PRICES_MAX)


def forget_prices() -> None:
    """Drop every reshard price, followed reshard and strategy this process keeps
    (``kept``, ``partitioner.cached_reshard_steps``, the tilings): the next plan prices
    from scratch, as a fresh process's first plan does."""
    kept.forget()
    partitioner.forget()


def operand_reshard_seconds(cg: CostGraph, chosen: Sequence) -> list[list[float]]:
    """Per node, per operand that is no literal: the seconds (times the operand's weight)
    of moving it from the spec its producer writes it in to the spec the node reads it in,
    under ``chosen`` (a strategy per node, ``CostGraph.node_strategies``). Of the readers
    that share a copy (``CostGraph.shared_reads``), the first to want a spec pays for it."""
    graph, sizes, hw = cg.space.graph, cg.space.axis_sizes, cg.space.hardware
    combines = cg.space.backend.merges_all_gathers
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
                   chosen[value.producer].out_specs[value.index], wants[i],
                   combines and independent_gather(graph, value, cg.space.trailing))
            copy = (sharing.get((node.id, i)), wants[i])
            if copy[0] is not None and copy in made:
                seconds.append(0.0)
                continue
            made.add(copy)
            if key not in prices:
                prices[key] = reshard_seconds(*key[:4], sizes, hw, key[4])
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
    gathers: np.ndarray | None   # [distinct src, distinct dst]: all-gathers' axes (sets)
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
    """Reshard seconds and bytes of one program's arrays (``space``), cached by shape and
    specs, not by value: a repeated layer's values share them. Arrays (shape and dtype),
    specs and lists of specs (``spec_list``: a spec per group strategy) are numbered, so
    that the caches hash small ints. Every room of the cost stage asks it for prices."""

    def __init__(self, space):
        self.hw = space.hardware
        self.axis_sizes = space.axis_sizes
        self.axis_items = tuple(space.axis_sizes.items())
        self.collective_itemsize = space.backend.collective_itemsize
        self.gathers_combined = space.backend.merges_all_gathers
        self.graph, self.trailing = space.graph, space.trailing
        self.arrays = Interner()          # (shape, dtype) of values
        self.value_array = [self.arrays.number((v.shape, v.dtype)) for v in space.graph.values]
        self.spec_lists = Interner()
        self.specs = Interner()
        self.kept_prices = kept_prices(self.hw)
        self._prices: dict = {}
        self._pairs: dict = {}
        self._reshard_matrices: dict = {}
        self._bytes: dict = {}
        self._gathers: dict = {}

    def combines(self, value_id: int) -> bool:
        """Whether the combiner merges the all-gathers resharding a value: the backend
        combines all-gathers and they are independent of others
        (``xla.independent_gather``)."""
        return self.gathers_combined and independent_gather(
            self.graph, self.graph.values[value_id], self.trailing)

    def spec_list(self, specs_: tuple[Spec, ...]) -> int:
        """The number of a list of specs."""
        return self.spec_lists.number(specs_)

    def reshard(self, value_id: int, src: Spec, dst: Spec) -> float:
        return self.reshard_by_number(self.value_array[value_id], self.specs.number(src),
                                      self.specs.number(dst))

    def reshard_by_number(self, array: int, src: int, dst: int, combined: bool = False
                          ) -> float:
        """Seconds to reshard array number ``array`` from spec number ``src`` to ``dst``;
        ``combined``: less its all-gathers' latency (``combines``)."""
        key = (array, src, dst, combined)
        seconds = self._prices.get(key)
        if seconds is None:
            shape, dtype = self.arrays.items[array]
            dtype = wire_dtype(dtype, self.collective_itemsize)
            src_spec, dst_spec = self.specs.items[src], self.specs.items[dst]
            kept_key = (shape, dtype, src_spec, dst_spec, self.axis_items, combined)
            seconds = self.kept_prices.get(kept_key)
            if seconds is None:
                seconds = self.kept_prices[kept_key] = reshard_seconds(
                    shape, dtype, src_spec, dst_spec, self.axis_sizes, self.hw, combined)
            self._prices[key] = seconds
        return seconds

    def gathers_by_number(self, array: int, src: int, dst: int) -> frozenset:
        """The axes of the all-gathers resharding array number ``array`` from spec ``src``
        to ``dst`` (``reshard_gathers``)."""
        key = (array, src, dst)
        found = self._gathers.get(key)
        if found is None:
            shape, dtype = self.arrays.items[array]
            found = self._gathers[key] = reshard_gathers(
                shape, wire_dtype(dtype, self.collective_itemsize), self.specs.items[src],
                self.specs.items[dst], self.axis_sizes, self.hw)
        return found

    def pairs(self, array: int, srcs: int, dsts: int, combined: bool = False) -> Pairs:
        key = (array, srcs, dsts, combined)
        if key not in self._pairs:
            self._pairs[key] = self._pairs_of(array, self.spec_lists.items[srcs],
                                              self.spec_lists.items[dsts], combined)
        return self._pairs[key]

    def _pairs_of(self, array: int, srcs: tuple, dsts: tuple, combined: bool) -> Pairs:
        # distinct specs in order of first appearance: the same program gives the same
        # matrices, whatever the process's hash seed
        src_keys = {s: i for i, s in enumerate(dict.fromkeys(srcs))}
        dst_keys = {d: i for i, d in enumerate(dict.fromkeys(dsts))}
        src_ids = [self.specs.number(a) for a in src_keys]
        dst_ids = [self.specs.number(b) for b in dst_keys]
        seconds = np.array([[float(self.reshard_by_number(array, a, b, combined))
                             for b in dst_ids] for a in src_ids])
        gathers = None
        if combined:
            gathers = np.empty((len(src_ids), len(dst_ids)), dtype=object)
            for i, a in enumerate(src_ids):
                for j, b in enumerate(dst_ids):
                    gathers[i, j] = self.gathers_by_number(array, a, b)
        shape, dtype = self.arrays.items[array]
        return Pairs(np.array([src_keys[s] for s in srcs], dtype=np.intp),
                      np.array([dst_keys[d] for d in dsts], dtype=np.intp), seconds, gathers,
                      np.equal.outer(src_ids, dst_ids),
                      np.array([specs.per_device_bytes(shape, dtype, d, self.axis_sizes)
                                for d in dst_keys], dtype=float))

    def reshard_matrix(self, array: int, srcs: int, dsts: int, combined: bool = False
                       ) -> tuple[np.ndarray, np.ndarray]:
        """[src strategy, dst strategy] seconds, from the distinct specs on each side, and
        its diagonal (for a value and reader in one group); ``combined``: less the
        latency of all-gathers the combiner merges (``combines``)."""
        key = (array, srcs, dsts, combined)
        if key not in self._reshard_matrices:
            pairs = self.pairs(array, srcs, dsts, combined)
            matrix = pairs.seconds[np.ix_(pairs.rows, pairs.cols)]
            diagonal = np.diag(matrix).copy() if len(pairs.rows) == len(pairs.cols) else None
            self._reshard_matrices[key] = matrix, diagonal
        return self._reshard_matrices[key]

    def gather_matrix(self, array: int, srcs: int, dsts: int) -> np.ndarray:
        """[src strategy, dst strategy]: the axes of the all-gathers resharding takes, a
        set per pair (``reshard_gathers``)."""
        pairs = self.pairs(array, srcs, dsts, True)
        return pairs.gathers[np.ix_(pairs.rows, pairs.cols)]

    def per_device_bytes(self, array: int, spec_list: int) -> np.ndarray:
        key = (array, spec_list)
        if key not in self._bytes:
            shape, dtype = self.arrays.items[array]
            self._bytes[key] = np.array([
                specs.per_device_bytes(shape, dtype, spec, self.axis_sizes)
                for spec in self.spec_lists.items[spec_list]])
        return self._bytes[key]


@dataclasses.dataclass(frozen=True, eq=False)
class GroupCosts:
    """Per group, its seconds per strategy (``node_costs``) and their parts: compute,
    collectives and resharding inside the group; the resharding matrices of the edges
    between groups (those the shared copies pay aside)."""
    node_costs: tuple[np.ndarray, ...]
    compute: tuple[np.ndarray, ...]
    collectives: tuple[np.ndarray, ...]
    reshard: tuple[np.ndarray, ...]
    edges: tuple[Edge, ...]


def price_groups(graph, groups: Groups, prices: ReshardPrices,
                 paid_once: Mapping[tuple[int, int], tuple]) -> GroupCosts:
    """Per group its seconds, and the edges between groups: a read inside its value's
    group adds the diagonal of its resharding matrix to the group, one across groups the
    matrix to their edge, less the specs a shared copy pays for (``paid_once``: per read,
    its value's key and the mask of those specs, ``shared.SharedCopies.paid_once``)."""
    group_of_node, menus, value_array = groups.group_of_node, groups.menus, prices.value_array
    node_costs = [np.zeros(groups.group_size(g)) for g in range(len(groups.groups))]
    compute = [np.zeros(len(c)) for c in node_costs]
    collectives = [np.zeros(len(c)) for c in node_costs]
    reshard = [np.zeros(len(c)) for c in node_costs]
    for node in graph.nodes:
        g, menu = group_of_node[node.id], menus[node.id]
        node_costs[g] += menu.seconds
        compute[g] += menu.compute
        collectives[g] += menu.comm
    edges: dict[tuple[int, int], np.ndarray] = {}
    for node in graph.nodes:
        gv = group_of_node[node.id]
        for i, value_id in enumerate(node.operands):
            if value_id is None:
                continue
            value = graph.values[value_id]
            gu = group_of_node[value.producer]
            matrix, diagonal = prices.reshard_matrix(
                value_array[value_id], menus[value.producer].out_lists[value.index],
                menus[node.id].in_lists[i], prices.combines(value_id))
            weight = node.operand_weights[i]   # mostly 1.0, and x * 1.0 is x
            if gu == gv:
                moved = diagonal if weight == 1.0 else diagonal * weight
                node_costs[gu] += moved
                reshard[gu] += moved
                continue
            if (node.id, i) in paid_once:   # those specs are priced by shared reshards
                matrix = np.where(paid_once[(node.id, i)][1][None, :], 0.0, matrix)
            matrix = matrix if weight == 1.0 else matrix * weight
            if (gv, gu) in edges:   # the sums below are new arrays, never a cached one
                edges[(gv, gu)] += matrix.T
            else:
                edges[(gu, gv)] = edges.get((gu, gv), 0) + matrix
    return GroupCosts(tuple(node_costs), tuple(compute), tuple(collectives), tuple(reshard),
                      tuple(Edge(u, v, m) for (u, v), m in edges.items()))
