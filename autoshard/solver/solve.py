"""solve: pick one strategy per group, minimizing time under a per-device memory budget.

The solver sees only numbers (no jax): a ``request.Request`` of cost vectors, edge
resharding matrices and memory terms; it returns a ``Result``. ``request.evaluation``
prices any choice independently, so tests can check the solver's arithmetic and the plan's
reported cost reads the same sums.

The ILP (scipy.optimize.milp, HiGHS): a binary x[g, s] per group strategy, one-hot per
group; per pair of groups a continuous e[r, c] over the distinct rows and columns of the
pair's matrices (edge costs, and memory that depends on both groups' strategies) whose
marginals equal the x's (so e is the product of the two one-hots).

The relaxation is most often integral; when it is not, an incumbent built from it and
reduced-cost fixing leave branch and bound a small problem (``cheapest``). Under a memory
budget the unconstrained optimum is tried first. When it does not fit,
memory is priced into the objective (Lagrangian relaxation: a few LPs of the same
problem, which stay integral), giving plans within the budget and a lower bound on the
best one. Small problems then add the memory rows the current solution violates, lazily,
until none does (branch and bound); large ones keep the priced plan ("priced").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
from scipy import optimize, sparse

from autoshard.solver import highs
from autoshard.solver.request import (
    CopyTerm,
    GroupTerm,
    LiveRows,
    PairTerm,
    Request,
    Touching,
    allowed_mask,
    evaluate,
    fits,
    group_seconds,
    is_valid,
    peak_memory,
    row_bytes,
    term_values,
    tie_mask,
)

# HiGHS's model interface, for LPs re-solved from their last basis (``PricedLp``); None:
# every LP solved cold through ``optimize.milp``
highs_core = highs.core

SECONDS_SCALE = 1e6     # the ILP works in microseconds
OPTIMALITY_GAP = 1e-4
# Branch and bound over memory rows takes minutes past this many variables, where pricing
# memory takes seconds and lands within a few percent of the relaxation's bound.
EXACT_MAX_VARIABLES = 20_000
MIP_GAP = 1e-6          # branch and bound stops this close (relative) to its bound
# Past this many variables, the Lagrangian's LPs start from the last one's basis: below,
# a cold LP takes milliseconds, and starting afresh keeps the vertex HiGHS's presolve
# picks among equal optima
WARM_MIN_VARIABLES = EXACT_MAX_VARIABLES
# the first slack of reduced-cost fixing, as a fraction of the incumbent's gap to the
# relaxation's bound: the optimum is most often far closer to the bound than greedy
# incumbents are, and a fraction of the gap leaves a far smaller problem
FIRST_SLACK = 0.25
# Branch and bound over the whole gap proves the incumbent optimal, or finds better; where
# the relaxation is far from integral (copies several readers share) that may take many
# times what finding the incumbent took, and it is most often optimal already. The proof
# gets this share of the time spent so far (at least PROOF_MIN_S); past it the incumbent
# is kept ("time_limit", with the relaxation's bound).
PROOF_SHARE = 1.0
PROOF_MIN_S = 1.0
# reduced costs hold to HiGHS's dual feasibility tolerance (1e-7 on costs in
# microseconds); a variable is fixed only past the gap by this much more, relative to the
# incumbent's seconds (far above that tolerance)
REDUCED_COST_TOLERANCE = 1e-6


@dataclasses.dataclass(frozen=True)
class Result:
    choice: np.ndarray            # strategy index per group
    objective: float              # seconds
    memory_bytes: float           # peak per device
    status: str                   # optimal | priced | time_limit | greedy | trivial
    solve_seconds: float = 0.0
    lower_bound: float | None = None   # seconds no choice within the budget beats
    budget_binds: bool = False         # the cheapest choice regardless of memory exceeds it


class CannotBeat(Exception):
    """No choice is cheaper than ``Request.seconds_to_beat``: the cheapest regardless of
    memory (``lower_bound`` seconds) is not."""

    def __init__(self, lower_bound: float):
        super().__init__(f"no choice is cheaper than {lower_bound:.6g} s")
        self.lower_bound = lower_bound


class InfeasibleBudget(Exception):
    def __init__(self, smallest_bytes: float):
        super().__init__(
            f"no choice fits the memory budget; smallest reached {smallest_bytes:.4g} B")
        self.smallest_bytes = smallest_bytes


def greedy(request: Request) -> np.ndarray:
    """Cheapest strategy per group, then coordinate descent over neighbours."""
    choice = np.array([int(np.argmin(np.where(allowed_mask(request, g), c, np.inf)))
                       for g, c in enumerate(request.node_costs)])
    by_group: dict[int, list] = {}
    for u, v, m in request.edges:
        by_group.setdefault(u, []).append((v, m, False))
        by_group.setdefault(v, []).append((u, m, True))
    for _ in range(4):
        changed = False
        for g, cost in enumerate(request.node_costs):
            total = np.where(allowed_mask(request, g), cost, np.inf).astype(float)
            for other, m, transposed in by_group.get(g, ()):
                total = total + (m[choice[other], :] if transposed else m[:, choice[other]])
            best = int(np.argmin(total))
            if total[best] < total[choice[g]] - 1e-15:
                choice[g], changed = best, True
        if not changed:
            break
    return tie_up(request, choice)


def tie_up(request: Request, choice: np.ndarray) -> np.ndarray:
    """Move each tied group u to a strategy whose key matches v's choice, if it has one."""
    for u, v, keys_u, keys_v in request.ties:
        if keys_u[choice[u]] != keys_v[choice[v]]:
            matches = np.flatnonzero(keys_u == keys_v[choice[v]])
            if len(matches):
                choice[u] = int(min(matches, key=lambda s: request.node_costs[u][s]))
    return choice


