"""apply: re-interpret the traced program with the plan's sharding decisions.

The read/bind/write loop of ``jax.core.eval_jaxpr``, with two additions: an operand the
plan reshards is passed through ``with_sharding_constraint`` first, and a result is
constrained after, except where XLA's sharding propagation gives the planned spec anyway
(:func:`propagation_gives`: an elementwise result laid out as its same-shaped operands,
which every reader takes as it is). Fewer constraints compile faster. Scans, while loops
and conds are rebuilt with ``lax.scan`` / ``lax.while_loop`` / ``lax.switch`` around
re-interpreted bodies.

A program without loops, conds, rematerialized calls or effects is not re-interpreted but
written: :class:`JaxprWriter` copies its equations into a new jaxpr with the same
constraints, bound as one call (:func:`rewritten_function`), so that ``jax.jit`` does not
trace every equation a second time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
from collections.abc import Mapping, Sequence

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding

from autoshard.frontend import interpret as ik
from autoshard.frontend import jax_compat, specs
from autoshard.frontend.interpret import INLINED
from autoshard.frontend.jax_compat import Literal
from autoshard.frontend.specs import Spec
from autoshard.frontend.trace import has_static_leaves, hold_static_leaves, release_static_leaves
from autoshard.rules.elementwise import BINARY, NARY, UNARY
from autoshard.target.xla import fft_on_cpu

ELEMENTWISE = frozenset(UNARY + BINARY + NARY) - {"optimization_barrier", "sharding_constraint"}


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``apply`` does at one node: specs to constrain operands/results to (None: leave)."""

    in_specs: tuple[Spec | None, ...] = ()
    out_specs: tuple[Spec | None, ...] = ()


# Where the start indices begin among each primitive's operands. XLA's simplifier folds
# the slice that splits a dynamic slice's result (a reader asking for it split, however
# far downstream) into the dynamic slice itself, offsetting the start per device: each
# device then clamps its own start, and a start that can be clamped gives wrong rows. An
# optimization barrier on the result keeps the slice apart.
DYNAMIC_STARTS = {"dynamic_slice": 1, "dynamic_update_slice": 2}
# A split scatter's result is kept apart the same way: XLA folds ``y + scatter(zeros)``
# into ``scatter(y)``, and with the scatter split and ``y`` whole, adds ``y`` on the wrong
# rows.
SCATTERS = frozenset({"scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul",
                      "scatter-min", "scatter_min", "scatter-max", "scatter_max"})

_EVERY_RESULT = contextvars.ContextVar("autoshard_constrain_every_result", default=False)


@contextlib.contextmanager
def constraining_every_result():
    """Plans made inside constrain every result (for comparing with the pruned program;
    pass ``cache=False`` so that no cached plan answers)."""
    token = _EVERY_RESULT.set(True)
    try:
        yield
    finally:
        _EVERY_RESULT.reset(token)


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector paused: planning and tracing a program make many
    long-lived objects (the jaxpr, the graph, strategies, cost terms, tracers) and next to
    no cyclic garbage, so collections while they run would only walk those objects again
    and again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def forward_spec(node, index: int, spec: Spec, out_shape) -> Spec | None:
    """The result spec that propagation derives from operand ``index`` laid out as
    ``spec``: elementwise ops keep a same-shaped operand's spec, transpose permutes it,
    broadcast_in_dim carries it to the mapped dims; None where that is not so simple."""
    shape = tuple(node.operand_shapes[index])
    if node.primitive in ELEMENTWISE:
        return spec if shape == tuple(out_shape) else None
    if node.primitive == "transpose":
        return tuple(spec[d] for d in node.params["permutation"])
    if node.primitive == "broadcast_in_dim" and index == 0:
        out = [()] * len(out_shape)
        for d, o in enumerate(node.params["broadcast_dimensions"]):
            if spec[d] and shape[d] != out_shape[o]:
                return None
            out[o] = spec[d]
        return tuple(out)
    return None


