"""cost: StrategySpace -> CostGraph.

Nodes that simply follow an operand (elementwise chains, reshapes, converts, loop seams)
join their producer's group, so the solver picks one strategy per group. A CostGraph
holds what the solver needs and nothing of jax: a cost vector per group (compute,
collectives, resharding inside the group), a resharding matrix per edge between groups,
and per-device memory terms, each live over a range of nodes: every buffer XLA keeps
(arguments and outputs always; temporaries from their producer, or from the start for
work on arguments alone, to their last reader), the copies readers make (resharded, or
transposed for a dot or convolution), and the buffers of reductions (partial results,
results of the combined all-reduce). A resharded copy depends on two groups' strategies:
an ``EdgeMemoryTerm`` over the pair.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from autoshard import hardware as hwlib
from autoshard import specs
from autoshard.hardware import Hardware
from autoshard.solve import LiveRows
from autoshard.specs import Spec
from autoshard.strategies import (Collective, StrategySpace, expensive, loop_scope,
                                  reduction_waves, spreads, trailing_ancestors,
                                  transposed_operands)


# -- resharding -----------------------------------------------------------------------------

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


# -- the cost graph ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Edge:
    src: int                # group
    dst: int                # group
    cost: np.ndarray        # [strategies of src, strategies of dst], seconds


@dataclasses.dataclass(frozen=True)
class MemoryTerm:
    group: int
    num_bytes: np.ndarray   # per strategy of the group, per device


@dataclasses.dataclass(frozen=True)
class EdgeMemoryTerm:
    """Bytes per device that depend on two groups' strategies: the copy of a result of
    group ``src`` resharded into the spec a node of group ``dst`` reads it in."""
    src: int
    dst: int
    num_bytes: np.ndarray   # [strategies of src, strategies of dst], per device


@dataclasses.dataclass(frozen=True)
class SharedCost:
    """Seconds paid once if any member (group, group strategy) is chosen: the latency of
    one combined collective standing for all the like collectives it merges."""
    key: tuple                              # (kind, mesh axes, (loop scope, wave))
    seconds: float
    members: tuple[tuple[int, int], ...]


# Past this many shared copies of one value (its sources times the specs its readers may
# share), the solver would slow down more than the sharing is worth: each read pays its
# seconds, and one copy per wanted spec holds the bytes.
MAX_SHARED_COPIES = 16


@dataclasses.dataclass(frozen=True, eq=False)
class SharedReshard:
    """One resharded copy of a value that several readers may want in one spec: XLA makes
    it once for all of them. Its seconds are paid once if any member (producer group,
    reader group, paid[producer strategy, reader strategy]) is marked."""
    seconds: float
    members: tuple[tuple[int, int, np.ndarray], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Tie:
    """Groups u and v must choose strategies with equal keys (the same spec)."""
    u: int
    v: int
    keys_u: np.ndarray      # per strategy of u
    keys_v: np.ndarray      # per strategy of v


@dataclasses.dataclass(frozen=True, eq=False)
class CostGraph:
    space: StrategySpace
    group_of_node: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]          # member node ids, root first
    choice: tuple[np.ndarray, ...]               # per node: group strategy -> node strategy
    node_costs: tuple[np.ndarray, ...]           # per group, seconds
    edges: tuple[Edge, ...]
    memory_terms: tuple[MemoryTerm, ...]
    fixed_terms: tuple[int, ...]                 # arguments and outputs: always resident
    memory_rows: LiveRows                        # temporaries live together at a point
    shared_costs: tuple["SharedCost", ...] = ()  # latencies paid once for many collectives
    ties: tuple[Tie, ...] = ()                   # donated argument = its output's spec
    # rows index these after memory_terms: edge term k is term len(memory_terms) + k
    edge_memory_terms: tuple[EdgeMemoryTerm, ...] = ()
    shared_reshards: tuple[SharedReshard, ...] = ()   # copies several readers share
    # the reads (node, operand) whose copies those are -> the key of their value
    shared_reads: Mapping[tuple[int, int], tuple] = dataclasses.field(default_factory=dict)
    # (shared reshard, bytes): its copy, held if it is made; rows index these last
    shared_copy_terms: tuple[tuple[int, float], ...] = ()
    # some copies several readers share are counted once per reader (built without
    # ``share_held_copies``)
    held_per_read: bool = False
    # one more latency for trailing collectives that depend on like ones, paid as shared
    # reshards are (``_Builder.build_chained_latencies``)
    chained_latencies: tuple[SharedReshard, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def node_strategy(self, node_id: int, group_choice: Sequence[int]):
        g = self.group_of_node[node_id]
        return self.space.strategies[node_id][self.choice[node_id][group_choice[g]]]

    def node_strategies(self, group_choice: Sequence[int]) -> list:
        """Per node, its strategy when each group takes its strategy in ``group_choice``."""
        strategies, picks = self.space.strategies, self.choice
        return [strategies[n][picks[n][group_choice[g]]]
                for n, g in enumerate(self.group_of_node)]


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
class _Pairs:
    """The specs a value is written in (per strategy of its group) against those a reader
    reads it in (per strategy of the reader's group), by distinct spec on each side."""
    rows: np.ndarray        # per src strategy: its distinct spec
    cols: np.ndarray        # per dst strategy: its distinct spec
    seconds: np.ndarray     # [distinct src, distinct dst]: resharding
    same: np.ndarray        # [distinct src, distinct dst]: the same spec
    dst_bytes: np.ndarray   # per distinct dst: bytes per device


@dataclasses.dataclass(frozen=True, eq=False)
class _Menu:
    """A node's strategies in the order of its group's: per group strategy, the node's
    seconds, the spec each operand is read in and the spec each result is written in.
    Nodes with the same strategies and the same picks (a repeated layer's) share one.
    Lists of specs are numbered (``_Builder.spec_list``): caches key them by number."""
    seconds: np.ndarray
    in_lists: tuple[int, ...]    # per operand
    out_lists: tuple[int, ...]   # per result


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


class _Builder:
    def __init__(self, space: StrategySpace, donated: Sequence[tuple[int, int]],
                 native_reduce_scatter: bool = True, share_held_copies: bool = True):
        self.space = space
        self.native_reduce_scatter = native_reduce_scatter
        self.share_held_copies = share_held_copies
        self.held_per_read = False   # some copies readers share are held once per read
        self.graph = space.graph
        self.hw = space.hardware
        self.axis_sizes = space.axis_sizes
        self.axis_items = tuple(space.axis_sizes.items())
        self.kept_prices = kept_prices(self.hw)
        self.donated = tuple(donated)
        self.donated_outputs = {k for k, _ in donated}
        self.donated_arg_of_output = {self.graph.output_nodes[k]: arg for k, arg in donated}
        self.group_of_node: list[int] = []
        self.groups: list[list[int]] = []
        self.choice: list[np.ndarray] = []
        self.menus: list[_Menu] = []      # per node, once its group strategies are known
        self.value_num_bytes = [v.num_bytes for v in self.graph.values]
        self.fusible = [e is not None and e.fusible for e in space.einsums]
        self.arrays = Interner()          # (shape, dtype) of values
        self.value_array = [self.arrays.number((v.shape, v.dtype)) for v in self.graph.values]
        self.spec_lists = Interner()      # a spec per group strategy
        self.specs = Interner()
        self._menus: dict = {}
        self._prices: dict = {}
        self._pairs: dict = {}
        self._reshard_matrices: dict = {}
        self._copies: dict = {}
        self._bytes: dict = {}
        self._follows: dict = {}
        self._all_picks: dict = {}
        self._copy_starts: dict = {}
        self._reductions: dict = {}
        self._combines: dict = {}
        self._shared_copies: dict = {}
        self.paid_once: dict = {}             # shared reads -> (value key, specs shared)
        self.shared_copies_held: list = []    # (shared reshard, value, readers, bytes)

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
            src_spec, dst_spec = self.specs.items[src], self.specs.items[dst]
            kept_key = (shape, dtype, src_spec, dst_spec, self.axis_items)
            seconds = self.kept_prices.get(kept_key)
            if seconds is None:
                seconds = self.kept_prices[kept_key] = reshard_seconds(
                    shape, dtype, src_spec, dst_spec, self.axis_sizes, self.hw)
            self._prices[key] = seconds
        return seconds

    def pairs(self, array: int, srcs: int, dsts: int) -> _Pairs:
        key = (array, srcs, dsts)
        if key not in self._pairs:
            self._pairs[key] = self._pairs_of(array, self.spec_lists.items[srcs],
                                              self.spec_lists.items[dsts])
        return self._pairs[key]

    def _pairs_of(self, array: int, srcs: tuple, dsts: tuple) -> _Pairs:
        # distinct specs in order of first appearance: the same program gives the same
        # matrices, whatever the process's hash seed
        src_keys = {s: i for i, s in enumerate(dict.fromkeys(srcs))}
        dst_keys = {d: i for i, d in enumerate(dict.fromkeys(dsts))}
        src_ids = [self.specs.number(a) for a in src_keys]
        dst_ids = [self.specs.number(b) for b in dst_keys]
        seconds = np.array([[float(self.reshard_by_number(array, a, b)) for b in dst_ids]
                            for a in src_ids])
        shape, dtype = self.arrays.items[array]
        return _Pairs(np.array([src_keys[s] for s in srcs], dtype=np.intp),
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

    def per_device_bytes(self, array: int, spec_list: int) -> np.ndarray:
        key = (array, spec_list)
        if key not in self._bytes:
            shape, dtype = self.arrays.items[array]
            self._bytes[key] = np.array([
                specs.per_device_bytes(shape, dtype, spec, self.axis_sizes)
                for spec in self.spec_lists.items[spec_list]])
        return self._bytes[key]

    def all_picks(self, num_strategies: int) -> np.ndarray:
        """The choice of a group's root: every strategy of its own, one array per count."""
        if num_strategies not in self._all_picks:
            self._all_picks[num_strategies] = np.arange(num_strategies, dtype=np.int32)
        return self._all_picks[num_strategies]

    def menu_of(self, node_id: int) -> _Menu:
        strategies, picks = self.space.strategies[node_id], self.choice[node_id]
        key = (id(strategies), id(picks))   # both are shared by identical nodes and kept
        found = self._menus.get(key)
        if found is None:
            chosen = [strategies[c] for c in picks]
            node = self.graph.nodes[node_id]
            found = self._menus[key] = _Menu(
                np.array([s.seconds for s in strategies])[picks],
                tuple(self.spec_lists.number(tuple(s.in_specs[i] for s in chosen))
                      for i in range(len(node.operands))),
                tuple(self.spec_lists.number(tuple(s.out_specs[k] for s in chosen))
                      for k in range(len(node.outputs))))
        return found

    def out_specs(self, node_id: int, index: int) -> tuple[Spec, ...]:
        """The spec of a node's result per strategy of its group."""
        return self.spec_lists.items[self.menus[node_id].out_lists[index]]

    # -- grouping followers --
    def main_operand(self, node) -> int | None:
        einsum = self.space.einsums[node.id]
        if node.kind == "arg" or node.kind == "const" or einsum is None or not einsum.fusible:
            return None
        best, best_bytes = None, -1
        for i, v in enumerate(node.operands):
            if v is not None and self.graph.values[v].producer < node.id:
                if self.value_num_bytes[v] > best_bytes:
                    best, best_bytes = i, self.value_num_bytes[v]
        if best is None:
            return None
        producer = self.graph.values[node.operands[best]].producer
        if self.graph.nodes[producer].kind == "arg" and len(self.space.strategies[node.id]) > 1:
            # an argument's spec is where it arrives, not where its readers compute: a
            # replicated argument may be read in slices for free (Adam's update of a
            # replicated moment, split over the batch axes). Following it would keep
            # those plans out of the search, which pinning the argument opens.
            return None
        fixed = len(self.choice[self.groups[self.group_of_node[producer]][0]]) == 1
        if fixed and len(self.space.strategies[node.id]) > 1:
            return None   # a group with one strategy would decide this node's alone
        if not self.can_keep_donated_spec(node, node.operands[best]):
            return None
        out_bytes = max(self.value_num_bytes[o] for o in node.outputs)
        return best if out_bytes <= best_bytes else None

    def can_keep_donated_spec(self, node, value_id: int) -> bool:
        """Whether an output written into a donated argument can follow its operand: only
        if every spec the argument may take is one the operand comes in. A pinned argument
        whose spec the operand never has (a scan stacks it whole on the layer dim) needs
        the output resharded into it, so the output keeps a group of its own."""
        arg = self.donated_arg_of_output.get(node.id)
        if arg is None:
            return True
        value = self.graph.values[value_id]
        available = set(self.out_specs(value.producer, value.index))
        return all(s.out_specs[0] in available for s in self.space.strategies[arg])

    def follow(self, node, i) -> np.ndarray:
        value = self.graph.values[node.operands[i]]
        u = value.producer
        g = self.group_of_node[u]
        strategies = self.space.strategies[node.id]
        srcs = self.out_specs(u, value.index)
        # strategies are shared by identical nodes and held by the space
        key = (id(strategies), i, self.value_array[value.id],
               self.menus[u].out_lists[value.index])
        if key in self._follows:
            return self._follows[key]
        picks, by_spec = [], {}
        for src in srcs:
            if src not in by_spec:
                # take the operand as it comes when a strategy can; slicing it further
                # is a decision for the solver, not for a follower
                same = [k for k, t in enumerate(strategies) if t.in_specs[i] == src]
                if same:
                    by_spec[src] = min(same, key=lambda k: strategies[k].seconds)
                else:
                    by_spec[src] = int(np.argmin([self.reshard(value.id, src, t.in_specs[i])
                                                  + t.seconds for t in strategies]))
            picks.append(by_spec[src])
        self._follows[key] = np.asarray(picks, dtype=np.int32)
        return self._follows[key]

    def build_groups(self):
        for node in self.graph.nodes:
            i = self.main_operand(node)
            if i is None:
                self.group_of_node.append(len(self.groups))
                self.groups.append([node.id])
                self.choice.append(self.all_picks(len(self.space.strategies[node.id])))
            else:
                g = self.group_of_node[self.graph.values[node.operands[i]].producer]
                self.choice.append(self.follow(node, i))
                self.group_of_node.append(g)
                self.groups[g].append(node.id)
            self.menus.append(self.menu_of(node.id))

    # -- costs --
    def group_size(self, g) -> int:
        return len(self.choice[self.groups[g][0]])

    def build_costs(self):
        node_costs = [np.zeros(self.group_size(g)) for g in range(len(self.groups))]
        for node in self.graph.nodes:
            node_costs[self.group_of_node[node.id]] += self.menus[node.id].seconds
        edges: dict[tuple[int, int], np.ndarray] = {}
        shared, self.paid_once, self.shared_copies_held = self.build_shared_reshards()
        paid_once = self.paid_once
        for node in self.graph.nodes:
            gv = self.group_of_node[node.id]
            for i, value_id in enumerate(node.operands):
                if value_id is None:
                    continue
                value = self.graph.values[value_id]
                gu = self.group_of_node[value.producer]
                matrix, diagonal = self.edge_matrix(value, node, i)
                weight = node.operand_weights[i]   # mostly 1.0, and x * 1.0 is x
                if gu == gv:
                    node_costs[gu] += diagonal if weight == 1.0 else diagonal * weight
                    continue
                if (node.id, i) in paid_once:   # those specs are priced by shared reshards
                    matrix = np.where(paid_once[(node.id, i)][1][None, :], 0.0, matrix)
                matrix = matrix if weight == 1.0 else matrix * weight
                if (gv, gu) in edges:   # the sums below are new arrays, never a cached one
                    edges[(gv, gu)] += matrix.T
                else:
                    edges[(gu, gv)] = edges.get((gu, gv), 0) + matrix
        return (node_costs, [Edge(u, v, m) for (u, v), m in edges.items()], shared,
                {read: key for read, (key, paid, _) in paid_once.items() if paid.any()})

    def build_shared_reshards(self) -> tuple[tuple[SharedReshard, ...], dict, list]:
        """A ``SharedReshard`` per value, spec it is written in (those a copy costs alike
        from, together) and spec that two or more of its readers (``shared_reads``) may
        want; per such read, its value's key and masks over its reader's strategies of
        the specs it no longer pays for, and no longer holds, on its own; and per shared
        reshard, (its index, the value, the readers that may share it, the copy's bytes)."""
        by_key: dict[tuple, list] = {}
        for read, key in shared_reads(self.graph, self.group_of_node).items():
            by_key.setdefault(key, []).append(read)
        shared, paid_once, held = [], {}, []
        for (value_id, weight), reads in by_key.items():
            value = self.graph.values[value_id]
            copies, paid, holds = self.shared_copies(
                self.value_array[value_id], self.menus[value.producer].out_lists[value.index],
                tuple(self.menus[n].in_lists[i] for n, i in reads), weight)
            gu = self.group_of_node[value.producer]
            readers = [self.group_of_node[n] for n, _ in reads]
            for seconds, paid_by, num_bytes in copies:
                held.append((len(shared), value_id,
                             tuple(reads[r][0] for r, _ in paid_by), num_bytes))
                shared.append(SharedReshard(seconds, tuple((gu, readers[r], marked)
                                                           for r, marked in paid_by)))
            for read, paid_mask, held_mask in zip(reads, paid, holds):
                if held_mask.any():
                    paid_once[read] = (value_id, weight), paid_mask, held_mask
        return tuple(shared), paid_once, held

    def shared_copies(self, array: int, srcs: int, dsts: tuple[int, ...], weight: float):
        """For an array written in spec list ``srcs`` and read in the spec lists ``dsts``:
        the copies readers may share, as (seconds, ((reader, paid[src, dst]), ...), the
        copy's bytes per device), and per reader the masks of its specs some other reader
        may want too, whose seconds and whose bytes the shared copies take over.

        Past ``MAX_SHARED_COPIES`` (sources with distinct prices times wanted specs), each
        read pays its own seconds, and the copies price bytes alone, one per wanted spec;
        or, without ``share_held_copies``, each read holds its own copy too (fewer copies
        to solve for). Cached: layers repeat them."""
        key = (array, srcs, dsts, weight)
        if key in self._shared_copies:
            return self._shared_copies[key]
        src_specs = self.spec_lists.items[srcs]
        wanted = [self.spec_lists.items[d] for d in dsts]
        readers_of: dict = {}
        for r, specs_r in enumerate(wanted):
            for spec in dict.fromkeys(specs_r):
                readers_of.setdefault(spec, []).append(r)
        common = {spec: readers for spec, readers in readers_of.items() if len(readers) > 1}
        shape, dtype = self.arrays.items[array]
        timed, held_only, over = [], [], False
        for dst, readers in common.items():
            # the sources a copy costs alike from share one entry: the producer writes one
            # spec, so at most one of them is paid
            by_seconds: dict[float, np.ndarray] = {}
            for src in dict.fromkeys(src_specs):
                seconds = weight * self.reshard_by_number(array, self.specs.number(src),
                                                          self.specs.number(dst))
                if seconds > 0:
                    from_src = np.array([spec == src for spec in src_specs])
                    by_seconds[seconds] = by_seconds.get(seconds, False) | from_src
            over = over or len(timed) + len(by_seconds) > MAX_SHARED_COPIES
            if over and not self.share_held_copies:
                break   # each read pays its seconds and holds its copy
            to_dst = {r: np.array([spec == dst for spec in wanted[r]]) for r in readers}
            held = specs.per_device_bytes(shape, dtype, dst, self.axis_sizes)
            timed += [(seconds, tuple((r, from_src[:, None] & to_dst[r][None, :])
                                      for r in readers), held)
                      for seconds, from_src in by_seconds.items()]
            if by_seconds and self.share_held_copies:
                moved = functools.reduce(np.logical_or, by_seconds.values())
                held_only.append((0.0, tuple((r, moved[:, None] & to_dst[r][None, :])
                                             for r in readers), held))
        shared_specs = [np.array([spec in common for spec in specs_r]) for specs_r in wanted]
        unshared = [np.zeros_like(m) for m in shared_specs]
        if not over:
            found = timed, shared_specs, shared_specs
        elif self.share_held_copies:   # too many to solve for: each read pays its seconds
            found = held_only, unshared, shared_specs
        else:
            self.held_per_read = True
            found = [], unshared, unshared
        self._shared_copies[key] = found
        return found

    def donation_ties(self) -> tuple["Tie", ...]:
        """A donated argument and the output written into its buffer keep one spec: the
        next step takes that output back as this argument, and XLA aliases only buffers
        sharded alike."""
        ties = []
        for k, arg_node in self.donated:
            out_node = self.graph.output_nodes[k]
            if out_node is None:
                continue
            gu, gv = self.group_of_node[arg_node], self.group_of_node[out_node]
            srcs, dsts = self.out_specs(arg_node, 0), self.out_specs(out_node, 0)
            ids = {spec: i for i, spec in enumerate(dict.fromkeys(srcs + dsts))}
            ties.append(Tie(gu, gv, np.array([ids[s] for s in srcs]),
                            np.array([ids[s] for s in dsts])))
        return tuple(ties)

    def edge_matrix(self, value, node, i) -> tuple[np.ndarray, np.ndarray]:
        return self.reshard_matrix(self.value_array[value.id],
                                   self.menus[value.producer].out_lists[value.index],
                                   self.menus[node.id].in_lists[i])

    def build_shared_costs(self) -> tuple[SharedCost, ...]:
        """One latency per combined collective: per computation (per loop body, once per
        iteration) one for the trailing nodes' collectives, and one per wave of siblings
        (``reduction_waves``) for the others'."""
        members: dict[tuple, set] = {}
        waves = reduction_waves(self.graph, self.space.strategies)
        for node in self.graph.nodes:
            strategies = self.space.strategies[node.id]
            if not self.combines(node.id):
                continue
            g = self.group_of_node[node.id]
            wave = None if self.space.trailing[node.id] else waves[node.id]
            scope, seconds = (loop_scope(node), wave), self.hw.link_latency * node.weight
            for s, k in enumerate(self.choice[node.id]):
                for kind, axes in strategies[k].combined:
                    members.setdefault((kind, axes, scope, seconds), set()).add((g, s))
        return tuple(SharedCost(key[:3], key[3], tuple(sorted(m)))
                     for key, m in sorted(members.items(), key=lambda item: repr(item[0])))

    def makes(self, node_id: int, combined: tuple) -> np.ndarray:
        """Per strategy of the node's group: whether it makes this combined collective."""
        strategies = self.space.strategies[node_id]
        return np.array([combined in strategies[k].combined for k in self.choice[node_id]])

    def build_chained_latencies(self) -> tuple[SharedReshard, ...]:
        """A trailing collective that depends on a like one (``trailing_ancestors``) runs
        on its own: one more latency per collective kind, axes and computation, paid if
        any such pair of nodes makes it."""
        members: dict[tuple, dict] = {}
        before = trailing_ancestors(self.graph, self.space.strategies, self.space.trailing)
        for node in self.graph.nodes:
            if not before[node.id] or not self.combines(node.id):
                continue
            gn = self.group_of_node[node.id]
            for combined, ancestors in before[node.id].items():
                mine = self.makes(node.id, combined)
                if not mine.any():
                    continue
                key = (combined, loop_scope(node), self.hw.link_latency * node.weight)
                pairs = members.setdefault(key, {})
                for p in sorted(ancestors):
                    paid = np.outer(self.makes(p, combined), mine)
                    gp = self.group_of_node[p]
                    if paid.any():
                        pairs[gp, gn] = pairs[gp, gn] | paid if (gp, gn) in pairs else paid
        return tuple(SharedReshard(key[2], tuple((u, v, paid) for (u, v), paid in pairs.items()))
                     for key, pairs in sorted(members.items(), key=lambda item: repr(item[0]))
                     if pairs)

    # -- memory --
    def value_bytes(self, value_id: int) -> MemoryTerm:
        value = self.graph.values[value_id]
        g = self.group_of_node[value.producer]
        num_bytes = self.per_device_bytes(self.value_array[value_id],
                                          self.menus[value.producer].out_lists[value.index])
        return MemoryTerm(g, num_bytes)

    def broadcasts_kept(self, value) -> int:
        """Buffers XLA keeps for a value: one, but one broadcast per operand for an
        elementwise op spreading several smaller arrays over its shape (the inverse norm
        [b, t, 1] times the scale [d] of an RMSNorm keeps both, spread)."""
        node = self.graph.nodes[value.producer]
        if (node.primitive == "broadcast_in_dim"
                or not spreads(self.graph, node, value, self.space.einsums)):
            return 1
        return max(1, sum(math.prod(self.graph.values[v].shape) > 1
                          for v in node.operands if v is not None))

    def recomputable(self, node) -> bool:
        """A cheap elementwise op of one activation and constants (a relu, a reshape): XLA
        computes it again inside every fusion reading it rather than read its result. Not
        one that also reads a broadcast statistic (x - mean): reductions read that one."""
        einsum = self.space.einsums[node.id]
        if node.kind != "eqn" or einsum is None or not einsum.fusible or expensive(node):
            return False
        sizes = [math.prod(self.graph.values[v].shape) for v in node.operands if v is not None]
        return sum(n > 1 for n in sizes) <= 1

    def last_reads(self, copied: set) -> list[int]:
        """Per value, the last node that reads its buffer.

        A fused chain of elementwise ops is copied into every consumer, so a value feeding
        one is read where the chain's consumers run (a pre-activation kept for the backward
        pass). The result of a ``recomputable`` op is read from memory only by the nodes
        that cannot fuse it (the next convolution); the fusions recompute it from its
        operand. A reader in ``copied`` (value, node) reads a copy made earlier instead."""
        graph, einsums, materialized = self.graph, self.space.einsums, self.space.materialized
        direct = [v.producer for v in graph.values]    # nodes reading the buffer as such
        fused = [v.producer for v in graph.values]     # fusions computing from the value
        for value in reversed(graph.values):
            for user, _ in graph.users[value.id]:
                node = graph.nodes[user]
                if (value.id, user) in copied:
                    continue
                if einsums[user] is None or not einsums[user].fusible or node.kind != "eqn":
                    direct[value.id] = max(direct[value.id], user)
                    continue
                reach = user
                for o in node.outputs:
                    if not materialized[o]:
                        reach = max(reach, direct[o], fused[o])
                    elif self.recomputable(node):
                        reach = max(reach, fused[o])
                fused[value.id] = max(fused[value.id], reach)
        return [direct[v.id] if materialized[v.id] and self.recomputable(graph.node_of(v.id))
                else max(direct[v.id], fused[v.id]) for v in graph.values]

    def overwritten(self, last_read: Sequence[int], not_temporary: set) -> set[int]:
        """Temporaries an elementwise node overwrites with its result: XLA writes a fused
        result of the same shape in place of an operand read for the last time there."""
        graph, materialized, found = self.graph, self.space.materialized, set()
        for node in graph.nodes:
            einsum = self.space.einsums[node.id]
            if node.kind != "eqn" or einsum is None or not einsum.fusible or not node.outputs:
                continue
            out = graph.values[node.outputs[0]]
            if not materialized[out.id]:
                continue
            for v in node.operands:
                value = graph.values[v] if v is not None else None
                if (value is not None and v not in not_temporary and materialized[v]
                        and last_read[v] == node.id and value.shape == out.shape
                        and value.dtype == out.dtype):
                    found.add(v)
                    break
        return found

    def from_arguments(self) -> list[bool]:
        """Per value: an argument or constant, or computed outside loops by one fusion
        reading nothing else. XLA schedules such work first, so its buffer (a broadcast
        zero, a broadcast scale, a weight's gathered copy) lives from the start."""
        graph, materialized, flags = self.graph, self.space.materialized, []
        for value in graph.values:
            node = graph.nodes[value.producer]
            flags.append(node.kind in ("arg", "const") or (
                node.kind == "eqn" and node.weight == 1
                and all(v is None or flags[v] and (not materialized[v]
                                                   or graph.node_of(v).kind in ("arg", "const"))
                        for v in node.operands)))
        return flags

    def copy_bytes(self, array: int, srcs: int, dsts: int,
                   fused: bool) -> tuple[np.ndarray, np.ndarray | None] | None:
        """[src strategy, dst strategy] bytes of the copy a reader wanting spec dst makes of
        a value written in spec src: the collectives' result, or the slice (nothing when
        the reader is fused and slices as it reads). With it its diagonal, for a reader in
        the value's group; None when no pair of strategies copies."""
        key = (array, srcs, dsts, fused)
        if key not in self._copies:
            self._copies[key] = self._copy_bytes(self.pairs(array, srcs, dsts), fused)
        return self._copies[key]

    @staticmethod
    def _copy_bytes(pairs: _Pairs, fused: bool):
        copies = ~pairs.same & (pairs.seconds > 0) if fused else ~pairs.same
        if not copies.any():
            return None
        small = np.where(copies, pairs.dst_bytes, 0.0)
        matrix = small[np.ix_(pairs.rows, pairs.cols)]
        return matrix, np.diag(matrix).copy() if len(pairs.rows) == len(pairs.cols) else None

    def copy_starts(self, value_id: int, from_args: Sequence[bool]) -> dict[int, int]:
        """Per reader of a value (outputs aside), the node from which a copy made for that
        reader lives. XLA makes a copy once its source is ready and keeps it for every
        reader wanting the same spec or layout (a weight gathered for the forward pass
        stays for the backward one), so a reader's copy counts from the value's previous
        reader on; a first reader's from the reader itself, or from the start for a value
        of arguments alone, which XLA computes first."""
        if value_id not in self._copy_starts:
            readers = sorted({u for u, _ in self.graph.users[value_id]
                              if self.graph.nodes[u].kind != "output"})
            self._copy_starts[value_id] = {
                u: readers[k - 1] + 1 if k else (0 if from_args[value_id] else u)
                for k, u in enumerate(readers)}
        return self._copy_starts[value_id]

    def transposed_reads(self) -> list[tuple[int, int, int]]:
        """(value, node, operand) of the operands XLA copies into another layout first."""
        return [(node.operands[i], node.id, i) for node in self.graph.nodes
                for i, copied in enumerate(transposed_operands(node)) if copied]

    def reshard_buffers(self, from_args: Sequence[bool], copied: set):
        """(term, first node, last node) of every resharded copy a reader makes (see
        ``copy_starts``). An activation a reader also copies into another layout is
        resharded just before: the layout copy is the one kept. Outputs are written in
        their own spec: their buffers are counted as outputs."""
        graph = self.graph
        for value in graph.values:
            users = [(u, i) for u, i in graph.users[value.id] if graph.nodes[u].kind != "output"]
            if not users:
                continue
            starts = self.copy_starts(value.id, from_args)
            array, srcs = self.value_array[value.id], self.menus[value.producer].out_lists[
                value.index]
            gu = self.group_of_node[value.producer]
            for user, i in users:
                copy = self.copy_bytes(array, srcs, self.menus[user].in_lists[i],
                                       self.fusible[user])
                if copy is None:
                    continue
                gv = self.group_of_node[user]
                if (user, i) in self.paid_once:   # specs whose copy the readers share
                    copy = (np.where(self.paid_once[(user, i)][2][None, :], 0.0, copy[0]),)
                    if not copy[0].any():
                        continue
                term = MemoryTerm(gu, copy[1]) if gu == gv else EdgeMemoryTerm(gu, gv, copy[0])
                held = (value.id, user) not in copied or from_args[value.id]
                yield term, starts[user] if held else user, user

    def layout_copies(self, from_args: Sequence[bool], transposed):
        """(term, first node, last node) of the copies XLA makes of operands it reads in
        another layout (``transposed_reads``), in the spec their reader wants; live like
        any copy (see ``copy_starts``): a weight's from the start of the program."""
        graph = self.graph
        for value_id, node_id, i in transposed:
            dsts = self.menus[node_id].in_lists[i]
            yield (MemoryTerm(self.group_of_node[node_id],
                              self.per_device_bytes(self.value_array[value_id], dsts)),
                   self.copy_starts(value_id, from_args)[node_id], node_id)

    def combine_points(self) -> dict[tuple, int]:
        """Per computation (loop scope), where its combined collective runs: after the last
        node whose collectives may join it."""
        points: dict[tuple, int] = {}
        for node in self.graph.nodes:
            if self.joins_combined(node.id):
                points[loop_scope(node)] = node.id
        return points

    def combines(self, node_id: int) -> bool:
        """Whether some strategy of the node has a collective XLA combines with its like."""
        strategies = self.space.strategies[node_id]
        key = id(strategies)   # shared by identical nodes, held by the space
        if key not in self._combines:
            self._combines[key] = any(s.combined for s in strategies)
        return self._combines[key]

    def joins_combined(self, node_id: int) -> bool:
        """Whether the node's collectives may join the one combined at the end of its
        computation; its siblings' combine where they run."""
        return self.space.trailing[node_id] and self.combines(node_id)

    def collective_buffers(self, last_read: Sequence[int]):
        """(term, first node, last node) of the buffers a split contraction's reduction
        adds to its result's.

        A reduction on its own reads a partial result as big as the collective's input,
        at the node. A combined one writes its result where the combined collective runs,
        beside the partial results of all its parts. A backend without reduce-scatter
        all-reduces the partial result and keeps a slice, so the full result is held to
        the node's last reader, and when that all-reduce joins the combined one, the full
        partial result is held until then too. On its own, the full result is held to the
        last reader too where every reader fuses the slice (``slices_fused``); else the
        slice is written out at the node and the full result dies there."""
        points = self.combine_points()
        for node in self.graph.nodes:
            buffers = self.reduction_buffers(node)
            if buffers is None:
                continue
            g = self.group_of_node[node.id]
            value_id = node.outputs[0]
            combine_at = points.get(loop_scope(node), node.id)
            for num_bytes, first, last in zip(buffers, (node.id, node.id, combine_at),
                                              (node.id, last_read[value_id], combine_at)):
                if num_bytes is not None:
                    yield MemoryTerm(g, num_bytes), first, last

    def slices_fused(self, value_id: int) -> bool:
        """Whether every reader of a value is an elementwise fusion, into which XLA fuses
        the dynamic slice of an all-reduced result (a backend without reduce-scatter): the
        slice is then computed in each reader, never written, and the full result is read
        to the last of them. A reader that cannot fuse it (a dot, a collective, an output)
        makes XLA write the slice once, for every reader."""
        graph = self.graph
        users = graph.users[value_id]
        return bool(users) and all(self.fusible[u] and graph.nodes[u].kind == "eqn"
                                   for u, _ in users)

    def reduction_buffers(self, node) -> tuple[np.ndarray | None, ...] | None:
        """Per group strategy, the bytes of a node's reduction buffers (see
        ``collective_buffers``): at the node, held to its last reader, and where the
        combined collective runs, each None where it is nothing; None for a node that
        never reduces. Nodes sharing a menu share them."""
        strategies, picks = self.space.strategies[node.id], self.choice[node.id]
        # menus are held by the builder
        key = (id(self.menus[node.id]), self.slices_fused(node.outputs[0]))
        if key not in self._reductions:
            self._reductions[key] = self._reduction_buffers(node, strategies, picks)
        return self._reductions[key]

    def _reduction_buffers(self, node, strategies, picks):
        if not any(c.kind in REDUCTIONS for s in strategies for c in s.collectives):
            return None
        at_node, held, at_combine = (np.zeros(len(picks)) for _ in range(3))
        joins = self.joins_combined(node.id)
        value = self.graph.values[node.outputs[0]]
        for s, k in enumerate(picks):
            strategy = strategies[k]
            # reductions one after another over different axes reduce one buffer in place
            reductions = [c for c in strategy.collectives if c.kind in REDUCTIONS]
            for c in reductions[:1]:
                emulated = c.kind == "reduce-scatter" and not self.native_reduce_scatter
                if strategy.combined and joins:
                    at_combine[s] += c.num_bytes
                elif emulated and (joins or self.slices_fused(value.id)):
                    out_bytes = specs.per_device_bytes(value.shape, value.dtype,
                                                       strategy.out_specs[0], self.axis_sizes)
                    held[s] += c.num_bytes - out_bytes
                    if joins:
                        at_combine[s] += c.num_bytes
                    else:   # the partial result; the full one is held
                        at_node[s] += c.num_bytes
                else:   # the partial result, and an emulated reduce-scatter's full one
                    at_node[s] += c.num_bytes * (2 if emulated else 1)
        return tuple(b if b.any() else None for b in (at_node, held, at_combine))

    def build_memory(self):
        """Memory terms (arguments and outputs fixed; temporaries, resharded copies and
        collective buffers each with the range of nodes it is live over), the rows of
        terms live together, and the terms depending on two groups' strategies."""
        graph = self.graph
        terms: list[MemoryTerm] = []
        fixed = []
        resident = set()
        live = graph.live_values()
        for node_id in graph.arg_nodes:
            value_id = graph.nodes[node_id].outputs[0]
            resident.add(value_id)
            if value_id not in live:   # jax.jit drops an argument no output depends on
                continue
            fixed.append(len(terms))
            terms.append(self.value_bytes(value_id))
        aliased = set()   # written in place into a donated argument's buffer
        for k, value_id in enumerate(graph.outputs):
            if value_id is None:
                continue
            if k in self.donated_outputs:
                aliased.add(value_id)
                continue
            resident.add(value_id)
            fixed.append(len(terms))
            terms.append(self.value_bytes(value_id))
        if len(graph.outputs) > 1:   # the result tuple's table: a pointer per output
            fixed.append(len(terms))
            terms.append(MemoryTerm(0, np.full(self.group_size(0),
                                               float(POINTER_BYTES * len(graph.outputs)))))
        from_args, transposed = self.from_arguments(), self.transposed_reads()
        # a reader of a copy made before it does not hold the value: the copy does
        copied = {(v, n) for v, n, _ in transposed
                  if self.copy_starts(v, from_args)[n] < n}
        last_read = self.last_reads(copied)
        spans = []   # (term, first node, last node): a temporary lives from its producer
        #              (or the start) to its last reader
        not_temporary = resident | aliased
        in_place = self.overwritten(last_read, not_temporary)
        for value in graph.values:
            if value.id in not_temporary or not self.space.materialized[value.id]:
                continue
            seam = graph.nodes[value.producer]
            if seam.kind == "eqn" and value.id not in live:
                continue  # dead code: jax.jit drops it
            if seam.kind == "boundary" and seam.primitive != "loop_ys":
                continue  # a loop seam aliases the buffer it connects; a scan's stacked
                #           ys are buffers of their own, trip count x the body's slice
            first = 0 if from_args[value.id] else value.producer
            last = last_read[value.id] - (value.id in in_place)
            term = self.value_bytes(value.id)
            term = MemoryTerm(term.group, term.num_bytes * self.broadcasts_kept(value))
            spans.append((term, first, max(first, last)))
        spans += self.collective_buffers(last_read)
        spans += self.layout_copies(from_args, transposed)
        copies = list(self.reshard_buffers(from_args, copied))
        spans += [c for c in copies if isinstance(c[0], MemoryTerm)]
        edge_spans = [c for c in copies if isinstance(c[0], EdgeMemoryTerm)]
        shared_spans = list(self.shared_copy_spans(from_args))
        terms += [t for t, _, _ in spans]
        # edge terms are numbered after every group term, shared copies after them; a row
        # per point where some term dies, holding everything live there (peaks are just
        # before deaths)
        index = list(range(len(terms) - len(spans),
                           len(terms) + len(edge_spans) + len(shared_spans)))
        starts = [first for _, first, _ in spans + edge_spans + shared_spans]
        ends = [last for _, _, last in spans + edge_spans + shared_spans]
        rows = LiveRows(index, starts, ends, sorted(set(ends)))
        return (tuple(terms), tuple(fixed), rows, tuple(t for t, _, _ in edge_spans),
                tuple(t for t, _, _ in shared_spans))

    def shared_copy_spans(self, from_args: Sequence[bool]):
        """((shared reshard, bytes), first node, last node) of every copy readers share:
        held from the first of them that may make it (see ``copy_starts``) to the last."""
        for k, value_id, readers, num_bytes in self.shared_copies_held:
            starts = self.copy_starts(value_id, from_args)
            yield (k, num_bytes), min(starts[r] for r in readers), max(readers)


# XLA returns several results as a tuple: a buffer of one pointer per result, counted in
# the compiled program's output bytes (a single result is returned as itself).
POINTER_BYTES = 8

# Between plans of equal time, prefer the one that keeps fewer bytes per device.
TIEBREAK_SECONDS_PER_BYTE = 1e-15


def build_cost_graph(space: StrategySpace, donated: Sequence[tuple[int, int]] = (),
                     native_reduce_scatter: bool = True,
                     share_held_copies: bool = True) -> CostGraph:
    """Group followers, then price every group and every edge between groups.

    ``donated`` pairs an output index with the argument node whose buffer it reuses.
    ``native_reduce_scatter`` is False for backends whose XLA all-reduces and keeps a
    slice instead (CPU): memory then holds the full reduced result.
    ``share_held_copies`` False counts some copies readers share once per reader (see
    ``_Builder.shared_copies``): a smaller problem."""
    builder = _Builder(space, donated, native_reduce_scatter, share_held_copies)
    builder.build_groups()
    node_costs, edges, shared_reshards, sharing = builder.build_costs()
    terms, fixed, rows, edge_terms, shared_terms = builder.build_memory()
    for term in terms:
        node_costs[term.group] = node_costs[term.group] + TIEBREAK_SECONDS_PER_BYTE * term.num_bytes
    return CostGraph(space=space, group_of_node=tuple(builder.group_of_node),
                     groups=tuple(tuple(g) for g in builder.groups),
                     choice=tuple(builder.choice), node_costs=tuple(node_costs),
                     edges=tuple(edges), memory_terms=terms, fixed_terms=fixed,
                     memory_rows=rows, shared_costs=builder.build_shared_costs(),
                     ties=builder.donation_ties(), edge_memory_terms=edge_terms,
                     shared_reshards=shared_reshards, shared_reads=sharing,
                     shared_copy_terms=shared_terms, held_per_read=builder.held_per_read,
                     chained_latencies=builder.build_chained_latencies())
