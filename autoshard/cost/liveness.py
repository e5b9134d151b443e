"""cost.liveness: per-device memory terms, each live over a range of nodes, as XLA's
buffer assignment keeps them: every buffer XLA keeps (arguments and outputs always;
temporaries from their producer, or from the start for work on arguments alone, to
their last reader), the copies readers make (resharded, or transposed for a dot or
convolution), and the buffers of reductions (partial results, results of the combined
all-reduce). A resharded copy depends on two groups' strategies: a ``PairTerm`` over
the pair; a copy several readers share (``shared``) is held if it is made: a
``CopyTerm``. Loops XLA runs as loops keep more: a state buffer per carry through the
loop, what enters as a constant or a stack to the end of the body, stacked ys from the
loop's start, the slices a dot reads, and work hoisted out of the body (``Loops``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence, Set
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from autoshard.cost.reshard import REDUCTIONS, Pairs
from autoshard.frontend import specs
from autoshard.solver.request import CopyTerm, GroupTerm, LiveRows, MemoryTerm, PairTerm
from autoshard.target.xla import (
    collective_widening,
    contraction,
    conv_result_transposed,
    copies_bitcast_loop_operands,
    cpu_batch_groups_expanded,
    cpu_batched_scatter_indices,
    cpu_dot_widened,
    cpu_top_k_scratch,
    expensive,
    fft_on_cpu,
    layout_copies_made_when_written,
    loop_scope,
    read_order,
    spreads,
    transposed_operands,
    widening,
)

if TYPE_CHECKING:
    from autoshard.cost.grouping import Groups
    from autoshard.cost.reshard import ReshardPrices
    from autoshard.cost.shared import Combining, SharedCopies

# XLA returns several results as a tuple: a buffer of one pointer per result, counted in
# the compiled program's output bytes (a single result is returned as itself).
POINTER_BYTES = 8


LOOP_SEAMS = ("loop_const", "loop_carry", "loop_xs", "loop_ys")


@dataclasses.dataclass(frozen=True)
class Loops:
    """Where each loop of a program runs, in node order (keyed by its equation's key):
    its first node (its first seam), the last node of its body, and whether it is a scan
    unrolled whole (straight-line code to XLA: no loop state, no stacks)."""

    starts: dict
    ends: dict
    unrolled: frozenset

    @classmethod
    def of(cls, graph) -> Loops:
        starts, ends, unrolled = {}, {}, set()
        for node in graph.nodes:
            if node.kind == "boundary" and node.primitive in LOOP_SEAMS:
                loop = node.key[:-2]
                starts.setdefault(loop, node.id)
                ends.setdefault(loop, node.id)
                if node.params.get("static") or node.params.get("unrolled"):
                    unrolled.add(loop)
            for i, part in enumerate(node.key):
                if part == "body":   # nodes come in program order: the last one wins
                    ends[node.key[:i]] = node.id
        return cls(starts, ends, frozenset(unrolled))

    def start(self, seam) -> int:
        """The first node of the loop ``seam`` belongs to."""
        return self.starts[seam.key[:-2]]

    def body_end(self, seam) -> int:
        """The last node of the body of the loop ``seam`` belongs to."""
        return self.ends[seam.key[:-2]]

    def runs(self, seam) -> bool:
        """Whether XLA runs the loop of ``seam`` as a loop (not unrolled whole)."""
        return seam.key[:-2] not in self.unrolled

    def running(self) -> list[tuple]:
        """The keys of the loops XLA runs as loops, outermost first."""
        return sorted((k for k in self.starts if k not in self.unrolled), key=len)


def moves_with_loop(node) -> bool:
    """Whether a node inside a loop's body computes something new every iteration
    whatever its operands: a seam of a loop XLA runs, other than a constant's (a loop
    state, a slice of a stack)."""
    if node.kind != "boundary":
        return False
    if node.primitive == "loop_const":
        return False
    return not (node.params.get("static") or node.params.get("unrolled"))


class Memory(NamedTuple):
    """Per-device memory terms, the fixed ones among them (arguments and outputs: always
    resident), and the rows of terms live together (``with_rows``)."""
    terms: tuple[MemoryTerm, ...]
    fixed: tuple[int, ...]
    rows: LiveRows


def with_rows(terms: tuple, fixed: tuple, spans) -> Memory:
    """The ``Memory`` of ``terms`` and ``fixed`` with the spans' terms after them, and the
    rows: one per point where some span's term dies, holding every term live there
    (peaks are just before deaths)."""
    index = range(len(terms), len(terms) + len(spans))
    rows = LiveRows(index, [first for _, first, _ in spans], [last for _, _, last in spans],
                    sorted({last for _, _, last in spans}))
    return Memory(terms + tuple(t for t, _, _ in spans), fixed, rows)


@dataclasses.dataclass(frozen=True, eq=False)
class Uncopied:
    """What a program's memory counts before the resharded copies (``Liveness.uncopied``):
    the terms and the fixed ones among them (arguments, outputs); the (term, first node,
    last node) spans of temporaries, loop states, collective buffers and layout copies;
    per value, whether it is computed from the arguments alone (``from_arguments``); the
    reads (value, node) whose copy a layout copy made before them takes over."""
    terms: tuple[MemoryTerm, ...]
    fixed: tuple[int, ...]
    spans: tuple[tuple, ...]
    from_args: tuple[bool, ...]
    copied: frozenset


class Liveness:
    """Memory terms and live ranges of a program (``space``) as grouped (``groups``) and
    priced (``prices``); ``combined`` says where XLA's combined collectives run,
    ``donated_outputs`` which outputs are written into donated arguments, and
    ``native_reduce_scatter`` whether the backend reduce-scatters (else it all-reduces
    and keeps a slice). It keeps its caches; ``uncopied``, ``memory_before_pricing`` and
    ``memory`` are its results."""

    def __init__(self, space, groups: Groups, prices: ReshardPrices, combined: Combining,
                 donated_outputs: Collection[int] = (), native_reduce_scatter: bool = True):
        self.space, self.graph = space, space.graph
        self.groups, self.prices, self.combined = groups, prices, combined
        self.donated_outputs = frozenset(donated_outputs)
        self.native_reduce_scatter = native_reduce_scatter
        self.fusible = [e is not None and e.fusible for e in space.einsums]
        self._copies: dict = {}
        self._copy_starts: dict = {}
        self._reductions: dict = {}
        self._last_reads: dict = {}
        self._bitcasts: dict = {}
        self._dots_widened: dict[int, bool] = {}
        self._uncopied = None
        self._loops = None
        self._live = self.graph.live_values()   # what jax.jit keeps of the program

    def read_bytes(self, node_id: int, i: int) -> np.ndarray:
        """Per strategy of its group, the bytes per device of operand ``i`` of a node in
        the spec the node reads it in."""
        value_id = self.graph.nodes[node_id].operands[i]
        return self.prices.per_device_bytes(self.prices.value_array[value_id],
                                            self.groups.menus[node_id].in_lists[i])

    def value_bytes(self, value_id: int) -> GroupTerm:
        value = self.graph.values[value_id]
        g = self.groups.group_of_node[value.producer]
        num_bytes = self.prices.per_device_bytes(self.prices.value_array[value_id],
                                          self.groups.menus[value.producer].out_lists[value.index])
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

    def temporary_bytes(self, value) -> GroupTerm:
        """The bytes XLA keeps for a temporary, per strategy of its group: its buffer, or
        several (``broadcasts_kept``), or none where it is a bitcast of its operand
        (``bitcast_of_operand``)."""
        term = self.value_bytes(value.id)
        num_bytes = term.num_bytes * self.broadcasts_kept(value) * self.written_wide(value)
        bitcast = self.bitcast_of_operand(value)
        if bitcast is not None:
            num_bytes = np.where(bitcast, 0.0, num_bytes)
        return GroupTerm(term.group, num_bytes)

    def bitcast_of_operand(self, value) -> np.ndarray | None:
        """Per group strategy, whether a broadcast or transpose of an argument is a
        bitcast of it: the argument's buffer lives throughout, and a copy resharding it
        for a broadcast is held as long as the broadcast's result (``bitcast_read_to``).
        A broadcast: each device holds as many elements of the result as of the
        argument, the added dims split to one element a device (a weight broadcast to a
        copy per replica slice of a batch, the copies split over the replica axes, is
        each device's own weight). A transpose: on each device it moves only dims of one
        element (that weight copy's replica dim moved behind its layer dim, for a scan
        over layers). A transpose reads its argument through such broadcasts and loops'
        constants. None for other nodes. Computed once per value."""
        if value.id not in self._bitcasts:
            self._bitcasts[value.id] = self._bitcast_of_operand(value)
        return self._bitcasts[value.id]

    def _bitcast_of_operand(self, value) -> np.ndarray | None:
        node = self.graph.nodes[value.producer]
        if (node.primitive == "broadcast_in_dim" and node.operands[0] is not None
                and self.graph.node_of(node.operands[0]).kind == "arg"):
            moves_data = self.broadcast_moves_data
        elif node.primitive == "transpose" and self.from_argument(
                node.operands[0], ("broadcast_in_dim", "transpose")):
            moves_data = self.transpose_moves_data
        else:
            return None
        operand = self.graph.values[node.operands[0]]
        ins = self.groups.spec_lists[self.groups.menus[node.id].in_lists[0]]
        outs = self.groups.out_specs(node.id, value.index)
        return np.array([not moves_data(node, operand, value,
                                        i or specs.replicated(len(operand.shape)), o)
                         for i, o in zip(ins, outs)])

    def loop_operand_copies(self):
        """(term, first node, last node) of each copy XLA makes of a loop's stacked
        operand that is a bitcast of an argument (``bitcast_of_operand``), held while the
        loop runs, where its copy insertion makes one (``copies_bitcast_loop_operands``):
        a forward and a backward scan over the layers each copy the weights they read."""
        loops = self.loops()
        for seam in self.graph.nodes:
            if (seam.kind != "boundary" or seam.primitive != "loop_xs" or not loops.runs(seam)
                    or seam.operands[0] is None):
                continue
            stacked = self.graph.values[seam.operands[0]]
            bitcast = self.bitcast_of_operand(stacked)
            if bitcast is None or not bitcast.any() or not copies_bitcast_loop_operands():
                continue
            term = self.value_bytes(stacked.id)
            yield (GroupTerm(term.group, np.where(bitcast, term.num_bytes, 0.0)),
                   loops.start(seam), loops.body_end(seam))

    def from_argument(self, value_id: int | None, through: tuple[str, ...]) -> bool:
        """Whether a value is an argument, or made from one alone by ops of ``through``
        (each a bitcast where the argument splits so) and loops' constants."""
        while value_id is not None:
            node = self.graph.node_of(value_id)
            if node.kind == "arg":
                return True
            if not (node.primitive == "loop_const" or node.kind == "eqn"
                    and node.primitive in through):
                return False
            value_id = node.operands[0]
        return False

    def broadcast_moves_data(self, node, operand, value, spec_in, spec_out) -> bool:
        sizes = self.space.axis_sizes
        return (specs.per_device_bytes(operand.shape, value.dtype, spec_in, sizes)
                != specs.per_device_bytes(value.shape, value.dtype, spec_out, sizes))

    def transpose_moves_data(self, node, operand, value, spec_in, spec_out) -> bool:
        sizes = self.space.axis_sizes
        local_in = specs.local_shape(operand.shape, spec_in, sizes)
        local_out = specs.local_shape(value.shape, spec_out, sizes)
        order = [d for d in node.params["permutation"] if local_in[d] > 1]
        return (local_out != tuple(local_in[d] for d in node.params["permutation"])
                or order != sorted(order))

    def recomputable(self, node) -> bool:
        """A cheap elementwise op of one activation and constants (a relu, a reshape): XLA
        computes it again inside every fusion reading it rather than read its result. An
        expensive one only where the backend duplicates it (``Backend.duplicated``). One
        that also reads a broadcast (x - mean, rsqrt(var) times a scale) only where the
        backend computes such ops in each reader (XLA:GPU; XLA:CPU writes them for its
        reductions: ``Backend.broadcast_ops_written``), and only a cheap one (XLA:GPU
        writes and holds a softmax's division by its sum)."""
        einsum = self.space.einsums[node.id]
        if (node.kind != "eqn" or einsum is None or not einsum.fusible
                or expensive(einsum, node, self.space.backend.duplicated)):
            return False
        sizes = [math.prod(self.graph.values[v].shape) for v in node.operands if v is not None]
        if sum(n > 1 for n in sizes) <= 1:
            return True
        out = math.prod(self.graph.values[node.outputs[0]].shape)
        return (not self.space.backend.broadcast_ops_written and not einsum.expensive
                and sum(n == out for n in sizes) <= 1)

    def loops(self) -> Loops:
        """The program's loops, as XLA runs them (``Loops``); computed once."""
        if self._loops is None:
            self._loops = Loops.of(self.graph)
        return self._loops

    def read_at(self, value, user: int) -> int:
        """The last node at which ``user`` reads ``value``'s buffer. A loop reads what
        enters it every iteration: its constants and stacked xs are read to the end of
        its body. A stacked ys seam writes an iteration's slice into the stack where
        the body makes it (a dynamic-update-slice XLA runs right after its producer),
        not after the body."""
        node = self.graph.nodes[user]
        if node.kind != "boundary":
            return user
        loops = self.loops()
        if node.primitive in ("loop_const", "loop_xs"):
            return loops.body_end(node)
        if node.primitive == "loop_ys" and not node.params.get("unrolled"):
            start = loops.start(node)
            return value.producer if value.producer > start else loops.body_end(node)
        return user

    def last_reads(self, copied: set) -> list[int]:
        """Per value, the last node that reads its buffer.

        A fused chain of elementwise ops is copied into every consumer, so a value feeding
        one is read where the chain's consumers run (a pre-activation kept for the backward
        pass). The result of a ``recomputable`` op is read from memory only by the nodes
        that cannot fuse it (the next convolution); the fusions recompute it from its
        operand. A reader in ``copied`` (value, node) reads a copy made earlier instead.
        Computed once per ``copied``."""
        key = frozenset(copied)
        if key not in self._last_reads:
            self._last_reads[key] = self._last_reads_of(copied)
        return self._last_reads[key]

    def _last_reads_of(self, copied: set) -> list[int]:
        graph, einsums, materialized = self.graph, self.space.einsums, self.space.materialized
        direct = [v.producer for v in graph.values]    # nodes reading the buffer as such
        fused = [v.producer for v in graph.values]     # fusions computing from the value
        for value in reversed(graph.values):
            for user, _ in graph.users[value.id]:
                node = graph.nodes[user]
                if (value.id, user) in copied:
                    continue
                if einsums[user] is None or not einsums[user].fusible or node.kind != "eqn":
                    direct[value.id] = max(direct[value.id], self.read_at(value, user))
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

    def overwritten(self, last_read: Sequence[int], not_temporary: set) -> dict[int, int]:
        """Temporaries a node overwrites with its result: XLA writes a fused elementwise
        result of the same shape in place of an operand read for the last time there, if
        it stores both as wide (not a bf16 conv's f32 result that the fusion scales into
        bf16); and a sort writes each result in place of its operand (``sorted_in_place``).
        Each such operand maps to the result written over it."""
        graph, materialized, found = self.graph, self.space.materialized, {}
        for node in graph.nodes:
            if node.kind == "eqn" and node.primitive == "sort":
                found.update((v, out) for v, out in zip(node.operands, node.outputs)
                             if self.sorted_in_place(v, node.id, not_temporary))
                continue
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
                        and value.dtype == out.dtype
                        and self.written_wide(value) == self.written_wide(out)):
                    found[v] = out.id
                    break
        return found

    def sorted_in_place(self, value_id: int | None, node_id: int, not_temporary: set
                        ) -> bool:
        """Whether a sort writes its result in place of operand ``value_id``: a temporary
        in memory that the sort alone reads, once (XLA's dataflow lets a sort share that
        operand's buffer: the iota whose permutation ``argsort`` returns is sorted where
        it lies)."""
        return (value_id is not None and value_id not in not_temporary
                and self.space.materialized[value_id]
                and [u for u, _ in self.graph.users[value_id]] == [node_id])

    def written_into_outputs(self, last_read: Sequence[int], resident: set
                             ) -> dict[int, tuple[int, int]]:
        """Temporaries whose buffer is a program output's: the elementwise fusion writing
        an output (not donated) reads them for the last time, at the output's shape and
        dtype and at their own width (a contraction's result written wider, as XLA:CPU
        writes a bf16 convolution's in f32, holds no bf16 output), so XLA writes the
        output in place of one of them, which lives in the output's buffer from the start
        (a scan's stack of per-layer gradients that the update ``p - lr * g`` overwrites
        with the new weights). Each with the (node, operand) of the fusion that reads it
        (``sliced_as_read``)."""
        graph, materialized, found = self.graph, self.space.materialized, {}
        for value_id in resident:
            out, node = graph.values[value_id], graph.node_of(value_id)
            if node.kind != "eqn" or not self.fusible[node.id]:
                continue
            for v, read in self.fusion_reads(node):
                value = graph.values[v]
                if (v not in resident and materialized[v] and last_read[v] == node.id
                        and value.shape == out.shape and value.dtype == out.dtype
                        and graph.nodes[value.producer].kind != "arg"
                        and not self.copied_out(v) and self.written_wide(value) == 1.0):
                    found.setdefault(v, read)
                    break
        return found

    def sliced_as_read(self, value, read: tuple[int, int]) -> GroupTerm | PairTerm | None:
        """A temporary written into an output (``written_into_outputs``) where its reader
        ``read`` (node, operand) splits it as it reads: its own buffer, in the strategies
        that do so (a whole convolution's result the output's fusion slices: the output
        holds a slice, the result stays whole). None where no strategy does."""
        user, i = read
        array = self.prices.value_array[value.id]
        srcs = self.groups.menus[value.producer].out_lists[value.index]
        pairs = self.prices.pairs(array, srcs, self.groups.menus[user].in_lists[i])
        sliced = (~pairs.same & (pairs.seconds == 0))[np.ix_(pairs.rows, pairs.cols)]
        if not sliced.any():
            return None
        num_bytes = self.temporary_bytes(value).num_bytes
        gu, gv = self.groups.group_of_node[value.producer], self.groups.group_of_node[user]
        if gu == gv:
            return GroupTerm(gu, np.where(np.diag(sliced), num_bytes, 0.0))
        return PairTerm(gu, gv, np.where(sliced, num_bytes[:, None], 0.0))

    def copied_out(self, value_id: int) -> bool:
        """Whether XLA writes a value in another layout than a program output's and
        copies it out (``xla.conv_result_transposed``): no output is written in place of
        it."""
        node, value = self.graph.node_of(value_id), self.graph.values[value_id]
        return node.kind == "eqn" and conv_result_transposed(
            node, value.shape, self.space.backend.platform)

    def fusion_inputs(self, node) -> list[int]:
        """The values an elementwise node's fusion reads from memory, in operand order: its
        operands, and in place of each that XLA fuses into it (not in memory, made by an
        elementwise node), that one's (``p - 0.1 * g`` reads ``p`` and ``g``)."""
        return list(dict(self.fusion_reads(node)))

    def fusion_reads(self, node) -> list[tuple[int, tuple[int, int]]]:
        """``fusion_inputs``, each with the (node, operand) of the fused node reading it."""
        graph, materialized, found = self.graph, self.space.materialized, {}
        for i, v in enumerate(node.operands):
            if v is None or v in found:
                continue
            producer = graph.node_of(v)
            if materialized[v] or producer.kind != "eqn" or not self.fusible[producer.id]:
                found[v] = (node.id, i)
            else:
                for u, read in self.fusion_reads(producer):
                    found.setdefault(u, read)
        return list(found.items())

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
            dtype = self.prices.arrays.items[array][1]
            wide = collective_widening(dtype, self.space.backend.collective_itemsize)
            self._copies[key] = self._copy_bytes(self.prices.pairs(array, srcs, dsts), fused,
                                                 wide)
        return self._copies[key]

    @staticmethod
    def _copy_bytes(pairs: Pairs, fused: bool, wide: float):
        """``copy_bytes``; a collective's result at ``wide`` times its bytes (a backend
        whose collectives move narrow floats wider writes it so: ``collective_widening``;
        its readers convert it back as they read it)."""
        moved = pairs.seconds > 0
        copies = ~pairs.same & moved if fused else ~pairs.same
        if not copies.any():
            return None
        small = np.where(copies, pairs.dst_bytes * np.where(moved, wide, 1.0), 0.0)
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
        convolution's backward pass), the start: it reads the copy there, which a first
        reader's copy holds then and a later one's (made from the earlier copy) not at
        all. Work on arguments that XLA folds into its reader (a transpose into its dot)
        reads the copy at its own node."""
        if (value_id, node_id) in copied and from_args[value_id]:
            return self.copy_starts(value_id, from_args)[node_id]
        outputs = self.graph.nodes[node_id].outputs
        if outputs and all(from_args[v] and self.space.materialized[v] for v in outputs):
            return 0
        return max(node_id, self.read_at(self.graph.values[value_id], node_id))

    def wide(self, node, value_id: int) -> float:
        """How much wider than its dtype ``node`` reads or writes ``value_id`` in memory:
        the contraction width where the backend runs the node's primitive wider
        (``Backend.widened_contractions``), or the dot itself (``xla.cpu_dot_widened``,
        where XLA:CPU runs most dots narrow); 1 for every other node."""
        backend = self.space.backend
        widened = node.primitive in backend.widened_contractions or (
            node.primitive == "dot_general" and backend.platform == "cpu"
            and self.narrow_dot_widened(node))
        if not widened:
            return 1.0
        return widening(self.graph.values[value_id].dtype, backend.contraction_itemsize)

    def narrow_dot_widened(self, node) -> bool:
        """Whether a dot of narrow floats is one XLA:CPU runs in f32 (``cpu_dot_widened``)."""
        if node.id not in self._dots_widened:
            narrow = [widening(self.graph.values[v].dtype, 4) > 1 for v in node.operands
                      if v is not None]
            self._dots_widened[node.id] = any(narrow) and cpu_dot_widened(node)
        return self._dots_widened[node.id]

    def written_wide(self, value) -> float:
        """How much wider than its dtype XLA writes a computed value: as wide as a
        contraction run wider writes its result, or as one reads it (the fusion making
        an operand converts as it writes, ``wide``); 1 for others."""
        graph = self.graph
        producer = graph.nodes[value.producer]
        if producer.kind != "eqn":
            return 1.0
        return max([self.wide(producer, value.id)] + [
            self.wide(graph.nodes[u], value.id) for u, _ in graph.users[value.id]])

    def transposed_reads(self) -> list[tuple[int, int, int]]:
        """(value, node, operand) of the operands XLA copies first (not for dead code:
        ``jax.jit`` drops it): into another layout, or, for a contraction run wider, from
        an argument or constant held narrow (a fusion writes a value wide itself), or read
        by an FFT on XLA:CPU (``xla.fft_on_cpu``; a computed one is written where the copy
        is, its work fused into it)."""
        graph, platform = self.graph, self.space.backend.platform
        return [(v, node.id, i) for node in graph.nodes if self.runs(node)
                for i, (v, copied) in enumerate(zip(node.operands, transposed_operands(node)))
                if copied or v is not None and graph.node_of(v).kind in ("arg", "const") and (
                    self.wide(node, v) > 1.0
                    or fft_on_cpu(node.primitive, node.params, platform) == "copied")]

    def runs(self, node) -> bool:
        """Whether XLA runs the node: some output depends on one of its results."""
        return any(v in self._live for v in node.outputs)

    def reshard_buffers(self, from_args: Sequence[bool], copied: Set,
                        paid_once: Mapping[tuple[int, int], tuple]):
        """(term, first node, last node) of every resharded copy a reader makes (see
        ``copy_starts``). A reader that also copies the value into another layout keeps
        the layout copy: an activation is resharded just before it, and a value of
        arguments (a gathered weight) at the start, where its layout copy is made from
        the resharded one, which then dies. Outputs are written in their own spec: their
        buffers are counted as outputs. A read that shares a copy (``paid_once``, see
        ``shared.SharedCopies``) holds none of its own in the specs the copy is made in."""
        graph, menus = self.graph, self.groups.menus
        for value in graph.values:
            users = [(u, i) for u, i in graph.users[value.id]
                     if graph.nodes[u].kind != "output" and self.runs(graph.nodes[u])]
            if not users:
                continue
            starts = self.copy_starts(value.id, from_args)
            array = self.prices.value_array[value.id]
            srcs = menus[value.producer].out_lists[value.index]
            gu = self.groups.group_of_node[value.producer]
            for user, i in users:
                copy = self.copy_bytes(array, srcs, menus[user].in_lists[i], self.fusible[user])
                if copy is None:
                    continue
                gv = self.groups.group_of_node[user]
                if (user, i) in paid_once:   # specs whose copy the readers share
                    copy = (np.where(paid_once[(user, i)][2][None, :], 0.0, copy[0]),)
                    if not copy[0].any():
                        continue
                term = GroupTerm(gu, copy[1]) if gu == gv else PairTerm(gu, gv, copy[0])
                if (value.id, user) in copied and not from_args[value.id]:
                    yield term, user, user
                    continue
                last = self.held_to(value.id, user, from_args, copied)
                if last >= starts[user]:
                    yield term, starts[user], last
                yield from self.held_under_bitcast(term, user, last, copied)

    def held_under_bitcast(self, term, user: int, last: int, copied: Set):
        """A resharded copy (a weight gathered) that its reader, a broadcast, turns into a
        bitcast (``bitcast_of_operand``): held on, in the reader's strategies that are
        one, until the broadcast's result is last read (``bitcast_read_to``)."""
        bitcast, end = self.bitcast_read_to(user, copied)
        if bitcast is None or end <= last:
            return
        if isinstance(term, PairTerm):
            kept = PairTerm(term.u, term.v, np.where(bitcast[None, :], term.num_bytes, 0.0))
        else:
            kept = GroupTerm(term.group, np.where(bitcast, term.num_bytes, 0.0))
        yield kept, last + 1, end

    def bitcast_read_to(self, node_id: int, copied: Set) -> tuple[np.ndarray | None, int]:
        """For a broadcast that is a bitcast of its operand in some of its group's
        strategies (``bitcast_of_operand``): those strategies, and the last node that reads
        its result, which reads the operand's buffer (through a loop it enters as a
        constant: the loop's end). (None, -1) for other nodes."""
        node = self.graph.nodes[node_id]
        if node.kind != "eqn" or node.primitive != "broadcast_in_dim":
            return None, -1
        bitcast = self.bitcast_of_operand(self.graph.values[node.outputs[0]])
        if bitcast is None or not bitcast.any():
            return None, -1
        return bitcast, self.last_reads(copied)[node.outputs[0]]

    def layout_copies(self, from_args: Sequence[bool], transposed):
        """(term, first node, last node) of the copies XLA makes of operands it reads in
        another layout (``transposed_reads``), in the spec their reader wants; live like
        any copy (see ``copy_starts``): a weight's from the start of the program. A copy
        of arguments alone that no earlier reader makes alike (``layout_copy_kind``) is
        work on arguments alone, which XLA does first: it too lives from the start (a
        bf16 kernel read in f32 by a convolution, and transposed in f32 by its kernel
        gradient: two copies, both made at the start). XLA:CPU makes a computed value's
        first copy of a kind once the value is written (``layout_copy_made``): the
        activation a weight-gradient convolution reads transposed."""
        kinds: dict[int, set] = {}
        for value_id, node_id, i in sorted(transposed, key=lambda read: read[1]):
            num_bytes = (self.read_bytes(node_id, i)
                         * self.wide(self.graph.nodes[node_id], value_id))
            kind = self.layout_copy_kind(value_id, node_id, i)
            made = kinds.setdefault(value_id, set())
            first = self.copy_starts(value_id, from_args)[node_id]
            if kind not in made:
                first = min(first, self.layout_copy_made(self.graph.values[value_id],
                                                         from_args))
            made.add(kind)
            yield GroupTerm(self.groups.group_of_node[node_id], num_bytes), first, node_id

    def layout_copy_made(self, value, from_args: Sequence[bool]) -> float:
        """Where XLA makes a value's first layout copy of a kind, if it makes it early:
        at the start for a value of arguments alone; after its producer's node where the
        backend copies a value once written (``layout_copies_made_when_written``)."""
        if from_args[value.id]:
            return 0
        if layout_copies_made_when_written(self.space.backend.platform):
            return self.written_at(self.graph.nodes[value.producer], value) + 1
        return math.inf

    def layout_copy_kind(self, value_id: int, node_id: int, i: int) -> tuple:
        """What a layout copy of a value for operand ``i`` of a node is, as far as XLA
        makes one copy for readers alike: the reader's primitive and operand, the order
        it reads the value's dims in (``xla.read_order``), and how wide it reads it. A
        kernel gradient of a convolution reads its input in another order than the
        convolution: XLA copies the input twice."""
        node = self.graph.nodes[node_id]
        return (node.primitive, i, read_order(node, i), self.wide(node, value_id))

    def sorts_top_k(self, node) -> bool:
        """Whether XLA:CPU runs ``node``, a top_k, as a sort (``xla.cpu_top_k_scratch``)."""
        if self.space.backend.platform != "cpu" or node.primitive != "top_k":
            return False
        return cpu_top_k_scratch(np.dtype(self.graph.values[node.operands[0]].dtype)) > 0

    def packed_by_sort(self, value) -> bool:
        """Whether an elementwise result is computed where a top_k run as a sort
        (``sorts_top_k``), its one reader, packs its keys: never written on its own."""
        users = self.graph.users[value.id]
        return (self.fusible[value.producer] and len(users) == 1
                and value.id not in self.graph.outputs
                and self.sorts_top_k(self.graph.nodes[users[0][0]]))

    def scratch_buffers(self):
        """(term, node, node) of the buffers a node holds while it runs and no reader
        sees: those XLA:CPU sorts in for a top_k (``xla.cpu_top_k_scratch``), per element
        of its operand in the spec it reads; an FFT's own result before its copy out
        (``xla.fft_on_cpu``), which elementwise readers make as they read it; a
        convolution's result in its own layout before its copy into the program's output
        (``copied_out``); the expanded result of a convolution with batch groups
        (``xla.cpu_batch_groups_expanded``), as wide as the convolution runs; and the
        indices of a batched scatter made explicit (``xla.cpu_batched_scatter_indices``),
        from the indices in the spec it reads them in."""
        platform = self.space.backend.platform
        for node in self.graph.nodes:
            if not self.runs(node):
                continue
            g = self.groups.group_of_node[node.id]
            if self.sorts_top_k(node):
                value = self.graph.values[node.operands[0]]
                itemsize = np.dtype(value.dtype).itemsize
                yield GroupTerm(g, self.read_bytes(node.id, 0) * cpu_top_k_scratch(
                    np.dtype(value.dtype)) / itemsize), node.id, node.id
            elif (fft_on_cpu(node.primitive, node.params, platform) == "copied"
                  and not self.slices_fused(node.outputs[0])):
                yield self.value_bytes(node.outputs[0]), node.id, node.id
            elif (node.outputs and self.copied_out(node.outputs[0])
                  and node.outputs[0] in self.graph.outputs):
                yield self.value_bytes(node.outputs[0]), node.id, node.id
            if indices := cpu_batched_scatter_indices(node, platform):
                yield GroupTerm(g, self.read_bytes(node.id, 1) * indices), node.id, node.id
            if (expanded := cpu_batch_groups_expanded(node, platform)) > 1:
                value = self.graph.values[node.outputs[0]]
                term = self.value_bytes(value.id)
                yield GroupTerm(g, term.num_bytes * expanded * self.wide(node, value.id)
                                ), node.id, node.id

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
        slice is written out at the node and the full result dies there. A partial
        result written narrower than the backend's collectives move it (a bf16 dot jax
        0.12's XLA:CPU runs at bf16, reduced in f32) is converted to the wire's width
        at the node, and that copy is held until the combined collective reads it: the
        difference in width is held beside the result from the node to there."""
        points = self.combined.points
        for node in self.graph.nodes:
            buffers = self.reduction_buffers(node) if self.runs(node) else None
            if buffers is None:
                continue
            g = self.groups.group_of_node[node.id]
            value_id = node.outputs[0]
            combine_at = points.get(loop_scope(node), node.id)
            for num_bytes, first, last in zip(
                    buffers, (node.id, node.id, combine_at, node.id),
                    (node.id, last_read[value_id], combine_at, combine_at)):
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
        combined collective runs, and what a partial result's wider copy adds to it,
        held until then,
        each None where it is nothing; None for a node that never reduces. Nodes sharing
        a menu share them."""
        strategies, picks = self.space.strategies[node.id], self.groups.picks[node.id]
        wider = self.reduced_wider(self.graph.values[node.outputs[0]])
        key = (self.groups.menus[node.id], self.slices_fused(node.outputs[0]), wider)
        if key not in self._reductions:
            self._reductions[key] = self._reduction_buffers(node, strategies, picks, wider)
        return self._reductions[key]

    def _reduction_buffers(self, node, strategies, picks, wider: float):
        if not any(c.kind in REDUCTIONS for s in strategies for c in s.collectives):
            return None
        at_node, held, at_combine, converted = (np.zeros(len(picks)) for _ in range(4))
        joins = self.combined.joins[node.id]
        value = self.graph.values[node.outputs[0]]
        for s, k in enumerate(picks):
            strategy = strategies[k]
            # reductions one after another over different axes reduce one buffer in place
            reductions = [c for c in strategy.collectives if c.kind in REDUCTIONS]
            for c in reductions[:1]:
                emulated = c.kind == "reduce-scatter" and not self.native_reduce_scatter
                if emulated and (joins or self.slices_fused(value.id)):
                    out_bytes = specs.per_device_bytes(value.shape, value.dtype,
                                                       strategy.out_specs[0], self.space.axis_sizes)
                    held[s] += c.num_bytes - out_bytes
                    if joins:
                        at_combine[s] += c.num_bytes
                    else:   # the partial result; the full one is held
                        at_node[s] += c.num_bytes
                elif strategy.combined and joins:
                    at_combine[s] += c.num_bytes
                    converted[s] += c.num_bytes * (1.0 - 1.0 / wider) if wider else 0.0
                else:   # the partial result, and an emulated reduce-scatter's full one
                    at_node[s] += c.num_bytes * (2 if emulated else 1)
        return tuple(b if b.any() else None for b in (at_node, held, at_combine, converted))

    def reduced_wider(self, value) -> float:
        """How much wider the backend's collectives move a value than XLA writes it, where
        they move it wider (0 elsewhere): its partial result is then converted to the
        wire's width before it is reduced."""
        itemsize = self.space.backend.collective_itemsize
        wider = collective_widening(value.dtype, itemsize) / self.written_wide(value)
        return wider if wider > 1.0 else 0.0

    def memory(self, shared: SharedCopies) -> Memory:
        """Memory terms (arguments and outputs fixed; temporaries, resharded copies and
        collective buffers each with the range of nodes it is live over), the fixed ones
        among them, and the rows of terms live together; the copies readers share
        (``shared``) held once."""
        found = self.uncopied()
        from_args, copied = found.from_args, found.copied
        copies = list(self.reshard_buffers(from_args, copied, shared.paid_once))
        spans = [*found.spans, *(c for c in copies if isinstance(c[0], GroupTerm)),
                 *(c for c in copies if isinstance(c[0], PairTerm)),
                 *self.shared_copy_spans(from_args, copied, shared.held)]
        return with_rows(found.terms, found.fixed, spans)

    def memory_before_pricing(self) -> Memory:
        """``memory``'s terms, fixed terms and rows but the resharded copies, which depend
        on prices (which copies readers share): every peak they give is at most the
        priced graph's, so their floor (``request.fewest_peak``) bounds its floor."""
        found = self.uncopied()
        return with_rows(found.terms, found.fixed, found.spans)

    def uncopied(self) -> Uncopied:
        """What ``memory`` counts before the resharded copies (``Uncopied``). Computed
        once per graph."""
        if self._uncopied is not None:
            return self._uncopied
        graph = self.graph
        terms: list[MemoryTerm] = []
        fixed = []
        resident = set()
        live = self._live
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
            terms.append(GroupTerm(0, np.full(self.groups.group_size(0),
                                               float(POINTER_BYTES * len(graph.outputs)))))
        from_args, transposed = self.from_arguments(), self.transposed_reads()
        # a reader of a copy made before it does not hold the value: the copy does
        copied = {(v, n) for v, n, _ in transposed
                  if self.copy_starts(v, from_args)[n] < n}
        last_read = self.last_reads(copied)
        spans = []   # (term, first node, last node): a temporary lives from its producer
        #              (or the start) to its last reader
        states, in_state, held = self.loop_states(last_read, resident)
        hoisted = self.hoisted()
        not_temporary = resident | aliased | in_state
        written = self.written_into_outputs(last_read, resident)
        not_temporary |= set(written)
        for value_id, read in written.items():
            value = graph.values[value_id]
            term = self.sliced_as_read(value, read)
            if term is not None:
                spans.append((term, self.first_written(value, from_args), read[0]))
        in_place = self.overwritten(last_read, not_temporary)
        for value in graph.values:
            if value.id in not_temporary or not self.space.materialized[value.id]:
                continue
            seam = graph.nodes[value.producer]
            if seam.kind in ("eqn", "const") and value.id not in live:
                continue  # dead code, or a constant only it reads: jax.jit drops it
            if seam.kind == "boundary" and not self.seam_buffer(seam, value):
                continue  # a seam aliasing the buffer it connects
            if self.packed_by_sort(value):
                continue  # computed in the fusion that packs a top_k's keys
            first = self.first_written(value, from_args)
            last = held.get(value.id, last_read[value.id])
            if value.id in in_place:   # its buffer is its overwriter's from there on
                over = graph.values[in_place[value.id]]
                last = min(last, self.first_written(over, from_args)) - 1
                if last < first:
                    continue
            if value.id in hoisted:   # made before its loop, read by every iteration
                first, last = hoisted[value.id][0], max(last, hoisted[value.id][1])
            if from_args[value.id] and last == value.producer:
                last = first   # read through copies alone, made from it at the start
            spans.append((self.temporary_bytes(value), first, max(first, last)))
        spans += states
        spans += self.collective_buffers(last_read)
        spans += self.layout_copies(from_args, transposed)
        spans += self.scratch_buffers()
        spans += self.loop_operand_copies()
        self._uncopied = Uncopied(tuple(terms), tuple(fixed), tuple(spans), tuple(from_args),
                                  frozenset(copied))
        return self._uncopied

    def seam_buffer(self, seam, value) -> bool:
        """Whether a seam's result is a buffer of its own: a scan's stacked ys (trip
        count x the body's slice), and the slice of a stacked xs that some reader cannot
        slice as it reads (a dot, a convolution, a loop: XLA writes the dynamic slice out
        first; an elementwise reader fuses it, and so does the static slice of a scan
        unrolled whole, which slices the outer stack where it lies). Other seams alias
        the buffer they connect: a loop's state (``loop_states``), its constants, a
        branch's operands."""
        if seam.primitive == "loop_ys":
            return True
        if seam.primitive != "loop_xs":
            return False
        return not all(self.slices_as_it_reads(u) for u, _ in self.graph.users[value.id])

    def slices_as_it_reads(self, node_id: int) -> bool:
        """Whether XLA fuses a slice into a reader: an elementwise op, or the static slice
        of a scan unrolled whole."""
        node = self.graph.nodes[node_id]
        if node.kind == "boundary":
            return node.primitive == "loop_xs" and bool(node.params.get("static"))
        return (node.kind == "eqn" and self.fusible[node_id]
                and not contraction(self.space.einsums[node_id]))

    def hoisted(self) -> dict[int, tuple[int, int]]:
        """Values XLA computes before a loop rather than in it (while-loop-invariant code
        motion): made in a loop's body from what enters it as a constant alone (a
        stage's weights reshaped, a weight's transpose for the backward pass), each with
        the first node and the end of the body of the outermost such loop, over which
        its buffer is held (every iteration reads it)."""
        graph, loops, found = self.graph, self.loops(), {}
        for loop in loops.running():
            body, start, end = loop + ("body",), loops.starts[loop], loops.ends[loop]
            invariant: dict[int, bool] = {}

            def entered(v):   # a value the body reads, as this iteration's loop sees it
                if v is None or v in invariant:  # noqa: B023
                    return v is None or invariant[v]  # noqa: B023
                seam = graph.node_of(v)
                return not (seam.key[:-2] == loop  # noqa: B023
                            and seam.primitive != "loop_const")

            for node in graph.nodes[start:end + 1]:
                if node.key[:len(body)] != body:
                    continue
                flag = not moves_with_loop(node) and all(map(entered, node.operands))
                for v in node.outputs:
                    invariant[v] = flag
                    if flag and node.primitive != "loop_const":
                        found.setdefault(v, (start, end))
        return found

    def loop_init(self, value) -> bool:
        """Whether a value only initializes loop carries (a gradient accumulator's zeros):
        XLA writes it where the loop state is built, just before the loop, not first
        with the other work on arguments alone."""
        users = self.graph.users[value.id]
        return bool(users) and all(self.graph.nodes[u].primitive == "loop_carry" and i == 0
                                   for u, i in users)

    def first_written(self, value, from_args: Sequence[bool]) -> int:
        """The first node of a temporary's buffer: the start for work on arguments alone
        (``from_arguments``) but a loop's initial carry, else ``written_at``."""
        if from_args[value.id] and not self.loop_init(value):
            return 0
        return self.written_at(self.graph.nodes[value.producer], value)

    def written_at(self, seam, value) -> int:
        """The first node of a temporary's buffer: its producer's; for a loop's stacked
        ys, the loop's start (XLA keeps the stack in the loop state and writes each
        iteration's slice into it); for a slice of stacked xs, its first reader (XLA
        slices it there)."""
        if seam.kind != "boundary":
            return value.producer
        loops = self.loops()
        if seam.primitive == "loop_ys" and loops.runs(seam):
            return loops.start(seam)
        if seam.primitive == "loop_xs":
            return min(u for u, _ in self.graph.users[value.id])
        return value.producer

    def loop_states(self, last_read: Sequence[int], resident: set):
        """What XLA keeps for the carries of a loop it runs: a buffer per carry, the loop
        state, from the loop's start to the end of its body or the final value's last
        reader after the loop (none for a final value the program returns: the state is
        then the output's buffer). The body writes its new carry into the state where
        the old one is no longer read (an elementwise update in place: an accumulator);
        where it still is, the new value is a buffer of its own to the end of the body,
        copied into the state there.

        Returns the states' (term, first node, last node) spans, the body results written
        into their state, and the body results held to the end of the body (value ->
        last node)."""
        graph, loops = self.graph, self.loops()
        spans, in_state, held = [], set(), {}
        for node in graph.nodes:
            if node.primitive != "loop_carry" or node.kind != "boundary" or not loops.runs(node):
                continue
            body_in, final = node.outputs
            end = loops.body_end(node)
            result = node.operands[1]
            if result is not None and result != body_in and graph.node_of(result).kind == "eqn":
                producer, read = graph.values[result].producer, last_read[body_in]
                if producer > read or producer == read and self.fusible[producer]:
                    in_state.add(result)
                else:
                    held[result] = end
            if final not in resident:
                spans.append((self.value_bytes(body_in), node.id + 1,
                              max(end, last_read[final])))
        return spans + list(self.state_tables()), in_state, held

    def state_tables(self):
        """(term, first node, last node) of each loop's state tuple: XLA passes a loop's
        state as a tuple, a table of one pointer per element (a scan's counter, its
        carries, constants, xs and ys), held through the loop."""
        graph, loops, elements = self.graph, self.loops(), {}
        for node in graph.nodes:
            if node.kind == "boundary" and node.primitive in LOOP_SEAMS:
                loop = node.key[:-2]
                counter = node.primitive in ("loop_xs", "loop_ys")   # a scan's, once
                count, scan = elements.get(loop, (0, False))
                elements[loop] = (count + 1, scan or counter)
        for loop in loops.running():
            count, scan = elements[loop]
            num_bytes = np.full(self.groups.group_size(0), float(POINTER_BYTES * (count + scan)))
            yield GroupTerm(0, num_bytes), loops.starts[loop], loops.ends[loop]

    def shared_copy_spans(self, from_args: Sequence[bool], copied: Set, held: Sequence[tuple]):
        """(term, first node, last node) of every copy readers share: held from the first
        of them that may make it (see ``copy_starts``) to the last that shares it, as a
        term per reading node, each held up to that node (``held_to``) if a read at or
        after it shares the copy (``shared.held_until``); ``held``: per copy, (value, bytes,
        those (index, node)), ``SharedCopies.held``. A reader that is a bitcast of the copy
        holds it while its result is read (``bitcast_read_to``), in each of its strategies:
        a shared copy is held or not, whatever the reader's."""
        for value_id, num_bytes, until in held:
            starts = self.copy_starts(value_id, from_args)
            first = min(starts[node] for _, node in until)
            for k, node in until:
                last = max(self.held_to(value_id, node, from_args, copied),
                           self.bitcast_read_to(node, copied)[1])
                if last >= first:
                    yield CopyTerm(k, num_bytes), first, last
                first = node + 1
