"""strategies: Graph -> StrategySpace.

Every node gets its candidate strategies: which mesh axes split which einsum factor,
what spec each operand must arrive in, what spec each result leaves in, and what that
costs on one device (roofline compute and the collectives a split contraction needs).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from autoshard import hardware as hwlib
from autoshard import specs
from autoshard.errors import PinError
from autoshard.graph import Graph, Node
from autoshard.hardware import Hardware
from autoshard.rules import RULES, Einsum, rule_for
from autoshard.rules.replicated import REPLICATED
from autoshard.specs import Spec

REPLICATED_BELOW_ELEMENTS = 1024   # arrays this small are kept whole
MAX_STRATEGIES = 96


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
        if all(einsum.sizes[l] % group_of(ax, axis_sizes) == 0 for l, ax in split.items()):
            out.append(split)
    return out


def term_spec(term, split) -> Spec:
    return tuple(split.get(label, ()) if label is not None else () for label in term)


def strategy_name(split) -> str:
    return ",".join(f"{l}={'+'.join(ax)}" for l, ax in sorted(split.items())) or "replicated"


@dataclasses.dataclass(frozen=True)
class _Context:
    axis_sizes: Mapping[str, int]
    hardware: Hardware
    materialized: tuple            # (per operand: read from memory, per result: written)
    combined_kinds: frozenset      # collective kinds this node's reductions combine
    reduction_itemsize: int = 0    # the backend reduces narrower floats at this width


def einsum_strategies(node: Node, einsum: Einsum, out_shapes, out_dtypes, ctx) -> list[Strategy]:
    axis_sizes, hw, materialized = ctx.axis_sizes, ctx.hardware, ctx.materialized
    transposed = transposed_operands(node)
    result = []
    for split in assignments(einsum, axis_sizes):
        in_specs = tuple(term_spec(t, split) if v is not None else None
                         for t, v in zip(einsum.operands, node.operands))
        out_specs = [term_spec(t, split) for t in einsum.outputs]
        iteration_shards = math.prod(group_of(ax, axis_sizes) for ax in split.values())
        flops = einsum.flops / iteration_shards
        in_bytes_each = [specs.per_device_bytes(s, d, sp or specs.replicated(len(s)), axis_sizes)
                         for s, d, sp in zip(node.operand_shapes, node.operand_dtypes, in_specs)]
        in_bytes = sum(in_bytes_each)
        out_bytes = [specs.per_device_bytes(s, d, sp, axis_sizes)
                     for s, d, sp in zip(out_shapes, out_dtypes, out_specs)]
        if einsum.fusible:   # a fusion reads its materialized inputs, writes its outputs
            touched = (sum(b for b, m in zip(out_bytes, materialized[1]) if m)
                       + sum(b for b, m in zip(in_bytes_each, materialized[0]) if m))
        else:
            touched = in_bytes + sum(out_bytes)
        compute_s = (hw.compute_seconds(flops, touched) + layout_copy_seconds(
            in_bytes_each, transposed, hw)) * node.weight
        if node.kind in ("output", "boundary"):
            compute_s = slice_copy_seconds(node, out_shapes, in_bytes_each, out_bytes, hw)
        partial_axes = tuple(a for a in axis_sizes
                             for l in einsum.reduce if a in split.get(l, ()))
        name = strategy_name(split)
        if not partial_axes:
            permutes = shift_permutes(einsum, split, out_bytes, node.weight, ctx)
            result.append(Strategy(name, in_specs, tuple(out_specs), compute_s,
                                   sum(c.seconds for c in permutes), permutes))
            continue
        per_label = sorted(tuple(a for a in axis_sizes if a in split[l])
                           for l in einsum.reduce if split.get(l))
        reduced_bytes = [b * reduction_widening(d, ctx.reduction_itemsize)
                         for b, d in zip(out_bytes, out_dtypes)]
        result += reduction_variants(node, name, in_specs, out_specs, out_shapes, reduced_bytes,
                                     partial_axes, per_label, compute_s, einsum.reduce_op, ctx)
    return result


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


def reduction_widening(dtype, reduction_itemsize: int) -> float:
    """How much wider than ``dtype`` the backend's reductions move it: CPU XLA all-reduces
    bf16 and f16 in f32 (a convert before and after), so their collectives move 2x the
    program's bytes; 1 elsewhere."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return 1.0
    if not np.issubdtype(dtype, np.floating) and dtype.name not in ("bfloat16",):
        return 1.0
    return max(1.0, reduction_itemsize / dtype.itemsize)


