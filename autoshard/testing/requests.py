"""Solver requests checked by enumeration: the optimum of a small ``Request`` by trying
every choice, for tests of the solver and of coarsening."""

from __future__ import annotations

import itertools

import numpy as np

from autoshard.solver.request import Request, evaluate


def brute_force(request: Request) -> float:
    """Seconds of the cheapest allowed choice within the budget (inf if there is none)."""
    best = np.inf
    for choice in itertools.product(*[range(len(c)) for c in request.node_costs]):
        allowed = all(g >= len(request.allowed) or request.allowed[g] is None
                      or s in request.allowed[g] for g, s in enumerate(choice))
        seconds, peak = evaluate(request, choice)
        if allowed and (request.memory_budget is None or peak <= request.memory_budget):
            best = min(best, seconds)
    return best
