"""The memory floor (``bounds.memory_floor``) is a true lower bound, on every program and
setting: no choice of strategies peaks below it, so a budget below it is infeasible, and
the planner may reject it without solving.

Checked on the zoo's GPT with scanned layers under gradient accumulation and remat
(the settings ``microbatches="auto"`` and ``remat="auto"`` weigh) and a plain-JAX LM
against random choices and solved plans; on random small requests against every choice,
and against the solver under budgets below the floor; and on a hand-built request whose
floor is worked out in comments.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.cost import build_cost_graph
from autoshard.cost import graph as cost_graph
from autoshard.cost.strategies import build_strategies
from autoshard.frontend.trace import build_graph, trace_program
from autoshard.planning import api
from autoshard.report.hlo_report import hlo_report
from autoshard.rewrite.accumulate import Microbatching, microbatching
from autoshard.solver import search
from autoshard.solver.bounds import memory_floor, tiebreak_ceiling
from autoshard.solver.coarsen import coarsen
from autoshard.solver.request import (
    CopyTerm,
    GroupTerm,
    LiveRows,
    PairTerm,
    Request,
    SharedEdgeCost,
    peak_memory,
)
from autoshard.solver.solve import CannotBeat, InfeasibleBudget, smallest_memory_choice, solve
from autoshard.target.hardware import Backend
from autoshard.testing import plain
from autoshard.units import axis_sizes
from autoshard.zoo import models

RANDOM_CHOICES = 200
SMALL_REQUESTS = 100

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
def strategy_space(program: str, setting: str):
    """The program's strategies under the setting, and its mesh's backend."""
    make, shape = PROGRAMS[program]
    case, mesh = make(), mesh_of(shape)
    with microbatching(SETTINGS[setting]):
        graph = build_graph(trace_program(case.train_step, *case.abstract_args()))
    backend = Backend.of(mesh)
    return build_strategies(graph, axis_sizes(mesh), autoshard.H100, {}, backend), backend


@functools.cache
def requests(program: str, setting: str):
    """The full request and the coarsened one the planner solves, for both pricings of
    shared copies, with no budget."""
    space, backend = strategy_space(program, setting)
    out = []
    for share in (False, True):
        cg = build_cost_graph(space, (), backend.native_reduce_scatter, share)
        request = cg.request(None, 30.0)
        out.append((request, coarsen(cg, request).request))
    return out


def random_choices(request: Request, count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.array([rng.integers(len(c)) for c in request.node_costs])
            for _ in range(count)]


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("program,setting", CASES)
def test_solved_plan_holds_at_least_the_floor(program, setting):
    for request, coarse in requests(program, setting):
        solved = solve(coarse)   # no budget: the fastest plan
        assert memory_floor(request) <= memory_floor(coarse) <= solved.memory_bytes


@functools.cache
def floor_before_pricing(program: str, setting: str) -> float:
    """The floor ``build_cost_graph`` checks a budget against before it prices the edges
    (read off the ``InfeasibleBudget`` a zero budget raises)."""
    space, backend = strategy_space(program, setting)
    with pytest.raises(InfeasibleBudget) as e:
        build_cost_graph(space, (), backend.native_reduce_scatter, True, memory_budget=0.0)
    return e.value.smallest_bytes


@pytest.mark.parametrize("program,setting", CASES)
def test_floor_before_pricing_is_below_the_floor(program, setting):
    """Checked before the edges are priced, without the resharded copies: at most the
    priced request's floor, for both pricings of shared copies, and most of it (the
    arguments and the activations are there)."""
    early = floor_before_pricing(program, setting)
    for request, _ in requests(program, setting):
        floor = memory_floor(request)
        assert 0.5 * floor <= early <= floor * (1 + 1e-12)


def test_budget_the_memory_rules_out_is_never_priced(monkeypatch):
    """Under a budget below the floor before pricing, ``autoshard.plan`` raises
    ``MemoryBudgetError`` with that floor and never prices the edges and shared copies."""
    case = models.train_case("gpt_scan", "tiny")
    early = floor_before_pricing("gpt_scan", "as written")

    def no_price(*_):
        raise AssertionError("priced a graph the memory rules out")
    monkeypatch.setattr(cost_graph, "share_copies", no_price)
    monkeypatch.setattr(cost_graph, "price_groups", no_price)
    with pytest.raises(autoshard.MemoryBudgetError, match="every plan holds at least") as e:
        autoshard.plan(case.train_step, *case.abstract_args(), mesh=mesh_of((2, 4)),
                       hardware=autoshard.H100, memory_budget=early * 0.99, cache=False,
                       progress=False)
    assert e.value.smallest_bytes == early


def random_request(rng) -> Request:
    """A small request of every kind of memory term: group terms (some fixed), terms on
    pairs of groups and on one group's diagonal, a shared copy, random live ranges."""
    sizes = [int(rng.integers(1, 4)) for _ in range(int(rng.integers(2, 5)))]
    groups = range(len(sizes))
    terms = [GroupTerm(g, rng.integers(0, 100, sizes[g]).astype(float)) for g in groups
             for _ in range(int(rng.integers(1, 3)))]
    pairs = [(int(rng.choice(len(sizes))), int(rng.choice(len(sizes))))
             for _ in range(int(rng.integers(0, 3)))]
    edge_terms = [PairTerm(u, v, rng.integers(0, 50, (sizes[u], sizes[v])).astype(float))
                  for u, v in pairs]
    u, v = (int(g) for g in rng.choice(len(sizes), 2))
    shared = [SharedEdgeCost(1e-3, [(u, v, rng.random((sizes[u], sizes[v])) < 0.5)])]
    fixed = [t for t in range(len(terms)) if rng.random() < 0.3]
    live = [t for t in range(len(terms) + len(edge_terms) + 1) if t not in fixed]
    starts = rng.integers(0, 5, len(live))
    ends = starts + rng.integers(0, 4, len(live))
    return Request(node_costs=[rng.random(n) for n in sizes], edges=[],
                   memory_terms=terms + edge_terms + [CopyTerm(0, float(rng.integers(100)))],
                   shared_edge_costs=shared,
                   fixed_terms=fixed,
                   memory_rows=LiveRows(live, starts, ends, sorted(set(ends.tolist()))))