def transposed_for_dot(node, i: int) -> bool:
    """Whether XLA copies operand ``i`` of a dot_general into another layout first.

    XLA rewrites a dot that is not a (batched) matrix product as one over operands
    transposed to [batch, free, contracting] (lhs) and [batch, contracting, free] (rhs);
    an operand whose dims are not in that order already is copied, unless it is a
    matrix behind leading batch dims (read transposed in place). A weight [d, heads, k]
    read by the backward pass's dot contracting (heads, k) is copied, and so is
    q [b, t, heads, k] read by the scores' dot (batch b, heads); [d, f] or
    [experts, d, f] is not.
    """
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    shape, contract, batch = node.operand_shapes[i], (lc, rc)[i], (lb, rb)[i]
    free = [d for d in range(len(shape)) if d not in contract and d not in batch]
    order = [*batch, *free, *contract] if i == 0 else [*batch, *contract, *free]
    kept = [d for d in order if shape[d] != 1]
    nb = sum(shape[d] != 1 for d in batch)
    matrix_behind_batch = kept[:nb] == sorted(kept)[:nb] and len(kept) - nb <= 2
    return kept != sorted(kept) and not matrix_behind_batch


def transposed_for_conv(node, i: int) -> bool:
    """Whether XLA copies operand ``i`` of a convolution into another layout first.

    XLA:CPU convolves inputs laid out [batch, spatial..., feature] with kernels
    [spatial..., in, out]; an operand whose dims come in another order is copied: the
    kernel of a backward-data convolution, the activations of a weight-gradient one.
    """
    dn = node.params["dimension_numbers"]
    spec, shape = (dn.lhs_spec, dn.rhs_spec)[i], node.operand_shapes[i]
    order = [spec[0], *spec[2:], spec[1]] if i == 0 else [*spec[2:], spec[1], spec[0]]
    kept = [d for d in order if shape[d] != 1]
    return kept != sorted(kept)


TRANSPOSED_OPERANDS = {"dot_general": transposed_for_dot,
                       "conv_general_dilated": transposed_for_conv}


def layout_copy_seconds(in_bytes_each, copied: Sequence[bool], hw: Hardware) -> float:
    """The copies XLA makes of operands it reads in another layout (``transposed_operands``):
    each read and written once, before the node."""
    return hw.compute_seconds(0.0, 2 * sum(b for b, c in zip(in_bytes_each, copied) if c))


def transposed_operands(node: Node) -> tuple[bool, ...]:
    """Per operand of a node: whether XLA copies it into another layout before reading it."""
    transposed = TRANSPOSED_OPERANDS.get(node.primitive)
    return tuple(transposed is not None and v is not None and transposed(node, i)
                 for i, v in enumerate(node.operands))


def slice_copy_seconds(node: Node, out_shapes, in_bytes_each, out_bytes, hw: Hardware) -> float:
    """What a seam costs on one device. A scan copies each iteration's xs slice out of
    its stack (dynamic-slice) and its ys slice into its stack (dynamic-update-slice),
    reading and writing the slice; the ys stack is zero-filled once before the loop.
    Other seams hand a buffer over: the value's producer already wrote it."""
    if node.primitive == "loop_xs":
        length, slice_bytes, copies = node.operand_shapes[0][0], out_bytes[0], 2
    elif node.primitive == "loop_ys":
        length, slice_bytes, copies = out_shapes[0][0], in_bytes_each[0], 3
    else:
        return 0.0
    return hw.compute_seconds(0.0, copies * slice_bytes) * length * node.weight


def reduction_variants(node, name, in_specs, out_specs, out_shapes, out_bytes, partial_axes,
                       per_label, compute_s, reduce_op, ctx) -> list[Strategy]:
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
        if kind in ctx.combined_kinds:   # the combiner pays the latency once for all,
            # once per iteration of the loop body holding it (cost.SharedCost)
            return seconds - hw.link_latency * node.weight, ((kind, axes),)
        return seconds, ()
    reduces, combined = [], ()
    for axes in per_label:
        seconds, joins = priced("all-reduce", hwlib.all_reduce_seconds, axes)
        reduces.append(Collective("all-reduce", axes, num_bytes, seconds))
        combined += joins
    variants = [Strategy(name + f" all-reduce({'+'.join(partial_axes)})", in_specs,
                         tuple(out_specs), compute_s, sum(c.seconds for c in reduces),
                         tuple(reduces), combined)]
    if reduce_op != "sum" or len(out_specs) != 1:
        return variants
    # a contraction scatters over all its reduced axes at once; a reduce op all-reduces
    # over all but the last of its split dims first
    if node.primitive in CONTRACTIONS or len(per_label) == 1:
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
            if first or replicas == 1 or replicas % group_of(partial_axes, axis_sizes):
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


