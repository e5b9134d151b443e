"""strategies: Graph -> StrategySpace.

Every node gets its candidate strategies: which mesh axes split which einsum factor,
what spec each operand must arrive in, what spec each result leaves in, and what that
costs on one device (roofline compute and the collectives a split contraction needs).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from autoshard.cost import kept
from autoshard.errors import PinError
from autoshard.frontend import specs
from autoshard.frontend.graph import Graph, Node
from autoshard.frontend.specs import Spec
from autoshard.rules import RULES, Einsum, rule_for
from autoshard.rules.replicated import REPLICATED
from autoshard.target import hardware as hwlib
from autoshard.target.hardware import Backend, Hardware
from autoshard.target.xla import (
    collective_widening,
    contraction,
    fused_static_slices,
    hoisted_runs,
    materialized_values,
    moves_no_data,
    reshapes_dot_result,
    stored_widening,
    trailing_nodes,
    transposed_operands,
    transposes_dot_result,
    widening,
)

REPLICATED_BELOW_ELEMENTS = 1024   # arrays this small are kept whole (value_strategies)
MAX_STRATEGIES = 96
KEPT_MENUS_MAX = 1 << 13   # nodes' strategies a process keeps, at most, per Hardware


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    num_bytes: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    in_specs: tuple[Spec | None, ...]
    out_specs: tuple[Spec, ...]
    compute_s: float
    comm_s: float
    collectives: tuple[Collective, ...] = ()
    # collectives XLA's combiner merges with their like: their latency is paid once per
    # (kind, axes) for the whole program, not in comm_s
    combined: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def seconds(self) -> float:
        return self.compute_s + self.comm_s


@dataclasses.dataclass(frozen=True, eq=False)
class StrategySpace:
    graph: Graph
    strategies: tuple[tuple[Strategy, ...], ...]   # per node
    einsums: tuple[Einsum | None, ...]              # per node
    materialized: tuple[bool, ...]                  # per value: XLA keeps it in memory
    axis_sizes: Mapping[str, int]
    hardware: Hardware
    # per node: its collectives combine at the end of its computation (trailing_nodes),
    # not with their siblings (reduction_waves)
    trailing: tuple[bool, ...] = ()
    backend: Backend = dataclasses.field(default_factory=Backend.bare)   # priced for it
    # per node: the number of its strategies; nodes of one number share one tuple (a
    # repeated layer's nodes), so whatever follows from the strategies alone is computed
    # once per number
    menu_ids: tuple[int, ...] = ()

    def num_strategies(self) -> int:
        return sum(len(s) for s in self.strategies)


def group_of(axes: tuple[str, ...], axis_sizes) -> int:
    return math.prod(axis_sizes[a] for a in axes)


def assignments(einsum: Einsum, axis_sizes) -> list[dict[str, tuple[str, ...]]]:
    """Every way to give each mesh axis to one label (or none) that divides evenly."""
    names = [a for a, n in axis_sizes.items() if n > 1]
    labels = einsum.labels
    out = []
    for choice in itertools.product([None, *labels], repeat=len(names)):
        split: dict[str, tuple[str, ...]] = {}
        for axis, label in zip(names, choice):
            if label is not None:
                split[label] = split.get(label, ()) + (axis,)
        if (all(einsum.sizes[l] % group_of(ax, axis_sizes) == 0 for l, ax in split.items())
                and not leaves_replicas_in_reduction(einsum, split, choice)):
            out.append(split)
    return out


def leaves_replicas_in_reduction(einsum: Einsum, split, choice) -> bool:
    """A split reduce label of an einsum whose partial results XLA sums over every device
    (``Einsum.reduces_over_all_devices``), with some mesh axis left to replicate over:
    the replicas' copies would be summed too."""
    return (einsum.reduces_over_all_devices and bool(einsum.reduce & split.keys())
            and None in choice)


def term_spec(term, split) -> Spec:
    return tuple(split.get(label, ()) if label is not None else () for label in term)


def strategy_name(split) -> str:
    return ",".join(f"{l}={'+'.join(ax)}" for l, ax in sorted(split.items())) or "replicated"


