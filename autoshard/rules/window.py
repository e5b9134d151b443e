"""Windowed reductions: pooling (reduce_window) and its gradients (select_and_scatter_add,
select_and_gather_add).

A dim the window does not span (window 1, stride 1, no padding, no dilation: the batch
and channel dims of a pooling layer) splits together on every operand and result; a
spatial dim the window slides over stays whole, since a split would need the neighbours'
halo.
"""

from __future__ import annotations

import math

from autoshard.rules import Einsum, LabelMaker, register


def untouched_dims(params, rank: int) -> list[bool]:
    """Per dim: the window leaves it as it is."""
    ones = (1,) * rank
    window = params["window_dimensions"]
    strides = params.get("window_strides", ones)
    padding = params.get("padding", ((0, 0),) * rank)
    base = params.get("base_dilation", ones)
    dilation = params.get("window_dilation", ones)
    return [window[i] == 1 and strides[i] == 1 and tuple(padding[i]) == (0, 0)
            and base[i] == 1 and dilation[i] == 1 for i in range(rank)]


def window_terms(params, shape) -> tuple[tuple, dict]:
    labels = LabelMaker()
    term = tuple(labels.new(d) if keep else None
                 for d, keep in zip(shape, untouched_dims(params, len(shape))))
    return term, labels.sizes


def window_flops(params, out_shape) -> float:
    return float(math.prod(out_shape) * math.prod(params["window_dimensions"]))


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
def reduce_window(node, out_shapes) -> Einsum:
    """Max, sum and average pooling; the generic ``reduce_window`` takes its operands and
    then as many scalar init values."""
    term, sizes = window_terms(node.params, node.operand_shapes[0])
    num_arrays = len(out_shapes)
    inits = tuple((None,) * len(s) for s in node.operand_shapes[num_arrays:])
    return Einsum((term,) * num_arrays + inits, (term,) * num_arrays, sizes,
                  flops=num_arrays * window_flops(node.params, out_shapes[0]))


@register("select_and_scatter_add")
def select_and_scatter_add(node, out_shapes) -> Einsum:
    """Max pooling's gradient: (pooled cotangent, pooling input) -> input's cotangent."""
    source, operand = node.operand_shapes
    term, sizes = window_terms(node.params, operand)
    return Einsum((term, term), (term,), sizes, flops=2 * window_flops(node.params, source))


@register("select_and_scatter")
def select_and_scatter(node, out_shapes) -> Einsum:
    """(operand, source, init value) -> operand-shaped scatter of source."""
    operand, source, init = node.operand_shapes
    term, sizes = window_terms(node.params, operand)
    return Einsum((term, term, (None,) * len(init)), (term,), sizes,
                  flops=2 * window_flops(node.params, source))


@register("select_and_gather_add")
def select_and_gather_add(node, out_shapes) -> Einsum:
    """Max pooling's forward-mode derivative: (tangents, operand) -> pooled tangents."""
    term, sizes = window_terms(node.params, node.operand_shapes[0])
    return Einsum((term, term), (term,), sizes,
                  flops=2 * window_flops(node.params, out_shapes[0]))