def propagation_gives(graph, chosen, node) -> bool:
    """Whether XLA's propagation lays out ``node``'s result as planned with no constraint:
    an elementwise op, transpose or broadcast whose operands arrive as planned, whose
    result spec follows from an operand's (:func:`forward_spec`), and whose readers all
    take it in that spec (no reader pulls another spec back into it). ``chosen``: a
    strategy per node."""
    if _EVERY_RESULT.get() or node.kind != "eqn" or len(node.outputs) != 1 or not (
            node.primitive in ELEMENTWISE or node.primitive in ("transpose", "broadcast_in_dim")):
        return False
    strategy = chosen[node.id]
    (out_spec,) = strategy.out_specs
    (value_id,) = node.outputs
    out_shape = graph.values[value_id].shape
    follows = False
    for i, operand in enumerate(node.operands):
        if operand is None:
            continue
        value = graph.values[operand]
        have = chosen[value.producer].out_specs[value.index]
        if have != strategy.in_specs[i]:
            return False                        # resharded on the way in
        follows |= have is not None and forward_spec(node, i, have, out_shape) == out_spec
    readers_agree = all(chosen[user].in_specs[i] == out_spec
                        for user, i in graph.users[value_id])
    return follows and readers_agree and bool(graph.users[value_id])


def named_sharding(mesh: Mesh, spec: Spec) -> NamedSharding:
    return NamedSharding(mesh, specs.to_partition_spec(spec))


def kept_apart(eqn, decision: Decision) -> bool:
    """Whether the equation's results go through an optimization barrier before their
    readers: a dynamic slice or update at a traced start (``DYNAMIC_STARTS``), a scatter
    whose result is split (``SCATTERS``)."""
    name = eqn.primitive.name
    if name in DYNAMIC_STARTS:
        return any(not isinstance(v, Literal) for v in eqn.invars[DYNAMIC_STARTS[name]:])
    return name in SCATTERS and any(axes for spec in decision.out_specs if spec
                                    for axes in spec)


def fft_run(eqn, mesh: Mesh) -> str | None:
    """How an FFT runs on ``mesh`` (``xla.fft_on_cpu``): "elementwise" (``one_point_fft``),
    "copied" (its operand and result through identity gathers along ``whole_dim``), or
    None (as it is, and every other equation)."""
    return fft_on_cpu(eqn.primitive.name, eqn.params, mesh.devices.flat[0].platform)


def whole_dim(aval, specs) -> int:
    """The longest dim of ``aval`` its spec (the first of ``specs``) leaves whole, the last
    on ties (an FFT's transformed last dim is always whole). A gather along it moves
    nothing between devices, and XLA does not fold it into a bitcast, as it does a gather
    of one element (which left an all-gather's layout on the FFT's operand)."""
    spec = specs[0] if specs else None
    whole = [d for d in range(aval.ndim) if not (spec and spec[d])]
    return max(reversed(whole), key=lambda d: aval.shape[d])


def fft_in_specs(decision: Decision) -> tuple:
    """The specs an FFT's operand is laid out in: its own where it is resharded on the way
    in, else its result's (unconstrained, the operand arrives as planned, and an FFT's
    result is laid out as its operand on the leading dims, the transformed ones whole).
    Read from no spec, ``whole_dim`` might gather along a split dim, and XLA gathers the
    whole operand onto each device to do so."""
    return decision.in_specs or decision.out_specs


def one_point_fft(x, dtype):
    """An FFT, IFFT, RFFT or IRFFT of one point per transform: the value itself, as
    complex (an RFFT), or its real part (an IRFFT)."""
    if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
        return x.astype(dtype)
    return jax.numpy.real(x).astype(dtype)


def identity_gather(x, axis: int):
    """``x`` read through a gather of every index along ``axis`` (``fft_run``)."""
    return jax.numpy.take(x, jax.numpy.arange(x.shape[axis]), axis=axis, mode="clip",
                          unique_indices=True, indices_are_sorted=True)


