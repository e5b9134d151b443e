"""dot_general: batch, free and contracting factors."""

from __future__ import annotations

import math

from autoshard.rules import Einsum, LabelMaker, register


@register("dot_general")
def dot_general(node, out_shapes) -> Einsum:
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = node.operand_shapes
    labels = LabelMaker()
    lhs_l: list = [None] * len(lhs)
    rhs_l: list = [None] * len(rhs)
    out: list = []
    for i, j in zip(lb, rb):
        lhs_l[i] = rhs_l[j] = labels.new(lhs[i], "bcdefg")
        out.append(lhs_l[i])
    contract = set()
    for i, j in zip(lc, rc):
        lhs_l[i] = rhs_l[j] = labels.new(lhs[i], "kpqrst")
        contract.add(lhs_l[i])
    for i in range(len(lhs)):
        if i not in lc and i not in lb:
            lhs_l[i] = labels.new(lhs[i], "mhijl")
            out.append(lhs_l[i])
    for j in range(len(rhs)):
        if j not in rc and j not in rb:
            rhs_l[j] = labels.new(rhs[j], "nouvw")
            out.append(rhs_l[j])
    contracted = math.prod(lhs[i] for i in lc)
    flops = 2.0 * math.prod(out_shapes[0]) * contracted
    return Einsum((tuple(lhs_l), tuple(rhs_l)), (tuple(out),), labels.sizes,
                  reduce=frozenset(c for c in contract if c is not None), flops=flops)
