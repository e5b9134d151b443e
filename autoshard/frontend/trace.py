"""trace: a function and its (abstract) arguments -> Graph.

Nested ``jit``, ``custom_jvp_call``, ``custom_vjp_call`` and ``checkpoint`` bodies are
inlined; ``scan``, ``while`` and ``cond`` stay units whose bodies are planned too: their
body equations become nodes (weighted by the trip count) joined to the outside through
``boundary`` nodes that hold the loop-carried, sliced and stacked values.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from autoshard.errors import InputError
from autoshard.frontend import interpret as ik
from autoshard.frontend import jax_compat, validate
from autoshard.frontend.graph import Graph, Node, Value
from autoshard.frontend.interpret import INLINED


def argument_names(fn: Callable, num_args: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(num_args):
        p = params[i] if i < len(params) else None
        if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            names.append(f"args[{i}]")
        else:
            names.append(p.name)
    return names


def abstractify(path: str, leaf) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        validate.leaf_dtype(path, leaf.dtype)
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, (numbers.Number, np.bool_)):
        arr = np.asarray(leaf)
        return jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype))
    raise InputError(f"argument {path} is a {type(leaf).__name__}, not an array: pass arrays, "
                     "jax.ShapeDtypeStruct or numbers as leaves (close over other values)")


@jax.tree_util.register_pytree_node_class
class Static:
    """A leaf held out of tracing: a node with no children whose value rides in the tree
    structure, so two trees are alike only where their static values are equal."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def tree_flatten(self):
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value, children):
        return cls(value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def is_array_like(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def hold_static_leaves(tree):
    """``tree`` with the non-array leaves of every ``equinox.Module`` in it (functions,
    ints, strings, activation callables) held as ``Static``, as ``eqx.filter_jit`` treats
    them. Leaves outside modules are left alone."""
    eqx = sys.modules.get("equinox")
    if eqx is None:   # no module can be an equinox.Module
        return tree

    def is_module(x):
        return isinstance(x, eqx.Module)

    def hold(x):
        if not is_module(x):
            return x
        return jax.tree_util.tree_map(lambda leaf: leaf if is_array_like(leaf) else Static(leaf),
                                      x)
    return jax.tree_util.tree_map(hold, tree, is_leaf=is_module)


def release_static_leaves(tree):
    """The inverse of ``hold_static_leaves``: every ``Static`` replaced by its value."""
    return jax.tree_util.tree_map(lambda x: x.value if isinstance(x, Static) else x, tree,
                                  is_leaf=lambda x: isinstance(x, Static))


def has_static_leaves(tree_def) -> bool:
    """Whether a tree structure holds ``Static`` nodes."""
    tree = jax.tree_util.tree_unflatten(tree_def, [0] * tree_def.num_leaves)
    return any(isinstance(x, Static) for x in
               jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Static)))


def static_as_none(tree):
    """``tree`` with every ``Static`` node replaced by None (the static leaves' place in
    in/out shardings, as ``eqx.partition`` leaves it in the array half)."""
    return jax.tree_util.tree_map(lambda x: None if isinstance(x, Static) else x, tree,
                                  is_leaf=lambda x: isinstance(x, Static))


def flatten_args(fn: Callable, args: Sequence) -> tuple[list, list[str], Any]:
    """Flat abstract leaves, their paths as a user writes them, and the tree (static
    leaves of equinox modules held in it, see ``hold_static_leaves``)."""
    names = argument_names(fn, len(args))
    leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path(
        hold_static_leaves(tuple(args)))
    paths, leaves = [], []
    for key_path, leaf in leaves_with_paths:
        head, rest = key_path[0], key_path[1:]
        path = names[head.idx] + jax.tree_util.keystr(tuple(rest))
        paths.append(path)
        leaves.append(abstractify(path, leaf))
    return leaves, paths, in_tree


