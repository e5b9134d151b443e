"""cost.reshard: the collectives that move an array from one spec to another, their
seconds, and the matrices of those seconds between the specs a value is written in and
the specs a reader reads it in (``ReshardPrices``, cached by shape and specs)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from autoshard import hardware as hwlib
from autoshard import specs
from autoshard.hardware import Hardware
from autoshard.specs import Spec
from autoshard.strategies import Collective

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
    all-gather of their own (``gather_steps``).
    """
    if src == dst:
        return ()
    total = specs.nbytes(shape, dtype)
    leaving, joining = [], set()
    for s, d in zip(src, dst):
        common = 0
        while common < min(len(s), len(d)) and s[common] == d[common]:
            common += 1
        leaving.append(s[common:])
        joining |= set(d[common:])
    current = set(specs.spec_axes(src))
    out = []
    for axis in [a for axes in leaving for a in axes if a in joining]:
        num_bytes = total / specs.dim_shards(tuple(current), axis_sizes)
        seconds = hwlib.all_to_all_seconds(num_bytes, axis_sizes[axis], hw.bandwidth(axis),
                                           hw.link_latency)
        # the chunks for each peer are cut along the dim the axis joins, not the major
        # one: XLA copies the buffer into peer-major order first (read and write it)
        seconds += hw.compute_seconds(0.0, 2 * num_bytes)
        out.append(Collective("all-to-all", (axis,), num_bytes, seconds))
    gathered = [tuple(a for a in axes if a not in joining) for axes in leaving]
    return tuple(out) + gather_steps(shape, dtype, src, gathered, axis_sizes, hw)


def gather_steps(shape, dtype, src: Spec, gathered: Sequence[tuple[str, ...]],
                 axis_sizes: Mapping[str, int], hw: Hardware) -> tuple[Collective, ...]:
    """The all-gathers that take ``gathered[d]`` (axes) off each dim d of an array split as
    ``src``: one per dim, the last dim first, as XLA's partitioner emits them.

    An all-gather concatenates along the major dim of its buffer, so XLA lays a buffer
    out with the gathered dim major first: a copy (read and write it) before gathering a
    dim that is not major in the buffer's layout, which is row-major to start with and
    has the gathered dim major after each gather. P(data, model) -> P() gathers 'model'
    on dim 1 (copied first), then 'data' on dim 0 (copied back first).
    """
    current = [list(axes) for axes in src]
    major = None   # the dim the buffer's layout has major: row-major to start with
    out = []
    for d in reversed(range(len(shape))):
        if not gathered[d]:
            continue
        num_bytes = specs.nbytes(shape, dtype) / specs.num_shards(current, axis_sizes)
        local = [size // specs.dim_shards(axes, axis_sizes)
                 for size, axes in zip(shape, current)]
        first = major if major is not None else next(
            (k for k, n in enumerate(local) if n > 1), d)
        copy = 0.0 if first == d or local[first] == 1 else 2 * num_bytes
        current[d] = [a for a in current[d] if a not in gathered[d]]
        out_bytes = specs.nbytes(shape, dtype) / specs.num_shards(current, axis_sizes)
        seconds = hwlib.all_gather_seconds(out_bytes, specs.dim_shards(gathered[d], axis_sizes),
                                           hw.group_bandwidth(gathered[d]), hw.link_latency)
        out.append(Collective("all-gather", gathered[d], out_bytes,
                              seconds + hw.compute_seconds(0.0, copy)))
        major = d
    return tuple(out)


def reshard_seconds(shape, dtype, src: Spec, dst: Spec, axis_sizes, hw) -> float:
    return sum(c.seconds for c in reshard_collectives(shape, dtype, src, dst, axis_sizes, hw))


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
            key = (value.shape, value.dtype, chosen[value.producer].out_specs[value.index],
                   wants[i])
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
    """Resharding prices of the builder (``graph._Builder``), which holds the state:
    arrays, specs and lists of specs numbered (``Interner``), and the caches."""

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
            seconds = self._prices[key] = reshard_seconds(
                shape, dtype, self.specs.items[src], self.specs.items[dst], self.axis_sizes,
                self.hw)
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