class Rewriter:
    def __init__(self, decisions: Mapping[tuple, Decision], mesh: Mesh):
        self.decisions = decisions
        self.mesh = mesh

    def constrain(self, x, spec: Spec | None):
        if spec is None or isinstance(x, Literal) or not hasattr(x, "shape"):
            return x
        return jax.lax.with_sharding_constraint(x, named_sharding(self.mesh, spec))

    def constrain_all(self, xs, spec_list):
        if not spec_list:
            return list(xs)
        return [self.constrain(x, s) for x, s in zip(xs, spec_list)]

    def decision(self, key) -> Decision:
        return self.decisions.get(key, Decision())

    def run(self, jaxpr, consts, args, key) -> list:
        return ik.run_jaxpr(jaxpr, consts, args, self.eqn, key)

    def eqn(self, eqn, ins, key) -> list:
        name = eqn.primitive.name
        if name in INLINED:
            return ik.run_inlined(eqn, ins, lambda inner, consts, a: self.run(
                inner, consts, a, ik.inlined_key(key, name)))
        if name in CONTROL_FLOW_RULES:
            return CONTROL_FLOW_RULES[name](self, eqn, ins, key)
        decision = self.decision(key)
        ins = self.constrain_all(ins, decision.in_specs)
        fft = fft_run(eqn, self.mesh)
        if fft == "elementwise":
            return self.constrain_all([one_point_fft(ins[0], eqn.outvars[0].aval.dtype)],
                                      decision.out_specs)
        copied = fft == "copied"
        if copied:
            ins = [identity_gather(ins[0], whole_dim(eqn.invars[0].aval, fft_in_specs(decision)))]
        outs = ik.bind(eqn, ins)
        if kept_apart(eqn, decision):
            outs = list(lax.optimization_barrier(outs))
        if copied:
            outs = [identity_gather(outs[0],
                                    whole_dim(eqn.outvars[0].aval, decision.out_specs))]
        return self.constrain_all(outs, decision.out_specs)

    def seam(self, key, x, which="out"):
        decision = self.decision(key)
        spec_list = decision.out_specs if which == "out" else decision.in_specs
        return self.constrain(x, spec_list[0] if spec_list else None)

    def seams(self, key_of, xs, which="out") -> list:
        """Each of ``xs`` constrained at its seam ``key_of(k)``."""
        return [self.seam(key_of(k), x, which) for k, x in enumerate(xs)]

    def scan(self, eqn, ins, key) -> list:
        p = jax_compat.scan_params(eqn.params)
        body, body_consts = p.body, p.body_consts
        ops = ik.scan_operands(eqn.params, ins)
        ncarry = len(ops.carry)

        carry, xs, ys = (functools.partial(f, key) for f in (ik.carry_key, ik.xs_key, ik.ys_key))
        consts = self.seams(functools.partial(ik.const_key, key), ops.consts)
        init = self.seams(carry, ops.carry)
        stacked = self.seams(xs, ops.xs, "in")

        def step(state, x):
            state = self.seams(carry, state)
            outs = self.run(body, body_consts, [*consts, *state, *self.seams(xs, x)],
                            ik.body_key(key))
            return self.seams(carry, outs[:ncarry]), self.seams(ys, outs[ncarry:], "in")

        final, out_ys = lax.scan(step, init, stacked, length=p.length, reverse=p.reverse,
                                 unroll=p.unroll)
        return [*self.seams(carry, final), *self.seams(ys, out_ys)]

    def while_loop(self, eqn, ins, key) -> list:
        p = jax_compat.while_params(eqn.params)
        ops = ik.while_operands(eqn.params, ins)

        carry = functools.partial(ik.carry_key, key)
        body_consts = self.seams(functools.partial(ik.const_key, key), ops.consts)
        init = self.seams(carry, ops.carry)

        def cond_fun(state):
            (out,) = jax_compat.eval_jaxpr(p.cond, p.cond_consts, *ops.cond_consts, *state)
            return out

        def body_fun(state):
            state = self.seams(carry, state)
            outs = self.run(p.body, p.body_consts, [*body_consts, *state], ik.body_key(key))
            return self.seams(carry, outs)

        return self.seams(carry, lax.while_loop(cond_fun, body_fun, init))

    def cond(self, eqn, ins, key) -> list:
        index, ops = ik.cond_operands(ins)

        out = functools.partial(ik.branch_out_key, key)
        ops = self.seams(functools.partial(ik.branch_in_key, key), ops)

        def branch_fn(b, inner, consts):
            def fn(*operands):
                return self.seams(out, self.run(inner, consts, operands, ik.branch_key(key, b)))
            return fn

        branches = [branch_fn(b, inner, consts)
                    for b, (inner, consts) in enumerate(jax_compat.cond_branches(eqn.params))]
        return self.seams(out, lax.switch(index, branches, *ops))


# apply's rule per control-flow primitive (interpret.CONTROL_FLOW).
CONTROL_FLOW_RULES = {"scan": Rewriter.scan, "while": Rewriter.while_loop,
                      "cond": Rewriter.cond}
assert set(CONTROL_FLOW_RULES) == set(ik.CONTROL_FLOW)


def rewrite(closed_jaxpr, decisions: Mapping[tuple, Decision], mesh: Mesh):
    """A function of the flat arguments that runs the program with the plan's constraints."""
    rewriter = Rewriter(decisions, mesh)

    def flat_fn(*flat_args):
        with collection_paused():   # jax.jit traces it: a tracer per equation
            return rewriter.run(closed_jaxpr.jaxpr, closed_jaxpr.consts, flat_args, ())
    return flat_fn


class Unwritten(Exception):
    """The program holds what :class:`JaxprWriter` does not write (a loop, a cond, a
    rematerialized call): ``Rewriter`` runs it instead."""


