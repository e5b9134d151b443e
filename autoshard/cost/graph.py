"""cost.graph: the ``CostGraph`` the solver's request is built from, and
``build_cost_graph``, which prices a ``StrategySpace`` into it by composing the rooms, each
a function of the frozen results of those before it: groups (``grouping.group_nodes``),
shared copies (``shared.share_copies``), a cost vector per group and a resharding matrix
per edge between groups (``reshard.price_groups``), memory terms (``liveness.Liveness``),
latencies paid once (``shared``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from autoshard.cost.grouping import Groups, group_nodes
from autoshard.cost.liveness import Liveness
from autoshard.cost.reshard import ReshardPrices, price_groups
from autoshard.cost.shared import (
    chained_latencies,
    combined_gather_latencies,
    combined_latencies,
    combining,
    share_copies,
)
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
    # one more latency for trailing collectives that depend on like ones
    # (``shared.chained_latencies``), and one per computation whose inputs' all-gathers
    # the combiner merges (``shared.combined_gather_latencies``), paid as shared reshards are
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


def donation_ties(graph, donated: Sequence[tuple[int, int]], groups: Groups) -> tuple[Tie, ...]:
    """A donated argument and the output written into its buffer keep one spec: the next
    step takes that output back as this argument, and XLA aliases only buffers sharded
    alike."""
    ties = []
    for k, arg_node in donated:
        out_node = graph.output_nodes[k]
        if out_node is None:
            continue
        gu, gv = groups.group_of_node[arg_node], groups.group_of_node[out_node]
        srcs, dsts = groups.out_specs(arg_node, 0), groups.out_specs(out_node, 0)
        ids = {spec: i for i, spec in enumerate(dict.fromkeys(srcs + dsts))}
        ties.append(Tie(gu, gv, np.array([ids[s] for s in srcs]),
                        np.array([ids[s] for s in dsts])))
    return tuple(ties)


def with_tiebreak(node_costs: Sequence[np.ndarray], terms) -> tuple[np.ndarray, ...]:
    """``node_costs`` plus ``TIEBREAK_SECONDS_PER_BYTE`` per byte of each group's terms."""
    out = list(node_costs)
    for term in terms:
        if isinstance(term, GroupTerm):
            out[term.group] = out[term.group] + TIEBREAK_SECONDS_PER_BYTE * term.num_bytes
    return tuple(out)


def build_cost_graph(space: StrategySpace, donated: Sequence[tuple[int, int]] = (),
                     native_reduce_scatter: bool = True,
                     share_held_copies: bool = True,
                     memory_budget: float | None = None) -> CostGraph:
    """Group followers, then price every group and every edge between groups: the rooms
    in order, each taking the frozen results of those before it (``group_nodes``,
    ``share_copies``, ``price_groups``, ``Liveness``, the latencies of ``shared``).

    ``donated`` pairs an output index with the argument node whose buffer it reuses.
    ``native_reduce_scatter`` is False for backends whose XLA all-reduces and keeps a
    slice instead (CPU): memory then holds the full reduced result.
    ``share_held_copies`` False counts some copies readers share once per reader (see
    ``shared.share_copies``): a smaller problem. Given a ``memory_budget`` that the
    memory alone rules out (its floor before the edges are priced is over it), raises
    ``solve.InfeasibleBudget`` with that floor instead of pricing them."""
    graph, donated = space.graph, tuple(donated)
    prices = ReshardPrices(space)
    groups = group_nodes(space, prices, {graph.output_nodes[k]: arg for k, arg in donated})
    combined = combining(space)
    liveness = Liveness(space, groups, prices, combined, {k for k, _ in donated},
                        native_reduce_scatter)
    if memory_budget is not None:
        masks = [np.ones(groups.group_size(g), bool) for g in range(len(groups.groups))]
        floor = fewest_peak(*liveness.memory_before_pricing(), masks)
        if floor > memory_budget:
            raise InfeasibleBudget(floor)
    shared = share_copies(space, groups, prices, share_held_copies)
    costs = price_groups(graph, groups, prices, shared.paid_once)
    memory = liveness.memory(shared)
    chained = (chained_latencies(space, groups, combined)
               + combined_gather_latencies(space, groups, prices))
    parts = SecondsParts(costs.compute, costs.collectives, costs.reshard,
                         latency_edges=(False,) * len(shared.reshards) + (True,) * len(chained),
                         tiebreak_seconds_per_byte=TIEBREAK_SECONDS_PER_BYTE)
    return CostGraph(space=space, group_of_node=groups.group_of_node, groups=groups.groups,
                     picks=groups.picks, node_costs=with_tiebreak(costs.node_costs, memory.terms),
                     seconds_parts=parts, edges=costs.edges, memory_terms=memory.terms,
                     fixed_terms=memory.fixed, memory_rows=memory.rows,
                     shared_costs=combined_latencies(space, groups, combined),
                     ties=donation_ties(graph, donated, groups),
                     shared_reshards=shared.reshards, shared_reads=shared.reads,
                     held_per_read=shared.held_per_read, chained_latencies=chained)
