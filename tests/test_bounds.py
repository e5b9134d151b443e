"""The memory floor (``bounds.memory_floor``) is a true lower bound, on every program and
setting: no choice of strategies peaks below it, so a budget below it is infeasible, and
the planner may reject it without solving.

Checked on the zoo's GPT with scanned layers under gradient accumulation and remat
(the settings ``microbatches="auto"`` and ``remat="auto"`` weigh), a plain-JAX LM, a
generated MLP, and hand-built requests whose floors are worked out in comments.
"""

import dataclasses
import functools

import numpy as np
import pytest

import autoshard
from autoshard import api, models
from autoshard.accumulate import Microbatching, microbatching
from autoshard.bounds import memory_floor, tiebreak_ceiling
from autoshard.coarsen import coarsen
from autoshard.cost import build_cost_graph
from autoshard.mesh import axis_sizes
from autoshard.solve import (InfeasibleBudget, LiveRows, Request, peak_memory,
                             smallest_memory_choice, solve)
from autoshard.strategies import build_strategies
from autoshard.testing import plain
from autoshard.trace import build_graph, trace_program

RANDOM_CHOICES = 200

PROGRAMS = {
    "gpt_scan": (lambda: models.train_case("gpt_scan", "tiny"), (2, 4)),
    "plain_lm": (lambda: plain.lm("tiny"), (8,)),
}
SETTINGS = {   # the gpt_scan settings the auto search weighs
    "as written": None,
    "dots saved": Microbatching(1, remat="dots_saveable"),
    "nothing saved": Microbatching(1, remat="nothing_saveable"),
    "K=2 over data": Microbatching(2, ("data",), 2),
    "K=2 nothing saved": Microbatching(2, ("data",), 2, remat="nothing_saveable"),
}
CASES = [("gpt_scan", s) for s in SETTINGS] + [("plain_lm", "as written")]


@functools.cache
def mesh_of(shape):
    names = ("data", "model")[:len(shape)]
    return autoshard.make_mesh(shape, names)


@functools.cache
def requests(program: str, setting: str):
    """The full request and the coarsened one the planner solves, for both pricings of
    shared copies, with no budget."""
    make, shape = PROGRAMS[program]
    case, mesh = make(), mesh_of(shape)
    with microbatching(SETTINGS[setting]):
        graph = build_graph(trace_program(case.train_step, *case.abstract_args()))
    space = build_strategies(graph, axis_sizes(mesh), autoshard.H100, {},
                             api.combined_collectives(mesh))
    out = []
    for share in (False, True):
        cg = build_cost_graph(space, (), api.native_reduce_scatter(mesh), share)
        request = api.build_request(cg, None, 30.0)
        out.append((request, coarsen(cg, request).request))
    return out


def random_choices(request: Request, count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.array([rng.integers(len(c)) for c in request.node_costs])
            for _ in range(count)]


@pytest.mark.parametrize("program,setting", CASES)
def test_floor_is_below_every_choice(program, setting):
    for request, coarse in requests(program, setting):
        floor = memory_floor(request)
        assert floor > 0
        peaks = [peak_memory(request, c) for c in random_choices(request, RANDOM_CHOICES)]
        assert min(peaks) >= floor * (1 - 1e-12)
        assert peak_memory(request, smallest_memory_choice(request)) >= floor * (1 - 1e-12)
        # the coarsened request restricts choices: its floor is at least as high
        assert memory_floor(coarse) >= floor * (1 - 1e-12)


@pytest.mark.parametrize("program,setting", CASES)
def test_budget_below_floor_is_infeasible_when_solved(program, setting):
    """The solver, not told the floor, finds no plan within a budget just below it, and
    the plan it solves for holds at least the floor."""
    for request, coarse in requests(program, setting):
        floor = memory_floor(coarse)
        with pytest.raises(InfeasibleBudget) as info:
            solve(dataclasses.replace(coarse, memory_budget=floor * (1 - 1e-6)))
        assert info.value.smallest_bytes >= floor * (1 - 1e-12)
        solved = solve(coarse)   # no budget: the fastest plan, above both floors
        assert memory_floor(request) <= memory_floor(coarse) <= solved.memory_bytes


def test_plan_rejects_below_floor_without_solving(monkeypatch):
    """``autoshard.plan`` under a budget below the floor raises ``MemoryBudgetError``
    carrying the floor, and never calls the solver."""
    case = models.train_case("gpt_scan", "tiny")
    mesh = mesh_of((2, 4))
    floor = memory_floor(requests("gpt_scan", "as written")[0][0])

    def no_solve(request):
        raise AssertionError("solved a request the floor rules out")
    monkeypatch.setattr(api, "solve", no_solve)
    with pytest.raises(autoshard.MemoryBudgetError, match="every plan holds at least") as e:
        autoshard.plan(case.train_step, *case.abstract_args(), mesh=mesh,
                       hardware=autoshard.H100, memory_budget=floor * 0.99, cache=False,
                       progress=False)
    assert e.value.smallest_bytes >= floor * 0.99


def test_floor_by_hand():
    # group 0: strategies of 3 or 7 bytes; group 1: 5 or 2 bytes; an edge copy between
    # them of at least 1 byte (pair (1, 0)); a shared copy of 100 bytes need not be made.
    # Rows: {0, 1} and {1, 2, 3}; term 0 is also fixed (held in every row).
    request = Request(
        node_costs=[np.zeros(2), np.zeros(2)], edges=[],
        memory_terms=[(0, np.array([3.0, 7.0])), (1, np.array([5.0, 2.0]))],
        edge_memory_terms=[(0, 1, np.array([[4.0, 6.0], [1.0, 9.0]]))],
        shared_edge_costs=[(1.0, [(0, 1, np.array([[True, False], [False, False]]))])],
        shared_memory_terms=[(0, 100.0)], fixed_terms=[0],
        memory_rows=LiveRows([1, 2, 3], [0, 0, 0], [0, 1, 1], [0, 1]))
    # fixed 3; row at point 0: term 1 (2) + edge term (1) + shared (0); at point 1: 1
    assert memory_floor(request) == 6.0
    assert min(peak_memory(request, c) for c in ([0, 0], [0, 1], [1, 0], [1, 1])) >= 6.0
    # only strategy 1 of group 1 allowed: its edge column's least is 6, its bytes 2
    assert memory_floor(dataclasses.replace(request, allowed=[None, np.array([1])])) \
        == 3.0 + 2.0 + 6.0


def test_tiebreak_ceiling_bounds_every_choice():
    request, _ = requests("plain_lm", "as written")[0]
    ceiling = tiebreak_ceiling(request)
    for choice in random_choices(request, 20):
        assert api.tiebreak_seconds(request, choice) <= ceiling * (1 + 1e-12)