class GraphBuilder:
    """Mutable scratchpad that walks a jaxpr and freezes into a Graph."""

    def __init__(self):
        self.nodes: list[dict] = []
        self.values: list[Value] = []

    def new_node(self, kind, primitive, key, operands, operand_avals, out_avals, params=None,
                 weight=1.0, operand_weights=None, label="") -> list[int]:
        node_id = len(self.nodes)
        outs = []
        for index, aval in enumerate(out_avals):
            value = Value(len(self.values), tuple(aval.shape), aval.dtype, node_id, index)
            self.values.append(value)
            outs.append(value.id)
        self.nodes.append(dict(
            id=node_id, kind=kind, primitive=primitive, key=key, operands=list(operands),
            operand_shapes=tuple(tuple(a.shape) for a in operand_avals),
            operand_dtypes=tuple(a.dtype for a in operand_avals), outputs=tuple(outs),
            params=dict(params or {}), weight=float(weight),
            operand_weights=list(operand_weights or [weight] * len(operands)), label=label))
        return outs

    # -- walking ---------------------------------------------------------------------------
    def walk(self, jaxpr, consts, in_values, key, weight) -> list[int | None]:
        """The graph values of ``jaxpr``'s results: a node per constant and equation,
        joined by :func:`interpret.run_jaxpr` (a literal operand is no graph value)."""
        const_values = [self.new_node("const", "const", ik.const_key(key, i), [], [],
                                      [jax.typeof(const)], weight=weight)[0]
                        for i, const in enumerate(consts)]
        return ik.run_jaxpr(jaxpr, const_values, in_values,
                            lambda eqn, ins, k: self.eqn(eqn, ins, k, weight), key,
                            literal=lambda _: None)

    def eqn(self, eqn, ins, key, weight) -> list[int]:
        name = eqn.primitive.name
        if name in INLINED:
            inner, consts = jax_compat.inlined_body(eqn)
            return self.walk(inner, consts, ins, ik.inlined_key(key, name), weight)
        if name in CONTROL_FLOW_RULES:
            return CONTROL_FLOW_RULES[name](self, eqn, ins, key, weight)
        return self.new_node("eqn", name, key, ins, [v.aval for v in eqn.invars],
                             [v.aval for v in eqn.outvars], eqn.params, weight)

    def boundary(self, primitive, key, operands, operand_avals, out_avals, weight,
                 operand_weights=None, params=None):
        return self.new_node("boundary", primitive, key, operands, operand_avals, out_avals,
                             params, weight=weight, operand_weights=operand_weights)

    def carry_seams(self, key, init, init_avals, body_avals, out_avals, weight,
                    inner_weight) -> tuple[list[int], list[int]]:
        """A ``loop_carry`` seam per carry, its second operand (the body's result) left
        to :meth:`close_carries`. Returns (the body's carry values, the seams' nodes)."""
        body_in, nodes = [], []
        for k, (value, aval) in enumerate(zip(init, init_avals)):
            outs = self.boundary("loop_carry", ik.carry_key(key, k), [value, None],
                                 [aval, aval], [body_avals[k], out_avals[k]], weight,
                                 [weight, inner_weight])
            nodes.append(len(self.nodes) - 1)
            body_in.append(outs[0])
        return body_in, nodes

    def close_carries(self, nodes, body_out) -> list[int]:
        """Join each carry seam to the body's result; returns the loop's final carries."""
        outs = []
        for k, node_id in enumerate(nodes):
            self.nodes[node_id]["operands"][1] = body_out[k]
            outs.append(self.nodes[node_id]["outputs"][1])
        return outs

    def scan(self, eqn, ins, key, weight):
        p = jax_compat.scan_params(eqn.params)
        body, body_consts = p.body, p.body_consts
        inner_weight = weight * p.length
        ops = ik.scan_operands(eqn.params, ins)
        avals = ik.scan_operands(eqn.params, [v.aval for v in eqn.invars])
        body_avals = ik.scan_operands(eqn.params, [v.aval for v in body.invars])
        ncarry = len(ops.carry)
        body_in = []
        for k, (value, aval) in enumerate(zip(ops.consts, avals.consts)):
            body_in += self.boundary("loop_const", ik.const_key(key, k), [value], [aval],
                                     [body_avals.consts[k]], weight)
        carry_in, carry_nodes = self.carry_seams(
            key, ops.carry, avals.carry, body_avals.carry,
            [v.aval for v in eqn.outvars[:ncarry]], weight, inner_weight)
        body_in += carry_in
        # a scan unrolled whole slices its xs at static offsets (xla.hoisted_runs)
        static = {"static": True} if p.unroll >= p.length else None
        for k, (value, aval) in enumerate(zip(ops.xs, avals.xs)):
            body_in += self.boundary("loop_xs", ik.xs_key(key, k), [value], [aval],
                                     [body_avals.xs[k]], weight, None, static)
        body_out = self.walk(body, body_consts, body_in, ik.body_key(key), inner_weight)
        outs = self.close_carries(carry_nodes, body_out)
        # a scan unrolled whole is straight-line code to XLA (its one-trip loop is
        # inlined): its ys are the iterations' results, stacked by no loop
        unrolled = {"unrolled": True} if p.unroll >= p.length else None
        for k, value in enumerate(body_out[ncarry:]):
            outs += self.boundary("loop_ys", ik.ys_key(key, k), [value],
                                  [body.outvars[ncarry + k].aval],
                                  [eqn.outvars[ncarry + k].aval], weight, [inner_weight],
                                  unrolled)
        return outs

    def while_loop(self, eqn, ins, key, weight):
        p = jax_compat.while_params(eqn.params)
        body, body_consts = p.body, p.body_consts
        ops = ik.while_operands(eqn.params, ins)
        avals = ik.while_operands(eqn.params, [v.aval for v in eqn.invars])
        nb = len(ops.consts)
        body_in = []
        for k, (value, aval) in enumerate(zip(ops.consts, avals.consts)):
            body_in += self.boundary("loop_const", ik.const_key(key, k), [value], [aval],
                                     [body.invars[k].aval], weight)
        carry_in, carry_nodes = self.carry_seams(
            key, ops.carry, avals.carry, [v.aval for v in body.invars[nb:]],
            [v.aval for v in eqn.outvars], weight, weight)
        body_out = self.walk(body, body_consts, body_in + carry_in, ik.body_key(key), weight)
        return self.close_carries(carry_nodes, body_out)

    def cond(self, eqn, ins, key, weight):
        _, ops = ik.cond_operands(ins)
        _, avals = ik.cond_operands([v.aval for v in eqn.invars])
        branch_in = []
        for k, (value, aval) in enumerate(zip(ops, avals)):
            branch_in += self.boundary("branch_in", ik.branch_in_key(key, k), [value], [aval],
                                       [aval], weight)
        branch_outs = []
        for b, (inner, consts) in enumerate(jax_compat.cond_branches(eqn.params)):
            branch_outs.append(self.walk(inner, consts, branch_in, ik.branch_key(key, b),
                                         weight))
        outs = []
        for k, var in enumerate(eqn.outvars):
            operands = [bo[k] for bo in branch_outs]
            outs += self.boundary("branch_out", ik.branch_out_key(key, k), operands,
                                  [var.aval] * len(operands), [var.aval], weight)
        return outs

    def freeze(self, **fields) -> Graph:
        nodes = tuple(Node(**{**n, "operands": tuple(n["operands"]),
                              "operand_weights": tuple(n["operand_weights"])})
                      for n in self.nodes)
        users: list[list] = [[] for _ in self.values]
        for node in nodes:
            for i, value in enumerate(node.operands):
                if value is not None:
                    users[value].append((node.id, i))
        return Graph(nodes=nodes, values=tuple(self.values),
                     users=tuple(tuple(u) for u in users), **fields)


