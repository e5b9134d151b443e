"""The solver on hand-built graphs; the expected arithmetic is in the comments."""

import itertools
import time

import numpy as np
import pytest

from autoshard.solver import solve as solve_module
from autoshard.solver.request import (
    CopyTerm,
    GroupTerm,
    LiveRows,
    PairTerm,
    Request,
    SharedEdgeCost,
    Touching,
    evaluate,
    group_seconds,
    peak_memory,
)
from autoshard.solver.solve import InfeasibleBudget, greedy, solve
from autoshard.testing.requests import brute_force


def test_edge_cost_pulls_neighbours_together():
    # g0 costs [1, 2], g1 costs [3, 1]; choosing different strategies costs 5.
    # (0,0)=1+3=4  (1,1)=2+1=3  (0,1)=1+1+5=7  (1,0)=2+3+5=10  -> (1,1), 3 s
    r = Request(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 1.0])],
                edges=[(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))])
    result = solve(r)
    assert list(result.choice) == [1, 1]
    assert result.objective == pytest.approx(3.0)
    assert evaluate(r, [0, 1])[0] == pytest.approx(7.0)


def test_memory_budget_forces_smaller_strategy():
    # As above, but strategy 1 of g0 keeps 10 B resident; the budget is 5 B.
    # (1,1): 10+1=11 B > 5 -> infeasible; (0,0): 1+1=2 B, 4 s is the best that fits.
    r = Request(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 1.0])],
                edges=[(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))],
                memory_terms=[GroupTerm(0, np.array([1.0, 10.0])),
                              GroupTerm(1, np.array([1.0, 1.0]))],
                fixed_terms=[0, 1], memory_budget=5.0)
    result = solve(r)
    assert list(result.choice) == [0, 0]
    assert result.objective == pytest.approx(4.0)
    assert result.memory_bytes == pytest.approx(2.0)


def test_impossible_budget_reports_smallest():
    # The smallest any choice keeps is 1 + 1 = 2 B; a 1.5 B budget cannot be met.
    r = Request(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 1.0])], edges=[],
                memory_terms=[GroupTerm(0, np.array([1.0, 10.0])),
                              GroupTerm(1, np.array([1.0, 1.0]))],
                fixed_terms=[0, 1], memory_budget=1.5)
    with pytest.raises(InfeasibleBudget) as info:
        solve(r)
    assert info.value.smallest_bytes == pytest.approx(2.0)


def test_temporaries_only_count_while_live():
    # Two temporaries (terms 1, 2) never live together; fixed term 0 is 4 B.
    # Row peaks: 4+5=9 and 4+5=9 with strategy 0; budget 10 allows it (cost 0).
    # If they were counted together (4+5+5=14) the budget would force strategy 1.
    r = Request(node_costs=[np.array([0.0, 1.0]), np.array([0.0, 1.0])], edges=[],
                memory_terms=[GroupTerm(0, np.array([4.0, 4.0])),
                              GroupTerm(0, np.array([5.0, 1.0])),
                              GroupTerm(1, np.array([5.0, 1.0]))],
                fixed_terms=[0], memory_rows=[(1,), (2,)], memory_budget=10.0)
    result = solve(r)
    assert list(result.choice) == [0, 0] and result.memory_bytes == pytest.approx(9.0)


def test_chain_of_three_prefers_consistent_specs():
    # Three groups with strategies (replicated, split). Splitting saves 2 s of compute
    # per group but a switch between neighbours costs 3 s. Middle group is pinned to
    # "replicated" through its allowed set: best is all replicated (0) or
    # split-rep-split (6 compute + 6 switch = 12)? replicated everywhere costs 3*4=12,
    # split-rep-split costs 2+4+2 + 3+3 = 14 -> all replicated, 12 s.
    costs = [np.array([4.0, 2.0])] * 3
    switch = np.array([[0.0, 3.0], [3.0, 0.0]])
    r = Request(node_costs=costs, edges=[(0, 1, switch), (1, 2, switch)],
                allowed=[None, np.array([0]), None])
    result = solve(r)
    assert list(result.choice) == [0, 0, 0] and result.objective == pytest.approx(12.0)
    # without the pin: all split, 6 s
    free = solve(Request(node_costs=costs, edges=[(0, 1, switch), (1, 2, switch)]))
    assert list(free.choice) == [1, 1, 1] and free.objective == pytest.approx(6.0)