@dataclasses.dataclass(frozen=True)
class _Context:
    axis_sizes: Mapping[str, int]
    hardware: Hardware
    # (per operand, per result): 0 where fused, else how much wider than its dtype it is
    # read from or written to memory (``xla.stored_widening``; 1: its own width)
    materialized: tuple
    backend: Backend               # which collectives combine, the width they move
    # a transpose its producing dot computes (``xla.transposes_dot_result``)
    dot_transposed: bool = False
    runs: float = 1.0   # how many times XLA runs the node a call (``xla.hoisted_runs``)
    fused_slice: bool = False   # a static slice its readers fuse (``xla.fused_static_slices``)
    trailing: bool = False   # its collectives join the one combined at the end


def einsum_strategies(node: Node, einsum: Einsum, out_shapes, out_dtypes, ctx) -> list[Strategy]:
    axis_sizes, hw, materialized = ctx.axis_sizes, ctx.hardware, ctx.materialized
    transposed = transposed_operands(node)
    read_widths, write_widths = stored_widths(einsum, node, out_dtypes, ctx)
    result = []
    for split in assignments(einsum, axis_sizes):
        in_specs = tuple(term_spec(t, split) if v is not None else None
                         for t, v in zip(einsum.operands, node.operands))
        out_specs = [term_spec(t, split) for t in einsum.outputs]
        iteration_shards = math.prod(group_of(ax, axis_sizes) for ax in split.values())
        flops = einsum.flops / iteration_shards
        in_bytes_each = [specs.per_device_bytes(s, d, sp or specs.replicated(len(s)), axis_sizes)
                         for s, d, sp in zip(node.operand_shapes, node.operand_dtypes, in_specs)]
        out_bytes = [specs.per_device_bytes(s, d, sp, axis_sizes)
                     for s, d, sp in zip(out_shapes, out_dtypes, out_specs)]
        stored_in = [b * width for b, width in zip(in_bytes_each, read_widths)]
        stored_out = [b * width for b, width in zip(out_bytes, write_widths)]
        if einsum.fusible:   # a fusion reads its materialized inputs, writes its outputs
            touched = (sum(b for b, m in zip(stored_out, materialized[1]) if m)
                       + sum(b for b, m in zip(stored_in, materialized[0]) if m))
        else:
            touched = sum(stored_in) + sum(stored_out)
        if ((ctx.dot_transposed or moves_no_data(node, in_specs, axis_sizes))
                and materialized[0][0] and materialized[1][0]):
            touched = 0.0   # its result is its operand's buffer: nothing moves
        compute_s = (hw.compute_seconds(flops, touched) + layout_copy_seconds(
            stored_in, transposed, hw)) * ctx.runs
        if node.kind in ("output", "boundary"):
            compute_s = (0.0 if ctx.fused_slice else
                         slice_copy_seconds(node, out_shapes, stored_in, stored_out, hw, ctx.runs))
        partial_axes = tuple(a for a in axis_sizes
                             for l in einsum.reduce if a in split.get(l, ()))
        name = strategy_name(split)
        wire_bytes = [b * collective_widening(d, ctx.backend.collective_itemsize)
                      for b, d in zip(out_bytes, out_dtypes)]   # what collectives move
        if not partial_axes:
            permutes = shift_permutes(einsum, split, wire_bytes, node.weight, ctx)
            result.append(Strategy(name, in_specs, tuple(out_specs), compute_s,
                                   sum(c.seconds for c in permutes), permutes))
            continue
        per_label = sorted(tuple(a for a in axis_sizes if a in split[l])
                           for l in einsum.reduce if split.get(l))
        compute_s += rounding_before_reduction(node, einsum, out_bytes, wire_bytes,
                                               ctx) * node.weight
        result += reduction_variants(node, name, in_specs, out_specs, out_shapes, wire_bytes,
                                     partial_axes, per_label, compute_s, einsum, ctx)
    return result