POLISH_PASSES = 4


def polish(request: Request, choice: np.ndarray, deadline: float,
           budget: bool = True) -> np.ndarray:
    """Local search on a plan within the budget: move one group at a time to the cheapest
    strategy that lowers the plan's seconds and keeps it within the budget (when
    ``budget``). Pricing memory leaves such moves where the rounded relaxation
    overshot; rounding a fractional relaxation leaves them too."""
    choice, touching = choice.copy(), Touching.of(request)
    for _ in range(POLISH_PASSES):
        moved = False
        for g in range(len(request.node_costs)):
            if len(request.node_costs[g]) == 1:
                continue
            seconds = np.where(tie_mask(request, choice, g),
                               group_seconds(request, choice, g, touching), np.inf)
            now = seconds[choice[g]]
            if not np.isfinite(now):   # a tie ``choice`` breaks: no move keeps it
                continue
            for s in np.argsort(seconds, kind="stable")[:3]:
                if not seconds[s] < now - 1e-9 * max(abs(now), 1e-12):
                    break
                trial = choice.copy()
                trial[g] = s
                if not budget or fits(request, trial):
                    choice, moved = trial, True
                    break
            if time.perf_counter() > deadline:
                return choice
        if not moved:
            break
    return choice


def smallest_memory_choice(request: Request) -> np.ndarray:
    bytes_per_group = [np.zeros(len(c)) for c in request.node_costs]
    for term in request.memory_terms:
        if isinstance(term, GroupTerm):
            bytes_per_group[term.group] = bytes_per_group[term.group] + term.num_bytes
        elif isinstance(term, PairTerm) and term.u == term.v:
            bytes_per_group[term.u] = bytes_per_group[term.u] + np.diag(term.num_bytes)
    return np.array([int(np.argmin(np.where(allowed_mask(request, g), b, np.inf)))
                     for g, b in enumerate(bytes_per_group)])


def _pairs(request: Request):
    """Per pair of distinct groups (u, v): the summed cost matrix of its edges, the edge
    memory terms [(term, bytes[su, sv])] on it and the shared edge costs
    [(index, paid[su, sv])] on it, in order of first appearance."""
    costs: dict[tuple[int, int], np.ndarray] = {}
    memory: dict[tuple[int, int], list] = {}
    shared: dict[tuple[int, int], list] = {}

    def oriented(u, v, m, dtype=None):   # terms as they come: they are stacked as floats
        m = np.asarray(m, dtype)
        return ((u, v), m) if u < v else ((v, u), m.T)
    for u, v, m in request.edges:
        key, m = oriented(u, v, m, float)
        costs[key] = costs[key] + m if key in costs else m
    for t, (u, v, m) in request.terms_of(PairTerm):
        if u != v:
            key, m = oriented(u, v, m)
            memory.setdefault(key, []).append((t, m))
    for k, (_, members) in enumerate(request.shared_edge_costs):
        for u, v, paid in members:
            if u != v:
                key, paid = oriented(u, v, paid)
                shared.setdefault(key, []).append((k, paid))
    for key in dict.fromkeys([*costs, *memory, *shared]):
        u, v = key
        shape = (len(request.node_costs[u]), len(request.node_costs[v]))
        yield key, costs.get(key, np.zeros(shape)), memory.get(key, []), shared.get(key, [])


def _classes(matrices: Sequence[np.ndarray], rows: np.ndarray, cols: np.ndarray):
    """Rows ``rows`` (strategies of u) alike in every matrix of ``matrices`` ([u, v] each)
    form a class, and so do columns ``cols``; every matrix is constant on each (row class,
    column class) block. Returns the class of each row and column and each matrix reduced
    to one entry per block ([row class, column class])."""
    # copies of one matrix (a layer's terms, once per layer) tell rows apart no better:
    # each distinct matrix is cut to ``rows`` x ``cols`` and compared once
    index: dict[tuple, int] = {}   # distinct matrices, numbered in order of appearance
    of_id: dict[int, int] = {}
    which, firsts = [], []
    for m in matrices:
        if id(m) not in of_id:
            a = np.asarray(m)
            of_id[id(m)] = index.setdefault((a.dtype.str, a.shape, a.tobytes()), len(index))
            if of_id[id(m)] == len(firsts):
                firsts.append(a)
        which.append(of_id[id(m)])
    distinct = np.stack([np.asarray(a, float) for a in firsts])
    if len(rows) < distinct.shape[1]:
        distinct = distinct[:, rows]
    if len(cols) < distinct.shape[2]:
        distinct = distinct[:, :, cols]
    row_of, rep_rows = _row_classes(distinct.transpose(1, 0, 2).reshape(len(rows), -1))
    col_of, rep_cols = _row_classes(distinct[:, rep_rows].transpose(2, 0, 1)
                                    .reshape(len(cols), -1))
    reduced = distinct[:, rep_rows][:, :, rep_cols]
    return row_of, col_of, [reduced[k] for k in which]


