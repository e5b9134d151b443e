"""Per-primitive sharding rules, written as einsum factors.

A rule maps one node (its primitive, params and operand/output shapes) to an ``Einsum``:
a label per dim of every operand and output. Dims with the same label split together;
a label found only on operands is contracted (``reduce``) and, when split, leaves a
partial result that costs an all-reduce (or a reduce-scatter). A ``None`` label is a dim
that must not be split. ``str(einsum)`` is the golden form tests compare, e.g.
``"bmk,bkn->bmn reduce={k}"``.

Rules are registered right under their definition with ``@register("name", ...)``;
``rule_for`` falls back to a fully replicated rule and warns (Python's warning filters
show each primitive's warning once per process by default).
Primitives kept whole on purpose are listed with their reason in ``replicated``;
``coverage`` sorts every primitive JAX defines into ruled, planned by trace or replicated
(``python -m autoshard.rules.coverage`` writes ``docs/coverage.md``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

from autoshard.frontend.graph import Node


@dataclasses.dataclass(frozen=True)
class Einsum:
    operands: tuple[tuple[str | None, ...], ...]
    outputs: tuple[tuple[str | None, ...], ...]
    sizes: dict
    reduce: frozenset = frozenset()
    reduce_op: str = "sum"           # how partial results combine: sum, max, min, ...
    flops: float = 0.0
    fusible: bool = False            # XLA fuses it into neighbours (elementwise-like)
    shifted: frozenset = frozenset()  # labels rolled along: split, a collective-permute
    # what XLA does with the op, as its fusion and combiner see it:
    contraction: bool = False   # a dot or convolution: products of two operands, summed
    reduction: bool = False     # folds dims into statistics that fusions take their inputs in
    expensive: bool = False     # elementwise that XLA does not compute twice (exp, tanh, ...)
    # XLA's partitioner sums a split ``reduce`` label's partial results over every device,
    # replicas included: split one only where every mesh axis splits some label
    reduces_over_all_devices: bool = False

    def __str__(self) -> str:
        def term(labels):
            return "".join("." if l is None else l for l in labels)
        text = ",".join(term(o) for o in self.operands) + "->" + ",".join(
            term(o) for o in self.outputs)
        if self.reduce:
            text += " reduce={" + ",".join(sorted(self.reduce)) + "}"
        return text

    @property
    def labels(self) -> list[str]:
        seen = []
        for term in self.operands + self.outputs:
            for label in term:
                if label is not None and label not in seen:
                    seen.append(label)
        return seen


Rule = Callable[[Node], Einsum]
RULES: dict[str, Rule] = {}


def register(*names: str):
    def deco(rule: Rule) -> Rule:
        for name in names:
            RULES[name] = rule
        return rule
    return deco


class LabelMaker:
    """Hands out fresh single-letter labels and records their sizes."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

    def __init__(self):
        self.sizes: dict[str, int] = {}

    def new(self, size: int, hint: str = "") -> str | None:
        if size <= 1:
            return None
        free = [c for c in hint + self.ALPHABET if c not in self.sizes]
        label = free[0] if free else f"x{len(self.sizes)}"
        self.sizes[label] = int(size)
        return label

    def shrink(self, label: str | None, size: int) -> str | None:
        """Limit a label to splits that also divide ``size`` (gcd of the two extents)."""
        if label is None:
            return None
        self.sizes[label] = math.gcd(self.sizes[label], int(size))
        return label if self.sizes[label] > 1 else None


def rule_for(node: Node, out_shapes) -> Einsum:
    rule = RULES.get(node.primitive)
    if rule is None:
        warnings.warn(f"autoshard: no sharding rule for primitive '{node.primitive}'; its "
                      "operands and results stay replicated", stacklevel=2)
        return replicate_all(node, out_shapes)
    return rule(node, out_shapes)


def replicate_all(node: Node, out_shapes) -> Einsum:
    return Einsum(tuple((None,) * len(s) for s in node.operand_shapes),
                  tuple((None,) * len(s) for s in out_shapes), {})


from autoshard.rules import (  # noqa: E402,F401
    control_flow,
    conv,
    dot,
    elementwise,
    fft,
    indexing,
    reduce,
    replicated,
    shape,
    window,
)