def rounding_before_reduction(node: Node, einsum: Einsum, out_bytes, wire_bytes, ctx) -> float:
    """A backend that runs a narrow-float dot in f32 and reduces narrow floats in f32
    (CPU) rounds the dot's partial result to its dtype before the reduction: convert to
    bf16 and back. Next to each other XLA drops that pair (it allows excess precision);
    split by the reshape after a dot of several free dims (``xla.reshapes_dot_result``)
    they stay, in a fusion of their own that reads and writes the result at f32 width."""
    if not (contraction(einsum) and ctx.backend.contraction_itemsize
            and wire_bytes[0] > out_bytes[0] and reshapes_dot_result(node)):
        return 0.0
    return ctx.hardware.compute_seconds(0.0, 2 * wire_bytes[0])


def stored_widths(einsum: Einsum, node: Node, out_dtypes, ctx) -> tuple[list, list]:
    """How much wider than its dtype each operand is read and each result written
    (``xla.stored_widening``): a contraction on a backend that runs narrow floats wider
    reads and writes every narrow operand at that width, whether it is in memory or
    folded in; other nodes, what is in memory at the width it was stored."""
    if contraction(einsum):
        itemsize = ctx.backend.contraction_itemsize
        return ([widening(d, itemsize) for d in node.operand_dtypes],
                [widening(d, itemsize) for d in out_dtypes])
    return ([max(width, 1.0) for width in ctx.materialized[0]],
            [max(width, 1.0) for width in ctx.materialized[1]])


def shift_permutes(einsum: Einsum, split, out_bytes, weight: float, ctx) -> tuple:
    """The collective-permute of a roll along a split dim (``Einsum.shifted``): each
    device sends its block of the result to its neighbour over the dim's axes."""
    axes = tuple(a for a in ctx.axis_sizes for l in einsum.shifted if a in split.get(l, ()))
    if not axes:
        return ()
    hw = ctx.hardware
    seconds = hwlib.collective_permute_seconds(
        out_bytes[0], hw.group_bandwidth(axes), hw.link_latency) * weight
    return (Collective("collective-permute", axes, out_bytes[0], seconds),)


def layout_copy_seconds(in_bytes_each, copied: Sequence[bool], hw: Hardware) -> float:
    """The copies XLA makes of operands it reads in another layout (``transposed_operands``):
    each read and written once, before the node."""
    return hw.compute_seconds(0.0, 2 * sum(b for b, c in zip(in_bytes_each, copied) if c))


def slice_copy_seconds(node: Node, out_shapes, in_bytes_each, out_bytes, hw: Hardware,
                       runs: float) -> float:
    """What a seam costs on one device. A scan copies each iteration's xs slice out of
    its stack (dynamic-slice) and its ys slice into its stack (dynamic-update-slice),
    reading and writing the slice; the ys stack is zero-filled once before the loop. A
    scan unrolled whole stacks nothing: its readers read each iteration's result. Other
    seams hand a buffer over: the value's producer already wrote it. ``runs``: how many
    times the seam runs a call, less than its weight where XLA hoists a scan unrolled
    whole's static slices of a stack an outer loop keeps (``xla.hoisted_runs``)."""
    if node.params.get("unrolled"):
        return 0.0
    if node.primitive == "loop_xs":
        length, slice_bytes, copies = node.operand_shapes[0][0], out_bytes[0], 2
    elif node.primitive == "loop_ys":
        length, slice_bytes, copies = out_shapes[0][0], in_bytes_each[0], 3
    else:
        return 0.0
    return hw.compute_seconds(0.0, copies * slice_bytes) * length * runs


def concatenation(combined, num_bytes: float, node, ctx) -> float:
    """Seconds a backend that copies a combined all-reduce's operands into one buffer
    and its result back out (``Backend.all_reduce_copies``) spends copying this node's
    share: its bytes read and written once a copy, per combined all-reduce it joins."""
    copies = ctx.backend.all_reduce_copies
    joins = sum(kind == "all-reduce" for kind, _ in combined)
    return ctx.hardware.compute_seconds(0.0, 2 * num_bytes * joins * copies) * node.weight