def test_greedy_matches_ilp_on_a_tree():
    rng = np.random.default_rng(0)
    costs = [rng.uniform(0, 1, 4) for _ in range(6)]
    edges = [(i, i + 1, rng.uniform(0, 1, (4, 4))) for i in range(5)]
    r = Request(node_costs=costs, edges=edges)
    exact = solve(r)
    brute = min(evaluate(r, c)[0] for c in np.ndindex(*(4,) * 6))
    assert exact.objective == pytest.approx(brute)
    # coordinate descent is a local search: on this chain it reaches the optimum
    assert evaluate(r, greedy(r))[0] == pytest.approx(brute)


def test_solve_falls_back_to_greedy_when_the_ilp_finds_nothing(monkeypatch):
    # g0 costs [1, 2], g1 costs [3, 1], different strategies cost 5 (the first test's
    # request): greedy starts at (0, 1) = 7 s, moves g0 to 1 (2 + 1 = 3 s), and stops there.
    r = Request(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 1.0])],
                edges=[(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))])
    for method in ("_milp", "relax_with_reduced_costs"):
        monkeypatch.setattr(solve_module._Ilp, method, lambda self, *a, **k: (None, 1))
    result = solve(r)
    assert result.status == "greedy"
    assert list(result.choice) == list(greedy(r)) == [1, 1]
    assert result.objective == pytest.approx(3.0)


def test_resharded_copy_costs_memory_only_for_the_pair_that_makes_it():
    # g0 is a weight kept sharded (strategy 1, 1 B) or replicated (0, 8 B); g1 reads it
    # whole (0, 1 s) or sliced (1, 5 s). Gathering a sharded weight for a whole reader
    # takes 1 s and makes an 8 B copy; slicing a replicated one makes none (fused).
    #   (0, 0): 1 s, 8 B    (0, 1): 5 s, 8 B    (1, 0): 2 s, 1 + 8 = 9 B    (1, 1): 5 s, 1 B
    # Budget 5 B: only (1, 1) fits; without the copy (1, 0) at 2 s and 1 B would win.
    copy = np.array([[0.0, 0.0], [8.0, 0.0]])
    r = Request(node_costs=[np.zeros(2), np.array([1.0, 5.0])],
                edges=[(0, 1, np.array([[0.0, 0.0], [1.0, 0.0]]))],
                memory_terms=[GroupTerm(0, np.array([8.0, 1.0])), PairTerm(0, 1, copy)],
                fixed_terms=[0], memory_rows=[(1,)], memory_budget=5.0)
    assert evaluate(r, [1, 0]) == (pytest.approx(2.0), pytest.approx(9.0))
    assert evaluate(r, [0, 0])[1] == pytest.approx(8.0)
    result = solve(r)
    assert list(result.choice) == [1, 1]
    assert result.objective == pytest.approx(5.0) and result.memory_bytes == pytest.approx(1.0)
    without = solve(Request(node_costs=r.node_costs, edges=r.edges,
                            memory_terms=r.memory_terms[:1], fixed_terms=[0],
                            memory_budget=5.0))
    assert list(without.choice) == [1, 0]


def test_edge_memory_term_within_one_group_is_its_diagonal():
    # Both ends in group 0 (as after coarsening puts them in one class): strategy s
    # weighs bytes[s, s]: 5 B for strategy 0, 1 B for 1. Budget 2 B forces strategy 1.
    r = Request(node_costs=[np.array([0.0, 1.0])], edges=[],
                memory_terms=[PairTerm(0, 0, np.array([[5.0, 0.0], [0.0, 1.0]]))],
                memory_rows=[(0,)], memory_budget=2.0)
    assert evaluate(r, [0])[1] == pytest.approx(5.0)
    result = solve(r)
    assert list(result.choice) == [1] and result.memory_bytes == pytest.approx(1.0)


def test_memory_terms_on_the_same_pair_share_one_product():
    # Two edge terms on the pair (0, 1) live in different rows: row 0 holds the first
    # (4 B when both pick 0), row 1 the second (6 B when g0 picks 1 and g1 picks 0).
    # Costs favour (1, 0) (0 s), then (0, 0) (1 s), then (1, 1) (2 s); budget 5 B rules
    # out (1, 0) (6 B) but not (0, 0) (4 B).
    first = np.array([[4.0, 0.0], [0.0, 0.0]])
    second = np.array([[0.0, 0.0], [6.0, 0.0]])
    r = Request(node_costs=[np.array([1.0, 0.0]), np.array([0.0, 2.0])], edges=[],
                memory_terms=[PairTerm(0, 1, first), PairTerm(1, 0, second.T)],
                memory_rows=[(0,), (1,)], memory_budget=5.0)
    result = solve(r)
    assert list(result.choice) == [0, 0]
    assert result.objective == pytest.approx(1.0) and result.memory_bytes == pytest.approx(4.0)


