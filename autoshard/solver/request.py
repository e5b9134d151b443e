"""request: what the cost stage hands the solver, and the one pricing of any choice.

A ``Request`` holds numbers only (no jax): per group of nodes a cost per strategy, per
pair of groups a resharding matrix, memory terms with the rows of terms live together, and
costs paid once for many members. Its entries are named records (``Edge``, ``Tie``,
``SharedCost``, ``SharedEdgeCost``, and the memory terms ``GroupTerm``, ``PairTerm`` and
``CopyTerm``), and its memory terms are one list: the rows and ``fixed_terms`` index it.

``evaluation`` prices any choice (a strategy per group) from the request alone, every part
of it in one place (``Evaluation``: compute, collectives, resharding, shared latencies,
peak memory, budget and tie violations). The solver minimizes its ``seconds``; the plan's
reported cost, ``explain`` and the breakdown read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Between plans of equal time, prefer the one that keeps fewer bytes per device.
TIEBREAK_SECONDS_PER_BYTE = 1e-15


class Edge(NamedTuple):
    """Resharding between two groups: seconds per pair of their strategies."""
    u: int
    v: int
    cost: np.ndarray        # [strategies of u, strategies of v], seconds


class Tie(NamedTuple):
    """Groups u and v must choose strategies with equal keys (the same spec)."""
    u: int
    v: int
    keys_u: np.ndarray      # per strategy of u
    keys_v: np.ndarray      # per strategy of v


class SharedCost(NamedTuple):
    """Seconds paid once if any member (group, strategy) is chosen: the latency of one
    combined collective standing for all the like collectives it merges."""
    seconds: float
    members: Sequence[tuple[int, int]]


class SharedEdgeCost(NamedTuple):
    """Seconds paid once if any member (u, v, paid[su, sv]) is marked by its pair of
    choices: one resharded copy of a value that several readers want in one spec, or one
    more latency of chained collectives. u == v means one group: paid[s, s]."""
    seconds: float
    members: Sequence[tuple[int, int, np.ndarray]]


class GroupTerm(NamedTuple):
    """Bytes per device that depend on one group's strategy."""
    group: int
    num_bytes: np.ndarray   # per strategy of the group

    def held(self, choice, paid: Sequence[bool]) -> float:
        return float(self.num_bytes[choice[self.group]])

    def fewest(self, allowed: Sequence[np.ndarray]) -> float:
        """The fewest bytes under any allowed strategy (``allowed``: a mask per group)."""
        return float(np.min(np.asarray(self.num_bytes, float)[allowed[self.group]]))


class PairTerm(NamedTuple):
    """Bytes per device that depend on two groups' strategies: the copy of a result of
    group u resharded into the spec a node of group v reads it in. u == v means one
    group: bytes[s, s]."""
    u: int
    v: int
    num_bytes: np.ndarray   # [strategies of u, strategies of v]

    def held(self, choice, paid: Sequence[bool]) -> float:
        return float(self.num_bytes[choice[self.u], choice[self.v]])

    def fewest(self, allowed: Sequence[np.ndarray]) -> float:
        m = np.asarray(self.num_bytes, float)
        if self.u == self.v:
            return float(np.diag(m)[allowed[self.u]].min())
        return float(m[allowed[self.u]][:, allowed[self.v]].min())


class CopyTerm(NamedTuple):
    """The bytes of a copy several readers share, held if its shared edge cost
    (``Request.shared_edge_costs[copy]``) is paid."""
    copy: int
    num_bytes: float

    def held(self, choice, paid: Sequence[bool]) -> float:
        return float(self.num_bytes) if paid[self.copy] else 0.0

    def fewest(self, allowed: Sequence[np.ndarray]) -> float:
        return 0.0   # the copy need not be made


MemoryTerm = GroupTerm | PairTerm | CopyTerm