class JaxprWriter:
    """``Rewriter``'s rewrite written straight into a new jaxpr, equation by equation, with
    no tracing: every equation copied onto fresh variables, a ``sharding_constraint``
    equation where ``Rewriter`` calls ``with_sharding_constraint``, an
    ``optimization_barrier`` where it calls one, inlined calls inlined. ``jax.jit`` then
    binds the whole rewritten program as one call (:func:`called_whole`) instead of
    tracing it primitive by primitive: the same program, lowered without a second trace
    of every equation. Loops, conds and rematerialized calls are left to ``Rewriter``
    (``Unwritten``), and so are programs with effects (callbacks, prints)."""

    def __init__(self, decisions: Mapping[tuple, Decision], mesh: Mesh):
        self.decisions, self.mesh = decisions, mesh
        self.eqns: list = []
        self.constvars: list = []
        self.consts: list = []
        self._templates: dict = {}

    def write(self, closed_jaxpr):
        """The rewritten program as a ClosedJaxpr."""
        jaxpr = closed_jaxpr.jaxpr
        invars = [jax_compat.new_var(v.aval) for v in jaxpr.invars]
        consts = self.const_vars(jaxpr, closed_jaxpr.consts)
        outs = self.run(jaxpr, consts, invars, ())
        if jaxpr.effects or any(e.effects for e in self.eqns):
            raise Unwritten("effects")   # ordered ones thread tokens through a call
        return jax_compat.closed_jaxpr(self.constvars, invars, outs, self.eqns, self.consts,
                                       jaxpr.debug_info)

    def const_vars(self, jaxpr, values) -> list:
        """Fresh variables for ``jaxpr``'s constants, ``values``, held by the written one."""
        fresh = [jax_compat.new_var(v.aval) for v in jaxpr.constvars]
        self.constvars += fresh
        self.consts += list(values)
        return fresh

    def run(self, jaxpr, consts, args, key) -> list:
        return ik.run_jaxpr(jaxpr, consts, args, self.eqn, key, literal=lambda atom: atom)

    def eqn(self, eqn, ins, key) -> list:
        name = eqn.primitive.name
        if name in INLINED:
            if name in ik.REMAT:
                raise Unwritten(name)
            inner, consts = jax_compat.inlined_body(eqn)
            return self.run(inner, self.const_vars(inner, consts), ins,
                            ik.inlined_key(key, name))
        if name in CONTROL_FLOW_RULES:
            raise Unwritten(name)
        decision = self.decision(key)
        ins = self.constrain_all(ins, decision.in_specs)
        fft = fft_run(eqn, self.mesh)
        if fft == "elementwise":
            dtype = eqn.outvars[0].aval.dtype
            template = self.template(("one_point_fft", dtype), [ins[0].aval], jax.jit(
                functools.partial(one_point_fft, dtype=dtype)))
            return self.constrain_all(self.emit(template, ins[:1]), decision.out_specs)
        copied = fft == "copied"
        if copied:
            ins = self.identity_gather(ins, fft_in_specs(decision))
        outs = [jax_compat.new_var(v.aval) for v in eqn.outvars]
        self.eqns.append(eqn.replace(invars=list(ins), outvars=outs))
        if kept_apart(eqn, decision):
            outs = self.barrier(outs)
        if copied:
            outs = self.identity_gather(outs, decision.out_specs)
        return self.constrain_all(outs, decision.out_specs)

    decision = Rewriter.decision
    constrain_all = Rewriter.constrain_all   # each through this class's ``constrain``

    def constrain(self, atom, spec: Spec | None):
        if spec is None or isinstance(atom, Literal) or not hasattr(atom.aval, "shape"):
            return atom
        template = self.template(("constraint", spec), [atom.aval],   # made on a miss only
                                 lambda x: lax.with_sharding_constraint(
                                     x, named_sharding(self.mesh, spec)))
        return self.emit(template, [atom])[0]

    def barrier(self, atoms) -> list:
        template = self.template(("barrier",), [a.aval for a in atoms],
                                 lambda *xs: lax.optimization_barrier(xs))
        return self.emit(template, atoms)

    def identity_gather(self, atoms, specs) -> list:
        """The first of ``atoms`` through ``identity_gather`` along ``whole_dim``."""
        axis = whole_dim(atoms[0].aval, specs)
        template = self.template(("identity_gather", axis), [atoms[0].aval],
                                 jax.jit(functools.partial(identity_gather, axis=axis)))
        return self.emit(template, atoms[:1])

    def template(self, key: tuple, avals, fn):
        """The one equation ``fn`` traces to on ``avals``: its primitive, params and
        context, as tracing writes them (kept per ``key`` and avals)."""
        key = key + tuple(avals)
        found = self._templates.get(key)
        if found is None:
            traced = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                          for a in avals))
            (found,) = traced.jaxpr.eqns
            self._templates[key] = found
        return found

    def emit(self, template, atoms) -> list:
        """``template``'s primitive on ``atoms``, its results typed as the primitive's
        abstract evaluation types them (weak types kept)."""
        avals, _ = template.primitive.abstract_eval(*(a.aval for a in atoms),
                                                    **template.params)
        avals = avals if template.primitive.multiple_results else [avals]
        outs = [jax_compat.new_var(aval) for aval in avals]
        self.eqns.append(template.replace(invars=list(atoms), outvars=outs))
        return outs


