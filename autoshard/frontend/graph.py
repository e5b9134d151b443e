"""The SSA graph that every stage after ``trace`` works on.

A ``Node`` is one equation of the jaxpr (or an argument, a constant, or a loop/branch
boundary of a control-flow unit); a ``Value`` is one array flowing between nodes.
Nodes carry a ``key``: the path of their equation in the (nested) jaxpr, which is how
``apply`` finds the plan's decisions while it re-interprets the program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autoshard.frontend import specs


@dataclasses.dataclass(frozen=True)
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: Any
    producer: int          # node id
    index: int             # which output of the producer

    @property
    def num_bytes(self) -> int:
        return specs.nbytes(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One unit the planner chooses a strategy for.

    kind: "arg", "const", "eqn", "output" or "boundary" (the seam of a scan/while/cond body).
    operands: value ids, ``None`` for literals. operand_shapes covers literals too.
    weight: how many times the node runs per call (loop trip counts multiplied).
    operand_weights: how many times each operand's resharding happens per call.
    """

    id: int
    kind: str
    primitive: str
    key: tuple
    operands: tuple[int | None, ...]
    operand_shapes: tuple[tuple[int, ...], ...]
    operand_dtypes: tuple[Any, ...]
    outputs: tuple[int, ...]
    params: dict
    weight: float = 1.0
    operand_weights: tuple[float, ...] = ()
    label: str = ""        # argument path for "arg" nodes


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """The traced program: nodes in program order, values, and the calling convention."""

    nodes: tuple[Node, ...]
    values: tuple[Value, ...]
    arg_nodes: tuple[int, ...]             # node id per flat argument
    arg_paths: tuple[str, ...]
    outputs: tuple[int | None, ...]         # value id per flat output (None: literal)
    output_nodes: tuple[int | None, ...]    # the "output" node that holds each output's spec
    out_paths: tuple[str, ...]
    users: tuple[tuple[tuple[int, int], ...], ...]  # per value: (node id, operand index)
    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any
    out_avals: tuple

    def live_values(self) -> frozenset[int]:
        """The values some output depends on. ``jax.jit`` drops the rest (dead equations,
        and arguments only they read, as ``keep_unused=False`` does), so XLA neither
        computes nor holds them."""
        live, stack = set(), [v for v in self.outputs if v is not None]
        while stack:
            value_id = stack.pop()
            if value_id in live:
                continue
            live.add(value_id)
            stack.extend(v for v in self.node_of(value_id).operands
                         if v is not None and v not in live)
        return frozenset(live)

    def node_of(self, value_id: int) -> Node:
        return self.nodes[self.values[value_id].producer]

    @property
    def num_eqns(self) -> int:
        return sum(1 for n in self.nodes if n.kind == "eqn")

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        return f"Graph({len(self.nodes)} nodes {kinds}, {len(self.values)} values)"