def reduction_variants(node, name, in_specs, out_specs, out_shapes, out_bytes, partial_axes,
                       per_label, compute_s, einsum: Einsum, ctx) -> list[Strategy]:
    """A split contraction: all-reduce the partial result, or reduce-scatter it onto a dim.

    Reduced dims split over different mesh axes (``per_label``: each reduced label's
    axes) are all-reduced one after the other, one all-reduce per dim over its own axes
    (XLA's partitioner: a batch norm's statistics over batch and height). A contraction
    reduce-scatters over all of them at once; a reduce op all-reduces over all but the
    last and scatters over that one."""
    axis_sizes, hw = ctx.axis_sizes, ctx.hardware
    num_bytes = out_bytes[0]

    def priced(kind, seconds_fn, axes, num_bytes=num_bytes):
        n, bw = group_of(axes, axis_sizes), hw.group_bandwidth(axes)
        seconds = seconds_fn(num_bytes, n, bw, hw.link_latency) * node.weight
        merged = ctx.backend.combined_as(kind, ctx.trailing)
        if merged is not None:   # the combiner pays the latency once for all, once per
            # iteration of the loop body holding it (cost.SharedCost)
            return seconds - hw.link_latency * node.weight, ((merged, axes),)
        return seconds, ()
    reduces, combined = [], ()
    for axes in per_label:
        seconds, joins = priced("all-reduce", hwlib.all_reduce_seconds, axes)
        reduces.append(Collective("all-reduce", axes, num_bytes, seconds))
        combined += joins
    copied = concatenation(combined, num_bytes, node, ctx)
    variants = [Strategy(name + f" all-reduce({'+'.join(partial_axes)})", in_specs,
                         tuple(out_specs), compute_s + copied,
                         sum(c.seconds for c in reduces), tuple(reduces), combined)]
    # a batch-grouped conv's partial sum scattered onto its result aborts XLA's
    # partitioner (convolution_handler: new_input_batch_size % new_output_batch_size)
    if einsum.reduce_op != "sum" or len(out_specs) != 1 or einsum.reduces_over_all_devices:
        return variants
    # a contraction scatters over all its reduced axes at once; a reduce op all-reduces
    # over all but the last of its split dims first
    if einsum.contraction or len(per_label) == 1:
        first, first_joins, scatter_axes = (), (), partial_axes
    else:
        first, first_joins, scatter_axes = tuple(reduces[:-1]), combined[:-1], per_label[-1]
    rs, rs_combined = priced("reduce-scatter", hwlib.reduce_scatter_seconds, scatter_axes)
    scatter = (*first, Collective("reduce-scatter", scatter_axes, num_bytes, rs))
    seconds, joins = sum(c.seconds for c in scatter), first_joins + rs_combined
    out = out_specs[0]
    for d, size in enumerate(out_shapes[0]):
        scattered = out[d] + partial_axes
        if size % group_of(scattered, axis_sizes) == 0:
            spec = out[:d] + (scattered,) + out[d + 1:]
            replicas = math.prod(n for a, n in axis_sizes.items()
                                 if a not in specs.spec_axes(spec))
            if einsum.contraction and out[d] and batch_label(einsum, d):
                variants.append(regathered_scatter(node, name, in_specs, spec, compute_s,
                                                   partial_axes, d, out[d], num_bytes,
                                                   priced, ctx))
            elif first or replicas == 1 or replicas % group_of(partial_axes, axis_sizes):
                variants.append(Strategy(name + f" reduce-scatter({'+'.join(partial_axes)})->{d}",
                                         in_specs, (spec,), compute_s, seconds, scatter, joins))
            else:
                shard_bytes = num_bytes / group_of(partial_axes, axis_sizes)
                variants.append(replicated_scatter(node, name, in_specs, spec, compute_s,
                                                   partial_axes, d, shard_bytes, priced, ctx))
    return variants