def value_strategies(shape, axis_sizes, pinned: Spec | None = None) -> list[Strategy]:
    """An argument's (or constant's) candidate specs; nothing to compute."""
    if pinned is not None:
        candidates = [pinned]
    elif math.prod(shape) < REPLICATED_BELOW_ELEMENTS:
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


def folded_into_dots(graph: Graph, value) -> bool:
    """A transpose read only by dots: XLA folds it into their dimension numbers (its
    transpose-folding pass) and never writes it."""
    users = graph.users[value.id]
    return (graph.nodes[value.producer].primitive == "transpose" and bool(users)
            and value.id not in graph.outputs
            and all(graph.nodes[u].primitive == "dot_general" for u, _ in users))


def materialized_values(graph: Graph, einsums) -> list[bool]:
    """Which values XLA keeps in memory: not those fused between elementwise ops.

    Transposes read only by dots are not (``folded_into_dots``). Values crossing a loop
    or branch seam are in memory: the loop state, and the slices
    a body reads from stacked xs or writes into stacked ys, every iteration. So are the
    results of expensive ops read by several nodes (XLA computes them once), and what a
    reduction does not fuse (``kept_from_reduction``)."""
    outputs = set(v for v in graph.outputs if v is not None)

    def seam(node_id):
        return graph.nodes[node_id].kind == "boundary"
    flags = []
    for value in graph.values:
        if folded_into_dots(graph, value):
            flags.append(False)
            continue
        producer = einsums[value.producer]
        if (producer is None or not producer.fusible or value.id in outputs
                or seam(value.producer)):
            flags.append(True)
            continue
        users = {u for u, _ in graph.users[value.id]}
        flags.append(any(einsums[u] is None or not einsums[u].fusible or seam(u) for u in users)
                     or expensive(graph.nodes[value.producer]) and len(users) > 1)
    feeds, statistics = feeds_reductions(graph, einsums), statistics_of(graph, einsums)
    squared = feeds_reductions(graph, einsums, unary_only=True)
    for value in graph.values:
        if feeds[value.id] and not flags[value.id]:
            flags[value.id] = kept_from_reduction(graph, graph.nodes[value.producer], value,
                                                  einsums, statistics, squared[value.id])
    return flags


# Elementwise primitives XLA will not compute twice: fused into one consumer only, so a
# result read by several (a tanh kept for the backward pass) is written to memory.
EXPENSIVE = frozenset({"exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "sqrt",
                       "rsqrt", "cbrt", "pow", "erf", "erfc", "erf_inv", "atan2", "acos",
                       "asin", "atan", "acosh", "asinh", "atanh", "cosh", "sinh", "lgamma",
                       "digamma"})


def expensive(node: Node) -> bool:
    if node.primitive == "div":   # XLA: a float division is expensive, an integer one not
        return not all(np.issubdtype(d, np.integer) for d in node.operand_dtypes)
    return node.primitive in EXPENSIVE


REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                        "argmin"})


def feeds_reductions(graph: Graph, einsums, unary_only: bool = False) -> list[bool]:
    """Per value: read by a reduction, directly or through elementwise (fusible) nodes;
    with ``unary_only``, through nodes reading nothing else (a square)."""
    reduces = [node.primitive in REDUCTIONS for node in graph.nodes]
    fused = [node.kind == "eqn" and einsum is not None and einsum.fusible
             and (not unary_only or sum(v is not None for v in node.operands) == 1)
             for node, einsum in zip(graph.nodes, einsums)]
    feeds = [False] * len(graph.values)
    for value in reversed(graph.values):
        for user, _ in graph.users[value.id]:
            if reduces[user] or fused[user] and any(feeds[o] for o in graph.nodes[user].outputs):
                feeds[value.id] = True
                break
    return feeds