def test_floor_is_below_the_least_peak_of_small_requests():
    """Every choice of random small requests enumerated: the floor is at most the
    least peak; a budget below the floor the solver finds infeasible, and one at the least
    peak it meets."""
    rng = np.random.default_rng(0)
    for _ in range(SMALL_REQUESTS):
        request = random_request(rng)
        everyone = itertools.product(*(range(len(c)) for c in request.node_costs))
        least = min(peak_memory(request, list(c)) for c in everyone)
        floor = memory_floor(request)
        assert floor <= least * (1 + 1e-12)
        if floor > 0:
            with pytest.raises(InfeasibleBudget):
                solve(dataclasses.replace(request, memory_budget=floor * 0.999))
        fitted = solve(dataclasses.replace(request, memory_budget=least))
        assert floor <= fitted.memory_bytes <= least * (1 + 1e-9)


def test_plan_rejects_below_floor_without_solving(monkeypatch):
    """``autoshard.plan`` under a budget below the floor raises ``MemoryBudgetError``
    carrying the floor, and never calls the solver."""
    case = models.train_case("gpt_scan", "tiny")
    mesh = mesh_of((2, 4))
    floor = memory_floor(requests("gpt_scan", "as written")[0][0])

    def no_solve(request, **_):
        raise AssertionError("solved a request the floor rules out")
    monkeypatch.setattr(search, "solve", no_solve)
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
        memory_terms=[GroupTerm(0, np.array([3.0, 7.0])), GroupTerm(1, np.array([5.0, 2.0])),
                      PairTerm(0, 1, np.array([[4.0, 6.0], [1.0, 9.0]])), CopyTerm(0, 100.0)],
        shared_edge_costs=[SharedEdgeCost(1.0, [(0, 1, np.array([[True, False],
                                                                  [False, False]]))])],
        fixed_terms=[0],
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


# -- the microbatches x remat search -------------------------------------------------------