class LiveRows(Sequence):
    """Memory rows given as live ranges: row r < len(points) holds every term whose range
    [start, end] covers points[r]; the ``explicit`` rows follow, as lists of terms. Sums
    over all rows cost one pass, not one per row, so long programs stay cheap."""

    def __init__(self, terms, starts, ends, points, explicit=()):
        self.terms = np.asarray(terms, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)
        self.points = np.asarray(points, dtype=np.int64)
        self.explicit = tuple(tuple(r) for r in explicit)
        # the rows each term is live in: [first, last) over points
        self.first = np.searchsorted(self.points, self.starts, side="left")
        self.last = np.searchsorted(self.points, self.ends, side="right")

    def __len__(self) -> int:
        return len(self.points) + len(self.explicit)

    def __getitem__(self, r):
        if r >= len(self.points):
            return self.explicit[r - len(self.points)]
        live = (self.first <= r) & (r < self.last)
        return tuple(int(t) for t in np.sort(self.terms[live]))

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Bytes of every row, given the bytes of every term."""
        diff = np.zeros(len(self.points) + 1)
        np.add.at(diff, self.first, values[self.terms])
        np.add.at(diff, self.last, -values[self.terms])
        live = np.cumsum(diff)[:-1]
        explicit = [values[list(r)].sum() if r else 0.0 for r in self.explicit]
        return np.concatenate([live, explicit])


@dataclasses.dataclass(frozen=True)
class SecondsParts:
    """What a request's seconds are made of. Per group g, ``node_costs[g]`` is
    ``compute[g] + collectives[g] + reshard[g]`` (resharding inside the group) plus
    ``tiebreak_seconds_per_byte`` times the bytes of g's ``GroupTerm``s; edges are
    resharding between groups; shared costs are latencies of combined collectives; shared
    edge costs are resharded copies several readers share, or latencies where
    ``latency_edges`` marks them."""
    compute: Sequence[np.ndarray]
    collectives: Sequence[np.ndarray]
    reshard: Sequence[np.ndarray]
    latency_edges: Sequence[bool] = ()      # per shared edge cost
    tiebreak_seconds_per_byte: float = 0.0


@dataclasses.dataclass(frozen=True)
class Request:
    """A choice of one strategy per group, priced: what the cost stage hands the solver
    (``CostGraph.request``), and what coarsening hands it in place of that."""
    node_costs: Sequence[np.ndarray]                      # per group, seconds per strategy
    edges: Sequence[Edge]
    # one list, which ``fixed_terms`` and ``memory_rows`` index
    memory_terms: Sequence[MemoryTerm] = ()
    fixed_terms: Sequence[int] = ()                       # terms counted in every row
    memory_rows: Sequence[Sequence[int]] = ()             # terms live together
    memory_budget: float | None = None                    # bytes per device
    allowed: Sequence[np.ndarray | None] = ()             # per group: allowed strategies
    shared_costs: Sequence[SharedCost] = ()
    ties: Sequence[Tie] = ()
    time_limit_s: float = 60.0
    shared_edge_costs: Sequence[SharedEdgeCost] = ()
    # seconds a caller already has a plan for: where no choice regardless of memory is
    # cheaper, solving under the budget is skipped (``CannotBeat``)
    seconds_to_beat: float | None = None
    # node_costs and shared edge costs told apart (``Evaluation``); per group, so a
    # request over other groups (``coarsen.quotient``) drops them
    seconds_parts: SecondsParts | None = None

    def terms_of(self, kind: type) -> list[tuple[int, MemoryTerm]]:
        """(index, term) of every memory term of one kind (``GroupTerm``, ...)."""
        return [(t, term) for t, term in enumerate(self.memory_terms) if isinstance(term, kind)]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The cost of one choice of a request, every part of it (``evaluation``).

    ``seconds`` is what the solver minimizes; it is the sum of the five parts
    ``compute_s + collective_s + reshard_s + latency_s + tiebreak_s``. Without
    ``Request.seconds_parts`` (hand-built or coarsened requests) group seconds count as
    compute and shared edge costs as resharding.
    """
    seconds: float
    peak_bytes: float            # per device, the fullest memory row
    compute_s: float
    collective_s: float          # collectives inside strategies (combined latencies aside)
    reshard_s: float             # edges, resharding inside groups, shared copies
    latency_s: float             # combined collectives' latencies, paid once
    tiebreak_s: float            # the price per byte held that breaks ties of equal time
    over_budget_bytes: float     # the peak past ``Request.memory_budget``; 0 within it
    broken_ties: int             # ties (``Request.ties``) whose keys differ

    @property
    def comm_s(self) -> float:
        """Seconds moving data: collectives, their latencies and resharding."""
        return self.collective_s + self.latency_s + self.reshard_s

    @property
    def feasible(self) -> bool:
        return self.over_budget_bytes == 0.0 and self.broken_ties == 0


