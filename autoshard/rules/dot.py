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
                  reduce=frozenset(c for c in contract if c is not None), flops=flops,
                  contraction=True)


@register("ragged_dot_general")
def ragged_dot_general(node, out_shapes) -> Einsum:
    """A grouped matmul (``lax.ragged_dot``: an MoE's experts over their tokens' rows).

    The ragged dim's groups have sizes known only at run time, so it stays whole, and so
    does the kernels' group dim; batch, contracting and the other free dims split as in
    ``dot_general``. With a ragged contracting dim (the kernels' gradient) the result
    gains a leading group dim, also whole."""
    rdn = node.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    ragged, groups = set(rdn.lhs_ragged_dimensions), set(rdn.rhs_group_dimensions)
    lhs, rhs = node.operand_shapes[:2]
    labels = LabelMaker()
    lhs_l: list = [None] * len(lhs)
    rhs_l: list = [None] * len(rhs)
    out: list = [None] if ragged & set(lc) else []
    for i, j in zip(lb, rb):
        lhs_l[i] = rhs_l[j] = labels.new(lhs[i], "bcdefg")
        out.append(lhs_l[i])
    contract = set()
    for i, j in zip(lc, rc):
        if i not in ragged:
            lhs_l[i] = rhs_l[j] = labels.new(lhs[i], "kpqrst")
            contract.add(lhs_l[i])
    for i in range(len(lhs)):
        if i not in lc and i not in lb:
            lhs_l[i] = None if i in ragged else labels.new(lhs[i], "mhijl")
            out.append(lhs_l[i])
    for j in range(len(rhs)):
        if j not in rc and j not in rb and j not in groups:
            rhs_l[j] = labels.new(rhs[j], "nouvw")
            out.append(rhs_l[j])
    rest = tuple((None,) * len(s) for s in node.operand_shapes[2:])   # group sizes
    per_row = out_shapes[0][1:] if ragged & set(lc) else out_shapes[0]   # each row, one group
    flops = 2.0 * math.prod(per_row) * math.prod(lhs[i] for i in lc)
    return Einsum((tuple(lhs_l), tuple(rhs_l), *rest), (tuple(out),), labels.sizes,
                  reduce=frozenset(c for c in contract if c is not None), flops=flops)
