"""cost: StrategySpace -> CostGraph, the numbers the solver chooses by.

One module a concern; this package holds their public names:

- ``grouping``: nodes that simply follow an operand (elementwise chains, reshapes,
  converts, loop seams) join their producer's group, so the solver picks one strategy per
  group.
- ``reshard``: the collectives of a reshard and their seconds; a resharding matrix per
  edge between groups.
- ``shared``: seconds paid once for many choices: copies several readers share, the
  latency of a combined collective.
- ``liveness``: per-device memory terms, each live over a range of nodes, as XLA's buffer
  assignment keeps them.
- ``graph``: the ``CostGraph`` (a cost vector per group: compute, collectives and
  resharding inside the group; the edges; the memory terms and rows), the builder that
  prices a ``StrategySpace`` into it, and the ``request.Request`` it hands the solver
  (``CostGraph.request``).

The facts about XLA these rest on (which values it keeps, which collectives its combiner
merges, which operands it copies into another layout) live in ``strategies`` and
``hardware``; ``docs/architecture.md`` says where each kind of fact goes.
"""

from autoshard.cost.graph import CostGraph, build_cost_graph
from autoshard.cost.grouping import Menu
from autoshard.cost.liveness import POINTER_BYTES
from autoshard.cost.reshard import (
    REDUCTIONS,
    Interner,
    forget_prices,
    operand_reshard_seconds,
    reshard_collectives,
    reshard_seconds,
)
from autoshard.cost.shared import MAX_SHARED_COPIES, shared_reads

__all__ = [
    "CostGraph", "Interner", "MAX_SHARED_COPIES", "Menu", "POINTER_BYTES", "REDUCTIONS",
    "build_cost_graph", "forget_prices",
    "operand_reshard_seconds", "reshard_collectives", "reshard_seconds", "shared_reads",
]
