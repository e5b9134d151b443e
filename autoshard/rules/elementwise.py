"""Elementwise primitives: every dim of every same-shaped operand splits together."""

from __future__ import annotations

import math

import numpy as np

from autoshard.rules import Einsum, LabelMaker, register

UNARY = """abs acos acosh asin asinh atan atanh cbrt ceil clz conj copy copy_p cos cosh
digamma erf erf_inv erfc exp exp2 expm1 floor imag integer_pow is_finite lgamma log log1p
logistic neg not population_count real reduce_precision round rsqrt sign sin sinh sqrt square
tan tanh convert_element_type bessel_i0e bessel_i1e stop_gradient optimization_barrier
sharding_constraint zeros_like name reshard layout_constraint log2 one_minus_square
relayout""".split()
BINARY = """add add_any and atan2 complex div eq ge gt igamma igammac le lt max min mul ne
nextafter or pow rem shift_left shift_right_arithmetic shift_right_logical sub xor
polygamma zeta random_gamma_grad mulhi eq_to le_to lt_to igamma_grad_a random_gamma""".split()
NARY = ["select_n", "clamp", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32",
        "regularized_incomplete_beta", "polynomial"]
# Elementwise primitives XLA will not compute twice: fused into one consumer only, so a
# result read by several (a tanh kept for the backward pass) is written to memory. So is a
# float division; an integer one is cheap.
EXPENSIVE = frozenset("""exp exp2 expm1 log log1p log2 logistic tanh sqrt rsqrt cbrt pow erf
erfc erf_inv atan2 acos asin atan acosh asinh atanh cosh sinh lgamma digamma""".split())


def elementwise_einsum(operand_shapes, out_shapes, flops_per_element=1.0,
                       expensive: bool = False) -> Einsum:
    """Operands share the output's labels dim by dim; a size-1 dim that broadcasts against
    a larger one (``sub(f32[16,64,1024], f32[16,64,1])``) and scalars have none."""
    labels = LabelMaker()
    out_shape = out_shapes[0]
    out_labels = tuple(labels.new(size) for size in out_shape)

    def term(shape):
        if len(shape) != len(out_shape):
            return (None,) * len(shape)
        return tuple(l if d == o else None for l, d, o in zip(out_labels, shape, out_shape))
    operands = tuple(term(tuple(s)) for s in operand_shapes)
    return Einsum(operands, tuple(out_labels for _ in out_shapes), labels.sizes,
                  flops=flops_per_element * math.prod(out_shape), fusible=True,
                  expensive=expensive)


@register(*UNARY, *BINARY, *NARY, "device_put")
def elementwise(node, out_shapes) -> Einsum:
    if node.primitive in ("optimization_barrier", "device_put"):
        return barrier(node, out_shapes)
    return elementwise_einsum(node.operand_shapes, out_shapes, flops_per_element(node),
                              expensive=is_expensive(node))


def flops_per_element(node) -> float:
    """``polynomial(x, a_0, ..., a_N)`` is N multiply-adds by Horner's rule;
    ``one_minus_square`` is ``(1 + x)(1 - x)``; any other elementwise op counts one."""
    if node.primitive == "polynomial":
        return 2.0 * max(len(node.operand_shapes) - 2, 0)
    if node.primitive == "one_minus_square":
        return 3.0
    return 1.0


def is_expensive(node) -> bool:
    if node.primitive == "div":
        return not all(np.issubdtype(d, np.integer) for d in node.operand_dtypes)
    return node.primitive in EXPENSIVE


def barrier(node, out_shapes) -> Einsum:
    """optimization_barrier passes each operand through to its own result."""
    labels = LabelMaker()
    terms = tuple(tuple(labels.new(d) for d in shape) for shape in out_shapes)
    return Einsum(terms, terms, labels.sizes)


@register("bitcast_convert_type")
def bitcast_convert_type(node, out_shapes) -> Einsum:
    """Reinterprets bits elementwise (random bits made floats in ``jax.random.uniform``).
    Between widths it adds (narrower result) or drops (wider result) a minor dim that
    holds one element's pieces; that dim stays whole, the others split together."""
    (shape,), (out_shape,) = node.operand_shapes, out_shapes
    labels = LabelMaker()
    common = tuple(labels.new(d) for d in shape[:min(len(shape), len(out_shape))])
    operand = common + (None,) * (len(shape) - len(common))
    out = common + (None,) * (len(out_shape) - len(common))
    return Einsum((operand,), (out,), labels.sizes, flops=float(math.prod(out_shape)),
                  fusible=True)


@register("tie")
def tie(node, out_shapes) -> Einsum:
    """``tie(x, y)`` is ``y`` ordered after ``x``: ``x`` is read as it lies."""
    labels = LabelMaker()
    first = tuple(labels.new(d) for d in node.operand_shapes[0])
    out = tuple(labels.new(d) for d in out_shapes[0])
    return Einsum((first, out), (out,), labels.sizes, fusible=True)