def called_whole(closed_jaxpr):
    """A function of the flat arguments binding ``closed_jaxpr`` as one jit call: its
    trace records one equation, whatever the program's size."""
    return jax_compat.jit_call(closed_jaxpr, "autoshard_rewritten")


def rewritten_function(closed_jaxpr, decisions: Mapping[tuple, Decision], mesh: Mesh):
    """The program with the plan's constraints, as a function of the flat arguments:
    written as a jaxpr (on its first call, when ``jax.jit`` traces it) and called whole
    where :class:`JaxprWriter` writes it, else re-interpreted (:func:`rewrite`)."""
    found: list = []

    def flat_fn(*flat_args):
        if not found:
            try:
                with collection_paused():
                    written = JaxprWriter(decisions, mesh).write(closed_jaxpr)
                found.append(called_whole(written))
            except Unwritten:
                found.append(rewrite(closed_jaxpr, decisions, mesh))
        return found[0](*flat_args)
    return flat_fn


def make_jit(closed_jaxpr, in_tree, out_tree, decisions, mesh: Mesh,
             in_specs: Sequence[Spec], out_specs: Sequence[Spec], donate_argnums=(),
             check_args=None):
    """jax.jit of the rewritten program, taking and returning the user's pytrees.
    ``check_args(args)`` raises where the arguments are not the ones planned for."""
    flat_fn = rewritten_function(closed_jaxpr, decisions, mesh)

    def fn(*args):
        args = hold_static_leaves(args)
        if check_args is not None:
            check_args(args)
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != in_tree:
            from autoshard.errors import PlanError
            raise PlanError(f"arguments have structure {tree}; the plan was made for {in_tree}")
        return jax.tree_util.tree_unflatten(out_tree, flat_fn(*flat))

    in_shardings = jax.tree_util.tree_unflatten(in_tree,
                                                [named_sharding(mesh, s) for s in in_specs])
    out_shardings = jax.tree_util.tree_unflatten(out_tree,
                                                 [named_sharding(mesh, s) for s in out_specs])
    jitted = jax.jit(fn, in_shardings=tuple(in_shardings), out_shardings=out_shardings,
                     donate_argnums=donate_argnums)
    if check_args is None and not (has_static_leaves(in_tree) or has_static_leaves(out_tree)):
        return jitted
    return CheckedJit(jitted, in_tree, check_args)


class CheckedJit:
    """A jitted plan over the user's pytrees. The non-array leaves of equinox modules are
    held in the tree structure on the way in (so ``jax.jit`` sees only arrays) and given
    back on the way out, as ``eqx.filter_jit`` does; the arguments' tree is checked before
    jax.jit matches it against the in_shardings (whose own error names no argument), and
    their shapes and dtypes while tracing. Anything else is the jitted function's."""

    def __init__(self, jitted, in_tree, check_args=None):
        self._jitted, self._in_tree, self._check_args = jitted, in_tree, check_args
        functools.update_wrapper(self, jitted)

    def _held(self, args) -> tuple:
        held = hold_static_leaves(args)
        if jax.tree_util.tree_structure(held) != self._in_tree:
            if self._check_args is not None:
                self._check_args(held)   # raises, naming what differs
            from autoshard.errors import PlanError
            raise PlanError(f"arguments have structure {jax.tree_util.tree_structure(held)}; "
                            f"the plan was made for {self._in_tree} (static leaves of modules "
                            "must be the same)")
        return held

    def __call__(self, *args):
        return release_static_leaves(self._jitted(*self._held(args)))

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*self._held(args), **kwargs)

    def trace(self, *args, **kwargs):
        return self._jitted.trace(*self._held(args), **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)