def replicated_scatter(node, name, in_specs, spec, compute_s, partial_axes, d, shard_bytes,
                       priced, ctx) -> Strategy:
    """A contraction scattered onto a spec that leaves mesh axes unused (its result
    replicated along them over at least as many devices as it scatters over, a multiple
    of them): XLA's partitioner splits the partial result among those replicas first,
    all-reduces each device's part over the contracted axes and sends it to the device
    the spec wants it on. x P(None, "model") @ w P("model", None) -> P("model") all-
    reduces half the result over model, then permutes that half across data and model,
    on 8x2, 4x2 and 2x2 meshes; on 2x4 and 2x8 (fewer replicas than model's devices) it
    reduce-scatters."""
    ar, joins = priced("all-reduce", hwlib.all_reduce_seconds, partial_axes, shard_bytes)
    axes = tuple(a for a in ctx.axis_sizes if ctx.axis_sizes[a] > 1)
    permute = hwlib.collective_permute_seconds(shard_bytes, ctx.hardware.group_bandwidth(axes),
                                               ctx.hardware.link_latency) * node.weight
    collectives = (Collective("all-reduce", partial_axes, shard_bytes, ar),
                   Collective("collective-permute", axes, shard_bytes, permute))
    return Strategy(name + f" reduce-scatter({'+'.join(partial_axes)})->{d}", in_specs,
                    (spec,), compute_s, ar + permute, collectives, joins)


def batch_label(einsum: Einsum, d: int) -> bool:
    """Whether the result's dim ``d`` is a batch dim of the op: one every operand has."""
    label = einsum.outputs[0][d]
    return label is not None and all(label in term for term in einsum.operands)


def regathered_scatter(node, name, in_specs, spec, compute_s, partial_axes, d, split_by,
                       num_bytes, priced, ctx) -> Strategy:
    """A contraction scattered onto a batch dim its operands already split (over
    ``split_by``): XLA's partitioner does not slice the all-reduced result where it
    lies. It all-reduces the partial result over the contracted axes, all-gathers it
    over the batch dim's axes and keeps its device's slice of the whole. [16,128,8,32] x
    [16,8,32,256] batched over e (split over data), contracted over model, to e over
    (data, model): all-reduce f32[2,128,256] over model, all-gather f32[16,128,256] over
    data, on 8x2, 4x2 and 2x4 meshes, in f32 and bf16. Scattered onto a batch dim the
    operands do not split, or onto a split dim that is not a batch dim, it slices; so
    does a reduce op scattered onto a kept dim already split."""
    ar, ar_joins = priced("all-reduce", hwlib.all_reduce_seconds, partial_axes)
    gathered = num_bytes * group_of(split_by, ctx.axis_sizes)
    ag, ag_joins = priced("all-gather", hwlib.all_gather_seconds, split_by, gathered)
    collectives = (Collective("all-reduce", partial_axes, num_bytes, ar),
                   Collective("all-gather", split_by, gathered, ag))
    kept = num_bytes / group_of(partial_axes, ctx.axis_sizes)
    slice_s = ctx.hardware.compute_seconds(0.0, 2 * kept) * node.weight
    return Strategy(name + f" reduce-scatter({'+'.join(partial_axes)})->{d}", in_specs,
                    (spec,), compute_s + slice_s, ar + ag, collectives, ar_joins + ag_joins)


def value_strategies(shape, axis_sizes, pinned: Spec | None = None,
                     small_whole: bool = True) -> list[Strategy]:
    """An argument's (or constant's) candidate specs, nothing to compute: the pinned one,
    or every spec; with ``small_whole``, an array under ``REPLICATED_BELOW_ELEMENTS``
    only whole. That is for backends whose every all-gather pays a latency of its own
    (XLA:CPU's): a small array split saves less than gathering it costs. Where the
    combiner merges all-gathers (XLA:GPU's), a bias or a norm's scale split as FSDP
    splits its weight gathers with the weight, no latency of its own, and may pay: kept
    whole there, pinning it split would beat the unpinned plan."""
    if pinned is not None:
        candidates = [pinned]
    elif small_whole and math.prod(shape) < REPLICATED_BELOW_ELEMENTS:
        candidates = [specs.replicated(len(shape))]
    else:
        candidates = list(specs.enumerate_specs(shape, axis_sizes))
    return [Strategy(specs.spec_str(c), (), (c,), 0.0, 0.0) for c in candidates]


def sliced_by_scan(graph: Graph, node: Node) -> bool:
    return any(graph.nodes[u].primitive == "loop_xs" for u, _ in graph.users[node.outputs[0]])


def keep_scanned_dim_whole(found: list[Strategy]) -> list[Strategy]:
    """An argument a scan slices (stacked layer weights) never splits its leading dim:
    that would gather the whole stack before the loop, where splitting another dim
    gathers one layer at a time inside it."""
    kept = [s for s in found if not s.out_specs[0][0]]
    return kept or found


