"""search: the solve stage's retry over how shared copies are priced.

A value several readers want resharded alike can be priced two ways
(``cost.build_cost_graph(share_held_copies=...)``): each read holding its own copy (fewer
terms to solve for), or the readers sharing one copy held once (exact where the budget
binds; its memory lives from the first reader that may make it). ``solve_copies`` prices
per read first and solves the shared pricing only where that mattered: some copies were
held per read and the budget binds. The unconstrained optimum tells that, so the priced
search under the budget (``solve.lagrangian``), the costly part, runs once, on the
pricing whose plan is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from autoshard.solver.bounds import memory_floor, tiebreak_ceiling
from autoshard.solver.coarsen import Coarsened, coarsen
from autoshard.solver.request import Request
from autoshard.solver.solve import InfeasibleBudget, Result, solve

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Solved:
    """The outcome of ``solve_copies``: the last pricing's cost graph and request (None
    where the memory before pricing ruled the budget out), its coarsening (None where
    the memory floor ruled it out), and the solver's ``Result`` or the
    ``InfeasibleBudget`` that ended it; ``floor`` the request's memory floor, and
    ``seconds`` the time each stage took ({"cost", "coarsen", "solve"}, summed over the
    pricings)."""

    cost_graph: object
    request: Request
    coarse: Coarsened | None
    result: Result | InfeasibleBudget
    floor: float
    seconds: dict[str, float]


def solve_copies(price: Callable[[bool], tuple[object, Request]], budget: float,
                 reuse: bool = True, seconds_to_beat: float | None = None,
                 show: Callable[[str], None] = lambda _: None,
                 seconds: dict[str, float] | None = None) -> Solved:
    """The cheapest plan within ``budget``, its shared copies priced as the budget needs.

    ``price(share)`` builds the cost graph (``held_per_read`` where some copies are held
    once per reader) and its request, or raises ``InfeasibleBudget`` where the memory
    alone rules the budget out. Without ``share`` first: where no copy is held per
    read, or the unconstrained optimum fits, that is the answer; else the request with
    shared copies is solved under the budget. ``seconds_to_beat``: step seconds of a plan
    the caller has; ``solve.CannotBeat`` where no choice is faster (both pricings give
    the same seconds, so the first tells). ``seconds`` (the caller's, kept on a raise)
    hears each stage's seconds added to its "cost", "coarsen" and "solve"."""
    seconds = {} if seconds is None else seconds
    for stage in ("cost", "coarsen", "solve"):
        seconds.setdefault(stage, 0.0)
    first = solve_priced(price, False, budget, reuse, seconds_to_beat, show, seconds)
    binds = isinstance(first.result, InfeasibleBudget) or first.result.budget_binds
    if first.cost_graph is None or not (first.cost_graph.held_per_read and binds):
        return first
    log.debug("the budget binds with copies held per read: priced again with shared copies")
    return solve_priced(price, True, budget, reuse, seconds_to_beat, show, seconds)


def solve_priced(price, share: bool, budget: float, reuse: bool, seconds_to_beat,
                 show, seconds: dict[str, float]) -> Solved:
    """``solve_copies``'s one pricing, ``share``; the last where no copy is held per read.
    Adds each stage's seconds to ``seconds``."""
    started = time.perf_counter()
    try:
        cg, request = price(share)
    except InfeasibleBudget as e:   # the memory alone rules the budget out: not priced
        seconds["cost"] += time.perf_counter() - started
        return Solved(None, None, None, e, e.smallest_bytes, seconds)
    costed = time.perf_counter()
    seconds["cost"] += costed - started
    floor, coarse = memory_floor(request), None
    if floor > budget:   # no plan fits: known without solving
        return Solved(cg, request, None, InfeasibleBudget(floor), floor, seconds)
    show(f"coarsening {cg.num_groups} groups")
    coarse = coarsen(cg, request, reuse=reuse)
    coarsened = time.perf_counter()
    seconds["coarsen"] += coarsened - costed
    show(f"solving {coarse.num_classes} groups "
         f"({sum(len(c) for c in coarse.request.node_costs)} strategies)")
    try:
        result = solve(with_seconds_to_beat(coarse.request, request, seconds_to_beat),
                       within_budget=share or not cg.held_per_read)
    except InfeasibleBudget as e:
        result = e
    finally:   # a CannotBeat took its seconds too
        seconds["solve"] += time.perf_counter() - coarsened
    return Solved(cg, request, coarse, result, floor, seconds)


def with_seconds_to_beat(solved: Request, whole: Request, beat: float | None) -> Request:
    """``solved`` (the coarsened ``whole``) told the step seconds of the best plan the
    caller has, plus the most the byte tiebreak adds, so that the solver gives up
    (``CannotBeat``) only where no plan is faster."""
    if beat is None:
        return solved
    return dataclasses.replace(solved, seconds_to_beat=beat + tiebreak_ceiling(whole))
