"""cost.shared: seconds paid once for many choices. A resharded copy of a value that
several readers want in one spec is made once for all of them (``SharedEdgeCost``), and
XLA's combiner merges like collectives into one, whose latency is paid once
(``SharedCost``), and once more for each trailing collective that depends on a like one
it would otherwise join (chained latencies)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from autoshard.frontend import specs
from autoshard.solver.request import SharedCost, SharedEdgeCost
from autoshard.target.xla import (
    collective_widening,
    loop_scope,
    reduction_waves,
    trailing_ancestors,
)

if TYPE_CHECKING:
    from autoshard.cost.grouping import Groups
    from autoshard.cost.reshard import ReshardPrices

# Past this many shared copies of one value (its sources times the specs its readers may
# share), the solver would slow down more than the sharing is worth: each read pays its
# seconds, and one copy per wanted spec holds the bytes.
MAX_SHARED_COPIES = 16


def shared_reads(graph, group_of_node: Sequence[int]) -> dict[tuple[int, int], tuple]:
    """Reads (node, operand) of a value that other readers outside the value's group read
    too, at the same weight (outputs aside), each mapped to the key (value, weight) of its
    fellow readers: XLA reshards such a value once per spec they want, not once per read."""
    reads: dict[tuple, list] = {}
    for node in graph.nodes:
        if node.kind == "output":
            continue
        gv = group_of_node[node.id]
        for i, value_id in enumerate(node.operands):
            if value_id is not None and group_of_node[graph.values[value_id].producer] != gv:
                reads.setdefault((value_id, node.operand_weights[i]), []).append((node.id, i))
    return {read: key for key, found in reads.items() if len(found) > 1 for read in found}


def held_until(shared: list, seconds: float, members: list) -> tuple[tuple[int, int], ...]:
    """Appends to ``shared`` a copy's ``SharedEdgeCost`` (``members``: (reading node,
    (group, reader's group, marked pairs)) per read that may share it), and one of no
    seconds per later reading node, paid if a read at or after that node shares the copy;
    returns (that cost's index, the node) per reading node, in program order. XLA keeps
    the copy until its last reader that shares it: past that reader it is not held (a
    weight gathered for the forward and backward passes is not held through the
    optimizer's update, which reads the weight as it is stored)."""
    until = []
    for j, node in enumerate(sorted({node for node, _ in members})):
        until.append((len(shared), node))
        shared.append(SharedEdgeCost(seconds if j == 0 else 0.0,
                                     tuple(m for n, m in members if n >= node)))
    return tuple(until)


@dataclasses.dataclass(frozen=True, eq=False)
class SharedCopies:
    """The copies of values that several readers share (``share_copies``): their
    ``SharedEdgeCost``s (``reshards``); per read that shares one, its value's key (value,
    weight) and masks over its reader's strategies of the specs it no longer pays for,
    and no longer holds, on its own (``paid_once``); per copy, (the value, the copy's
    bytes per device, ``held_until``'s (index, node) per node that may read it)
    (``held``); and whether some copies readers share are held once per read
    (``held_per_read``: built without ``share_held_copies``)."""
    reshards: tuple[SharedEdgeCost, ...]
    paid_once: Mapping[tuple[int, int], tuple]
    held: tuple[tuple, ...]
    held_per_read: bool

    @property
    def reads(self) -> dict[tuple[int, int], tuple]:
        """The reads (node, operand) whose copies the shared ones are -> their value's key
        (``CostGraph.shared_reads``)."""
        return {read: key for read, (key, paid, _) in self.paid_once.items() if paid.any()}


def share_copies(space, groups: Groups, prices: ReshardPrices,
                 share_held_copies: bool = True) -> SharedCopies:
    """A ``SharedEdgeCost`` per value, spec it is written in (those a copy costs alike
    from, together) and spec that two or more of its readers (``shared_reads``) may want
    (with those ``held_until`` adds), and what each read that shares one no longer pays
    or holds on its own (``SharedCopies``)."""
    return _Sharer(space, groups, prices, share_held_copies).build()


class _Sharer:
    """``share_copies``'s state: the program's grouping and prices, and its cache."""

    def __init__(self, space, groups: Groups, prices: ReshardPrices, share_held_copies: bool):
        self.space, self.graph, self.groups, self.prices = space, space.graph, groups, prices
        self.share_held_copies = share_held_copies
        self.held_per_read = False   # some copies readers share are held once per read
        self._shared_copies: dict = {}

    def build(self) -> SharedCopies:
        by_key: dict[tuple, list] = {}
        for read, key in shared_reads(self.graph, self.groups.group_of_node).items():
            by_key.setdefault(key, []).append(read)
        menus, group_of_node = self.groups.menus, self.groups.group_of_node
        shared, paid_once, held = [], {}, []
        for (value_id, weight), reads in by_key.items():
            value = self.graph.values[value_id]
            copies, paid, holds = self.shared_copies(
                self.prices.value_array[value_id], menus[value.producer].out_lists[value.index],
                tuple(menus[n].in_lists[i] for n, i in reads), weight,
                self.prices.combines(value_id))
            gu = group_of_node[value.producer]
            readers = [group_of_node[n] for n, _ in reads]
            for seconds, paid_by, num_bytes in copies:
                members = [(reads[r][0], (gu, readers[r], marked)) for r, marked in paid_by]
                held.append((value_id, num_bytes, held_until(shared, seconds, members)))
            for read, paid_mask, held_mask in zip(reads, paid, holds):
                if held_mask.any():
                    paid_once[read] = (value_id, weight), paid_mask, held_mask
        return SharedCopies(tuple(shared), paid_once, tuple(held), self.held_per_read)

    def shared_copies(self, array: int, srcs: int, dsts: tuple[int, ...], weight: float,
                      combined: bool):
        """For an array written in spec list ``srcs`` and read in the spec lists ``dsts``
        (``combined``: its all-gathers' latency paid aside, ``ReshardPrices.combines``):
        the copies readers may share, as (seconds, ((reader, paid[src, dst]), ...), the
        copy's bytes per device), and per reader the masks of its specs whose seconds, and
        whose bytes, the shared copies take over.

        The specs the most readers may want are shared first, up to ``MAX_SHARED_COPIES``
        copies (sources with distinct prices times wanted specs); past it, each read of a
        spec pays its own seconds, and its copies price bytes alone, one per wanted spec;
        or, without ``share_held_copies``, each such read holds its own copy too (fewer
        copies to solve for). A copy is held as wide as the collectives write it
        (``collective_widening``), as a reader's own copy is. Cached: layers repeat them."""
        key = (array, srcs, dsts, weight, combined)
        if key in self._shared_copies:
            return self._shared_copies[key]
        src_specs = self.groups.spec_lists[srcs]
        wanted = [self.groups.spec_lists[d] for d in dsts]
        readers_of: dict = {}
        for r, specs_r in enumerate(wanted):
            for spec in dict.fromkeys(specs_r):
                readers_of.setdefault(spec, []).append(r)
        common = {spec: readers for spec, readers in readers_of.items() if len(readers) > 1}
        shape, dtype = self.prices.arrays.items[array]
        prices = {dst: self.copy_prices(array, src_specs, dst, weight, combined)
                  for dst in common}
        paid_specs, count = set(), 0
        for dst in sorted(common, key=lambda d: -len(common[d])):   # stable: first seen first
            if count + len(prices[dst]) <= MAX_SHARED_COPIES:
                paid_specs.add(dst)
                count += len(prices[dst])
        held_specs = set(common) if self.share_held_copies else paid_specs
        self.held_per_read = self.held_per_read or held_specs != set(common)
        copies = []
        for dst, readers in common.items():
            if dst not in held_specs:
                continue   # each read pays its seconds and holds its copy
            by_seconds = prices[dst]
            to_dst = {r: np.array([spec == dst for spec in wanted[r]]) for r in readers}
            held = (specs.per_device_bytes(shape, dtype, dst, self.prices.axis_sizes)
                    * collective_widening(dtype, self.space.backend.collective_itemsize))
            if dst in paid_specs:
                copies += [(seconds, tuple((r, from_src[:, None] & to_dst[r][None, :])
                                           for r in readers), held)
                           for seconds, from_src in by_seconds.items()]
            elif by_seconds:   # each read pays its seconds; the copy is held once
                moved = functools.reduce(np.logical_or, by_seconds.values())
                copies.append((0.0, tuple((r, moved[:, None] & to_dst[r][None, :])
                                          for r in readers), held))
        found = (copies, [np.array([spec in paid_specs for spec in specs_r]) for specs_r in wanted],
                 [np.array([spec in held_specs for spec in specs_r]) for specs_r in wanted])
        self._shared_copies[key] = found
        return found

    def copy_prices(self, array: int, src_specs: tuple, dst, weight: float,
                    combined: bool) -> dict:
        """Per price of a copy into ``dst`` (times ``weight``), the sources it costs that
        from: those share one entry, since the producer writes one spec and at most one
        of them is paid."""
        by_seconds: dict[float, np.ndarray] = {}
        prices = self.prices
        for src in dict.fromkeys(src_specs):
            seconds = weight * prices.reshard_by_number(array, prices.specs.number(src),
                                                        prices.specs.number(dst), combined)
            if seconds > 0:
                from_src = np.array([spec == src for spec in src_specs])
                by_seconds[seconds] = by_seconds.get(seconds, False) | from_src
        return by_seconds


@dataclasses.dataclass(frozen=True)
class Combining:
    """Which nodes' collectives XLA's combiner merges with their like: per node, whether
    some strategy of it has such a collective (``combines``) and whether they may join
    the one combined at the end of its computation (``joins``: a trailing node's; its
    siblings' combine where they run); per computation (loop scope), where that one
    runs: after the last node that joins it (``points``)."""
    combines: tuple[bool, ...]
    joins: tuple[bool, ...]
    points: Mapping[tuple, int]


def combining(space) -> Combining:
    """The ``Combining`` of a program's strategies."""
    by_menu: dict = {}
    combines = []
    for node in space.graph.nodes:
        key = space.menu_ids[node.id]
        if key not in by_menu:
            by_menu[key] = any(s.combined for s in space.strategies[node.id])
        combines.append(by_menu[key])
    joins = tuple(bool(space.trailing[n]) and c for n, c in enumerate(combines))
    points = {loop_scope(node): node.id for node in space.graph.nodes if joins[node.id]}
    return Combining(tuple(combines), joins, points)


def combined_latencies(space, groups: Groups, combined: Combining) -> tuple[SharedCost, ...]:
    """One latency per combined collective: per computation (per loop body, once per
    iteration) one for the trailing nodes' collectives, and one per wave of siblings
    (``reduction_waves``) for the others'."""
    graph, link_latency = space.graph, space.hardware.link_latency
    members: dict[tuple, set] = {}
    waves = reduction_waves(graph, space.strategies, space.menu_ids)
    for node in graph.nodes:
        strategies = space.strategies[node.id]
        if not combined.combines[node.id]:
            continue
        g = groups.group_of_node[node.id]
        wave = None if space.trailing[node.id] else waves[node.id]
        scope, seconds = (loop_scope(node), wave), link_latency * node.weight
        for s, k in enumerate(groups.picks[node.id]):
            for kind, axes in strategies[k].combined:
                members.setdefault((kind, axes, scope, seconds), set()).add((g, s))
    return tuple(SharedCost(key[3], tuple(sorted(m)))
                 for key, m in sorted(members.items(), key=lambda item: repr(item[0])))


def combined_gather_latencies(space, groups: Groups, prices: ReshardPrices
                              ) -> tuple[SharedEdgeCost, ...]:
    """Per computation (per loop body, once per iteration) and mesh axes, one latency for
    the all-gathers resharding its inputs and one for those its trailing nodes read,
    where the backend's combiner merges each into one (``ReshardPrices.combines``; their
    reshards are priced without it): paid if any such read picks a pair of specs that
    all-gathers over those axes. The combiner merges only all-gathers over the same
    devices."""
    if not prices.gathers_combined:
        return ()
    graph, menus, group_of_node = space.graph, groups.menus, groups.group_of_node
    members: dict[tuple, dict] = {}
    for node in graph.nodes:
        for i, value_id in enumerate(node.operands):
            if value_id is None or not prices.combines(value_id):
                continue
            value = graph.values[value_id]
            found = prices.gather_matrix(prices.value_array[value_id],
                                         menus[value.producer].out_lists[value.index],
                                         menus[node.id].in_lists[i])
            gu, gv = group_of_node[value.producer], group_of_node[node.id]
            for axes in sorted(frozenset().union(*found.ravel())):
                gathers = np.vectorize(lambda gathered, axes=axes: axes in gathered,
                                       otypes=[bool])(found)
                key = (loop_scope(node), bool(space.trailing[node.id]), axes,
                       space.hardware.link_latency * node.operand_weights[i])
                pairs = members.setdefault(key, {})
                pairs[gu, gv] = pairs[gu, gv] | gathers if (gu, gv) in pairs else gathers
    return tuple(SharedEdgeCost(key[3], tuple((u, v, paid) for (u, v), paid in pairs.items()))
                 for key, pairs in sorted(members.items(), key=lambda item: repr(item[0])))


def makes(space, groups: Groups, node_id: int, collective: tuple) -> np.ndarray:
    """Per strategy of the node's group: whether it makes this combined collective."""
    strategies = space.strategies[node_id]
    return np.array([collective in strategies[k].combined for k in groups.picks[node_id]])


def chained_latencies(space, groups: Groups,
                      combined: Combining) -> tuple[SharedEdgeCost, ...]:
    """A trailing collective that depends on a like one the combiner may still be
    filling when it reaches it (``trailing_ancestors``) starts another combined op:
    one more latency per such node, collective kind and axes, paid if the node and
    any of those makes it."""
    graph, group_of_node = space.graph, groups.group_of_node
    members: dict[tuple, dict] = {}
    before = trailing_ancestors(graph, space.strategies, space.trailing)
    for node in graph.nodes:
        if not before[node.id] or not combined.combines[node.id]:
            continue
        gn = group_of_node[node.id]
        for collective, ancestors in before[node.id].items():
            mine = makes(space, groups, node.id, collective)
            if not mine.any():
                continue
            key = (collective, node.id, space.hardware.link_latency * node.weight)
            pairs = members.setdefault(key, {})
            for p in sorted(ancestors):
                paid = np.outer(makes(space, groups, p, collective), mine)
                gp = group_of_node[p]
                if paid.any():
                    pairs[gp, gn] = pairs[gp, gn] | paid if (gp, gn) in pairs else paid
    return tuple(SharedEdgeCost(key[2], tuple((u, v, paid) for (u, v), paid in pairs.items()))
                 for key, pairs in sorted(members.items(), key=lambda item: repr(item[0]))
                 if pairs)