def prune(strategies: list[Strategy]) -> list[Strategy]:
    """Keep the cheapest strategy per distinct (operand specs, result specs)."""
    best: dict = {}
    for s in strategies:
        key = (s.in_specs, s.out_specs)
        if key not in best or s.seconds < best[key].seconds:
            best[key] = s
    kept = sorted(best.values(), key=lambda s: s.seconds)
    return kept[:MAX_STRATEGIES] if len(kept) > MAX_STRATEGIES else kept


def node_strategies(node: Node, einsum: Einsum, out_values, pin: Spec | None,
                    ctx: _Context, whole: tuple = ((), ())) -> list[Strategy]:
    """``whole``: per operand and per result, whether it must stay unsplit."""
    found = einsum_strategies(node, einsum, [v.shape for v in out_values],
                              [v.dtype for v in out_values], ctx)
    if any(whole[0]) or any(whole[1]):   # the replicated strategy always survives
        found = keep_whole(found, *whole)
    if pin is not None:  # filter before prune's cap, so a pinned spec survives it
        found = [s for s in found if specs_match(s.out_specs[0], pin)]
        if not found:
            raise PinError(f"pin {node.label!r}: {specs.spec_str(pin)} is not a spec this "
                           "result can be produced in (axes sharing a dim go in mesh order)")
    return prune(found)


def specs_match(spec: Spec, pin) -> bool:
    """``spec`` is ``pin``, where a pin's ``None`` dims (left to the planner) take any axes."""
    return spec == pin or len(spec) == len(pin) and all(
        p is None or p == d for d, p in zip(spec, pin))


def whole_values(graph: Graph) -> list[bool]:
    """Per value: kept whole by every reader. Zero-size arrays (nothing to split, and XLA
    cannot read a split one back), and results of primitives without a rule or kept
    replicated on purpose: XLA's partitioner may push a split its reader asks for back
    into the primitive (an fft before it had a rule), which then fails at run time."""
    flags = []
    for value in graph.values:
        node = graph.nodes[value.producer]
        flags.append(math.prod(value.shape) == 0
                     or node.kind == "eqn" and (node.primitive not in RULES
                                                or node.primitive in REPLICATED))
    return flags


def computed_whole(einsum: Einsum) -> Einsum:
    """``einsum`` computed on whole operands into whole results
    (``Backend.whole_primitives``): its readers slice what they split, and its operands
    are gathered, as XLA's partitioner does."""
    def whole(terms):
        return tuple((None,) * len(t) for t in terms)
    return dataclasses.replace(einsum, operands=whole(einsum.operands),
                               outputs=whole(einsum.outputs), sizes={}, reduce=frozenset(),
                               shifted=frozenset())


def keep_whole(found: list[Strategy], whole_in: tuple[bool, ...],
               whole_out: tuple[bool, ...]) -> list[Strategy]:
    """The strategies that split no operand or result flagged whole (``whole_values``)."""
    def splits(spec_list, flags):
        return any(flag and spec is not None and any(spec)
                   for spec, flag in zip(spec_list, flags))
    return [s for s in found
            if not splits(s.in_specs, whole_in) and not splits(s.out_specs, whole_out)]


def hashable(value):
    """``value`` if it hashes, else its repr: params of equal meaning compare equal."""
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def node_signature(graph: Graph, node: Node) -> tuple:
    """What a node's rule and strategies depend on: equal signatures, equal strategies."""
    params = tuple((k, hashable(v)) for k, v in node.params.items())   # jax orders them
    return (node.kind, node.primitive, params, node.operand_shapes, node.operand_dtypes,
            tuple(v is None for v in node.operands),
            tuple((graph.values[v].shape, graph.values[v].dtype) for v in node.outputs),
            node.weight)


PLAIN_TYPES = (int, float, bool, str, type(None), np.dtype, enum.Enum)


def plain(value) -> bool:
    """Whether ``value`` is made of numbers, strings, dtypes and enums alone: a signature
    a process may keep across programs (``kept``) without keeping alive what a program
    holds (a jaxpr in a primitive's params, a callback's closure)."""
    if isinstance(value, (tuple, frozenset)):
        return all(plain(v) for v in value)
    return isinstance(value, PLAIN_TYPES)