def budgeted_request(seed: int, groups: int = 6, strategies: int = 3) -> Request:
    """Random costs, edges, memory terms on live ranges and a resharded copy, under a
    budget halfway between the smallest plan's peak and the unconstrained optimum's."""
    rng = np.random.default_rng(seed)
    edges = []
    for _ in range(8):
        u, v = sorted(rng.choice(groups, 2, replace=False))
        edges.append((int(u), int(v), rng.random((strategies, strategies))))
    terms = [GroupTerm(g, rng.random(strategies) * 10) for g in range(groups)]
    rows = LiveRows(terms=range(1, groups + 1), starts=[*range(1, groups), 0],
                    ends=[*[min(g + 2, groups) for g in range(1, groups)], 1],
                    points=range(groups))
    node_costs = [rng.random(strategies) for _ in range(groups)]
    terms.append(PairTerm(0, 3, rng.random((strategies, strategies)) * 10))
    request = Request(node_costs=node_costs, edges=edges, memory_terms=terms, fixed_terms=[0],
                      memory_rows=rows)
    peaks = [peak_memory(request, c)
             for c in itertools.product(range(strategies), repeat=groups)]
    free = peak_memory(request, solve(request).choice)
    return Request(**{**request.__dict__, "memory_budget": (min(peaks) + free) / 2})


@pytest.mark.parametrize("seed", range(6))
def test_budgeted_optimum_matches_brute_force(seed):
    request = budgeted_request(seed)
    result = solve(request)
    assert result.status == "optimal"
    assert result.objective == pytest.approx(brute_force(request))
    assert result.memory_bytes <= request.memory_budget


@pytest.mark.parametrize("seed", range(6))
def test_priced_plans_fit_and_bound_the_optimum(seed, monkeypatch):
    # without branch and bound, pricing memory alone must still give a plan within the
    # budget, and its lower bound must not exceed the true optimum
    monkeypatch.setattr(solve_module, "EXACT_MAX_VARIABLES", 0)
    request = budgeted_request(seed)
    best = brute_force(request)
    result = solve(request)
    assert result.status in ("optimal", "priced")
    assert result.memory_bytes <= request.memory_budget
    assert result.lower_bound <= best * (1 + 1e-9) <= result.objective * (1 + 1e-9)
    if result.status == "optimal":
        assert result.objective == pytest.approx(best)


def test_a_copy_two_readers_want_is_paid_once():
    # g0 makes a value in spec A (strategy 0; B costs 10 s). Readers g1 and g2 each run
    # in 1 s wanting it in B (strategy 0) or in 3 s taking A (strategy 1). Resharding
    # A -> B is made once for both readers: at 5 s, 5 + 1 + 1 = 7 > 3 + 3, so both take
    # A; at 3 s, 3 + 1 + 1 = 5 < 6, so both take B (paid per reader it would be 8 > 6).
    for copy_s, readers in ((5.0, 1), (3.0, 0)):
        reshard = np.array([[1.0, 0.0], [0.0, 0.0]])   # paid[g0: A, reader: wants B]
        request = Request(node_costs=[np.array([0.0, 10.0]), np.array([1.0, 3.0]),
                                      np.array([1.0, 3.0])], edges=[],
                          shared_edge_costs=[SharedEdgeCost(copy_s, [(0, 1, reshard),
                                                                     (0, 2, reshard)])])
        result = solve(request)
        assert list(result.choice) == [0, readers, readers]
        assert result.objective == pytest.approx(min(copy_s + 2, 6.0))
        assert evaluate(request, [0, 0, 1])[0] == pytest.approx(copy_s + 1 + 3)


@pytest.mark.parametrize("seed", range(4))
def test_shared_edge_costs_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    base = budgeted_request(seed)
    shared = []
    for _ in range(4):
        u = int(rng.integers(6))
        readers = rng.choice([g for g in range(6)], 2, replace=False)
        shared.append(SharedEdgeCost(float(rng.random() * 2),
                                     [(u, int(v), rng.random((3, 3)) < 0.4) for v in readers]))
    request = Request(**{**base.__dict__, "shared_edge_costs": shared})
    result = solve(request)
    assert result.objective == pytest.approx(brute_force(request))
    # and by hand, without evaluate: each shared cost paid once where any reader marks it
    # (both sides above are evaluate's), the cheapest choice within the budget
    assert result.objective == pytest.approx(seconds_by_hand(request, result.choice))
    within = [c for c in itertools.product(range(3), repeat=6)
              if peak_memory(request, c) <= request.memory_budget]
    assert result.objective == pytest.approx(min(seconds_by_hand(request, c) for c in within))