def statistics_of(graph: Graph, einsums) -> list[bool]:
    """Per value: computed from a reduction's result by elementwise ops (a mean, a
    variance, an inverse norm)."""
    flags = []
    for value in graph.values:
        node = graph.nodes[value.producer]
        fused = node.kind == "eqn" and einsums[node.id] is not None and einsums[node.id].fusible
        flags.append(node.primitive in REDUCTIONS
                     or fused and any(v is not None and flags[v] for v in node.operands))
    return flags


def spreads(graph: Graph, node: Node, value, einsums) -> bool:
    """Whether ``value`` spreads smaller arrays over a bigger shape: a broadcast, or an
    elementwise op all of whose array operands are smaller (rsqrt[b, t, 1] * scale[d])."""
    einsum = einsums[node.id]
    if node.kind != "eqn" or einsum is None or not einsum.fusible:
        return False
    sizes = [math.prod(graph.values[v].shape) for v in node.operands if v is not None]
    if node.primitive == "broadcast_in_dim":
        return bool(sizes) and sizes[0] < math.prod(value.shape)
    return bool(sizes) and max(sizes) < math.prod(value.shape)


def kept_from_reduction(graph: Graph, node: Node, value, einsums, statistics,
                        squared: bool) -> bool:
    """Whether XLA keeps in memory a value a reduction reads through fused elementwise
    ops. The reduction takes the elementwise chain in, but not a broadcast (the norm scale
    or the inverse norm, spread over the activation), nor an activation centred on one of
    its statistics (x - mean), nor an op combining two activations that other nodes read
    too when the reduction reads it through ops of one operand (the residual sum a norm
    squares): those are written to memory, often for the backward pass."""
    if spreads(graph, node, value, einsums):
        return True
    if node.kind != "eqn" or einsums[node.id] is None or not einsums[node.id].fusible:
        return False
    size = math.prod(value.shape)
    operands = [graph.values[v] for v in node.operands if v is not None]
    if node.primitive in ("sub", "add") and any(
            math.prod(v.shape) < size and statistics[v.id] for v in operands):
        return True
    full = [v for v in operands if math.prod(v.shape) == size]
    return squared and len(full) >= 2 and len({u for u, _ in graph.users[value.id]}) > 1


CONTRACTIONS = ("dot_general", "conv_general_dilated")


def loop_scope(node: Node) -> tuple:
    """The key of the innermost loop body holding ``node`` (``()`` outside any loop).
    A loop body is a computation of its own: XLA combines collectives within it, once
    per iteration, never with those outside. Loop seams belong to the outside."""
    key = node.key
    for i in range(len(key) - 1, -1, -1):
        if key[i] == "body":
            return key[:i + 1]
    return ()


def trailing_nodes(graph: Graph) -> list[bool]:
    """Nodes no contraction of their own computation depends on (weight gradients feeding
    an optimizer update, or a scan's per-layer gradients stacked by loop_ys): their
    collectives are independent of each other, so XLA's combiner merges them.

    A value entering a loop body, or carried to its next iteration, feeds the body's
    contractions; one stacked by loop_ys leaves the iteration that made it."""
    scopes = [loop_scope(node) for node in graph.nodes]
    trailing = [True] * len(graph.nodes)
    for node in reversed(graph.nodes):
        for value_id in node.outputs:
            for user, _ in graph.users[value_id]:
                u = graph.nodes[user]
                if scopes[user] != scopes[node.id]:
                    leaves = u.primitive == "loop_ys" and len(scopes[user]) < len(scopes[node.id])
                    if not leaves:
                        trailing[node.id] = False
                elif u.primitive in CONTRACTIONS or not trailing[user]:
                    trailing[node.id] = False
    return trailing


def reduction_waves(graph: Graph, strategies: Sequence[Sequence[Strategy]]) -> list[int]:
    """Per node, how many nodes that may reduce across devices precede it on the longest
    path within its computation. Two reducing nodes of one wave depend on neither: XLA's
    combiner merges their like collectives into one (the input gradients of q, k and v
    summed after three row-parallel dots)."""
    scopes = [loop_scope(node) for node in graph.nodes]
    reducing: dict[int, bool] = {}   # identical nodes share their strategies
    for found in strategies:
        if id(found) not in reducing:
            reducing[id(found)] = any(c.kind in ("all-reduce", "reduce-scatter")
                                      for s in found for c in s.collectives)
    reduces = [reducing[id(found)] for found in strategies]
    wave = [0] * len(graph.nodes)
    for node in graph.nodes:
        for v in node.operands:
            if v is None:
                continue
            p = graph.values[v].producer
            if scopes[p] == scopes[node.id]:
                wave[node.id] = max(wave[node.id], wave[p] + reduces[p])
    return wave


