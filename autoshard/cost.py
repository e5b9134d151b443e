"""cost: StrategySpace -> CostGraph.

Nodes that simply follow an operand (elementwise chains, reshapes, converts, loop seams)
join their producer's group, so the solver picks one strategy per group. A CostGraph
holds what the solver needs and nothing of jax: a cost vector per group (compute,
collectives, resharding inside the group), a resharding matrix per edge between groups,
and the per-device memory of every value as a vector over its group's strategies.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import numpy as np

from autoshard import hardware as hwlib
from autoshard import specs
from autoshard.hardware import Hardware
from autoshard.specs import Spec
from autoshard.strategies import Collective, StrategySpace, loop_scope


# -- resharding -----------------------------------------------------------------------------

def reshard_collectives(shape: Sequence[int], dtype, src: Spec, dst: Spec,
                        axis_sizes: Mapping[str, int], hw: Hardware) -> tuple[Collective, ...]:
    """The collectives that turn an array split as ``src`` into one split as ``dst``.

    Per dim, axes past the common prefix of ``src`` and ``dst`` leave that dim. An axis
    that leaves one dim and joins another moves by all-to-all; one that leaves and joins
    none is all-gathered; one that only joins is a free local slice.
    """
    if src == dst:
        return ()
    total = specs.nbytes(shape, dtype)
    leaving, joining = [], set()
    for s, d in zip(src, dst):
        common = 0
        while common < min(len(s), len(d)) and s[common] == d[common]:
            common += 1
        leaving += s[common:]
        joining |= set(d[common:])
    current = set(specs.spec_axes(src))
    out = []
    for axis in [a for a in leaving if a in joining]:
        num_bytes = total / specs.dim_shards(tuple(current), axis_sizes)
        seconds = hwlib.all_to_all_seconds(num_bytes, axis_sizes[axis], hw.bandwidth(axis),
                                           hw.link_latency)
        out.append(Collective("all-to-all", (axis,), num_bytes, seconds))
    gathered = tuple(a for a in leaving if a not in joining)
    if gathered:
        current -= set(gathered)
        num_bytes = total / specs.dim_shards(tuple(current), axis_sizes)
        group = specs.dim_shards(gathered, axis_sizes)
        seconds = hwlib.all_gather_seconds(num_bytes, group, hw.group_bandwidth(gathered),
                                           hw.link_latency)
        out.append(Collective("all-gather", gathered, num_bytes, seconds))
    return tuple(out)


def reshard_seconds(shape, dtype, src: Spec, dst: Spec, axis_sizes, hw) -> float:
    return sum(c.seconds for c in reshard_collectives(shape, dtype, src, dst, axis_sizes, hw))


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
class SharedCost:
    """Seconds paid once if any member (group, group strategy) is chosen: the latency of
    one combined collective standing for all the like collectives it merges."""
    key: tuple                              # (kind, mesh axes, loop scope)
    seconds: float
    members: tuple[tuple[int, int], ...]


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
    memory_rows: tuple[tuple[int, ...], ...]     # temporaries live together at a point
    shared_costs: tuple["SharedCost", ...] = ()  # latencies paid once for many collectives
    ties: tuple[Tie, ...] = ()                   # donated argument = its output's spec

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def node_strategy(self, node_id: int, group_choice: Sequence[int]):
        g = self.group_of_node[node_id]
        return self.space.strategies[node_id][self.choice[node_id][group_choice[g]]]


class _Builder:
    def __init__(self, space: StrategySpace, donated: Sequence[tuple[int, int]]):
        self.space = space
        self.graph = space.graph
        self.hw = space.hardware
        self.axis_sizes = space.axis_sizes
        self.donated = tuple(donated)
        self.donated_outputs = {k for k, _ in donated}
        self.group_of_node: list[int] = []
        self.groups: list[list[int]] = []
        self.choice: list[np.ndarray] = []

    @functools.lru_cache(maxsize=None)
    def reshard(self, value_id: int, src: Spec, dst: Spec) -> float:
        v = self.graph.values[value_id]
        return reshard_seconds(v.shape, v.dtype, src, dst, self.axis_sizes, self.hw)

    def out_spec(self, node_id: int, group_strategy: int, index: int) -> Spec:
        s = self.space.strategies[node_id][self.choice[node_id][group_strategy]]
        return s.out_specs[index]

    # -- grouping followers --
    def main_operand(self, node) -> int | None:
        einsum = self.space.einsums[node.id]
        if node.kind == "arg" or node.kind == "const" or einsum is None or not einsum.fusible:
            return None
        best, best_bytes = None, -1
        for i, v in enumerate(node.operands):
            if v is not None and self.graph.values[v].producer < node.id:
                if self.graph.values[v].num_bytes > best_bytes:
                    best, best_bytes = i, self.graph.values[v].num_bytes
        if best is None:
            return None
        producer = self.graph.values[node.operands[best]].producer
        fixed = len(self.choice[self.groups[self.group_of_node[producer]][0]]) == 1
        if fixed and len(self.space.strategies[node.id]) > 1:
            return None   # a group with one strategy would decide this node's alone
        out_bytes = max(self.graph.values[o].num_bytes for o in node.outputs)
        return best if out_bytes <= best_bytes else None

    def follow(self, node, i) -> np.ndarray:
        value = self.graph.values[node.operands[i]]
        u = value.producer
        g = self.group_of_node[u]
        strategies = self.space.strategies[node.id]
        picks, by_spec = [], {}
        for s in range(len(self.choice[self.groups[g][0]])):
            src = self.out_spec(u, s, value.index)
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
        return np.asarray(picks, dtype=np.int32)

    def build_groups(self):
        for node in self.graph.nodes:
            i = self.main_operand(node)
            if i is None:
                self.group_of_node.append(len(self.groups))
                self.groups.append([node.id])
                self.choice.append(np.arange(len(self.space.strategies[node.id]), dtype=np.int32))
            else:
                g = self.group_of_node[self.graph.values[node.operands[i]].producer]
                self.choice.append(self.follow(node, i))
                self.group_of_node.append(g)
                self.groups[g].append(node.id)

    # -- costs --
    def group_size(self, g) -> int:
        return len(self.choice[self.groups[g][0]])

    def build_costs(self):
        node_costs = [np.zeros(self.group_size(g)) for g in range(len(self.groups))]
        for node in self.graph.nodes:
            g = self.group_of_node[node.id]
            seconds = np.array([s.seconds for s in self.space.strategies[node.id]])
            node_costs[g] += seconds[self.choice[node.id]]
        edges: dict[tuple[int, int], np.ndarray] = {}
        for node in self.graph.nodes:
            gv = self.group_of_node[node.id]
            for i, value_id in enumerate(node.operands):
                if value_id is None:
                    continue
                value = self.graph.values[value_id]
                gu = self.group_of_node[value.producer]
                matrix = self.edge_matrix(value, node, i) * node.operand_weights[i]
                if gu == gv:
                    node_costs[gu] += np.diag(matrix)
                elif (gv, gu) in edges:
                    edges[(gv, gu)] += matrix.T
                else:
                    edges[(gu, gv)] = edges.get((gu, gv), 0) + matrix
        return node_costs, [Edge(u, v, m) for (u, v), m in edges.items()]

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
            srcs = [self.out_spec(arg_node, s, 0) for s in range(self.group_size(gu))]
            dsts = [self.out_spec(out_node, s, 0) for s in range(self.group_size(gv))]
            ids = {spec: i for i, spec in enumerate(dict.fromkeys(srcs + dsts))}
            ties.append(Tie(gu, gv, np.array([ids[s] for s in srcs]),
                            np.array([ids[s] for s in dsts])))
        return tuple(ties)

    def edge_matrix(self, value, node, i) -> np.ndarray:
        gu = self.group_of_node[value.producer]
        srcs = [self.out_spec(value.producer, s, value.index) for s in range(self.group_size(gu))]
        gv = self.group_of_node[node.id]
        dsts = [self.space.strategies[node.id][c].in_specs[i] for c in self.choice[node.id]]
        # distinct specs in order of first appearance: the same program gives the same
        # matrices, whatever the process's hash seed
        src_keys = {s: i for i, s in enumerate(dict.fromkeys(srcs))}
        dst_keys = {d: i for i, d in enumerate(dict.fromkeys(dsts))}
        small = np.array([[self.reshard(value.id, a, b) for b in dst_keys] for a in src_keys])
        return small[np.ix_([src_keys[s] for s in srcs], [dst_keys[d] for d in dsts])]

    def build_shared_costs(self) -> tuple[SharedCost, ...]:
        members: dict[tuple, set] = {}
        for node in self.graph.nodes:
            strategies = self.space.strategies[node.id]
            if not any(s.combined for s in strategies):
                continue
            g = self.group_of_node[node.id]
            # one combined collective per computation: per loop body, once per iteration
            scope, seconds = loop_scope(node), self.hw.link_latency * node.weight
            for s, k in enumerate(self.choice[node.id]):
                for kind, axes in strategies[k].combined:
                    members.setdefault((kind, axes, scope, seconds), set()).add((g, s))
        return tuple(SharedCost(key[:3], key[3], tuple(sorted(m)))
                     for key, m in sorted(members.items(), key=lambda item: repr(item[0])))

    # -- memory --
    def value_bytes(self, value_id: int) -> MemoryTerm:
        value = self.graph.values[value_id]
        g = self.group_of_node[value.producer]
        num_bytes = np.array([specs.per_device_bytes(value.shape, value.dtype,
                                                     self.out_spec(value.producer, s, value.index),
                                                     self.axis_sizes)
                              for s in range(self.group_size(g))])
        return MemoryTerm(g, num_bytes)

    def combined_terms(self) -> dict[tuple, list[MemoryTerm]]:
        """A combined collective runs once all its parts are ready: every part's input and
        result buffers are live together at that point. Per computation (loop scope)."""
        terms: dict[tuple, list[MemoryTerm]] = {}
        for node in self.graph.nodes:
            strategies = self.space.strategies[node.id]
            if not any(s.combined for s in strategies):
                continue
            g = self.group_of_node[node.id]
            num_bytes = np.zeros(self.group_size(g))
            for s, k in enumerate(self.choice[node.id]):
                if strategies[k].combined:
                    num_bytes[s] = sum(c.num_bytes for c in strategies[k].collectives) + sum(
                        specs.per_device_bytes(self.graph.values[v].shape,
                                               self.graph.values[v].dtype, spec, self.axis_sizes)
                        for v, spec in zip(node.outputs, strategies[k].out_specs))
            terms.setdefault(loop_scope(node), []).append(MemoryTerm(g, num_bytes))
        return terms

    def build_memory(self):
        graph = self.graph
        terms: list[MemoryTerm] = []
        fixed = []
        resident = set()
        for node_id in graph.arg_nodes:
            value_id = graph.nodes[node_id].outputs[0]
            resident.add(value_id)
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
        last_use = {}
        for value in graph.values:
            users = [u for u, _ in graph.users[value.id]]
            last_use[value.id] = max([value.producer, *users])
        births: dict[int, list[int]] = {}
        not_temporary = resident | aliased
        for value in graph.values:
            if value.id in not_temporary or not self.space.materialized[value.id]:
                continue
            seam = graph.nodes[value.producer]
            if seam.kind == "boundary" and seam.primitive != "loop_ys":
                continue  # a loop seam aliases the buffer it connects; a scan's stacked
                #           ys are buffers of their own, trip count x the body's slice
            births.setdefault(value.producer, []).append(value.id)
        term_of_value = {}
        for values in births.values():
            for value_id in values:
                term_of_value[value_id] = len(terms)
                terms.append(self.value_bytes(value_id))
        rows, live = [], set()
        deaths: dict[int, list[int]] = {}
        for value_id in term_of_value:
            deaths.setdefault(last_use[value_id], []).append(value_id)
        for node in graph.nodes:
            live |= set(births.get(node.id, ()))
            dying = deaths.get(node.id, ())
            if dying:
                rows.append(tuple(sorted(term_of_value[v] for v in live)))
                live -= set(dying)
        for combined in self.combined_terms().values():
            rows.append(tuple(range(len(terms), len(terms) + len(combined))))
            terms += combined
        unique_rows = tuple(dict.fromkeys(rows))
        return tuple(terms), tuple(fixed), unique_rows


# Between plans of equal time, prefer the one that keeps fewer bytes per device.
TIEBREAK_SECONDS_PER_BYTE = 1e-15


def build_cost_graph(space: StrategySpace,
                     donated: Sequence[tuple[int, int]] = ()) -> CostGraph:
    """Group followers, then price every group and every edge between groups.

    ``donated`` pairs an output index with the argument node whose buffer it reuses."""
    builder = _Builder(space, donated)
    builder.build_groups()
    node_costs, edges = builder.build_costs()
    terms, fixed, rows = builder.build_memory()
    for term in terms:
        node_costs[term.group] = node_costs[term.group] + TIEBREAK_SECONDS_PER_BYTE * term.num_bytes
    return CostGraph(space=space, group_of_node=tuple(builder.group_of_node),
                     groups=tuple(tuple(g) for g in builder.groups),
                     choice=tuple(builder.choice), node_costs=tuple(node_costs),
                     edges=tuple(edges), memory_terms=terms, fixed_terms=fixed,
                     memory_rows=rows, shared_costs=builder.build_shared_costs(),
                     ties=builder.donation_ties())