def seconds_by_hand(request: Request, choice) -> float:
    """Groups' and edges' seconds, and each shared edge cost's once if any of its
    members (u, v, paid) has paid[choice[u], choice[v]]."""
    return (sum(costs[s] for costs, s in zip(request.node_costs, choice))
            + sum(m[choice[u], choice[v]] for u, v, m in request.edges)
            + sum(shared.seconds for shared in request.shared_edge_costs
                  if any(paid[choice[u], choice[v]] for u, v, paid in shared.members)))


def test_a_shared_copy_is_held_once_and_only_when_made():
    # the copy of test_a_copy_two_readers_want_is_paid_once at 3 s, now 8 B per device:
    # made (both readers take B), it is held once: 8 B. A budget of 6 B rules it out,
    # and the readers keep A (6 s).
    reshard = np.array([[1.0, 0.0], [0.0, 0.0]])
    request = Request(node_costs=[np.array([0.0, 10.0]), np.array([1.0, 3.0]),
                                  np.array([1.0, 3.0])], edges=[],
                      shared_edge_costs=[SharedEdgeCost(3.0, [(0, 1, reshard), (0, 2, reshard)])],
                      memory_terms=[GroupTerm(0, np.array([0.0, 0.0])), CopyTerm(0, 8.0)],
                      fixed_terms=[0], memory_rows=[(1,)])
    assert evaluate(request, [0, 0, 0]) == (5.0, 8.0)
    assert evaluate(request, [0, 1, 1]) == (6.0, 0.0)
    assert list(solve(request).choice) == [0, 0, 0]
    budgeted = Request(**{**request.__dict__, "memory_budget": 6.0})
    result = solve(budgeted)
    assert list(result.choice) == [0, 1, 1] and result.status == "optimal"


def request_with_shared_costs(seed: int) -> Request:
    """A budgeted request plus latencies and resharded copies paid once for many."""
    rng = np.random.default_rng(seed)
    request = budgeted_request(seed)
    shared = [(float(rng.random()), [(int(g), int(rng.integers(3))) for g in rng.choice(6, 3)])
              for _ in range(3)]
    shared_edges = [SharedEdgeCost(float(rng.random()),
                                   [(0, int(v), rng.random((3, 3)) < 0.4) for v in (1, 2, 2)])
                    for _ in range(2)]
    return Request(**{**request.__dict__, "shared_costs": shared,
                      "shared_edge_costs": shared_edges})


@pytest.mark.parametrize("seed", range(4))
def test_group_seconds_are_the_plan_seconds_of_moving_one_group(seed):
    request = request_with_shared_costs(seed)
    touching = Touching.of(request)
    choice = np.random.default_rng(seed).integers(3, size=6)
    base = evaluate(request, choice)[0]
    for g in range(6):
        seconds = group_seconds(request, choice, g, touching)
        for s in range(3):
            moved = choice.copy()
            moved[g] = s
            assert (evaluate(request, moved)[0] - base
                    == pytest.approx(seconds[s] - seconds[choice[g]], abs=1e-12))


@pytest.mark.parametrize("seed", [4, 9, 14])
def test_polish_lowers_a_priced_plan_within_the_budget(seed):
    # pricing memory alone leaves these plans above the optimum; single moves within the
    # budget bring them down, never above what they were, never over the budget
    request = budgeted_request(seed, groups=7)
    ilp = solve_module._Ilp(request)
    priced, seconds, _ = solve_module.lagrangian(request, ilp, ilp.solve(60)[0],
                                                 time.perf_counter() + 60)
    polished = solve_module.polish(request, priced, time.perf_counter() + 60)
    assert evaluate(request, polished)[0] < seconds - 1e-9
    assert evaluate(request, polished)[0] >= brute_force(request) - 1e-9
    assert peak_memory(request, polished) <= request.memory_budget