def build_strategies(graph: Graph, axis_sizes: Mapping[str, int], hw: Hardware,
                     pins: Mapping[int, Spec] | None = None,
                     backend: Backend | None = None) -> StrategySpace:
    """Enumerate every node's strategies. ``pins`` maps arg/output node ids to a fixed spec;
    ``backend`` says which collectives XLA's combiner merges, the width its collectives
    move narrower floats at and whether it forms reduce-scatter (``Backend.of(mesh)``;
    default ``Backend.bare()``)."""
    pins = pins or {}
    backend = backend or Backend.bare()
    numbers: dict = {}   # equal signatures, one number: hashed once per node
    signatures = [numbers.setdefault(node_signature(graph, node), len(numbers))
                  for node in graph.nodes]
    signature_of = list(numbers)
    einsums, rules_seen = [], {}
    for node, signature in zip(graph.nodes, signatures):
        if node.kind in ("arg", "const"):
            einsums.append(None)
            continue
        if signature not in rules_seen:
            einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
            if node.primitive in backend.whole_primitives:
                einsum = computed_whole(einsum)
            rules_seen[signature] = einsum
        einsums.append(rules_seen[signature])
    materialized = materialized_values(graph, einsums, backend.duplicated)
    stored = stored_widening(graph, einsums, materialized, backend.contraction_itemsize)
    runs = hoisted_runs(graph, stored)
    fused = fused_static_slices(graph, einsums)
    trailing = (trailing_nodes(graph, einsums) if backend.combined
                else [False] * len(graph.nodes))
    unsplit = whole_values(graph)
    all_strategies = []
    known: dict = {}   # a repeated layer's nodes (and arguments of a shape) share strategies
    menus = kept.kept("strategies", hw, KEPT_MENUS_MAX)   # as do nodes alike built before
    mesh = (tuple(axis_sizes.items()), backend)
    for node, einsum in zip(graph.nodes, einsums):
        out_values = [graph.values[v] for v in node.outputs]
        if node.kind == "arg":
            pin = pins.get(node.id)
            scanned = pin is None and sliced_by_scan(graph, node)
            key = ("arg", out_values[0].shape, pin, scanned)
            if key not in known:
                found = value_strategies(out_values[0].shape, axis_sizes, pin,
                                         not backend.merges_all_gathers)
                known[key] = tuple(keep_scanned_dim_whole(found) if scanned else found)
            all_strategies.append(known[key])
            continue
        if node.kind == "const":
            all_strategies.append(tuple(value_strategies(out_values[0].shape, {})))
            continue
        reads = tuple(stored[v] if v is not None and materialized[v] else 0.0
                      for v in node.operands)
        writes = tuple(stored[v.id] if materialized[v.id] else 0.0 for v in out_values)
        whole = (tuple(v is not None and unsplit[v] for v in node.operands),
                 tuple(unsplit[v.id] for v in out_values))
        dot_transposed = transposes_dot_result(graph, node)
        key = (signatures[node.id], reads, writes, trailing[node.id], pins.get(node.id), whole,
               dot_transposed, runs[node.id], fused[node.id])
        if key not in known:
            signature = signature_of[signatures[node.id]]
            kept_key = (signature, *key[1:], mesh) if plain(signature) else None
            found = None if kept_key is None else menus.get(kept_key)
            if found is None:
                found = tuple(node_strategies(
                    node, einsum, out_values, pins.get(node.id),
                    _Context(axis_sizes, hw, (reads, writes), backend, dot_transposed,
                             runs[node.id], fused[node.id], trailing[node.id]), whole))
                if kept_key is not None:
                    menus[kept_key] = found
            known[key] = found
        all_strategies.append(known[key])
    numbers = {}   # every tuple is alive here, so its id names it
    menu_ids = tuple(numbers.setdefault(id(found), len(numbers)) for found in all_strategies)
    return StrategySpace(graph, tuple(all_strategies), tuple(einsums), tuple(materialized),
                         dict(axis_sizes), hw, tuple(trailing), backend, menu_ids)
