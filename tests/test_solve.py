"""The solver on hand-built graphs; the expected arithmetic is in the comments."""

import numpy as np
import pytest

from autoshard.solve import InfeasibleBudget, Request, evaluate, greedy, solve


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
                memory_terms=[(0, np.array([1.0, 10.0])), (1, np.array([1.0, 1.0]))],
                fixed_terms=[0, 1], memory_budget=5.0)
    result = solve(r)
    assert list(result.choice) == [0, 0]
    assert result.objective == pytest.approx(4.0)
    assert result.memory_bytes == pytest.approx(2.0)


def test_impossible_budget_reports_smallest():
    # The smallest any choice keeps is 1 + 1 = 2 B; a 1.5 B budget cannot be met.
    r = Request(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 1.0])], edges=[],
                memory_terms=[(0, np.array([1.0, 10.0])), (1, np.array([1.0, 1.0]))],
                fixed_terms=[0, 1], memory_budget=1.5)
    with pytest.raises(InfeasibleBudget) as info:
        solve(r)
    assert info.value.smallest_bytes == pytest.approx(2.0)


def test_temporaries_only_count_while_live():
    # Two temporaries (terms 1, 2) never live together; fixed term 0 is 4 B.
    # Row peaks: 4+5=9 and 4+5=9 with strategy 0; budget 10 allows it (cost 0).
    # If they were counted together (4+5+5=14) the budget would force strategy 1.
    r = Request(node_costs=[np.array([0.0, 1.0]), np.array([0.0, 1.0])], edges=[],
                memory_terms=[(0, np.array([4.0, 4.0])), (0, np.array([5.0, 1.0])),
                              (1, np.array([5.0, 1.0]))],
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
    assert evaluate(r, greedy(r))[0] >= brute - 1e-12