def frustrated_request(seed: int, groups: int = 5, strategies: int = 2) -> Request:
    """An odd ring of groups whose edges charge 4 s (and a little noise) for equal
    neighbours, plus random chords. No choice avoids an equal pair on an odd ring, but
    x = 1/2 everywhere avoids every charge: the LP relaxation is fractional, so solving
    needs the incumbent and branch and bound."""
    rng = np.random.default_rng(seed)
    pairs = [(g, (g + 1) % groups) for g in range(groups)]
    pairs += [tuple(rng.choice(groups, 2, replace=False)) for _ in range(2)]
    edges = [(int(u), int(v), 4 * np.eye(strategies) + rng.random((strategies, strategies)))
             for u, v in pairs]
    return Request(node_costs=[rng.random(strategies) for _ in range(groups)], edges=edges)


@pytest.mark.parametrize("seed", range(8))
def test_fractional_relaxation_solved_to_the_optimum(seed):
    request = frustrated_request(seed)
    ilp = solve_module._Ilp(request)
    x, _ = ilp.relax(60.0)
    assert not solve_module.is_integral(x[: ilp.num_x])
    result = solve(request)
    assert result.status == "optimal"
    assert result.objective == pytest.approx(brute_force(request))
    assert result.lower_bound <= result.objective * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_clock_limited_branching_never_returns_worse_than_the_incumbent(seed, monkeypatch):
    # branch and bound stopped by the clock with nothing found: the incumbent built from
    # the relaxation stands, reported as time-limited with the relaxation's bound
    request = frustrated_request(seed)
    best = brute_force(request)
    monkeypatch.setattr(solve_module, "OPTIMALITY_GAP", -1.0)   # always branch
    monkeypatch.setattr(solve_module._Ilp, "branch", lambda self, *a, **k: (None, 1))
    result = solve(request)
    assert result.status == "time_limit"   # the incumbent, not greedy's fallback
    assert result.lower_bound <= best * (1 + 1e-9) <= result.objective * (1 + 1e-9)
    assert result.objective <= evaluate(request, greedy(request))[0] * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_priced_lps_from_the_last_basis_match_cold_ones(seed, monkeypatch):
    # the Lagrangian's LPs differ in their costs alone: each re-solved from the last
    # basis has the optimum of the same LP solved cold through milp, and the pricing
    # reaches the same plan within the budget and the same bound
    request = budgeted_request(seed)
    ilp = solve_module._Ilp(request)
    start = ilp.solve(60)[0]
    priced = solve_module.PricedLp(ilp)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        weights = rng.random(len(request.memory_terms)) * 1e-2
        warm, status = priced.solve(60.0, weights)
        assert status == 0
        warm_objective = ilp.objective_s
        ilp.relax(60.0, ilp.memory_coefficients(weights))
        assert warm_objective == pytest.approx(ilp.objective_s, rel=1e-9, abs=1e-12)
    monkeypatch.setattr(solve_module, "WARM_MIN_VARIABLES", 0)   # warm at any size
    warm = solve_module.lagrangian(request, ilp, start, time.perf_counter() + 60)
    monkeypatch.setattr(solve_module, "highs_core", None)   # every LP cold through milp
    cold = solve_module.lagrangian(request, ilp, start, time.perf_counter() + 60)
    assert warm[1] == pytest.approx(cold[1]) and warm[2] == pytest.approx(cold[2])


@pytest.mark.parametrize("seed", range(4))
def test_relaxation_held_by_highs_has_linprogs_bound_and_reduced_costs(seed, monkeypatch):
    # past WARM_MIN_VARIABLES the unconstrained relaxation is solved in the ILP's own
    # HiGHS instance (whose basis the priced LPs start from): on fractional relaxations,
    # the same bound as linprog's, reduced costs that bound every choice alike, and the
    # same optimum out of solve
    request = frustrated_request(seed)
    cold = solve_module._Ilp(request)
    cold.relax_with_reduced_costs(60.0)
    monkeypatch.setattr(solve_module, "WARM_MIN_VARIABLES", 0)
    held = solve_module._Ilp(request)
    x, status = held.relax_with_reduced_costs(60.0)
    assert status == 0 and not solve_module.is_integral(x[: held.num_x])
    assert held.objective_s == pytest.approx(cold.objective_s, rel=1e-9)
    for choice in itertools.product(range(2), repeat=len(request.node_costs)):
        fixed = sum(held.reduced_costs[held.offsets[g] + s] for g, s in enumerate(choice))
        assert evaluate(request, choice)[0] >= held.objective_s + fixed - 1e-9
    assert solve(request).objective == pytest.approx(brute_force(request))