def stack_step(params, batch):
    """A marked loss over a scanned stack of MLP layers whose activations outweigh them."""
    def loss(params, batch):
        def layer(h, w):
            return jnp.tanh(h @ w["up"]) @ w["down"] + h, None
        h, _ = jax.lax.scan(layer, batch["x"], params)
        return jnp.mean((h - batch["y"]) ** 2)
    value, grads = autoshard.value_and_grad(loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def stack_args(layers=4, rows=2048, d=64, f=256):
    shape = jax.ShapeDtypeStruct
    params = {"up": shape((layers, d, f), jnp.float32), "down": shape((layers, f, d), jnp.float32)}
    return params, {"x": shape((rows, d), jnp.float32), "y": shape((rows, d), jnp.float32)}


def compiled_bytes(plan, args) -> int:
    """XLA's memory analysis of the compiled plan: arguments + outputs + temporaries -
    aliased."""
    compiled = plan.jit().lower(*args).compile()
    return hlo_report(compiled, plan.hardware, plan.mesh).memory_bytes


def settings_tried(mesh):
    """The plan ``remat="auto"`` and ``microbatches="auto"`` choose under a budget plans
    without remat miss, and each setting it tried, planned alone under that budget (None
    where the search found it over the budget, and planning it alone must say so; None
    too where the search dropped it as unable to beat the best and no plan of it fits)."""
    args = stack_args()
    plan = functools.partial(autoshard.plan, stack_step, *args, mesh=mesh,
                             hardware=autoshard.H100, cache=False, progress=False)
    budget = 0.7 * plan().cost.memory_bytes
    chosen = plan(memory_budget=budget, microbatches="auto", remat="auto")
    alone = []
    for t in chosen.stats.settings:
        setting = Microbatching(t["microbatches"], tuple(t["replica_axes"]),
                                int(np.prod([mesh.shape[a] for a in t["replica_axes"]])),
                                remat=t["remat"])
        with microbatching(None if setting == Microbatching(1) else setting):
            if t["outcome"].startswith("over budget"):
                with pytest.raises(autoshard.MemoryBudgetError):
                    plan(memory_budget=budget)
                alone.append((t, None))
            elif t["outcome"].startswith("cannot beat"):
                try:
                    alone.append((t, plan(memory_budget=budget)))
                except autoshard.MemoryBudgetError:
                    alone.append((t, None))
            else:
                alone.append((t, plan(memory_budget=budget)))
    return args, budget, chosen, alone


def test_auto_search_drops_only_settings_that_lose(mesh_1d):
    """Under a budget plans without remat miss, the settings the search rejects by the
    floor do not fit when planned alone, those it drops as unable to beat the best are
    no faster planned alone, and the chosen plan is the fastest of those that fit, in
    the budget once compiled too."""
    args, budget, chosen, alone = settings_tried(mesh_1d)
    assert chosen.cost.memory_bytes <= budget and compiled_bytes(chosen, args) <= budget
    assert {t["outcome"].split(":")[0] for t, _ in alone} >= {"fits", "over budget"}
    for t, plan_ in alone:
        if plan_ is not None:
            assert plan_.cost.memory_bytes <= budget
            assert chosen.cost.total_s <= plan_.cost.total_s * (1 + 1e-9), t


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "remat='dots_saveable' in one step planned alone compiles 422 B (3.6 %) over the "
    "budget: XLA copies one loop carry instead of updating it in place, and holds the "
    "backward pass's stack of gradients longer than the memory model does"))
def test_each_setting_planned_alone_fits_once_compiled(mesh_1d):
    args, budget, _, alone = settings_tried(mesh_1d)
    for t, plan_ in alone:
        if plan_ is not None:
            assert compiled_bytes(plan_, args) <= budget, t


def test_solver_gives_up_only_where_no_choice_beats_the_best():
    # two groups of a fast big strategy (1 s, 10 B) and a slow small one (2 s, 1 B), live
    # together under 12 B: the fastest choice regardless of memory (2 s, 20 B) does not
    # fit; the fastest that fits takes 3 s (11 B)
    request = Request(node_costs=[np.array([1.0, 2.0]), np.array([1.0, 2.0])], edges=[],
                      memory_terms=[GroupTerm(0, np.array([10.0, 1.0])),
                                    GroupTerm(1, np.array([10.0, 1.0]))],
                      memory_rows=LiveRows([0, 1], [0, 0], [0, 0], [0]), memory_budget=12.0)
    assert solve(request).objective == pytest.approx(3.0)
    assert solve(dataclasses.replace(request, seconds_to_beat=2.5)).objective == \
        pytest.approx(3.0)   # 2 s regardless of memory might beat 2.5 s: solved
    with pytest.raises(CannotBeat) as info:
        solve(dataclasses.replace(request, seconds_to_beat=1.5))
    assert info.value.lower_bound == pytest.approx(2.0, rel=1e-5)   # less the MIP gap
    roomy = dataclasses.replace(request, memory_budget=20.0, seconds_to_beat=1.5)
    assert solve(roomy).objective == pytest.approx(2.0)   # the fastest fits: returned
