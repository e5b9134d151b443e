"""coarsen: CostGraph -> a smaller Request that the solver solves in place of the whole one.

Two reductions, both exact for what they keep:

- **Repeated structure.** The layers of an unrolled model (and their backward passes and
  optimizer updates) are copies of one another: the same primitives, shapes and wiring.
  Groups are put in classes by colour refinement (Weisfeiler-Lehman) over the group
  graph, starting from what makes two groups interchangeable (their strategies, follower
  picks and costs, an argument's role: its path without layer indices) and refining by
  their neighbours for a few rounds, so that a copy next to something different (the
  first layer after the embedding, the last before the head) keeps a class of its own.
  Copies that feed one another directly alternate between ``PERIOD`` classes, so that
  neighbouring layers may still choose differently (Megatron's column- and row-parallel
  pairs). Every class is solved as one group: its costs, the edges of all its members
  and their memory terms are summed onto it, so that the reduced problem prices exactly
  every plan in which the copies of a class choose alike, boundaries included.
- **Dominated strategies.** A strategy never cheaper (alone and against every neighbour)
  and never smaller than another of its group is never needed; it is excluded.

``coarsen`` returns the reduced request and the map that expands its choice back to every
group of the original one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from autoshard.solver.request import (
    CopyTerm,
    Edge,
    GroupTerm,
    MemoryTerm,
    PairTerm,
    Request,
    SharedCost,
    SharedEdgeCost,
    Tie,
    allowed_mask,
)

if TYPE_CHECKING:   # the cost stage's graph, read by attribute: the solver imports no jax
    from autoshard.cost import CostGraph

REFINE_ROUNDS = 4
JOINS = frozenset({"stack", "concatenate"})   # operands that are pieces of the result
PARTS = frozenset({"unstack", "split"})       # results that are pieces of the operand
PERIOD = 2   # copies alternate between this many classes: Megatron pairs column and row


@dataclasses.dataclass(frozen=True)
class Coarsened:
    request: Request
    class_of_group: np.ndarray      # original group -> group of the reduced request

    def expand(self, choice: Sequence[int]) -> np.ndarray:
        return np.asarray(choice)[self.class_of_group]

    @property
    def num_classes(self) -> int:
        return len(self.request.node_costs)


def interner():
    """A function giving equal keys equal small ints, in order of first appearance: exact
    (no hash collisions) and the same in every process."""
    table: dict = {}
    return lambda key: table.setdefault(key, len(table))


LAYER_INDEX = re.compile(r"\[\d+\]|(?<=_)\d+\b")


def role(label: str) -> str:
    """An argument's path with its layer indices dropped: what it is in every layer
    (``params['blocks'][3]['w']`` and ``...[5]['w']`` alike, Adam's mu and nu apart)."""
    return LAYER_INDEX.sub("#", label)


def node_keys(cg: CostGraph) -> list[int]:
    """Per node: its primitive, its strategies and its follower picks (and an argument's
    role), as a small int."""
    space = cg.space
    strategy_key, node_key = interner(), interner()
    by_number: dict[int, int] = {}   # per number of nodes' strategies (``menu_ids``)
    keys = []
    for node in space.graph.nodes:
        number = space.menu_ids[node.id]
        if number not in by_number:
            by_number[number] = strategy_key(tuple((s.in_specs, s.out_specs, s.combined)
                                                   for s in space.strategies[node.id]))
        keys.append(node_key((node.primitive, by_number[number],
                              cg.picks[node.id].tobytes(),
                              role(node.label) if node.kind == "arg" else "")))
    return keys


def initial_colours(cg: CostGraph, request: Request, keys: list[int]) -> list[int]:
    """Groups are interchangeable when their members are and the group costs the same."""
    colour = interner()
    return [colour((tuple(keys[n] for n in members),
                    np.round(np.asarray(request.node_costs[g], float), 18).tobytes()))
            for g, members in enumerate(cg.groups)]


def interchangeable(primitive: str, shapes, pieces: frozenset) -> bool:
    """Whether a node's operands (or results) are pieces of one array, all alike: a
    stack's layers, a concatenation's equal parts (``pieces`` names such primitives)."""
    return primitive in pieces and len(set(shapes)) == 1


def group_links(cg: CostGraph, keys: list[int]) -> tuple[list[list], list[list]]:
    """Per group, its (label, neighbour) pairs into and out of it. A label says which kind
    of node's which result feeds which kind of node's which operand; it names nodes by
    kind, not by place in their group, because one group may span every layer (the
    residual stream follows its adds from the embedding to the head). Pieces of one array
    that are alike (the layers a stack joins or an unstack parts) are not told apart by
    their place, so that each layer's copy of what reads or makes them (its optimizer
    update) falls in one class."""
    graph = cg.space.graph
    joined = [interchangeable(n.primitive, n.operand_shapes, JOINS) for n in graph.nodes]
    parted = [interchangeable(n.primitive, [graph.values[v].shape for v in n.outputs], PARTS)
              for n in graph.nodes]
    ins = [[] for _ in cg.groups]
    outs = [[] for _ in cg.groups]
    for node in graph.nodes:
        gv = cg.group_of_node[node.id]
        for i, value_id in enumerate(node.operands):
            if value_id is None:
                continue
            value = graph.values[value_id]
            gu = cg.group_of_node[value.producer]
            if gu == gv:
                continue
            label = (keys[value.producer], 0 if parted[value.producer] else value.index,
                     keys[node.id], 0 if joined[node.id] else i)
            ins[gv].append((label, gu))
            outs[gu].append((label, gv))
    return ins, outs


def refine(colours: list[int], ins, outs, rounds: int) -> list[int]:
    for _ in range(rounds):
        colour = interner()
        colours = [colour((c, tuple(sorted((l, colours[h]) for l, h in ins[g])),
                           tuple(sorted((l, colours[h]) for l, h in outs[g]))))
                   for g, c in enumerate(colours)]
    return colours


def chained(colours: list[int], ins) -> set[int]:
    """Colours with an edge between two of their groups: copies that feed one another."""
    return {colours[g] for g, links in enumerate(ins) for _, h in links
            if colours[h] == colours[g]}


def by_period(colours: list[int], split: set[int], period: int) -> list[tuple[int, int]]:
    """Split each colour in ``split`` into ``period`` classes that alternate along the
    program: the k-th copy goes with copies k +- period."""
    seen: dict[int, int] = {}
    out = []
    for c in colours:
        rank = seen.get(c, 0) if c in split else 0
        seen[c] = rank + 1
        out.append((c, rank % period))
    return out


def repeated_classes(cg: CostGraph, request: Request, rounds: int = REFINE_ROUNDS,
                     period: int = PERIOD) -> np.ndarray:
    """Class per group, numbered in order of first appearance.

    Copies that feed one another directly (the layers of a plain MLP) may want to differ
    from their neighbours: Megatron pairs a column-parallel layer with a row-parallel one.
    Those are split into ``period`` alternating classes, and the split is refined into the
    rest of their layers (backward pass, parameters, optimizer state)."""
    keys = node_keys(cg)
    ins, outs = group_links(cg, keys)
    initial = initial_colours(cg, request, keys)
    split = chained(initial, ins)
    colours = refine(initial, ins, outs, rounds)
    split = {c for g, c in enumerate(colours) if initial[g] in split}
    if split and period > 1:
        number = interner()
        colours = refine([number(c) for c in by_period(colours, split, period)],
                         ins, outs, rounds)
    number = interner()
    return np.array([number(c) for c in colours], dtype=np.int64)


def quotient(request: Request, class_of: np.ndarray) -> Request:
    """The request over classes: every plan whose groups of one class choose alike costs
    (and weighs) the same in both."""
    num = int(class_of.max()) + 1 if len(class_of) else 0
    node_costs = [None] * num
    for g, c in enumerate(class_of):
        cost = np.asarray(request.node_costs[g], float)
        node_costs[c] = cost.copy() if node_costs[c] is None else node_costs[c] + cost
    edges: dict[tuple[int, int], np.ndarray] = {}
    for u, v, m in request.edges:
        cu, cv = int(class_of[u]), int(class_of[v])
        if cu == cv:
            node_costs[cu] = node_costs[cu] + np.diag(m)
        elif (cv, cu) in edges:
            edges[(cv, cu)] = edges[(cv, cu)] + m.T
        else:
            edges[(cu, cv)] = edges.get((cu, cv), 0) + m
    allowed = [None] * num
    for g in range(len(class_of)):
        if g < len(request.allowed) and request.allowed[g] is not None:
            c = class_of[g]
            mine = set(np.asarray(request.allowed[g]).tolist())
            allowed[c] = mine if allowed[c] is None else allowed[c] & mine
    ties = []
    for u, v, keys_u, keys_v in request.ties:
        cu, cv = int(class_of[u]), int(class_of[v])
        if cu == cv:   # one choice for both: only strategies whose keys agree
            same = set(np.flatnonzero(keys_u == keys_v).tolist())
            allowed[cu] = same if allowed[cu] is None else allowed[cu] & same
        else:
            ties.append(Tie(cu, cv, keys_u, keys_v))
    shared: dict[tuple, float] = {}   # copies of a layer's latency: one entry, summed
    for seconds, members in request.shared_costs:
        key = tuple(sorted({(int(class_of[g]), s) for g, s in members}))
        shared[key] = shared.get(key, 0.0) + seconds
    shared_edges, entry_of = _merged(request.shared_edge_costs, class_of.tolist())
    return dataclasses.replace(
        request, node_costs=node_costs,
        edges=[Edge(u, v, m) for (u, v), m in edges.items()],
        memory_terms=[term_over_classes(term, class_of, entry_of)
                      for term in request.memory_terms],
        allowed=[None if a is None else np.array(sorted(a), dtype=np.int64) for a in allowed],
        shared_costs=[SharedCost(seconds, members) for members, seconds in shared.items()],
        shared_edge_costs=shared_edges,
        ties=_unique_ties(ties), seconds_parts=None)


def term_over_classes(term: MemoryTerm, class_of: np.ndarray, entry_of: list[int]):
    """A memory term of the request over classes (``quotient``): on its groups' classes,
    or on its shared copy's merged entry. A pair term whose groups share a class counts
    its diagonal (the class chooses once)."""
    if isinstance(term, GroupTerm):
        return GroupTerm(int(class_of[term.group]), term.num_bytes)
    if isinstance(term, PairTerm):
        return PairTerm(int(class_of[term.u]), int(class_of[term.v]), term.num_bytes)
    return CopyTerm(entry_of[term.copy], term.num_bytes)


def _merged(shared_edges, class_of: Sequence[int]):
    """The shared edge costs over classes (``class_of``), those paid under the same
    condition (copies of a layer's reshard, now on the same classes) as one entry of their
    summed seconds; and each entry's new index. A layer's copies share their marks (the
    cost stage makes them once), so conditions are told apart by the mark arrays
    themselves, alive in the request."""
    by_condition: dict[tuple, int] = {}
    merged, entry_of = [], []
    for seconds, members in shared_edges:
        key = tuple((class_of[u], class_of[v], id(paid)) for u, v, paid in members)
        k = by_condition.get(key)
        if k is None:
            k = by_condition[key] = len(merged)
            merged.append([seconds, tuple((class_of[u], class_of[v], paid)
                                          for u, v, paid in members)])
        else:
            merged[k][0] += seconds
        entry_of.append(k)
    return [SharedEdgeCost(seconds, members) for seconds, members in merged], entry_of


def _unique_ties(ties):
    seen, out = set(), []
    for u, v, ku, kv in ties:
        key = (u, v, ku.tobytes(), kv.tobytes())
        if key not in seen:
            seen.add(key)
            out.append(Tie(u, v, ku, kv))
    return out


def strategy_features(request: Request) -> list[np.ndarray]:
    """Per group, one row per strategy of everything that strategy costs or weighs: its
    own seconds, its row of every edge matrix, its bytes in every memory term, its share
    of every shared cost. A tie's keys enter as +key and -key, so only equal keys compare."""
    feats: list[dict[bytes, np.ndarray]] = [{} for _ in request.node_costs]

    def add(g, columns):   # a column already there adds nothing to compare (layer copies)
        columns = np.ascontiguousarray(columns, dtype=float)
        feats[g].setdefault(columns.tobytes(), columns)
    for g, c in enumerate(request.node_costs):
        add(g, np.asarray(c, float)[:, None])
    def add_pair(u, v, m):   # a term over two groups' strategies (one group: its diagonal)
        if u == v:
            add(u, np.diag(m)[:, None])
        else:
            add(u, m)
            add(v, m.T)
    marks_seen: set = set()

    def add_marks(u, v, paid):
        # paid once if marked: a positive price per mark compares strategies as the marks
        # do, whatever the price, so each mark array is one feature (layers share them)
        if (u, v, id(paid)) not in marks_seen:
            marks_seen.add((u, v, id(paid)))
            add_pair(u, v, np.asarray(paid, float))
    for u, v, m in request.edges:
        add_pair(u, v, m)
    for term in request.memory_terms:
        if isinstance(term, GroupTerm):
            add(term.group, np.asarray(term.num_bytes, float)[:, None])
        elif isinstance(term, PairTerm):
            add_pair(*term)
        elif term.num_bytes > 0:   # held if its copy is made
            for u, v, paid in request.shared_edge_costs[term.copy].members:
                add_marks(u, v, paid)
    for seconds, members in request.shared_costs:
        by_group: dict[int, np.ndarray] = {}
        for g, s in members:
            by_group.setdefault(g, np.zeros(len(request.node_costs[g])))[s] = seconds
        for g, paid in by_group.items():
            add(g, paid[:, None])
    for seconds, members in request.shared_edge_costs:   # paid if any member is marked
        for u, v, paid in members if seconds > 0 else ():
            add_marks(u, v, paid)
    for u, v, keys_u, keys_v in request.ties:
        add(u, np.stack([keys_u, -keys_u], axis=1))
        add(v, np.stack([keys_v, -keys_v], axis=1))
    return [np.concatenate(list(f.values()), axis=1) for f in feats]


def telling_columns(features: np.ndarray) -> np.ndarray:
    """``features`` without the columns that tell no strategies apart for dominance: those
    equal on every strategy, and repeats of an earlier column (layer copies of one term,
    summed onto a class, give many)."""
    f = features[:, (features != features[:1]).any(axis=0)]
    first = {column.tobytes(): i for i, column in reversed(list(enumerate(f.T.copy())))}
    return f[:, sorted(first.values())]


def undominated(features: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Allowed strategies no other allowed one beats: not worse anywhere, and better
    somewhere or equal and listed first."""
    f = telling_columns(features[allowed])
    n = len(f)
    not_worse = (f[:, None, :] <= f[None, :, :]).all(-1)     # [a, b]: a <= b everywhere
    # not worse anywhere, so better somewhere unless equal everywhere (each not worse
    # than the other)
    equal = not_worse & not_worse.T
    first = np.arange(n)[:, None] < np.arange(n)[None, :]
    beats = not_worse & (~equal | first)
    np.fill_diagonal(beats, False)
    return np.flatnonzero(allowed)[~beats.any(axis=0)]


MAX_DOMINANCE_FEATURES = 4096   # past this, comparing all pairs costs more than it saves


def drop_dominated(request: Request) -> Request:
    """Exclude every strategy another strategy of its group dominates: replacing it by
    the dominating one never costs more time or memory, whatever the other groups pick."""
    allowed = []
    for g, f in enumerate(strategy_features(request)):
        mask = allowed_mask(request, g)
        if f.shape[1] > MAX_DOMINANCE_FEATURES or mask.sum() <= 1:
            allowed.append(None if mask.all() else np.flatnonzero(mask))
            continue
        allowed.append(undominated(f, mask))
    return dataclasses.replace(request, allowed=allowed)


def coarsen(cg: CostGraph, request: Request, reuse: bool = True) -> Coarsened:
    """The request to solve in place of ``request`` (built from ``cg``): layers solved once
    when ``reuse``, dominated strategies dropped always."""
    if reuse:
        class_of = repeated_classes(cg, request)
        reduced = quotient(request, class_of)
    else:
        class_of, reduced = np.arange(len(request.node_costs)), request
    return Coarsened(drop_dominated(reduced), class_of)