def evaluation(request: Request, choice: Sequence[int]) -> Evaluation:
    """Every part of the cost of ``choice`` (a strategy per group), from the request alone."""
    node_s = sum(float(c[choice[g]]) for g, c in enumerate(request.node_costs))
    edge_s = sum(float(m[choice[u], choice[v]]) for u, v, m in request.edges)
    marked = shared_edges_paid(request, choice)
    once, paid = shared_paid(request, choice, marked)
    parts = request.seconds_parts
    latency_edges = parts.latency_edges if parts is not None else ()
    copies = sum(request.shared_edge_costs[k].seconds for k in paid
                 if not (k < len(latency_edges) and latency_edges[k]))
    latencies = sum(request.shared_edge_costs[k].seconds for k in paid
                    if k < len(latency_edges) and latency_edges[k])
    if parts is None:
        compute, collective, inside, tiebreak = node_s, 0.0, 0.0, 0.0
    else:
        compute, collective, inside = (sum(float(v[choice[g]]) for g, v in enumerate(vectors))
                                       for vectors in (parts.compute, parts.collectives,
                                                       parts.reshard))
        tiebreak = parts.tiebreak_seconds_per_byte * sum(
            float(term.num_bytes[choice[term.group]]) for _, term in request.terms_of(GroupTerm))
    peak = peak_memory(request, choice, marked)
    budget = request.memory_budget
    return Evaluation(
        seconds=plan_seconds(request, choice, marked), peak_bytes=peak, compute_s=compute,
        collective_s=collective, reshard_s=inside + edge_s + copies,
        latency_s=once + latencies, tiebreak_s=tiebreak,
        over_budget_bytes=max(0.0, peak - budget) if budget is not None else 0.0,
        broken_ties=sum(int(keys_u[choice[u]] != keys_v[choice[v]])
                        for u, v, keys_u, keys_v in request.ties))


def plan_seconds(request: Request, choice, marked: Sequence[bool] | None = None) -> float:
    """``Evaluation.seconds`` alone: group, edge and shared seconds, summed as the solver
    sums them (its hot loops read this, not the parts). ``marked``: ``shared_edges_paid``
    of ``choice``, where the caller has it."""
    once, paid = shared_paid(request, choice, marked)
    return (sum(float(c[choice[g]]) for g, c in enumerate(request.node_costs))
            + sum(float(m[choice[u], choice[v]]) for u, v, m in request.edges)
            + (once + sum(request.shared_edge_costs[k].seconds for k in paid)))


def shared_paid(request: Request, choice, marked: Sequence[bool] | None = None
                ) -> tuple[float, list[int]]:
    """The seconds of the shared costs ``choice`` pays, and the shared edge costs it pays
    (their indices; ``marked``: ``shared_edges_paid``, where the caller has it)."""
    once = sum(seconds for seconds, members in request.shared_costs
               if any(choice[g] == s for g, s in members))
    if marked is None:
        marked = shared_edges_paid(request, choice)
    return once, [k for k, paid in enumerate(marked) if paid]


def evaluate(request: Request, choice: Sequence[int]) -> tuple[float, float]:
    """(seconds, peak bytes per device) of ``choice``: ``Evaluation.seconds`` and
    ``.peak_bytes`` without the rest of ``evaluation``."""
    marked = shared_edges_paid(request, choice)
    return plan_seconds(request, choice, marked), peak_memory(request, choice, marked)


def shared_edges_paid(request: Request, choice) -> list[bool]:
    """Per shared edge cost: whether ``choice`` marks any of its members."""
    return [any(paid[choice[u], choice[v]] for u, v, paid in members)
            for _, members in request.shared_edge_costs]


def term_values(request: Request, choice, marked: Sequence[bool] | None = None
                ) -> np.ndarray:
    """Bytes of every memory term under ``choice`` (``marked``: as ``plan_seconds``)."""
    paid = shared_edges_paid(request, choice) if marked is None else marked
    return np.array([term.held(choice, paid) for term in request.memory_terms], dtype=float)


def row_bytes(request: Request, choice, marked: Sequence[bool] | None = None) -> np.ndarray:
    values = term_values(request, choice, marked)
    fixed = values[list(request.fixed_terms)].sum() if request.fixed_terms else 0.0
    if isinstance(request.memory_rows, LiveRows):
        rows = request.memory_rows.sums(values) if len(request.memory_rows) else [0.0]
    else:
        rows = [values[list(r)].sum() if r else 0.0 for r in request.memory_rows] or [0.0]
    return fixed + np.asarray(rows)


def peak_memory(request: Request, choice, marked: Sequence[bool] | None = None) -> float:
    if not len(request.memory_terms):
        return 0.0
    return float(row_bytes(request, choice, marked).max())


