"""Reductions, arg-reductions and cumulative ops."""

from __future__ import annotations

import math

from autoshard.rules import Einsum, LabelMaker, register

REDUCE_OPS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
              "reduce_prod": "prod", "reduce_and": "and", "reduce_or": "or",
              "reduce_xor": "xor"}
STATISTICS = ("sum", "max", "min", "prod")   # reductions whose inputs XLA fuses in (``reduction``)


@register(*REDUCE_OPS)
def reduce(node, out_shapes) -> Einsum:
    (shape,) = node.operand_shapes
    axes = set(node.params["axes"])
    labels = LabelMaker()
    operand = tuple(labels.new(d) for d in shape)
    out = tuple(l for i, l in enumerate(operand) if i not in axes)
    reduced = frozenset(operand[i] for i in axes if operand[i] is not None)
    op = REDUCE_OPS[node.primitive]
    if op in ("prod", "xor"):  # no cheap combine: keep reduced dims whole
        operand = tuple(None if i in axes else l for i, l in enumerate(operand))
        reduced = frozenset()
    return Einsum((operand,), (out,), labels.sizes, reduce=reduced, reduce_op=op,
                  flops=float(math.prod(shape)), reduction=op in STATISTICS)


@register("argmax", "argmin")
def arg_reduce(node, out_shapes) -> Einsum:
    (shape,) = node.operand_shapes
    axes = set(node.params["axes"])
    labels = LabelMaker()
    operand = tuple(None if i in axes else labels.new(d) for i, d in enumerate(shape))
    out = tuple(l for i, l in enumerate(operand) if i not in axes)
    return Einsum((operand,), (out,), labels.sizes, flops=float(math.prod(shape)),
                  reduction=True)


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(node, out_shapes) -> Einsum:
    (shape,) = node.operand_shapes
    axis = node.params["axis"]
    labels = LabelMaker()
    term = tuple(None if i == axis else labels.new(d) for i, d in enumerate(shape))
    return Einsum((term,), (term,), labels.sizes, flops=float(math.prod(shape)))


@register("reduce")
def generic_reduce(node, out_shapes) -> Einsum:
    """``lax.reduce`` with its own computation (several operands, then their init values):
    the reduced dims stay whole, since partial results have no known combine."""
    num_operands = len(out_shapes)
    shape = node.operand_shapes[0]
    axes = set(node.params["dimensions"])
    labels = LabelMaker()
    term = tuple(None if i in axes else labels.new(d) for i, d in enumerate(shape))
    out = tuple(l for i, l in enumerate(term) if i not in axes)
    inits = tuple(() for _ in node.operand_shapes[num_operands:])
    return Einsum((term,) * num_operands + inits, (out,) * num_operands, labels.sizes,
                  flops=float(num_operands * math.prod(shape)))
