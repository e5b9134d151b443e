"""The contract ``trace`` and ``apply`` share when they walk a jaxpr.

Both interpret the same program with JAX's read/bind/write loop: ``trace`` to build the
graph the planner decides on, ``apply`` to run the program with those decisions. A
decision is found by its node key, so the two must agree on every key and on how each
control-flow equation's operands split into constants, carries and sliced inputs. Both
read those facts here:

- the node keys: an equation is ``key + (i,)`` inside the jaxpr at ``key``; an inlined
  call adds its primitive's name; a ``scan`` / ``while`` adds ``("const", k)``,
  ``("carry", k)``, ``("xs", k)``, ``("ys", k)`` for its seams and ``"body"`` for its body;
  a ``cond`` adds ``("in", k)``, ``("out", k)`` and ``"branch{b}"``;
- :data:`INLINED`: the call primitives whose body is walked in place;
- the operand layouts of ``scan``, ``while`` and ``cond`` (:func:`scan_operands`,
  :func:`while_operands`, :func:`cond_operands`).

Each interpreter keeps a table of its own rules for the control-flow primitives
(:data:`CONTROL_FLOW` names them), as JAX keeps one rule table per interpreter. The
interpreters that run the program (``apply``, and ``pipeline``'s rewrite of a layer stack)
share the loop itself: :func:`run_jaxpr` reads each equation's inputs, hands them to the
interpreter's rule for the equation, and writes its results; :func:`run_inlined` and
:func:`bind` are the rules both give an inlined call and an ordinary primitive. ``trace``
runs the same loop over graph values (a literal is no value of the graph).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autoshard.frontend import jax_compat
from autoshard.frontend.jax_compat import INLINED, REMAT, Literal, split_closed  # noqa: F401

# Primitives kept as units, their bodies walked under their own keys.
CONTROL_FLOW = ("scan", "while", "cond")


def literal_value(literal: Literal):
    """A literal operand read as its value (what running the program needs)."""
    return literal.val


def run_jaxpr(jaxpr, consts: Sequence, args: Sequence, rule: Callable,
              key: tuple = (), literal: Callable = literal_value) -> list:
    """JAX's read/bind/write loop over ``jaxpr``: each equation's results are
    ``rule(eqn, inputs, its node key)``, a literal input read as ``literal(atom)``."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom):
        return literal(atom) if isinstance(atom, Literal) else env[atom]
    for i, eqn in enumerate(jaxpr.eqns):
        env.update(zip(eqn.outvars, rule(eqn, [read(v) for v in eqn.invars], eqn_key(key, i))))
    return [read(v) for v in jaxpr.outvars]


def run_inlined(eqn, ins: Sequence, run_body: Callable) -> list:
    """An inlined call (:data:`INLINED`): its body run by ``run_body(jaxpr, consts,
    args)``, under ``jax.checkpoint`` where the call rematerializes (:data:`REMAT`)."""
    inner, consts = jax_compat.inlined_body(eqn)
    body = lambda *a: run_body(inner, consts, a)  # noqa: E731
    if eqn.primitive.name in REMAT:
        body = jax.checkpoint(body, **jax_compat.remat_options(eqn.params))
    return list(body(*ins))


def bind(eqn, ins: Sequence) -> list:
    """The equation's primitive applied to ``ins``, its results as a list."""
    outs = eqn.primitive.bind(*ins, **eqn.params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


# -- node keys ------------------------------------------------------------------------------
def arg_key(i: int) -> tuple:
    """The ``i``-th flat argument."""
    return ("arg", i)


def output_key(k: int) -> tuple:
    """The ``k``-th flat output of the program."""
    return ("out", k)


def eqn_key(key: tuple, i: int) -> tuple:
    """The ``i``-th equation of the jaxpr at ``key``."""
    return key + (i,)


def inlined_key(key: tuple, primitive: str) -> tuple:
    """The body of an inlined call (``jit``, ``custom_vjp_call``, ...) at ``key``."""
    return key + (primitive,)


def const_key(key: tuple, k: int) -> tuple:
    """The seam of a loop's ``k``-th constant (closed over by every iteration)."""
    return key + ("const", k)


def carry_key(key: tuple, k: int) -> tuple:
    """The seam of a loop's ``k``-th carry (its init, every iteration's, and the final)."""
    return key + ("carry", k)


def xs_key(key: tuple, k: int) -> tuple:
    """The seam of a scan's ``k``-th sliced input: the stacked array, and its slice."""
    return key + ("xs", k)


def ys_key(key: tuple, k: int) -> tuple:
    """The seam of a scan's ``k``-th stacked output: each iteration's slice, and the stack."""
    return key + ("ys", k)


def body_key(key: tuple) -> tuple:
    """The body of a scan or while loop."""
    return key + ("body",)


def branch_in_key(key: tuple, k: int) -> tuple:
    """The seam of a cond's ``k``-th operand (after the branch index)."""
    return key + ("in", k)


def branch_out_key(key: tuple, k: int) -> tuple:
    """The seam of a cond's ``k``-th result."""
    return key + ("out", k)


def branch_key(key: tuple, b: int) -> tuple:
    """The ``b``-th branch of a cond."""
    return key + (f"branch{b}",)


# -- operand layouts ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoopOperands:
    """A loop equation's operands by role. ``cond_consts``: the while condition's
    constants (a scan has none); ``xs``: a scan's sliced inputs (a while has none)."""

    consts: Sequence
    carry: Sequence
    xs: Sequence = ()
    cond_consts: Sequence = ()


def scan_operands(params, ins: Sequence) -> LoopOperands:
    """``scan``'s operands: ``num_consts`` constants, ``num_carry`` carries, then xs."""
    p = jax_compat.scan_params(params)
    nc, ncarry = p.num_consts, p.num_carry
    return LoopOperands(consts=ins[:nc], carry=ins[nc:nc + ncarry], xs=ins[nc + ncarry:])


def while_operands(params, ins: Sequence) -> LoopOperands:
    """``while``'s operands: the condition's constants, the body's, then the carries."""
    p = jax_compat.while_params(params)
    cn, bn = p.cond_nconsts, p.body_nconsts
    return LoopOperands(consts=ins[cn:cn + bn], carry=ins[cn + bn:], cond_consts=ins[:cn])


def cond_operands(ins: Sequence) -> tuple[Any, Sequence]:
    """``cond``'s operands: (the branch index, the branches' operands)."""
    return ins[0], ins[1:]