def _row_classes(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``m``, its class (equal rows, one class; numbered in the rows' sorted
    order, as ``np.unique(m, axis=0)`` numbers them), and the first row of each class."""
    m = np.ascontiguousarray(m, dtype=float)
    seen: dict[bytes, int] = {}
    first = np.array([seen.setdefault(row.tobytes(), i) for i, row in enumerate(m)])
    reps = np.array(list(seen.values()))
    distinct = m[reps]
    telling = distinct[:, (distinct != distinct[:1]).any(axis=0)]   # equal columns tie
    order = np.lexsort(telling.T[::-1]) if telling.shape[1] else np.arange(len(reps))
    rank = np.empty(len(m), dtype=np.int64)
    rank[reps[order]] = np.arange(len(reps))
    return rank[first], reps[order]


def is_integral(x: np.ndarray, tolerance: float = 1e-6) -> bool:
    return bool(np.all(np.minimum(np.abs(x), np.abs(1 - x)) <= tolerance))


class _Ilp:
    """Variables and constraints of the ILP, built once; memory rows appended lazily."""

    def __init__(self, request: Request):
        self.request = request
        self.offsets = np.cumsum([0] + [len(c) for c in request.node_costs])
        self.num_x = int(self.offsets[-1])
        cost = [np.asarray(c, float) * SECONDS_SCALE for c in request.node_costs]
        rows, cols, vals = [], [], []
        num_groups = len(request.node_costs)
        # (rows, cols, vals) of the rows built here, as arrays; one-hot per group first
        blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [(
            np.repeat(np.arange(num_groups), np.diff(self.offsets)), np.arange(self.num_x),
            np.ones(self.num_x))]
        lower, upper = [1.0] * num_groups, [1.0] * num_groups
        row = num_groups
        edge_costs = []
        next_var = self.num_x
        self.edge_memory: dict[int, tuple[int, np.ndarray]] = {}   # term -> (base, e bytes)
        # shared edge cost k is paid through y_k >= every member's marked products
        shared_rows: list[tuple[int, np.ndarray]] = []
        for (u, v), m, memory, shared in _pairs(request):
            # only allowed strategies get product variables: the others are 0 anyway
            su = np.flatnonzero(allowed_mask(request, u))
            sv = np.flatnonzero(allowed_mask(request, v))
            row_of, col_of, (cost_keys, *keys) = _classes(
                [m] + [b for _, b in memory] + [p for _, p in shared], su, sv)
            r_n, c_n = cost_keys.shape
            base = next_var
            edge_costs.append(cost_keys.ravel() * SECONDS_SCALE)
            for (t, _), term_keys in zip(memory, keys):
                self.edge_memory[t] = (base, term_keys.ravel())
            for (k, _), paid_keys in zip(shared, keys[len(memory):]):
                shared_rows.append((k, base + np.flatnonzero(paid_keys.ravel())))
            next_var += r_n * c_n
            # sum_c e[r, c] = sum of x[u, s] with row(s) = r, then
            # sum_r e[r, c] = sum of x[v, t] with column(t) = c
            e_row, e_col = np.divmod(np.arange(r_n * c_n), c_n)
            e_vars = np.arange(base, base + r_n * c_n)
            for e_of, classes, strategies, g, num in ((e_row, row_of, su, u, r_n),
                                                       (e_col, col_of, sv, v, c_n)):
                blocks.append((np.concatenate([row + e_of, row + classes]),
                               np.concatenate([e_vars, self.offsets[g] + strategies]),
                               np.repeat([1.0, -1.0], [len(e_vars), len(strategies)])))
                lower.extend([0.0] * num); upper.extend([0.0] * num); row += num
        shared_costs = []
        for seconds, members in request.shared_costs:   # y >= sum_s x[g, s] per group
            by_group: dict[int, list[int]] = {}
            for g, s in members:
                by_group.setdefault(g, []).append(s)
            for g, strategies in by_group.items():
                rows.append(row); cols.append(next_var); vals.append(1.0)
                for s in strategies:
                    rows.append(row); cols.append(self.offsets[g] + s); vals.append(-1.0)
                lower.append(0.0); upper.append(np.inf); row += 1
            shared_costs.append(np.array([seconds * SECONDS_SCALE]))
            next_var += 1
        for k, (_, members) in enumerate(request.shared_edge_costs):   # within one group
            for u, v, paid in members:
                if u == v:
                    shared_rows.append((k, np.flatnonzero(np.diag(paid)) + self.offsets[u]))
        first_y = self.first_shared_y = next_var
        for k, marked in shared_rows:   # y_k >= sum of the member's marked products
            rows.append(row); cols.append(first_y + k); vals.append(1.0)
            rows.extend([row] * len(marked)); cols.extend(marked.tolist())
            vals.extend([-1.0] * len(marked))
            lower.append(0.0); upper.append(np.inf); row += 1
        shared_costs.append(np.array([seconds * SECONDS_SCALE
                                      for seconds, _ in request.shared_edge_costs]))
        next_var += len(request.shared_edge_costs)
        for u, v, keys_u, keys_v in request.ties:   # sum of x with key k equal on both sides
            for k in np.union1d(keys_u, keys_v):
                for s in np.flatnonzero(keys_u == k):
                    rows.append(row); cols.append(self.offsets[u] + s); vals.append(1.0)
                for t in np.flatnonzero(keys_v == k):
                    rows.append(row); cols.append(self.offsets[v] + t); vals.append(-1.0)
                lower.append(0.0); upper.append(0.0); row += 1
        self.num_vars = next_var
        self.cost = np.concatenate(cost + edge_costs + shared_costs)
        self.rows, self.cols, self.vals = rows, cols, vals
        self.blocks = blocks   # entries beside rows/cols/vals (memory rows, appended)
        self.lower, self.upper, self.num_rows = lower, upper, row
        self.integrality = np.zeros(self.num_vars)
        self.integrality[: self.num_x] = 1
        self._highs = None   # the relaxation held by HiGHS, with its last basis (``lp``)
        self.var_upper = np.ones(self.num_vars)
        for g in range(len(request.node_costs)):
            mask = allowed_mask(request, g)
            self.var_upper[self.offsets[g]: self.offsets[g + 1]] = mask.astype(float)

    def memory_coefficients(self, weights: np.ndarray) -> np.ndarray:
        """Per variable, the sum over memory terms of weight x bytes: a term's bytes sit on
        its group's x, or on its pair's product e (edge terms), or on the diagonal of its
        one group's x, or on a shared copy's y."""
        coeff = np.zeros(self.num_vars)
        for t in np.flatnonzero(weights):
            w, term = float(weights[t]), self.request.memory_terms[t]
            if isinstance(term, CopyTerm):   # a shared copy: on its y
                coeff[self.first_shared_y + term.copy] += w * float(term.num_bytes)
            elif isinstance(term, GroupTerm):
                g = term.group
                coeff[self.offsets[g]: self.offsets[g + 1]] += w * np.asarray(term.num_bytes,
                                                                               float)
            elif t in self.edge_memory:
                base, keys = self.edge_memory[t]
                coeff[base: base + len(keys)] += w * keys
            else:   # a pair term on one group: its diagonal
                g = term.u
                coeff[self.offsets[g]: self.offsets[g + 1]] += w * np.diag(term.num_bytes)
        return coeff

    def add_memory_row(self, terms: Sequence[int]):
        weights = np.zeros(len(self.request.memory_terms))
        np.add.at(weights, np.asarray(list(self.request.fixed_terms) + list(terms), np.int64),
                  1.0 / self.request.memory_budget)   # rows are normalized by the budget
        coeff = self.memory_coefficients(weights)
        for key in np.flatnonzero(coeff):
            self.rows.append(self.num_rows); self.cols.append(int(key))
            self.vals.append(float(coeff[key]))
        self.lower.append(-np.inf)
        self.upper.append(1.0)
        self.num_rows += 1
        self._highs = None

    def solve(self, time_limit_s: float, extra_cost: np.ndarray | None = None,
              rounded: bool = False):
        """(choice, HiGHS status). ``extra_cost`` is added to the objective (in seconds);
        ``rounded`` takes a fractional relaxation's largest x per group instead of
        branching."""
        x, status = self.relax(time_limit_s, extra_cost)
        if not rounded and (x is None or not is_integral(x[: self.num_x])):
            x, status = self.branch(time_limit_s, extra_cost)
        if x is None:
            return None, status
        return self.choice_of(x), status

    def matrix(self) -> sparse.csr_array:
        rows, cols, vals = (
            np.concatenate([np.asarray(listed, dtype)] + [b[k] for b in self.blocks])
            for k, (listed, dtype) in enumerate(((self.rows, np.int64), (self.cols, np.int64),
                                                 (self.vals, float))))
        return sparse.csr_array((vals, (rows, cols)), shape=(self.num_rows, self.num_vars))

    def objective(self, extra_cost: np.ndarray | None) -> np.ndarray:
        return self.cost if extra_cost is None else self.cost + extra_cost * SECONDS_SCALE

    def _milp(self, time_limit_s: float, extra_cost, integrality=None, upper=None, **options):
        res = optimize.milp(self.objective(extra_cost),
                            constraints=optimize.LinearConstraint(self.matrix(), self.lower,
                                                                  self.upper),
                            bounds=optimize.Bounds(0, self.var_upper if upper is None else upper),
                            integrality=integrality,
                            options={"time_limit": max(time_limit_s, 1.0), "presolve": True,
                                     **options})
        if res.x is not None:
            self.objective_s = res.fun / SECONDS_SCALE   # a lower bound when relaxed
        return res.x, res.status

    def relax(self, time_limit_s: float, extra_cost: np.ndarray | None = None):
        """The LP relaxation: (every variable's value or None, HiGHS status). The
        relaxation of a sharding ILP is most often integral already: then it is the ILP's
        optimum, found at the price of one LP instead of branch and bound."""
        return self._milp(time_limit_s, extra_cost)

    def relax_with_reduced_costs(self, time_limit_s: float):
        """The LP relaxation as ``relax``, keeping its reduced costs in seconds
        (``self.reduced_costs``): a choice that sets a variable to 1 costs at least the
        relaxation's objective plus that variable's reduced cost.

        HiGHS's presolve is off: on these relaxations (one-hot rows, edge products tied to
        their groups by equalities) it removes little and its reductions and postsolve
        cost more than they save. A coarsened GPT's relaxation (15k rows, 120k variables)
        solves in half the time without it, to the same solution.

        Past ``WARM_MIN_VARIABLES``, solved in ``lp()``, whose basis the Lagrangian's LPs
        then start from (``PricedLp``)."""
        if self.num_vars > WARM_MIN_VARIABLES and highs_core is not None:
            x, status = lp_solve(self.lp(), time_limit_s, self.cost)
            if x is not None:
                self.objective_s = lp_objective_s(self.lp())
                self.reduced_costs = (np.asarray(self.lp().getSolution().col_dual)
                                      / SECONDS_SCALE)
            return x, status
        a_ub, b_ub, a_eq, b_eq = self.linprog_rows()
        res = optimize.linprog(self.cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq,
                               bounds=np.stack([np.zeros(self.num_vars), self.var_upper], 1),
                               method="highs-ds",
                               options={"time_limit": max(time_limit_s, 1.0),
                                        "presolve": False})
        if res.x is None:
            return None, res.status
        self.objective_s = res.fun / SECONDS_SCALE
        self.reduced_costs = (res.lower.marginals + res.upper.marginals) / SECONDS_SCALE
        return res.x, res.status

    def linprog_rows(self):
        """The rows as ``linprog`` takes them: (A_ub, b_ub, A_eq, b_eq), rows bounded below
        negated."""
        a, lower, upper = self.matrix(), np.asarray(self.lower), np.asarray(self.upper)
        equal = lower == upper
        above, below = ~equal & np.isfinite(lower), ~equal & np.isfinite(upper)
        return (sparse.vstack([-a[above], a[below]]),
                np.concatenate([-lower[above], upper[below]]), a[equal], lower[equal])

    def lp(self):
        """The relaxation held by HiGHS (scipy's bindings), built once: each solve starts
        from the last one's basis."""
        if self._highs is None:
            self._highs = highs_model(self)
        return self._highs

    def branch(self, time_limit_s: float, extra_cost: np.ndarray | None = None,
               excluded: np.ndarray | None = None):
        """The ILP by branch and bound: (every variable's value or None, HiGHS status).
        Variables ``excluded`` (a mask) are held at 0."""
        upper = None if excluded is None else np.where(excluded, 0.0, self.var_upper)
        return self._milp(time_limit_s, extra_cost, self.integrality, upper,
                          mip_rel_gap=MIP_GAP)

    def choice_of(self, x: np.ndarray) -> np.ndarray:
        """Per group, the strategy with the largest x (the one chosen when x is integral)."""
        return np.array([int(np.argmax(x[self.offsets[g]: self.offsets[g + 1]]))
                         for g in range(len(self.offsets) - 1)])

    def support(self, x: np.ndarray, tolerance: float = 1e-6) -> list[np.ndarray]:
        """Per group, the strategies a relaxed solution ``x`` gives any weight."""
        return [np.flatnonzero(x[self.offsets[g]: self.offsets[g + 1]] > tolerance)
                for g in range(len(self.offsets) - 1)]


def term_prices(request: Request, row_prices: np.ndarray) -> np.ndarray:
    """Per memory term, the summed price of the rows it is counted in."""
    prices = np.zeros(len(request.memory_terms))
    rows = request.memory_rows
    if isinstance(rows, LiveRows):
        n = len(rows.points)
        through = np.concatenate([[0.0], np.cumsum(row_prices[:n])])
        np.add.at(prices, rows.terms, through[rows.last] - through[rows.first])
        for r, terms in enumerate(rows.explicit):
            np.add.at(prices, np.asarray(terms, np.int64), row_prices[n + r])
    else:
        for r, terms in enumerate(rows):
            np.add.at(prices, np.asarray(terms, np.int64), row_prices[r])
    if len(request.fixed_terms):
        np.add.at(prices, np.asarray(request.fixed_terms, np.int64), row_prices.sum())
    return prices


LAGRANGE_ROUNDS = 12


def lagrangian(request: Request, ilp: _Ilp, choice: np.ndarray, deadline: float,
               visited: list | None = None):
    """Memory priced into the objective instead of constrained (Lagrangian relaxation).

    Row prices are a shape (where memory runs over: the violations seen so far, summed)
    times a level, searched by bisection: raised while the plan runs over the budget,
    lowered once it fits. Every priced problem is the unconstrained one, whose relaxation
    is most often integral, and differs from the last in its costs alone (``PricedLp``).
    Returns (best choice within the budget or None, its seconds, a lower bound on the
    budgeted optimum in seconds); appends every choice it prices to ``visited``."""
    budget = request.memory_budget
    priced = PricedLp(ilp, warm=ilp.num_vars > WARM_MIN_VARIABLES)
    unit = max(evaluate(request, choice)[0], 1e-9) / budget   # the budget costs a plan
    shape = np.zeros(len(row_bytes(request, choice)))
    best, best_seconds, bound = None, np.inf, 0.0
    level, low, high = 0.0, 0.0, np.inf     # ``choice`` is the plan at level 0
    for _ in range(LAGRANGE_ROUNDS):
        if visited is not None:
            visited.append(choice)
        over = row_bytes(request, choice) / budget - 1
        if over.max() <= 1e-9:
            seconds = evaluate(request, choice)[0]
            if seconds < best_seconds:
                best, best_seconds = choice.copy(), seconds
            high = min(high, level)
        else:
            low = max(low, level)
            shape += np.maximum(over, 0) / np.maximum(over, 0).sum()
        if np.isinf(high):
            level = max(level * 4, 1.0)
        else:
            level = np.sqrt(low * high) if low > 0 else high / 4
        if time.perf_counter() > deadline or high <= low * 1.01:
            break
        row_prices = level * unit * shape / shape.sum()
        candidate, status = priced.solve(deadline - time.perf_counter(),
                                          term_prices(request, row_prices))
        if candidate is None:
            break
        choice = candidate
        if status == 0:
            bound = max(bound, ilp.objective_s - row_prices.sum() * budget)
    return best, best_seconds, bound


class PricedLp:
    """The LP relaxation of ``ilp`` under changing costs. ``warm``: each solve starts from
    the last one's optimal basis (the unconstrained relaxation's first, where ``cheapest``
    solved it in ``ilp.lp()``), where the Lagrangian's LPs, which differ in their memory
    prices alone, need a fraction of a cold solve's simplex iterations (a tenth of its
    time on a 70e9-parameter train step); else, or where scipy's HiGHS bindings are not
    at hand, each is solved cold (``_Ilp.solve``)."""

    def __init__(self, ilp: _Ilp, warm: bool = True):
        self.ilp = ilp
        self.warm = warm and highs_core is not None

    def solve(self, time_limit_s: float, weights: np.ndarray):
        """(a choice, or None; milp's status: 0 optimal, 1 out of time, 2 infeasible, 4
        other) of the problem with memory term t priced at ``weights[t]`` seconds per
        byte: the relaxation's, where it is integral. Where it is fractional, its largest
        x per group can be far from any good choice (slower and larger than the plans on
        either side of the price); then the ILP restricted to the strategies the
        relaxation weighs is solved too, in half the time left, and the cheaper of the
        two under the prices kept (``priced_seconds``)."""
        started = time.perf_counter()
        extra_cost = self.ilp.memory_coefficients(weights)
        if self.warm:
            x, status = lp_solve(self.ilp.lp(), time_limit_s, self.ilp.objective(extra_cost))
            if x is not None:
                self.ilp.objective_s = lp_objective_s(self.ilp.lp())
        else:
            x, status = self.ilp.relax(time_limit_s, extra_cost)
        if x is None:
            return None, status
        choice, weighed = self.ilp.choice_of(x), x[: self.ilp.num_x]
        if is_integral(weighed):
            return choice, status
        request = self.ilp.request
        restricted = _Ilp(dataclasses.replace(request, allowed=self.ilp.support(weighed)))
        remaining = time_limit_s - (time.perf_counter() - started)
        found, _ = restricted.solve(remaining / 2, restricted.memory_coefficients(weights))
        candidates = [c for c in (choice, found) if c is not None and is_valid(request, c)]
        if candidates:
            choice = min(candidates, key=lambda c: priced_seconds(request, c, weights))
        return choice, status


def priced_seconds(request: Request, choice, weights: np.ndarray) -> float:
    """A choice's seconds plus its memory terms' bytes at ``weights`` seconds per byte."""
    return evaluate(request, choice)[0] + float(weights @ term_values(request, choice))


# HiGHS model statuses as milp's: 0 optimal, 1 out of time or iterations, 2 infeasible
HIGHS_STATUS = {"kOptimal": 0, "kTimeLimit": 1, "kIterationLimit": 1, "kInfeasible": 2}


def lp_solve(highs, time_limit_s: float, cost: np.ndarray):
    """(every variable's value or None, milp's status) of the LP ``highs`` holds, with
    objective ``cost`` (microseconds), from its last basis."""
    highs.setOptionValue("time_limit", max(time_limit_s, 1.0))
    highs.changeColsCost(len(cost), np.arange(len(cost), dtype=np.int32), cost)
    highs.run()
    status = HIGHS_STATUS.get(highs.getModelStatus().name, 4)
    if status != 0:
        return None, status
    return np.asarray(highs.getSolution().col_value), 0


def lp_objective_s(highs) -> float:
    return highs.getInfo().objective_function_value / SECONDS_SCALE


def highs_model(ilp: _Ilp):
    """A HiGHS instance holding ``ilp``'s relaxation as ``linprog`` poses it in
    ``_Ilp.relax_with_reduced_costs`` (its rows in that order, one-sided rows as upper
    bounds, then the equalities; dual simplex, no presolve), so that it lands on the
    optimum linprog does; quiet."""
    a_ub, b_ub, a_eq, b_eq = ilp.linprog_rows()
    return highs.lp_instance(ilp.cost, ilp.var_upper,
                             sparse.csc_array(sparse.vstack([a_ub, a_eq])),
                             np.concatenate([np.full(len(b_ub), -np.inf), b_eq]),
                             np.concatenate([b_ub, b_eq]))


def solve(request: Request, within_budget: bool = True) -> Result:
    """Cheapest choice within the memory budget (ILP), best found on time limit.

    The unconstrained problem first: if its optimum fits, it is the answer. Otherwise
    memory is priced in (``lagrangian``), which finds plans within the budget in a few
    LPs and a lower bound on the best one; when they do not meet, the memory rows the
    current choice violates are added to the ILP until none is, while time remains.

    ``within_budget=False`` stops at the unconstrained optimum where it does not fit
    (``budget_binds``), after ``CannotBeat``: for a caller that then solves the request
    with memory priced otherwise."""
    start = time.perf_counter()
    deadline = start + request.time_limit_s
    if all(len(c) == 1 for c in request.node_costs):
        choice = np.zeros(len(request.node_costs), int)
        seconds, peak = evaluate(request, choice)
        if request.memory_budget is not None and peak > request.memory_budget:
            raise InfeasibleBudget(peak)
        return Result(choice, seconds, peak, "trivial", time.perf_counter() - start, seconds,
                      False)
    ilp = _Ilp(request)
    choice, status_name, bound = cheapest(request, ilp, deadline)
    if request.memory_budget is None or fits(request, choice):
        return finish(request, choice, status_name, start, bound, budget_binds=False)
    cannot_go_below = evaluate(request, choice)[0] if status_name == "optimal" else bound
    if (request.seconds_to_beat is not None and cannot_go_below is not None
            and cannot_go_below * (1 - MIP_GAP) >= request.seconds_to_beat):
        raise CannotBeat(cannot_go_below * (1 - MIP_GAP))
    if not within_budget:
        return finish(request, choice, status_name, start, bound)
    visited: list = []
    best, best_seconds, bound = lagrangian(request, ilp, choice, deadline, visited)
    if best is not None and best_seconds <= bound * (1 + OPTIMALITY_GAP):
        return finish(request, best, "optimal", start, bound)
    if best is not None:
        mixed = recombined(request, visited, deadline)
        mixed_seconds = np.inf if mixed is None else evaluate(request, mixed)[0]
        if mixed_seconds < best_seconds:
            best, best_seconds = mixed, mixed_seconds
    if best is None or ilp.num_vars <= EXACT_MAX_VARIABLES:
        exact = add_violated_rows(request, ilp, choice, deadline)
        if exact is not None and (best is None or evaluate(request, exact[0])[0] <= best_seconds):
            return finish(request, *exact, start, bound)
    if best is None:
        smallest = peak_memory(request, smallest_memory_choice(request))
        raise InfeasibleBudget(min(smallest, peak_memory(request, choice)))
    return finish(request, polish(request, best, deadline), "priced", start, bound)


def recombined(request: Request, plans: Sequence[np.ndarray], deadline: float):
    """The cheapest choice within the budget that takes each group's strategy from one of
    ``plans`` (the Lagrangian's, over the budget and within it), or None: the ILP over
    those few strategies a group, its memory rows added as they are violated. Pricing
    memory finds plans on either side of the budget, and the budgeted optimum often
    mixes them (one layer's layout from one, the rest from the other), which no price
    makes optimal and moving one group at a time (``polish``) does not reach."""
    allowed = [np.unique([plan[g] for plan in plans]) for g in range(len(request.node_costs))]
    mixed = dataclasses.replace(request, allowed=allowed)
    cheapest_plan = min(plans, key=lambda plan: evaluate(request, plan)[0])
    found = add_violated_rows(mixed, _Ilp(mixed), cheapest_plan, deadline)
    return None if found is None or not is_valid(request, found[0]) else found[0]


def cheapest(request: Request, ilp: _Ilp, deadline: float):
    """The cheapest choice regardless of memory: (choice, status, lower bound in seconds).

    The LP relaxation first; when it is fractional, an incumbent is built from it before
    branching (its rounding and greedy's, polished by local search; the ILP over the
    strategies the relaxation gives weight, a small problem), so that branch and bound,
    limited by the clock, never returns worse than that. The relaxation's objective bounds
    every choice from below, and its reduced costs rule out most variables before
    branching (``fixed_by_reduced_costs``)."""
    started = time.perf_counter()
    x, status = ilp.relax_with_reduced_costs(deadline - started)
    if x is None:
        if status == 2:  # infeasible
            raise InfeasibleBudget(peak_memory(request, smallest_memory_choice(request)))
        return greedy(request), "greedy", None
    if is_integral(x[: ilp.num_x]):
        return ilp.choice_of(x), "optimal" if status == 0 else "time_limit", None
    bound = ilp.objective_s if status == 0 else 0.0
    best = incumbent(request, ilp, x, deadline)
    best_seconds = np.inf if best is None else evaluate(request, best)[0]
    if best_seconds <= bound * (1 + MIP_GAP):
        return best, "optimal", bound
    if status != 0 or best is None:   # no reduced costs to trust, or nothing to beat
        x, status = ilp.branch(deadline - time.perf_counter())
        if x is not None and evaluate(request, ilp.choice_of(x))[0] <= best_seconds:
            return ilp.choice_of(x), "optimal" if status == 0 else "time_limit", bound
        return (greedy(request), "greedy", bound) if best is None else (best, "time_limit",
                                                                         bound)
    return fixed_by_reduced_costs(request, ilp, best, bound, deadline, started)


def fixed_by_reduced_costs(request: Request, ilp: _Ilp, best: np.ndarray, bound: float,
                           deadline: float, started: float):
    """Branch and bound on what reduced costs leave: (choice, status, lower bound).

    A choice costs at least the relaxation's ``bound`` plus the reduced cost of every
    variable it sets, so one costing at most ``bound + slack`` sets no variable whose
    reduced cost exceeds ``slack``: holding those at 0 loses none of them, and most
    products of two groups' strategies are such. A small slack first (a fraction of the
    incumbent's gap, a smaller problem): its optimum is the optimum if it is within the
    slack; else the slack widens to the gap of the best choice found, which is exact, and
    given a share of the time spent since ``started`` (``PROOF_SHARE``): past it, the best
    choice found is kept, with the relaxation's bound."""
    best_seconds = evaluate(request, best)[0]
    for fraction in (FIRST_SLACK, 1.0):
        slack = (best_seconds - bound) * fraction
        tolerance = REDUCED_COST_TOLERANCE * best_seconds
        now = time.perf_counter()
        limit = deadline if fraction < 1.0 else min(
            deadline, now + max(PROOF_MIN_S, PROOF_SHARE * (now - started)))
        x, status = ilp.branch(limit - now, excluded=ilp.reduced_costs > slack + tolerance)
        if x is not None and evaluate(request, ilp.choice_of(x))[0] < best_seconds:
            best = ilp.choice_of(x)
            best_seconds = evaluate(request, best)[0]
        if status == 0 and best_seconds - bound <= slack + tolerance:
            return best, "optimal", bound   # every cheaper choice was in the problem
        if status not in (0, 2):   # 2: nothing within the slack
            break
    return best, "time_limit", bound


def incumbent(request: Request, ilp: _Ilp, x: np.ndarray, deadline: float) -> np.ndarray:
    """A good choice from a fractional relaxation ``x``: the best of its rounding and
    greedy's, each polished, and the ILP restricted to the strategies ``x`` weighs; None
    when none keeps the ties."""
    candidates = [polish(request, tie_up(request, ilp.choice_of(x)), deadline, budget=False),
                  polish(request, greedy(request), deadline, budget=False)]
    restricted = _Ilp(dataclasses.replace(request, allowed=ilp.support(x[: ilp.num_x])))
    choice, _ = restricted.solve((deadline - time.perf_counter()) / 2)   # half: the rest
    #                                                     is branch and bound's on the whole
    if choice is not None:
        candidates.append(choice)
    valid = [c for c in candidates if is_valid(request, c)]
    return min(valid, key=lambda c: evaluate(request, c)[0]) if valid else None


def finish(request: Request, choice, status: str, start: float,
           bound: float | None = None, budget_binds: bool = True) -> Result:
    seconds, peak = evaluate(request, choice)
    if status == "optimal":
        bound = seconds
    return Result(choice, seconds, peak, status, time.perf_counter() - start, bound,
                  budget_binds)


def add_violated_rows(request: Request, ilp: _Ilp, choice, deadline: float):
    """Row generation: add the rows ``choice`` violates most and solve again, until the
    solution fits (then it is the budgeted optimum) or time runs out. Returns
    (choice, status) within the budget, or None."""
    added: set[int] = set()
    for _ in range(30):
        values = row_bytes(request, choice)
        over = [r for r in np.flatnonzero(values > request.memory_budget * (1 + 1e-9))
                if r not in added]
        for r in sorted(over, key=lambda r: -values[r])[:8]:
            added.add(r)
            ilp.add_memory_row(request.memory_rows[r] if request.memory_rows else ())
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return None
        choice, status = ilp.solve(remaining)
        if choice is None:
            return None
        if fits(request, choice):
            return choice, "optimal" if status == 0 else "time_limit"
        if status != 0:
            return None
    return None
