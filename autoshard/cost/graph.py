"""cost.graph: the ``CostGraph`` the solver's request is built from, and the builder that
prices a ``StrategySpace`` into it: groups (``grouping``), a cost vector per group and a
resharding matrix per edge between groups (``reshard``), shared copies and latencies
(``shared``), memory terms (``liveness``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from autoshard.cost.grouping import Grouping
from autoshard.cost.liveness import Liveness
from autoshard.cost.reshard import Interner, ReshardPrices
from autoshard.cost.shared import SharedCopies
from autoshard.cost.strategies import StrategySpace
from autoshard.solver.request import (
    TIEBREAK_SECONDS_PER_BYTE,
    Edge,
    GroupTerm,
    LiveRows,
    MemoryTerm,
    Request,
    SecondsParts,
    SharedCost,
    SharedEdgeCost,
    Tie,
    fewest_peak,
)
from autoshard.solver.solve import InfeasibleBudget


@dataclasses.dataclass(frozen=True, eq=False)
class CostGraph:
    space: StrategySpace
    group_of_node: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]          # member node ids, root first
    picks: tuple[np.ndarray, ...]                # per node: group strategy -> node strategy
    node_costs: tuple[np.ndarray, ...]           # per group, seconds
    edges: tuple[Edge, ...]
    memory_terms: tuple[MemoryTerm, ...]         # the rows and fixed_terms index these
    fixed_terms: tuple[int, ...]                 # arguments and outputs: always resident
    memory_rows: LiveRows                        # temporaries live together at a point
    shared_costs: tuple[SharedCost, ...] = ()  # latencies paid once for many collectives
    ties: tuple[Tie, ...] = ()                   # donated argument = its output's spec
    shared_reshards: tuple[SharedEdgeCost, ...] = ()   # copies several readers share
    # the reads (node, operand) whose copies those are -> the key of their value
    shared_reads: Mapping[tuple[int, int], tuple] = dataclasses.field(default_factory=dict)
    # some copies several readers share are counted once per reader (built without
    # ``share_held_copies``)
    held_per_read: bool = False
    # one more latency for trailing collectives that depend on like ones, paid as shared
    # reshards are (``_Builder.build_chained_latencies``)
    chained_latencies: tuple[SharedEdgeCost, ...] = ()
    # node_costs split into compute, collectives and resharding inside groups (the
    # memory tiebreak, ``TIEBREAK_SECONDS_PER_BYTE`` per byte of memory_terms, aside)
    seconds_parts: SecondsParts | None = None

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def shared_edge_costs(self) -> tuple[SharedEdgeCost, ...]:
        """Costs paid once if any member pair of choices is marked: the shared copies,
        then the chained latencies (``seconds_parts.latency_edges`` tells them apart)."""
        return self.shared_reshards + self.chained_latencies

    def request(self, memory_budget: float | None, time_limit_s: float) -> Request:
        """What the solver is handed: this graph's numbers, and the budget."""
        return Request(node_costs=self.node_costs, edges=self.edges,
                       shared_costs=self.shared_costs,
                       ties=self.ties, memory_terms=self.memory_terms,
                       shared_edge_costs=self.shared_edge_costs,
                       fixed_terms=self.fixed_terms, memory_rows=self.memory_rows,
                       memory_budget=memory_budget, time_limit_s=time_limit_s,
                       seconds_parts=self.seconds_parts)

    def node_strategy(self, node_id: int, group_choice: Sequence[int]):
        g = self.group_of_node[node_id]
        return self.space.strategies[node_id][self.picks[node_id][group_choice[g]]]

    def node_strategies(self, group_choice: Sequence[int]) -> list:
        """Per node, its strategy when each group takes its strategy in ``group_choice``."""
        strategies, picks = self.space.strategies, self.picks
        return [strategies[n][picks[n][group_choice[g]]]
                for n, g in enumerate(self.group_of_node)]