def fewest_peak(terms: Sequence[MemoryTerm], fixed_terms: Sequence[int], rows,
                masks: Sequence[np.ndarray]) -> float:
    """The fewest bytes the peak of ``terms`` can be, each term at the fewest bytes any
    strategy ``masks`` allow gives it (a shared copy need not be made): the fixed terms
    plus the largest row. Terms never hold negative bytes, so dropping terms lowers it."""
    whole = [bool(mask.all()) for mask in masks]
    known: dict[tuple[int, bool], float] = {}   # a repeated layer's terms share byte arrays

    def fewest(term: MemoryTerm) -> float:
        if isinstance(term, CopyTerm):
            return 0.0
        groups = (term.group,) if isinstance(term, GroupTerm) else (term.u, term.v)
        if not all(whole[g] for g in groups):
            return term.fewest(masks)
        key = (id(term.num_bytes), isinstance(term, PairTerm) and term.u == term.v)
        if key not in known:
            known[key] = term.fewest(masks)
        return known[key]
    floors = np.asarray([fewest(term) for term in terms], float)
    if not len(floors):
        return 0.0
    fixed = floors[list(fixed_terms)].sum() if len(fixed_terms) else 0.0
    if isinstance(rows, LiveRows):
        live = rows.sums(floors) if len(rows) else np.zeros(1)
    else:
        live = np.array([floors[list(r)].sum() if r else 0.0 for r in rows] or [0.0])
    return float(fixed + live.max())


def allowed_mask(request: Request, g: int) -> np.ndarray:
    n = len(request.node_costs[g])
    if g < len(request.allowed) and request.allowed[g] is not None:
        mask = np.zeros(n, bool)
        mask[np.asarray(request.allowed[g])] = True
        return mask
    return np.ones(n, bool)


@dataclasses.dataclass(frozen=True)
class Touching:
    """Per group, the indices of the edges, shared costs and shared edge costs it is in."""
    edges: list
    shared: list
    shared_edges: list

    @classmethod
    def of(cls, request: Request, groups: Sequence[int] | None = None) -> Touching:
        """For every group, or only for ``groups`` (the others left with none)."""
        n = len(request.node_costs)
        wanted = np.ones(n, bool)
        if groups is not None:
            wanted[:] = False
            wanted[list(groups)] = True
        edges, shared, shared_edges = ([[] for _ in range(n)] for _ in range(3))
        for k, (u, v, _) in enumerate(request.edges):
            for g in (u, v):
                if wanted[g]:
                    edges[g].append(k)
        for k, (_, members) in enumerate(request.shared_costs):
            for g in dict.fromkeys(g for g, _ in members if wanted[g]):
                shared[g].append(k)
        for k, (_, members) in enumerate(request.shared_edge_costs):
            for g in dict.fromkeys(x for u, v, _ in members for x in (u, v) if wanted[x]):
                shared_edges[g].append(k)
        return cls(edges, shared, shared_edges)


def group_seconds(request: Request, choice, g: int, touching: Touching) -> np.ndarray:
    """Per strategy of group g, the plan's seconds that depend on g's choice (the rest
    held at ``choice``): moving g from s to t changes the plan by [t] - [s]."""
    total = np.asarray(request.node_costs[g], float).copy()
    for k in touching.edges[g]:
        u, v, m = request.edges[k]
        total += m[:, choice[v]] if u == g else m[choice[u], :]
    for k in touching.shared[g]:
        seconds, members = request.shared_costs[k]
        if not any(h != g and choice[h] == s for h, s in members):
            total[sorted({s for h, s in members if h == g})] += seconds
    for k in touching.shared_edges[g]:
        seconds, members = request.shared_edge_costs[k]
        total += seconds * shared_edge_marks(members, choice, g, len(total))
    return total


def shared_edge_marks(members, choice, g: int, num_strategies: int) -> np.ndarray:
    """Per strategy of group g, whether a shared edge cost with ``members`` is paid when
    g takes it and the other groups keep ``choice``."""
    paid = np.zeros(num_strategies, bool)
    for u, v, m in members:
        if u == g and v == g:
            paid |= np.diag(m).astype(bool)
        elif u == g or v == g:
            paid |= np.asarray(m[:, choice[v]] if u == g else m[choice[u], :], bool)
        elif m[choice[u], choice[v]]:
            paid[:] = True   # paid whatever g chooses
            break
    return paid


def tie_mask(request: Request, choice, g: int) -> np.ndarray:
    """Strategies of group g that keep its ties with the others' choices."""
    mask = allowed_mask(request, g)
    for u, v, keys_u, keys_v in request.ties:
        if u == g and v != g:
            mask &= keys_u == keys_v[choice[v]]
        elif v == g and u != g:
            mask &= keys_v == keys_u[choice[u]]
    return mask


def is_valid(request: Request, choice) -> bool:
    """Whether ``choice`` takes allowed strategies and keeps every tie."""
    return (all(allowed_mask(request, g)[s] for g, s in enumerate(choice))
            and all(keys_u[choice[u]] == keys_v[choice[v]]
                    for u, v, keys_u, keys_v in request.ties))


def fits(request: Request, choice) -> bool:
    return bool(row_bytes(request, choice).max() <= request.memory_budget * (1 + 1e-9))
