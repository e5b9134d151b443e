"""Shape primitives: broadcast, reshape, transpose, squeeze, slicing, padding, iota."""

from __future__ import annotations

import math

import jax

from autoshard.rules import Einsum, LabelMaker, register


def _move(operand_terms, out_terms, labels) -> Einsum:
    return Einsum(tuple(operand_terms), tuple(out_terms), labels.sizes, fusible=True)


@register("broadcast_in_dim")
def broadcast_in_dim(node, out_shapes) -> Einsum:
    operand = node.operand_shapes[0]
    (out_shape,) = out_shapes
    labels = LabelMaker()
    out = [labels.new(d) for d in out_shape]
    term = tuple(out[o] if operand[i] == out_shape[o] else None
                 for i, o in enumerate(node.params["broadcast_dimensions"]))
    extra = [(None,) * len(s) for s in node.operand_shapes[1:]]  # dynamic shapes
    return _move([term, *extra], [tuple(out)], labels)


def reshape_groups(in_shape, out_shape):
    """Pair up runs of input and output dims whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i] if i < len(in_shape) else [], [j] if j < len(out_shape) else []
        pi = in_shape[i] if gi else 1
        pj = out_shape[j] if gj else 1
        i, j = i + len(gi), j + len(gj)
        while pi != pj:
            if pi < pj:
                gi.append(i); pi *= in_shape[i]; i += 1
            else:
                gj.append(j); pj *= out_shape[j]; j += 1
        groups.append((gi, gj))
    return groups


@register("reshape")
def reshape(node, out_shapes) -> Einsum:
    in_shape = node.operand_shapes[0]
    (out_shape,) = out_shapes
    labels = LabelMaker()
    in_t: list = [None] * len(in_shape)
    out_t: list = [None] * len(out_shape)
    for gi, gj in reshape_groups(list(in_shape), list(out_shape)):
        gi = [i for i in gi if in_shape[i] > 1]
        gj = [j for j in gj if out_shape[j] > 1]
        if gi and gj:  # the major dims of a merge/split split together
            label = labels.shrink(labels.new(in_shape[gi[0]]), out_shape[gj[0]])
            in_t[gi[0]] = out_t[gj[0]] = label
    extra = [(None,) * len(s) for s in node.operand_shapes[1:]]
    return _move([tuple(in_t), *extra], [tuple(out_t)], labels)


@register("transpose")
def transpose(node, out_shapes) -> Einsum:
    in_shape = node.operand_shapes[0]
    labels = LabelMaker()
    in_t = [labels.new(d) for d in in_shape]
    out_t = tuple(in_t[p] for p in node.params["permutation"])
    return _move([tuple(in_t)], [out_t], labels)


@register("squeeze")
def squeeze(node, out_shapes) -> Einsum:
    in_shape = node.operand_shapes[0]
    dims = {d % len(in_shape) for d in node.params["dimensions"]}
    labels = LabelMaker()
    in_t = [None if i in dims else labels.new(d) for i, d in enumerate(in_shape)]
    out_t = tuple(l for i, l in enumerate(in_t) if i not in dims)
    return _move([tuple(in_t)], [out_t], labels)


@register("expand_dims")
def expand_dims(node, out_shapes) -> Einsum:
    in_shape = node.operand_shapes[0]
    labels = LabelMaker()
    in_t = [labels.new(d) for d in in_shape]
    it = iter(in_t)
    out_t = tuple(None if d == 1 and i in node.params["dimensions"] else next(it)
                  for i, d in enumerate(out_shapes[0]))
    return _move([tuple(in_t)], [out_t], labels)


def _keep_dims(node, out_shapes, whole_dims) -> Einsum:
    """Operand 0 and the output share every dim except ``whole_dims``; other operands
    (indices, padding values) stay whole."""
    shape = node.operand_shapes[0]
    labels = LabelMaker()
    term = tuple(None if i in whole_dims else labels.new(d) for i, d in enumerate(shape))
    rest = [(None,) * len(s) for s in node.operand_shapes[1:]]
    return Einsum((term, *rest), tuple(term for _ in out_shapes), labels.sizes,
                  fusible=node.primitive in ("pad", "slice", "rev"))


@register("concatenate")
def concatenate(node, out_shapes) -> Einsum:
    dim = node.params["dimension"]
    labels = LabelMaker()
    term = tuple(None if i == dim else labels.new(d) for i, d in enumerate(out_shapes[0]))
    return Einsum(tuple(term for _ in node.operand_shapes), (term,), labels.sizes)


@register("stage_shift")
def stage_shift(node, out_shapes) -> Einsum:
    """A roll along one dim (a pipeline's stage buffer moving one stage on): every dim
    keeps its split; the rolled dim split costs each device a send of its block to its
    neighbour (a collective-permute)."""
    labels = LabelMaker()
    term = tuple(labels.new(d) for d in out_shapes[0])
    rolled = term[node.params["dimension"]]
    return Einsum((term,), (term,), labels.sizes,
                  shifted=frozenset({rolled} if rolled else ()))


@register("split")
def split(node, out_shapes) -> Einsum:
    return _keep_dims(node, out_shapes, {node.params["axis"]})


@register("pad")
def pad(node, out_shapes) -> Einsum:
    padded = {i for i, (lo, hi, interior) in enumerate(node.params["padding_config"])
              if lo or hi or interior}
    return _keep_dims(node, out_shapes, padded)


@register("slice")
def slice_(node, out_shapes) -> Einsum:
    cut = {i for i, (a, b) in enumerate(zip(node.operand_shapes[0], out_shapes[0])) if a != b}
    strides = node.params.get("strides") or ()
    cut |= {i for i, s in enumerate(strides) if s not in (None, 1)}
    return _keep_dims(node, out_shapes, cut)


@register("rev")
def rev(node, out_shapes) -> Einsum:
    return _keep_dims(node, out_shapes, set(node.params["dimensions"]))


@register("dynamic_slice")
def dynamic_slice(node, out_shapes) -> Einsum:
    cut = {i for i, (a, b) in enumerate(zip(node.operand_shapes[0], out_shapes[0])) if a != b}
    return _keep_dims(node, out_shapes, cut)


@register("dynamic_update_slice")
def dynamic_update_slice(node, out_shapes) -> Einsum:
    operand, update = node.operand_shapes[:2]
    labels = LabelMaker()
    term = tuple(labels.new(a) if a == b else None for a, b in zip(operand, update))
    rest = [(None,) * len(s) for s in node.operand_shapes[2:]]
    return Einsum((term, term, *rest), (term,), labels.sizes)


@register("iota", "empty", "empty2", "iota_2x32_shape")
def iota(node, out_shapes) -> Einsum:
    """Made from indices alone (``iota_2x32_shape``: the hi and lo words of a random-bits
    counter), so each device makes its own part."""
    labels = LabelMaker()
    term = tuple(labels.new(d) for d in out_shapes[0])
    return Einsum((), tuple(term for _ in out_shapes), labels.sizes, fusible=True)


@register("sort")
def sort(node, out_shapes) -> Einsum:
    shape = node.operand_shapes[0]
    dim = node.params["dimension"]
    labels = LabelMaker()
    term = tuple(None if i == dim else labels.new(d) for i, d in enumerate(shape))
    flops = math.prod(shape) * max(1.0, math.log2(max(shape[dim], 2)))
    return Einsum(tuple(term for _ in node.operand_shapes), tuple(term for _ in out_shapes),
                  labels.sizes, flops=flops)


@register("top_k", "approx_top_k")
def top_k(node, out_shapes) -> Einsum:
    """The values and indices of the k largest along one dim (the last unless ``axis`` or
    ``reduction_dimension`` says otherwise); the other dims split."""
    shape = node.operand_shapes[0]
    axis = node.params.get("axis", node.params.get("reduction_dimension", -1)) % len(shape)
    labels = LabelMaker()
    term = tuple(None if i == axis else labels.new(d) for i, d in enumerate(shape))
    rest = tuple((None,) * len(s) for s in node.operand_shapes[1:])  # a dynamic k
    return Einsum((term, *rest), tuple(term for _ in out_shapes), labels.sizes,
                  flops=float(math.prod(shape)))


@register("tile")
def tile(node, out_shapes) -> Einsum:
    """Dims repeated once split with the result; repeated dims stay whole."""
    reps = node.params["reps"]
    return _keep_dims(node, out_shapes, {i for i, r in enumerate(reps) if r != 1})


@register("stack")
def stack(node, out_shapes) -> Einsum:
    """Operands of one shape stacked along a new dim, which stays whole."""
    axis = node.params["axis"]
    labels = LabelMaker()
    term = tuple(labels.new(d) for d in node.operand_shapes[0])
    out = term[:axis] + (None,) + term[axis:]
    return Einsum(tuple(term for _ in node.operand_shapes), (out,), labels.sizes)


@register("unstack")
def unstack(node, out_shapes) -> Einsum:
    """Slices along one dim, each a result without it; the other dims split."""
    axis = node.params["axis"]
    labels = LabelMaker()
    term = tuple(None if i == axis else labels.new(d)
                 for i, d in enumerate(node.operand_shapes[0]))
    out = term[:axis] + term[axis + 1:]
    return Einsum((term,), tuple(out for _ in out_shapes), labels.sizes)


# threefry2x32: 20 rounds of add, rotate and xor on a pair of words, plus key injections
THREEFRY_OPS_PER_WORD = 60


def bits_made_in_shards(key_dtype) -> bool:
    """Partitionable threefry (JAX's default) hashes each element's own counter, so each
    device makes just its part. XLA makes other generators' bits (rbg's
    RngBitGenerator, threefry with ``jax_threefry_partitionable`` off) whole on every
    device and slices them: the values never depend on the split, only the work does."""
    impl = getattr(getattr(key_dtype, "_impl", None), "name", "threefry2x32")
    return impl == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)


@register("random_bits", "random_uniform")
def random_bits(node, out_shapes) -> Einsum:
    """The key stays whole; the bits split like the array they fill, where the generator
    makes them in shards (``bits_made_in_shards``)."""
    labels = LabelMaker()
    out = tuple(labels.new(d) for d in out_shapes[0])
    if not bits_made_in_shards(node.operand_dtypes[0] if node.operand_dtypes else None):
        out = (None,) * len(out)
    return Einsum(tuple((None,) * len(s) for s in node.operand_shapes), (out,), labels.sizes,
                  flops=float(THREEFRY_OPS_PER_WORD * math.prod(out_shapes[0])))


@register("rng_bit_generator", "random_seed", "random_wrap", "random_unwrap", "random_split",
          "random_fold_in", "random_clone")
def key_ops(node, out_shapes) -> Einsum:
    """PRNG keys are tiny: keep them whole."""
    return Einsum(tuple((None,) * len(s) for s in node.operand_shapes),
                  tuple((None,) * len(s) for s in out_shapes), {})
