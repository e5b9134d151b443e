"""cost.liveness: per-device memory terms, each live over a range of nodes, as XLA's
buffer assignment keeps them: every buffer XLA keeps (arguments and outputs always;
temporaries from their producer, or from the start for work on arguments alone, to
their last reader), the copies readers make (resharded, or transposed for a dot or
convolution), and the buffers of reductions (partial results, results of the combined
all-reduce). A resharded copy depends on two groups' strategies: a ``PairTerm`` over
the pair; a copy several readers share (``shared``) is held if it is made: a
``CopyTerm``."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from autoshard import specs
from autoshard.cost.reshard import REDUCTIONS, Pairs
from autoshard.request import CopyTerm, GroupTerm, LiveRows, MemoryTerm, PairTerm
from autoshard.xla import expensive, loop_scope, spreads, transposed_operands


# XLA returns several results as a tuple: a buffer of one pointer per result, counted in
# the compiled program's output bytes (a single result is returned as itself).
POINTER_BYTES = 8


def with_rows(terms: tuple, fixed: tuple, spans) -> tuple[tuple, tuple, LiveRows]:
    """(every term: ``terms`` then the spans', ``fixed``, the rows): a row per point where
    some span's term dies, holding every term live there (peaks are just before deaths)."""
    index = range(len(terms), len(terms) + len(spans))
    rows = LiveRows(index, [first for _, first, _ in spans], [last for _, _, last in spans],
                    sorted({last for _, _, last in spans}))
    return terms + tuple(t for t, _, _ in spans), fixed, rows


class Liveness:
    """Memory terms and live ranges, for the builder (``graph._Builder``), which holds
    the program; this room keeps its caches."""

    def init_liveness(self):
        self._copies: dict = {}
        self._copy_starts: dict = {}
        self._reductions: dict = {}
        self._uncopied = None

    def value_bytes(self, value_id: int) -> GroupTerm:
        value = self.graph.values[value_id]
        g = self.group_of_node[value.producer]
        num_bytes = self.per_device_bytes(self.value_array[value_id],
                                          self.menus[value.producer].out_lists[value.index])
        return GroupTerm(g, num_bytes)

    def broadcasts_kept(self, value) -> int:
        """Buffers XLA keeps for a value: one, but one broadcast per operand for an
        elementwise op spreading several smaller arrays over its shape (the inverse norm
        [b, t, 1] times the scale [d] of an RMSNorm keeps both, spread)."""
        node = self.graph.nodes[value.producer]
        if not spreads(self.graph, node, value, self.space.einsums):
            return 1
        return max(1, sum(math.prod(self.graph.values[v].shape) > 1
                          for v in node.operands if v is not None))

    def recomputable(self, node) -> bool:
        """A cheap elementwise op of one activation and constants (a relu, a reshape): XLA
        computes it again inside every fusion reading it rather than read its result. Not
        one that also reads a broadcast statistic (x - mean): reductions read that one."""
        einsum = self.space.einsums[node.id]
        if node.kind != "eqn" or einsum is None or not einsum.fusible or expensive(einsum):
            return False
        sizes = [math.prod(self.graph.values[v].shape) for v in node.operands if v is not None]
        return sum(n > 1 for n in sizes) <= 1

    def last_reads(self, copied: set) -> list[int]:
        """Per value, the last node that reads its buffer.

        A fused chain of elementwise ops is copied into every consumer, so a value feeding
        one is read where the chain's consumers run (a pre-activation kept for the backward
        pass). The result of a ``recomputable`` op is read from memory only by the nodes
        that cannot fuse it (the next convolution); the fusions recompute it from its
        operand. A reader in ``copied`` (value, node) reads a copy made earlier instead."""
        graph, einsums, materialized = self.graph, self.space.einsums, self.space.materialized
        direct = [v.producer for v in graph.values]    # nodes reading the buffer as such
        fused = [v.producer for v in graph.values]     # fusions computing from the value
        for value in reversed(graph.values):
            for user, _ in graph.users[value.id]:
                node = graph.nodes[user]
                if (value.id, user) in copied:
                    continue
                if einsums[user] is None or not einsums[user].fusible or node.kind != "eqn":
                    direct[value.id] = max(direct[value.id], user)
                    continue
                reach = user
                for o in node.outputs:
                    if not materialized[o]:
                        reach = max(reach, direct[o], fused[o])
                    elif self.recomputable(node):
                        reach = max(reach, fused[o])
                fused[value.id] = max(fused[value.id], reach)
        return [direct[v.id] if materialized[v.id] and self.recomputable(graph.node_of(v.id))
                else max(direct[v.id], fused[v.id]) for v in graph.values]

    def overwritten(self, last_read: Sequence[int], not_temporary: set) -> set[int]:
        """Temporaries an elementwise node overwrites with its result: XLA writes a fused
        result of the same shape in place of an operand read for the last time there."""
        graph, materialized, found = self.graph, self.space.materialized, set()
        for node in graph.nodes:
            einsum = self.space.einsums[node.id]
            if node.kind != "eqn" or einsum is None or not einsum.fusible or not node.outputs:
                continue
            out = graph.values[node.outputs[0]]
            if not materialized[out.id]:
                continue
            for v in node.operands:
                value = graph.values[v] if v is not None else None
                if (value is not None and v not in not_temporary and materialized[v]
                        and last_read[v] == node.id and value.shape == out.shape
                        and value.dtype == out.dtype):
                    found.add(v)
                    break
        return found

    def from_arguments(self) -> list[bool]:
        """Per value: an argument or constant, or computed outside loops by one fusion
        reading nothing else. XLA schedules such work first, so its buffer (a broadcast
        zero, a broadcast scale, a weight's gathered copy) lives from the start."""
        graph, materialized, flags = self.graph, self.space.materialized, []
        for value in graph.values:
            node = graph.nodes[value.producer]
            flags.append(node.kind in ("arg", "const") or (
                node.kind == "eqn" and node.weight == 1
                and all(v is None or flags[v] and (not materialized[v]
                                                   or graph.node_of(v).kind in ("arg", "const"))
                        for v in node.operands)))
        return flags

    def copy_bytes(self, array: int, srcs: int, dsts: int,
                   fused: bool) -> tuple[np.ndarray, np.ndarray | None] | None:
        """[src strategy, dst strategy] bytes of the copy a reader wanting spec dst makes of
        a value written in spec src: the collectives' result, or the slice (nothing when
        the reader is fused and slices as it reads). With it its diagonal, for a reader in
        the value's group; None when no pair of strategies copies."""
        key = (array, srcs, dsts, fused)
        if key not in self._copies:
            self._copies[key] = self._copy_bytes(self.pairs(array, srcs, dsts), fused)
        return self._copies[key]

    @staticmethod
    def _copy_bytes(pairs: Pairs, fused: bool):
        copies = ~pairs.same & (pairs.seconds > 0) if fused else ~pairs.same
        if not copies.any():
            return None
        small = np.where(copies, pairs.dst_bytes, 0.0)
        matrix = small[np.ix_(pairs.rows, pairs.cols)]
        return matrix, np.diag(matrix).copy() if len(pairs.rows) == len(pairs.cols) else None

    def copy_starts(self, value_id: int, from_args: Sequence[bool]) -> dict[int, int]:
        """Per reader of a value (outputs aside), the node from which a copy made for that
        reader lives. XLA makes a copy once its source is ready and keeps it for every
        reader wanting the same spec or layout (a weight gathered for the forward pass
        stays for the backward one), so a reader's copy counts from the value's previous
        reader on; a first reader's from the reader itself, or from the start for a value
        of arguments alone, which XLA computes first."""
        if value_id not in self._copy_starts:
            readers = sorted({u for u, _ in self.graph.users[value_id]
                              if self.graph.nodes[u].kind != "output"})
            self._copy_starts[value_id] = {
                u: readers[k - 1] + 1 if k else (0 if from_args[value_id] else u)
                for k, u in enumerate(readers)}
        return self._copy_starts[value_id]

    def held_to(self, value_id: int, node_id: int, from_args: Sequence[bool],
                copied: set) -> int:
        """The last node at which a reader's copy of a value is held (its first is
        ``copy_starts``'s): the reader; for a value of arguments that the reader reads
        through a copy into another layout, that copy's first node, where it is made from
        the resharded copy (XLA copies a weight gathered at the start into the backward
        pass's layout there, and frees the gathered one); for a reader XLA computes at the
        start into a buffer of its own (``from_arguments``: the reversed kernel of a
        convolution's backward pass), -1: it reads the copy there, before the copy's
        first node. Work on arguments that XLA folds into its reader (a transpose into
        its dot) reads the copy at its own node."""
        if (value_id, node_id) in copied and from_args[value_id]:
            return self.copy_starts(value_id, from_args)[node_id]
        outputs = self.graph.nodes[node_id].outputs
        if outputs and all(from_args[v] and self.space.materialized[v] for v in outputs):
            return -1
        return node_id

    def transposed_reads(self) -> list[tuple[int, int, int]]:
        """(value, node, operand) of the operands XLA copies into another layout first."""
        return [(node.operands[i], node.id, i) for node in self.graph.nodes
                for i, copied in enumerate(transposed_operands(node)) if copied]

    def reshard_buffers(self, from_args: Sequence[bool], copied: set):
        """(term, first node, last node) of every resharded copy a reader makes (see
        ``copy_starts``). A reader that also copies the value into another layout keeps
        the layout copy: an activation is resharded just before it, and a value of
        arguments (a gathered weight) at the start, where its layout copy is made from
        the resharded one, which then dies. Outputs are written in their own spec: their
        buffers are counted as outputs."""
        graph = self.graph
        for value in graph.values:
            users = [(u, i) for u, i in graph.users[value.id] if graph.nodes[u].kind != "output"]
            if not users:
                continue
            starts = self.copy_starts(value.id, from_args)
            array, srcs = self.value_array[value.id], self.menus[value.producer].out_lists[
                value.index]
            gu = self.group_of_node[value.producer]
            for user, i in users:
                copy = self.copy_bytes(array, srcs, self.menus[user].in_lists[i],
                                       self.fusible[user])
                if copy is None:
                    continue
                gv = self.group_of_node[user]
                if (user, i) in self.paid_once:   # specs whose copy the readers share
                    copy = (np.where(self.paid_once[(user, i)][2][None, :], 0.0, copy[0]),)
                    if not copy[0].any():
                        continue
                term = GroupTerm(gu, copy[1]) if gu == gv else PairTerm(gu, gv, copy[0])
                if (value.id, user) in copied and not from_args[value.id]:
                    yield term, user, user
                    continue
                last = self.held_to(value.id, user, from_args, copied)
                if last >= starts[user]:
                    yield term, starts[user], last

    def layout_copies(self, from_args: Sequence[bool], transposed):
        """(term, first node, last node) of the copies XLA makes of operands it reads in
        another layout (``transposed_reads``), in the spec their reader wants; live like
        any copy (see ``copy_starts``): a weight's from the start of the program."""
        for value_id, node_id, i in transposed:
            dsts = self.menus[node_id].in_lists[i]
            yield (GroupTerm(self.group_of_node[node_id],
                              self.per_device_bytes(self.value_array[value_id], dsts)),
                   self.copy_starts(value_id, from_args)[node_id], node_id)

    def collective_buffers(self, last_read: Sequence[int]):
        """(term, first node, last node) of the buffers a split contraction's reduction
        adds to its result's.

        A reduction on its own reads a partial result as big as the collective's input,
        at the node. A combined one writes its result where the combined collective runs,
        beside the partial results of all its parts. A backend without reduce-scatter
        all-reduces the partial result and keeps a slice, so the full result is held to
        the node's last reader, and when that all-reduce joins the combined one, the full
        partial result is held until then too. On its own, the full result is held to the
        last reader too where every reader fuses the slice (``slices_fused``); else the
        slice is written out at the node and the full result dies there."""
        points = self.combine_points()
        for node in self.graph.nodes:
            buffers = self.reduction_buffers(node)
            if buffers is None:
                continue
            g = self.group_of_node[node.id]
            value_id = node.outputs[0]
            combine_at = points.get(loop_scope(node), node.id)
            for num_bytes, first, last in zip(buffers, (node.id, node.id, combine_at),
                                              (node.id, last_read[value_id], combine_at)):
                if num_bytes is not None:
                    yield GroupTerm(g, num_bytes), first, last

    def slices_fused(self, value_id: int) -> bool:
        """Whether every reader of a value is an elementwise fusion, into which XLA fuses
        the dynamic slice of an all-reduced result (a backend without reduce-scatter): the
        slice is then computed in each reader, never written, and the full result is read
        to the last of them. A reader that cannot fuse it (a dot, a collective, an output)
        makes XLA write the slice once, for every reader."""
        graph = self.graph
        users = graph.users[value_id]
        return bool(users) and all(self.fusible[u] and graph.nodes[u].kind == "eqn"
                                   for u, _ in users)

    def reduction_buffers(self, node) -> tuple[np.ndarray | None, ...] | None:
        """Per group strategy, the bytes of a node's reduction buffers (see
        ``collective_buffers``): at the node, held to its last reader, and where the
        combined collective runs, each None where it is nothing; None for a node that
        never reduces. Nodes sharing a menu share them."""
        strategies, picks = self.space.strategies[node.id], self.picks[node.id]
        key = (self.menu_key(node.id), self.slices_fused(node.outputs[0]))
        if key not in self._reductions:
            self._reductions[key] = self._reduction_buffers(node, strategies, picks)
        return self._reductions[key]

    def _reduction_buffers(self, node, strategies, picks):
        if not any(c.kind in REDUCTIONS for s in strategies for c in s.collectives):
            return None
        at_node, held, at_combine = (np.zeros(len(picks)) for _ in range(3))
        joins = self.joins_combined(node.id)
        value = self.graph.values[node.outputs[0]]
        for s, k in enumerate(picks):
            strategy = strategies[k]
            # reductions one after another over different axes reduce one buffer in place
            reductions = [c for c in strategy.collectives if c.kind in REDUCTIONS]
            for c in reductions[:1]:
                emulated = c.kind == "reduce-scatter" and not self.native_reduce_scatter
                if emulated and (joins or self.slices_fused(value.id)):
                    out_bytes = specs.per_device_bytes(value.shape, value.dtype,
                                                       strategy.out_specs[0], self.axis_sizes)
                    held[s] += c.num_bytes - out_bytes
                    if joins:
                        at_combine[s] += c.num_bytes
                    else:   # the partial result; the full one is held
                        at_node[s] += c.num_bytes
                elif strategy.combined and joins:
                    at_combine[s] += c.num_bytes
                else:   # the partial result, and an emulated reduce-scatter's full one
                    at_node[s] += c.num_bytes * (2 if emulated else 1)
        return tuple(b if b.any() else None for b in (at_node, held, at_combine))

    def build_memory(self):
        """Memory terms (arguments and outputs fixed; temporaries, resharded copies and
        collective buffers each with the range of nodes it is live over), the fixed ones
        among them, and the rows of terms live together."""
        terms, fixed, spans, from_args, copied = self.uncopied_memory()
        copies = list(self.reshard_buffers(from_args, copied))
        spans = [*spans, *(c for c in copies if isinstance(c[0], GroupTerm)),
                 *(c for c in copies if isinstance(c[0], PairTerm)),
                 *self.shared_copy_spans(from_args, copied)]
        return with_rows(terms, fixed, spans)

    def memory_before_pricing(self):
        """``build_memory``'s terms, fixed terms and rows but the resharded copies, which
        depend on prices (which copies readers share): every peak they give is at most
        the priced graph's, so their floor (``request.fewest_peak``) bounds its floor."""
        terms, fixed, spans, _, _ = self.uncopied_memory()
        return with_rows(terms, fixed, spans)

    def uncopied_memory(self):
        """What ``build_memory`` counts before the resharded copies: the fixed terms
        (arguments, outputs) and their indices; the (term, first node, last node) spans
        of temporaries, collective buffers and layout copies; per value, whether it is
        read from the arguments; the reads whose copy a layout copy made before them
        takes over. Computed once per graph."""
        if self._uncopied is not None:
            return self._uncopied
        graph = self.graph
        terms: list[MemoryTerm] = []
        fixed = []
        resident = set()
        live = graph.live_values()
        for node_id in graph.arg_nodes:
            value_id = graph.nodes[node_id].outputs[0]
            resident.add(value_id)
            if value_id not in live:   # jax.jit drops an argument no output depends on
                continue
            fixed.append(len(terms))
            terms.append(self.value_bytes(value_id))
        aliased = set()   # written in place into a donated argument's buffer
        for k, value_id in enumerate(graph.outputs):
            if value_id is None:
                continue
            if k in self.donated_outputs:
                aliased.add(value_id)
                continue
            resident.add(value_id)
            fixed.append(len(terms))
            terms.append(self.value_bytes(value_id))
        if len(graph.outputs) > 1:   # the result tuple's table: a pointer per output
            fixed.append(len(terms))
            terms.append(GroupTerm(0, np.full(self.group_size(0),
                                               float(POINTER_BYTES * len(graph.outputs)))))
        from_args, transposed = self.from_arguments(), self.transposed_reads()
        # a reader of a copy made before it does not hold the value: the copy does
        copied = {(v, n) for v, n, _ in transposed
                  if self.copy_starts(v, from_args)[n] < n}
        last_read = self.last_reads(copied)
        spans = []   # (term, first node, last node): a temporary lives from its producer
        #              (or the start) to its last reader
        not_temporary = resident | aliased
        in_place = self.overwritten(last_read, not_temporary)
        for value in graph.values:
            if value.id in not_temporary or not self.space.materialized[value.id]:
                continue
            seam = graph.nodes[value.producer]
            if seam.kind == "eqn" and value.id not in live:
                continue  # dead code: jax.jit drops it
            if seam.kind == "boundary" and seam.primitive != "loop_ys":
                continue  # a loop seam aliases the buffer it connects; a scan's stacked
                #           ys are buffers of their own, trip count x the body's slice
            first = 0 if from_args[value.id] else value.producer
            last = last_read[value.id] - (value.id in in_place)
            if from_args[value.id] and last == value.producer:
                last = first   # read through copies alone, made from it at the start
            term = self.value_bytes(value.id)
            term = GroupTerm(term.group, term.num_bytes * self.broadcasts_kept(value))
            spans.append((term, first, max(first, last)))
        spans += self.collective_buffers(last_read)
        spans += self.layout_copies(from_args, transposed)
        self._uncopied = (tuple(terms), tuple(fixed), tuple(spans), from_args, copied)
        return self._uncopied

    def shared_copy_spans(self, from_args: Sequence[bool], copied: set):
        """(term, first node, last node) of every copy readers share: held from the first
        of them that may make it (see ``copy_starts``) to the last that shares it, as a
        term per reading node, each held up to that node (``held_to``) if a read at or
        after it shares the copy (``shared.held_until``)."""
        for value_id, num_bytes, until in self.shared_copies_held:
            starts = self.copy_starts(value_id, from_args)
            first = min(starts[node] for _, node in until)
            for k, node in until:
                last = self.held_to(value_id, node, from_args, copied)
                if last >= first:
                    yield CopyTerm(k, num_bytes), first, last
                first = node + 1