def trailing_ancestors(graph: Graph, strategies: Sequence[Sequence[Strategy]],
                       trailing: Sequence[bool]) -> list[dict]:
    """Per trailing node, per combined collective (kind, axes): the trailing nodes of its
    computation before it that may make that collective. XLA's combiner merges like
    collectives none of which depends on another: an all-reduced input gradient of the
    first layer and a layer norm's statistic summed from it run as two, however late; the
    loss's sum over the batch joins the weight gradients, on no collective of its kind."""
    scopes = [loop_scope(node) for node in graph.nodes]
    kinds: dict[int, frozenset] = {}   # identical nodes share their strategies
    before: list[dict] = [{} for _ in graph.nodes]
    for node in graph.nodes:
        if not trailing[node.id]:
            continue
        merged = before[node.id]
        for v in node.operands:
            if v is None:
                continue
            p = graph.values[v].producer
            if not trailing[p] or scopes[p] != scopes[node.id]:
                continue
            found = strategies[p]
            if id(found) not in kinds:
                kinds[id(found)] = frozenset(k for s in found for k in s.combined)
            for key, nodes in before[p].items():
                merged[key] = merged[key] | nodes if key in merged else nodes
            for key in kinds[id(found)]:
                merged[key] = merged.get(key, frozenset()) | {p}
    return before


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


def build_strategies(graph: Graph, axis_sizes: Mapping[str, int], hw: Hardware,
                     pins: Mapping[int, Spec] | None = None,
                     combined_kinds: tuple[str, ...] = (),
                     reduction_itemsize: int = 0) -> StrategySpace:
    """Enumerate every node's strategies. ``pins`` maps arg/output node ids to a fixed spec;
    ``combined_kinds`` are the collective kinds the backend's combiner merges;
    ``reduction_itemsize`` the width its reductions run narrower floats at (CPU: 4)."""
    pins = pins or {}
    trailing = trailing_nodes(graph) if combined_kinds else [False] * len(graph.nodes)
    numbers: dict = {}   # equal signatures, one number: hashed once per node
    signatures = [numbers.setdefault(node_signature(graph, node), len(numbers))
                  for node in graph.nodes]
    einsums, rules_seen = [], {}
    for node, signature in zip(graph.nodes, signatures):
        if node.kind in ("arg", "const"):
            einsums.append(None)
            continue
        if signature not in rules_seen:
            rules_seen[signature] = rule_for(node, [graph.values[v].shape for v in node.outputs])
        einsums.append(rules_seen[signature])
    materialized = materialized_values(graph, einsums)
    unsplit = whole_values(graph)
    all_strategies = []
    known: dict = {}   # a repeated layer's nodes (and arguments of a shape) share strategies
    combining = frozenset(combined_kinds)
    for node, einsum in zip(graph.nodes, einsums):
        out_values = [graph.values[v] for v in node.outputs]
        if node.kind == "arg":
            pin = pins.get(node.id)
            scanned = pin is None and sliced_by_scan(graph, node)
            key = ("arg", out_values[0].shape, pin, scanned)
            if key not in known:
                found = value_strategies(out_values[0].shape, axis_sizes, pin)
                known[key] = tuple(keep_scanned_dim_whole(found) if scanned else found)
            all_strategies.append(known[key])
            continue
        if node.kind == "const":
            all_strategies.append(tuple(value_strategies(out_values[0].shape, {})))
            continue
        reads = tuple(v is not None and materialized[v] for v in node.operands)
        writes = tuple(materialized[v.id] for v in out_values)
        whole = (tuple(v is not None and unsplit[v] for v in node.operands),
                 tuple(unsplit[v.id] for v in out_values))
        key = (signatures[node.id], reads, writes, trailing[node.id], pins.get(node.id), whole)
        if key not in known:
            known[key] = tuple(node_strategies(node, einsum, out_values, pins.get(node.id),
                                               _Context(axis_sizes, hw, (reads, writes),
                                                        combining, reduction_itemsize),
                                                whole))
        all_strategies.append(known[key])
    return StrategySpace(graph, tuple(all_strategies), tuple(einsums), tuple(materialized),
                         dict(axis_sizes), hw, tuple(trailing))
