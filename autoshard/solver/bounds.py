"""bounds: what no plan of a request can go below, known without solving it.

``memory_floor`` is a lower bound of the peak bytes per device of every choice of a
``request.Request`` (``request.fewest_peak``): each memory term at the fewest bytes any
allowed strategy (or pair of strategies) gives it, summed over the terms live together,
at the row where that sum is largest. No choice holds less in that row, so a floor above
the budget proves the budget infeasible in one pass over the terms, where the solver
needs a run of LPs to give up.

``tiebreak_ceiling`` is the most the byte tiebreak (``request.TIEBREAK_SECONDS_PER_BYTE``)
adds to any choice's seconds: a solver's bound on the objective, less it, bounds the
plan's time.
"""

from __future__ import annotations

import numpy as np

from autoshard.solver.request import (
    TIEBREAK_SECONDS_PER_BYTE,
    GroupTerm,
    Request,
    allowed_mask,
    fewest_peak,
)


def memory_floor(request: Request) -> float:
    """Bytes per device that every choice of ``request`` reaches at its peak (at least).

    Example: two groups whose cheapest strategies hold 3 and 5 bytes, live together,
    have a floor of 8 bytes, whatever the pair their cheapest strategies cost together.
    """
    masks = [allowed_mask(request, g) for g in range(len(request.node_costs))]
    return fewest_peak(request.memory_terms, request.fixed_terms, request.memory_rows, masks)


def tiebreak_ceiling(request: Request) -> float:
    """Seconds the byte tiebreak adds to a choice's objective, at most: every group term
    at its largest."""
    return TIEBREAK_SECONDS_PER_BYTE * sum(float(np.max(term.num_bytes))
                                           for _, term in request.terms_of(GroupTerm))
