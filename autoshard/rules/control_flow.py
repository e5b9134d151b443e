"""The seams of scan, while and cond: values entering and leaving their bodies.

loop_const / branch_in: the body sees the outer value as it is.
loop_carry: init, the body's carry-out and both results share one spec (XLA keeps a
  loop-carried value in one sharding).
loop_xs / loop_ys: the per-iteration slice drops (adds) the leading scanned dim, which
  stays whole.
branch_out: every branch's result and the cond's result share one spec.
output: the spec a program's result is handed back in (jit's out_shardings).
"""

from __future__ import annotations

from autoshard.rules import Einsum, LabelMaker, register


@register("loop_const", "loop_carry", "branch_in", "branch_out", "output")
def same_spec(node, out_shapes) -> Einsum:
    labels = LabelMaker()
    term = tuple(labels.new(d) for d in out_shapes[0])
    return Einsum(tuple(term for _ in node.operand_shapes), tuple(term for _ in out_shapes),
                  labels.sizes, fusible=True)


@register("loop_xs")
def loop_xs(node, out_shapes) -> Einsum:
    labels = LabelMaker()
    term = tuple(labels.new(d) for d in out_shapes[0])
    return Einsum(((None, *term),), (term,), labels.sizes, fusible=True)


@register("loop_ys")
def loop_ys(node, out_shapes) -> Einsum:
    labels = LabelMaker()
    term = tuple(labels.new(d) for d in node.operand_shapes[0])
    return Einsum((term,), ((None, *term),), labels.sizes, fusible=True)