class _Builder(Grouping, ReshardPrices, SharedCopies, Liveness):
    """Prices a ``StrategySpace``. It holds what every room reads (the program, the
    donations, arrays and specs numbered so that a repeated layer's values share prices);
    each room (``init_grouping``, ``init_reshard``, ``init_shared``, ``init_liveness``)
    sets up its own state and caches."""

    def __init__(self, space: StrategySpace, donated: Sequence[tuple[int, int]],
                 native_reduce_scatter: bool = True, share_held_copies: bool = True):
        self.space = space
        self.native_reduce_scatter = native_reduce_scatter
        self.graph = space.graph
        self.hw = space.hardware
        self.axis_sizes = space.axis_sizes
        self.axis_items = tuple(space.axis_sizes.items())
        self.donated = tuple(donated)
        self.donated_outputs = {k for k, _ in donated}
        self.donated_arg_of_output = {self.graph.output_nodes[k]: arg for k, arg in donated}
        self.value_num_bytes = [v.num_bytes for v in self.graph.values]
        self.fusible = [e is not None and e.fusible for e in space.einsums]
        self.arrays = Interner()          # (shape, dtype) of values
        self.value_array = [self.arrays.number((v.shape, v.dtype)) for v in self.graph.values]
        self.spec_lists = Interner()      # a spec per group strategy
        self.specs = Interner()
        self.init_grouping()
        self.init_reshard()
        self.init_shared(share_held_copies)
        self.init_liveness()

    def build_costs(self):
        """Per group its seconds, and their ``SecondsParts``; the edges between groups;
        the shared reshards; the reads whose copies those are."""
        node_costs = [np.zeros(self.group_size(g)) for g in range(len(self.groups))]
        compute = [np.zeros(len(c)) for c in node_costs]
        collectives = [np.zeros(len(c)) for c in node_costs]
        reshard = [np.zeros(len(c)) for c in node_costs]
        for node in self.graph.nodes:
            g, menu = self.group_of_node[node.id], self.menus[node.id]
            node_costs[g] += menu.seconds
            compute[g] += menu.compute
            collectives[g] += menu.comm
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
        return (node_costs, (tuple(compute), tuple(collectives), tuple(reshard)),
                [Edge(u, v, m) for (u, v), m in edges.items()], shared,
                {read: key for read, (key, paid, _) in paid_once.items() if paid.any()})

    def donation_ties(self) -> tuple[Tie, ...]:
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


def build_cost_graph(space: StrategySpace, donated: Sequence[tuple[int, int]] = (),
                     native_reduce_scatter: bool = True,
                     share_held_copies: bool = True,
                     memory_budget: float | None = None) -> CostGraph:
    """Group followers, then price every group and every edge between groups.

    ``donated`` pairs an output index with the argument node whose buffer it reuses.
    ``native_reduce_scatter`` is False for backends whose XLA all-reduces and keeps a
    slice instead (CPU): memory then holds the full reduced result.
    ``share_held_copies`` False counts some copies readers share once per reader (see
    ``_Builder.shared_copies``): a smaller problem. Given a ``memory_budget`` that the
    memory alone rules out (its floor before the edges are priced is over it), raises
    ``solve.InfeasibleBudget`` with that floor instead of pricing them."""
    builder = _Builder(space, donated, native_reduce_scatter, share_held_copies)
    builder.build_groups()
    if memory_budget is not None:
        masks = [np.ones(builder.group_size(g), bool) for g in range(len(builder.groups))]
        floor = fewest_peak(*builder.memory_before_pricing(), masks)
        if floor > memory_budget:
            raise InfeasibleBudget(floor)
    node_costs, node_parts, edges, shared_reshards, sharing = builder.build_costs()
    terms, fixed, rows = builder.build_memory()
    for term in terms:
        if isinstance(term, GroupTerm):
            node_costs[term.group] = (node_costs[term.group]
                                      + TIEBREAK_SECONDS_PER_BYTE * term.num_bytes)
    chained = builder.build_chained_latencies()
    parts = SecondsParts(*node_parts, latency_edges=(False,) * len(shared_reshards)
                         + (True,) * len(chained),
                         tiebreak_seconds_per_byte=TIEBREAK_SECONDS_PER_BYTE)
    return CostGraph(space=space, group_of_node=tuple(builder.group_of_node),
                     groups=tuple(tuple(g) for g in builder.groups),
                     picks=tuple(builder.picks), node_costs=tuple(node_costs),
                     seconds_parts=parts,
                     edges=tuple(edges), memory_terms=terms, fixed_terms=fixed,
                     memory_rows=rows, shared_costs=builder.build_shared_costs(),
                     ties=builder.donation_ties(),
                     shared_reshards=shared_reshards, shared_reads=sharing,
                     held_per_read=builder.held_per_read,
                     chained_latencies=chained)