# trace's rule per control-flow primitive (interpret.CONTROL_FLOW).
CONTROL_FLOW_RULES = {"scan": GraphBuilder.scan, "while": GraphBuilder.while_loop,
                      "cond": GraphBuilder.cond}
assert set(CONTROL_FLOW_RULES) == set(ik.CONTROL_FLOW)


@dataclasses.dataclass(frozen=True)
class Program:
    """A traced function: its closed jaxpr and calling convention, before any graph."""

    closed_jaxpr: Any
    leaves: tuple             # abstract flat arguments
    paths: tuple[str, ...]    # per flat argument, as a user writes it
    in_tree: Any
    out_tree: Any
    out_avals: tuple
    out_paths: tuple[str, ...]

    @property
    def num_eqns(self) -> int:
        return len(self.closed_jaxpr.jaxpr.eqns)


def trace_program(fn: Callable, *args) -> Program:
    """``fn`` at ``args`` (arrays or jax.ShapeDtypeStruct pytrees) as a jaxpr.

    Nothing of the arguments' size is allocated: tracing sees only shapes and dtypes.
    """
    leaves, paths, in_tree = flatten_args(fn, args)

    def flat_fn(*flat):
        out = hold_static_leaves(fn(*release_static_leaves(
            jax.tree_util.tree_unflatten(in_tree, flat))))
        validate.output_leaves(jax.tree_util.tree_flatten_with_path(out)[0])
        return out

    with tracing_errors(fn, args):
        closed, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
    out_avals, out_tree = jax.tree_util.tree_flatten(out_shapes)
    out_paths = ["out" + jax.tree_util.keystr(k) for k, _ in
                 jax.tree_util.tree_flatten_with_path(out_shapes)[0]]
    return Program(closed, tuple(leaves), tuple(paths), in_tree, out_tree, tuple(out_avals),
                   tuple(out_paths))


def tracing_errors(fn: Callable, args: Sequence):
    """Errors raised while tracing ``fn`` at ``args``, or a part of it, named as
    ``trace_program`` names them (``validate.tracing``)."""
    return validate.tracing(fn, dict(zip(argument_names(fn, len(args)), args)))


def build_graph(program: Program) -> Graph:
    """The program's Graph: a node per equation, argument, constant and output."""
    closed = program.closed_jaxpr
    builder = GraphBuilder()
    arg_values, arg_nodes = [], []
    for i, (leaf, path) in enumerate(zip(program.leaves, program.paths)):
        arg_nodes.append(len(builder.nodes))
        arg_values += builder.new_node("arg", "arg", ik.arg_key(i), [], [], [leaf], label=path)
    outputs = builder.walk(closed.jaxpr, closed.consts, arg_values, (), 1.0)
    output_nodes = []
    for k, (value, aval) in enumerate(zip(outputs, program.out_avals)):
        output_nodes.append(len(builder.nodes) if value is not None else None)
        if value is not None:
            builder.new_node("output", "output", ik.output_key(k), [value], [aval], [aval],
                             label=program.out_paths[k])
    return builder.freeze(arg_nodes=tuple(arg_nodes), arg_paths=program.paths,
                          outputs=tuple(outputs), output_nodes=tuple(output_nodes),
                          out_paths=program.out_paths, closed_jaxpr=closed,
                          in_tree=program.in_tree, out_tree=program.out_tree,
                          out_avals=program.out_avals)


def trace(fn: Callable, *args) -> Graph:
    """Trace ``fn`` at ``args`` (arrays or jax.ShapeDtypeStruct pytrees) into a Graph."""
    return build_graph(trace_program(fn, *args))
