"""conv_general_dilated: batch and output-feature splits, input features contracted."""

from __future__ import annotations

import math

from autoshard.rules import Einsum, LabelMaker, register


@register("conv_general_dilated")
def conv(node, out_shapes) -> Einsum:
    lhs, rhs = node.operand_shapes
    (out,) = out_shapes
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = node.params["feature_group_count"] * node.params["batch_group_count"]
    labels = LabelMaker()
    lhs_t: list = [None] * len(lhs)
    rhs_t: list = [None] * len(rhs)
    out_t: list = [None] * len(out)
    lhs_t[lhs_spec[0]] = out_t[out_spec[0]] = labels.new(lhs[lhs_spec[0]])
    reduce = set()
    if groups == 1:
        rhs_t[rhs_spec[0]] = out_t[out_spec[1]] = labels.new(rhs[rhs_spec[0]])
        lhs_t[lhs_spec[1]] = rhs_t[rhs_spec[1]] = labels.new(lhs[lhs_spec[1]])
        if lhs_t[lhs_spec[1]]:
            reduce.add(lhs_t[lhs_spec[1]])
    if node.params["batch_group_count"] > 1:  # weight-gradient convs: keep batch whole
        lhs_t[lhs_spec[0]] = out_t[out_spec[0]] = None
    kernel = math.prod(rhs[d] for d in rhs_spec[1:])  # input features x window
    flops = 2.0 * math.prod(out) * kernel
    return Einsum((tuple(lhs_t), tuple(rhs_t)), (tuple(out_t),), labels.sizes,
                  reduce=frozenset(reduce), flops=flops)
