"""cost: StrategySpace -> CostGraph, the numbers the solver chooses by.

One module a room; each room is a function (or a small class) of the ``StrategySpace``,
the frozen results of the rooms before it and its options, and returns a frozen result:

- ``reshard``: the collectives of a reshard and their seconds (``ReshardPrices``, cached
  by shape and specs, which every room asks); per group its seconds and a resharding
  matrix per edge between groups (``price_groups`` -> ``GroupCosts``).
- ``grouping``: nodes that simply follow an operand (elementwise chains, reshapes,
  converts, loop seams) join their producer's group, so the solver picks one strategy per
  group (``group_nodes`` -> ``Groups``).
- ``shared``: seconds paid once for many choices: copies several readers share
  (``share_copies`` -> ``SharedCopies``), the latency of a combined collective
  (``combining`` -> ``Combining``, ``combined_latencies``, ``chained_latencies``).
- ``liveness``: per-device memory terms, each live over a range of nodes, as XLA's buffer
  assignment keeps them (``Liveness`` -> ``Uncopied``, ``Memory``).
- ``kept``: what a process keeps between the cost graphs it builds (reshard seconds,
  nodes' strategies), per Hardware; ``forget_prices`` drops it.
- ``graph``: the ``CostGraph`` (a cost vector per group: compute, collectives and
  resharding inside the group; the edges; the memory terms and rows),
  ``build_cost_graph``, which composes the rooms in order, and the ``request.Request`` it
  hands the solver (``CostGraph.request``).

The facts about XLA these rest on (which values it keeps, which collectives its combiner
merges, which operands it copies into another layout) live in ``strategies`` and
``hardware``; ``docs/architecture.md`` says where each kind of fact goes.
"""

from autoshard.cost.graph import CostGraph, build_cost_graph
from autoshard.cost.grouping import Groups, Menu, group_nodes
from autoshard.cost.liveness import POINTER_BYTES, Liveness, Memory, Uncopied
from autoshard.cost.reshard import (
    REDUCTIONS,
    GroupCosts,
    Interner,
    ReshardPrices,
    forget_prices,
    operand_reshard_seconds,
    price_groups,
    reshard_collectives,
    reshard_seconds,
)
from autoshard.cost.shared import (
    MAX_SHARED_COPIES,
    Combining,
    SharedCopies,
    chained_latencies,
    combined_latencies,
    combining,
    share_copies,
    shared_reads,
)

__all__ = [
    "CostGraph", "Combining", "GroupCosts", "Groups", "Interner", "Liveness",
    "MAX_SHARED_COPIES", "Memory", "Menu", "POINTER_BYTES", "REDUCTIONS", "ReshardPrices",
    "SharedCopies", "Uncopied", "build_cost_graph", "chained_latencies",
    "combined_latencies", "combining", "forget_prices", "group_nodes",
    "operand_reshard_seconds", "price_groups", "reshard_collectives", "reshard_seconds",
    "share_copies", "shared_reads",
]
