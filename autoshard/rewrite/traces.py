"""traces: a marked loss's jaxprs, kept across the settings one plan weighs.

The settings search (``planning/settings.py``) traces the program once per setting. Under
a remat policy or a pipeline, the marked loss is traced again inside that trace: to a
jaxpr (``pipeline.pipelined``), again where its repeated layers are rolled into a scan
(``unrolled.rolled``), and again on one microbatch's rows. Every setting traces the same
Python function at the same shapes, so its jaxpr, its run of repeated layers and the roll
of that run are kept here and read back: a setting pays the autodiff of its own program,
not the loss's Python again.

A jaxpr that closed over a tracer of the trace it was made in (a loss that closes over
its batch, under the step's trace) belongs to that trace: it is not kept.

The program around the marked loss does not change between settings either: the
optimizer's update, often thousands of equations over a list of layers, is the same in
every setting. So the first setting traces the marked loss as one call equation
(``MARKED``), and each setting's program is that jaxpr with the call's equations in
place (``Traces.program``): the first setting's own, each other setting's traced alone
under it. Every setting's program is the one a trace of the whole step gives. Where the
loss is called more than once, inside a loop, or closes over a tracer of the step, the
whole step is traced again instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import jax

from autoshard.frontend import jax_compat
from autoshard.frontend.interpret import INLINED
from autoshard.frontend.trace import Program, trace_program, tracing_errors

# The name of the call equation a marked loss is traced as, under a settings search.
MARKED = "autoshard_marked_loss"


def function_key(fun: Callable, tree, kwargs: dict) -> Hashable | None:
    """``fun`` called on flat arguments of structure ``tree`` with ``kwargs``, as a key;
    None where a keyword argument is no key (an array, a list)."""
    key = (fun, tree, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def arguments_key(args: Sequence) -> tuple:
    """The types of flat arguments (shape, dtype, weak type, and what else JAX's type of
    each holds): the jaxpr of a function depends on nothing else of them."""
    return tuple(str(jax.typeof(x)) for x in args)


class Traces:
    """Jaxprs and what is read from them, by function and argument types."""

    def __init__(self, marking: bool = True):
        """``marking``: whether the marked loss is traced as a call, so that the step
        around it is kept (False: each setting traces the whole step)."""
        self._kept: dict = {}
        self._calls: list[MarkedCall | None] = []   # the marked calls of the trace under way
        self._around: Around | None = None   # the program around the marked call
        self._marking = marking

    def program(self, fn: Callable, args: Sequence) -> Program:
        """``trace_program(fn, *args)`` under the setting in force: the marked call
        traced alone and put in place of the first setting's; the whole program traced
        where none was kept or the call's results differ in type from that one's."""
        if self._around is not None:
            program = self._around.replayed(fn, args)
            if program is not None:
                return program
        self._calls = []
        program = trace_program(fn, *args)
        if not self._calls:
            return program
        inlined = without_calls(program, sum(c is not None for c in self._calls))
        if inlined is None:   # a call inside a loop or a custom derivative: as written
            self._marking = False
            return trace_program(fn, *args)
        self._around = Around.of(program, self._calls)
        return inlined

    def marked_call(self, fun: Callable, args: Sequence):
        """``fun(*args)``, traced as one call equation (``MARKED``) where every leaf of
        ``args`` is a tracer, so that other settings can replace it."""
        flat, tree = jax.tree.flatten(tuple(args))
        if not self._marking or not flat or not all(jax_compat.is_tracer(x) for x in flat):
            self._calls.append(None)
            return fun(*args)
        call = MarkedCall(fun, tree)
        self._calls.append(call)
        return call.as_call(flat)

    def jaxpr(self, key: Hashable | None, fun: Callable, args: Sequence):
        """``jax.make_jaxpr(fun, return_shape=True)(*args)``, kept under ``key`` (the
        function's, ``function_key``) and the arguments' types; None keeps nothing."""
        if key is None:
            return jax.make_jaxpr(fun, return_shape=True)(*args)
        full = ("jaxpr", key, arguments_key(args))
        found = self._kept.get(full)
        if found is None:
            found = jax.make_jaxpr(fun, return_shape=True)(*args)
            if not any(jax_compat.is_tracer(c) for c in found[0].consts):
                self._kept[full] = found
        return found

    def read(self, what: Hashable, key: Hashable | None, args: Sequence, make: Callable):
        """``make()``: something read from the jaxpr of the function ``key`` at ``args``
        (its repeated layers, their roll), kept with that jaxpr."""
        full = ("jaxpr", key, arguments_key(args))
        if key is None or full not in self._kept:
            return make()
        read_key = (what, full)
        if read_key not in self._kept:
            self._kept[read_key] = make()
        return self._kept[read_key]

    def remembered(self, what: Hashable, key: Hashable | None):
        """What was remembered of the function ``key`` at any arguments (None: nothing)."""
        return None if key is None else self._kept.get((what, key))

    def remember(self, what: Hashable, key: Hashable | None, value) -> None:
        """Remember ``value`` of the function ``key``, whatever its arguments."""
        if key is not None:
            self._kept[what, key] = value


@dataclasses.dataclass
class MarkedCall:
    """The marked loss ``fun`` on flat arguments of structure ``tree``, as one call."""

    fun: Callable
    tree: object
    out_tree: object = None

    def as_call(self, flat: Sequence):
        """``fun``'s results, traced as one ``MARKED`` call equation."""
        def body(*leaves):
            out, self.out_tree = jax.tree.flatten(self.fun(*jax.tree.unflatten(self.tree,
                                                                             leaves)))
            return out
        body.__name__ = body.__qualname__ = MARKED
        outs = jax.jit(body)(*flat)
        return jax.tree.unflatten(self.out_tree, outs)

    def inline(self, flat: Sequence) -> list:
        """``fun``'s flat results, traced in place."""
        return jax.tree.leaves(self.fun(*jax.tree.unflatten(self.tree, flat)))


@dataclasses.dataclass(frozen=True)
class Around:
    """A program holding one marked call equation, reached through inlined calls only
    (``path``: the equations from the top jaxpr down to it)."""

    program: Program
    path: tuple
    call: MarkedCall

    @staticmethod
    def of(program: Program, calls: list) -> Around | None:
        """The program around its one marked call; None where the loss was called more
        or less than once, or its call is not found at the top or in inlined calls, or
        reads more than its arguments (tracers it closes over)."""
        if len(calls) != 1 or calls[0] is None:
            return None
        paths = list(marked_paths(program.closed_jaxpr.jaxpr))
        if len(paths) != 1:
            return None
        call_eqn = paths[0][-1]
        if len(call_eqn.invars) != calls[0].tree.num_leaves:
            return None
        return Around(program, paths[0], calls[0])

    def replayed(self, fn: Callable, args: Sequence) -> Program | None:
        """The program with its marked call traced again, in place, under the setting in
        force; None where that call's results differ in type from the first setting's."""
        call = self.path[-1]
        types = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                      weak_type=getattr(v.aval, "weak_type", False))
                 for v in call.invars]
        with tracing_errors(fn, args):
            body = jax.make_jaxpr(self.call.inline)(types)
        if [v.aval for v in jax_compat.split_closed(body)[0].outvars] != \
                [v.aval for v in call.outvars]:
            return None
        return self.with_body(body)

    def with_body(self, body) -> Program:
        """The program with ``body``'s equations in place of its marked call."""
        closed = jax_compat.inline_call(self.program.closed_jaxpr, self.path, body)
        return dataclasses.replace(self.program, closed_jaxpr=closed)


def without_calls(program: Program, count: int) -> Program | None:
    """``program`` with the bodies of its ``count`` marked calls in their place: the
    program a trace without the calls gives; None where some call is not found through
    calls alone (it is inside a loop, a remat or a custom derivative)."""
    closed = program.closed_jaxpr
    for _ in range(count):
        path = next(marked_paths(jax_compat.split_closed(closed)[0]), None)
        if path is None:
            return None
        call = path[-1]
        closed = jax_compat.inline_call(closed, path, call.params[INLINED[call.primitive.name]])
    return dataclasses.replace(program, closed_jaxpr=closed)


# The calls a marked call is found in: those whose body is the program as written (not a
# remat's, nor a custom derivative's), so that putting a body in place changes nothing else.
CALLS = ("jit", "pjit", "closed_call", "core_call")


def marked_paths(jaxpr, above: tuple = ()):
    """Each ``MARKED`` call equation in ``jaxpr`` or its inlined calls, as the equations
    from ``jaxpr`` down to it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in CALLS:
            continue
        if eqn.params.get("name") == MARKED:
            yield above + (eqn,)
        else:
            yield from marked_paths(jax_compat.inlined_body(eqn)[0], above + (eqn,))
