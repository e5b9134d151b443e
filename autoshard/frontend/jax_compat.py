"""What autoshard reads of JAX beyond its promised API, for every JAX it supports.

A compiler that reads jaxprs lives on JAX's internals: the layout of a control-flow
equation's params, the jaxpr classes, the primitives a release adds or renames, the hooks
that define a primitive, the runtime state of a multi-process run. All of it is read
here, and nowhere else imports ``jax._src``; each difference between the supported
releases is named where it is handled. A new JAX release is a change to this module.

Supported: jax 0.10.2 (the last release for Python 3.11) to 0.12 (:data:`OLDEST`,
:data:`NEWEST`).
The differences handled here:

- jaxprs: in 0.12 ``ClosedJaxpr`` is ``Jaxpr`` (a jaxpr carries the values of its
  constants), and equations hold such jaxprs where 0.10 held ``ClosedJaxpr`` wrappers;
  :func:`split_closed` and :func:`closed_jaxpr` read and write both.
- ``scan``'s params: 0.10 counts its operands in ``num_consts`` and ``num_carry``; 0.12
  groups them in the flat tree ``ft_in`` (constants, carries, xs) (:func:`scan_params`).
- ``call_hi_primitive``: 0.12 writes some jax.numpy functions (``searchsorted``,
  ``nonzero``, ...) as one equation; its expansion is walked as an inlined body
  (:func:`expansion`).
- ``jit``'s params: ``inline`` is a bool in 0.10 and a ``jax.Inline`` in 0.12
  (:func:`jit_call` keeps JAX's own default).
- primitives: 0.12 adds ``log2``, ``one_minus_square`` (the derivative of ``tanh``),
  ``polynomial`` (Horner evaluation, in ``erf_inv`` and friends), ``relayout`` and
  collectives of ``shard_map``; it renames ``vary_unreduced_cast_p`` to
  ``vary_unreduced_cast`` and drops the split ``*_start``/``*_done`` forms of some
  collectives (:data:`PRIMITIVES_BY_VERSION`).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Primitive, Var

__all__ = ["ClosedJaxpr", "Jaxpr", "Literal", "Primitive", "Var"]


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.10.2"`` as ``(0, 10, 2)``."""
    return tuple(int(part) for part in text.split("."))


JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__[:3])
# The releases the suite runs on: the oldest supported, and the newest release line.
OLDEST, NEWEST = "0.10.2", "0.12"

# -- jaxprs ---------------------------------------------------------------------------------
# 0.12 merged ClosedJaxpr into Jaxpr: a jaxpr holds its constants' values, and
# ``jaxpr.jaxpr`` is the jaxpr itself (its ``constvars`` those with values attached).
JAXPR_HOLDS_CONSTS = ClosedJaxpr is Jaxpr


def is_jaxpr(value) -> bool:
    """``value`` is a jaxpr, open or closed."""
    return isinstance(value, (Jaxpr, ClosedJaxpr))


def split_closed(jaxpr) -> tuple[Any, Sequence]:
    """(the jaxpr, the values of its ``constvars``) of an open or closed jaxpr."""
    if hasattr(jaxpr, "consts"):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def closed_jaxpr(constvars: Sequence, invars: Sequence, outvars: Sequence, eqns: Sequence,
                 consts: Sequence, debug_info=None):
    """A closed jaxpr of these parts, without effects: a ``ClosedJaxpr`` wrapping a
    ``Jaxpr`` in 0.10, one ``Jaxpr`` holding ``consts`` in 0.12."""
    jaxpr = Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), frozenset(),
                  debug_info)
    return ClosedJaxpr(jaxpr, list(consts))


def inline_call(closed, path: Sequence, body):
    """``closed`` with the call equation at the end of ``path`` (equations from its jaxpr
    down through calls) replaced by the equations of ``body``, a closed jaxpr of the
    same types as the call's: the jaxpr a trace with ``body`` traced in place gives."""
    jaxpr, consts = split_closed(closed)
    call = path[0]
    if len(path) > 1:
        name = INLINED[call.primitive.name]
        inner = inline_call(call.params[name], path[1:], body)
        eqns = [call.replace(params={**call.params, name: inner}) if e is call else e
                for e in jaxpr.eqns]
        return ClosedJaxpr(jaxpr.replace(eqns=eqns), list(consts))
    inner, inner_consts = split_closed(body)
    into = dict(zip(inner.invars, call.invars))      # the body's inputs: the call's operands
    inlined = [_reading(e, into) for e in inner.eqns]
    out_of = {v: _read(a, into) for v, a in zip(call.outvars, inner.outvars)}
    at = next(i for i, e in enumerate(jaxpr.eqns) if e is call)
    eqns = (list(jaxpr.eqns[:at]) + inlined
            + [_reading(e, out_of) for e in jaxpr.eqns[at + 1:]])
    new = jaxpr.replace(constvars=list(jaxpr.constvars) + list(inner.constvars), eqns=eqns,
                        outvars=[_read(v, out_of) for v in jaxpr.outvars],
                        effects=jaxpr.effects | inner.effects)
    return ClosedJaxpr(new, list(consts) + list(inner_consts))


def _read(atom, replaced: dict):
    """``atom``, or what ``replaced`` puts in its place (a literal is never replaced)."""
    return atom if isinstance(atom, Literal) else replaced.get(atom, atom)


def _reading(eqn, replaced: dict):
    """``eqn`` reading what ``replaced`` puts in place of its operands."""
    invars = [_read(v, replaced) for v in eqn.invars]
    return eqn if all(a is b for a, b in zip(invars, eqn.invars)) else eqn.replace(
        invars=invars)


def part_debug_info(jaxpr):
    """``jaxpr``'s debug info for a jaxpr made of some of its equations: its names of
    arguments and results dropped."""
    return jaxpr.debug_info.with_unknown_names()


def new_var(aval) -> Var:
    """A fresh variable of type ``aval``."""
    return Var(aval)


def eval_jaxpr(jaxpr, consts: Sequence, *args) -> list:
    """JAX's evaluation of an open jaxpr on ``consts`` and ``args``."""
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


def eval_eqn(eqn, ins: Sequence) -> list:
    """One equation applied to ``ins`` as :func:`eval_jaxpr` applies it (a call's body
    handed over as ``get_bind_params`` says); its results as a list."""
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def with_invars(eqn, invars: Sequence):
    """``eqn`` reading ``invars`` in place of its operands."""
    return eqn.replace(invars=list(invars))


def is_tracer(value) -> bool:
    """``value`` is a tracer (an abstract value of a trace in progress)."""
    return isinstance(value, jax.core.Tracer)


def used_inputs(closed) -> list[bool]:
    """Per input of ``closed``, whether some output depends on it (JAX's dead-code
    elimination, as ``jax.jit``'s ``keep_unused=False`` applies it)."""
    from jax._src.interpreters import partial_eval as pe
    jaxpr, _ = split_closed(closed)
    _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return list(used)


# -- call primitives ------------------------------------------------------------------------
# 0.12 writes some jax.numpy functions as one ``call_hi_primitive`` equation holding the
# function (``searchsorted``, ``nonzero``, ``ldexp``, ``frexp``, and with them ``interp``,
# ``histogram``, ``digitize``, and ``where``, ``argwhere`` and ``unique`` given a size),
# where 0.10 writes their primitives. Its expansion into those primitives (JAX's
# ``to_lojax``, what lowering does with it) is walked as an inlined body.
HIGH_LEVEL_CALL = "call_hi_primitive"
# Primitives whose body is inlined: name -> the param holding its (closed) jaxpr. Nested
# jits are ``jit`` (``pjit`` before 0.7); checkpoints are ``remat2`` (``checkpoint``,
# ``remat`` in older releases and in jaxprs written by hand).
INLINED = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "checkpoint": "jaxpr", "remat2": "jaxpr", "remat": "jaxpr",
    HIGH_LEVEL_CALL: "_prim",   # the body is the expansion (:func:`expansion`)
}
# Inlined calls that are rematerialized: ``apply`` wraps their body in ``jax.checkpoint``.
REMAT = ("checkpoint", "remat2", "remat")


def inlined_body(eqn) -> tuple[Any, Sequence]:
    """(jaxpr, consts) of an inlined call's body (:data:`INLINED`)."""
    if eqn.primitive.name == HIGH_LEVEL_CALL:
        return split_closed(expansion(eqn))
    return split_closed(eqn.params[INLINED[eqn.primitive.name]])


_EXPANSIONS: dict[int, tuple[Any, Any]] = {}   # id(eqn) -> (eqn, its expansion)
_MAX_EXPANSIONS = 1024


def expansion(eqn):
    """A ``call_hi_primitive`` equation as the closed jaxpr of its expansion into
    ordinary primitives, traced once per equation (so that ``trace`` and ``apply`` walk
    the same equations)."""
    found = _EXPANSIONS.get(id(eqn))
    if found is not None and found[0] is eqn:
        return found[1]
    avals = [v.aval for v in eqn.invars]
    closed = jax.make_jaxpr(lambda *xs: eqn.primitive.to_lojax(*xs, **eqn.params))(
        *(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals))
    if len(_EXPANSIONS) >= _MAX_EXPANSIONS:
        _EXPANSIONS.clear()
    _EXPANSIONS[id(eqn)] = (eqn, closed)
    return closed


def remat_options(params) -> dict:
    """``jax.checkpoint``'s keyword arguments that rematerialize as a checkpoint
    equation with ``params`` does."""
    return {"prevent_cse": params.get("prevent_cse", True), "policy": params.get("policy")}


# -- control flow ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScanParams:
    """A ``scan`` equation's params: its body (an open jaxpr and its consts), how its
    operands split (``num_consts`` constants, ``num_carry`` carries, then xs), and how
    it loops."""

    body: Any
    body_consts: Sequence
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int


def scan_params(params) -> ScanParams:
    """``scan``'s params. 0.10 counts constants and carries in ``num_consts`` and
    ``num_carry``; 0.12 groups the operands in ``ft_in``, a flat tree of three parts
    (constants, carries, xs)."""
    if "num_consts" in params:
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    else:
        consts, carry, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    body, body_consts = split_closed(params["jaxpr"])
    return ScanParams(body, body_consts, num_consts, num_carry, params["length"],
                      params["reverse"], params["unroll"])


@dataclasses.dataclass(frozen=True)
class WhileParams:
    """A ``while`` equation's params: its condition and body (open jaxprs and their
    consts), and the counts of the operands that are the condition's and the body's
    constants (the carries follow)."""

    cond: Any
    cond_consts: Sequence
    body: Any
    body_consts: Sequence
    cond_nconsts: int
    body_nconsts: int


def while_params(params) -> WhileParams:
    """``while``'s params (the same names in 0.10 and 0.12)."""
    cond, cond_consts = split_closed(params["cond_jaxpr"])
    body, body_consts = split_closed(params["body_jaxpr"])
    return WhileParams(cond, cond_consts, body, body_consts, params["cond_nconsts"],
                       params["body_nconsts"])


def cond_branches(params) -> list[tuple[Any, Sequence]]:
    """``cond``'s branches, each (open jaxpr, consts)."""
    return [split_closed(branch) for branch in params["branches"]]


# -- binding a jaxpr as one jit call --------------------------------------------------------
def jit_call(closed, name: str) -> Callable:
    """A function of the flat arguments binding ``closed`` as one ``jit`` equation
    (arguments kept whole, none donated): its trace records one equation, whatever the
    program's size. The params are those of a traced ``jax.jit`` call with the jaxpr, its
    arity and name replaced; the rest (``inline``: a bool in 0.10, a ``jax.Inline`` in
    0.12; the context mesh; compiler options) keep JAX's defaults."""
    template = jax.make_jaxpr(lambda x: jax.jit(lambda y: y)(x))(0.0).jaxpr.eqns[0]
    n_in, n_out = len(closed.in_avals), len(closed.out_avals)
    unspecified = template.params["in_shardings"][0]
    params = dict(template.params, jaxpr=closed, in_shardings=(unspecified,) * n_in,
                  out_shardings=(unspecified,) * n_out, in_layouts=(None,) * n_in,
                  out_layouts=(None,) * n_out, donated_invars=(False,) * n_in,
                  name=name, keep_unused=True)

    def flat_fn(*flat_args):
        return template.primitive.bind(*flat_args, **params)
    return flat_fn


# -- defining a primitive -------------------------------------------------------------------
def linear_primitive(name: str, impl: Callable, transpose: Callable,
                     batch: Callable) -> Primitive:
    """A primitive that keeps its operand's type, linear in it: run and lowered as
    ``impl(x, **params)``, transposed by ``transpose(ct, **params)`` (``ct`` never a
    symbolic zero), batched by ``batch(args, dims, **params)``."""
    from jax.interpreters import ad, batching, mlir
    prim = Primitive(name)
    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x, **_: x)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    ad.deflinear2(prim, lambda ct, x, **params: [transpose(ad.instantiate_zeros(ct),
                                                           **params)])
    batching.primitive_batchers[prim] = batch
    return prim


# -- primitives by release ------------------------------------------------------------------
# Modules that define primitives: packages walked whole, then single modules.
PRIMITIVE_PACKAGES = ("jax._src.lax", "jax._src.random", "jax._src.nn")
PRIMITIVE_MODULES = ("jax._src.ad_util", "jax._src.ad_checkpoint",
                     "jax._src.custom_derivatives", "jax._src.pjit", "jax._src.dispatch",
                     "jax._src.debugging", "jax._src.callback", "jax._src.checkify")

# The primitives that only some supported releases define: name -> (the defining module,
# the releases that define it). Every other primitive those modules define is in all of
# them. ``tests/unit/rules/test_rule_coverage.py`` checks this against the installed JAX.
V0_10, V0_12 = "0.10", "0.12"
PRIMITIVES_BY_VERSION: dict[str, tuple[str, tuple[str, ...]]] = {
    # 0.12 adds
    "log2": ("jax._src.lax.lax", (V0_12,)),
    "one_minus_square": ("jax._src.lax.lax", (V0_12,)),
    "polynomial": ("jax._src.lax.lax", (V0_12,)),
    "relayout": ("jax._src.pjit", (V0_12,)),
    "pbroadcast_dynamic": ("jax._src.lax.parallel", (V0_12,)),
    "unreduced_pmax": ("jax._src.lax.parallel", (V0_12,)),
    "unreduced_pmin": ("jax._src.lax.parallel", (V0_12,)),
    # 0.12 renames vary_unreduced_cast_p
    "vary_unreduced_cast": ("jax._src.lax.parallel", (V0_12,)),
    "vary_unreduced_cast_p": ("jax._src.lax.parallel", (V0_10,)),
    # 0.12 drops these split forms of collectives
    "pbroadcast_start": ("jax._src.lax.parallel", (V0_10,)),
    "pbroadcast_done": ("jax._src.lax.parallel", (V0_10,)),
    "psum_start": ("jax._src.lax.parallel", (V0_10,)),
    "unreduced_psum_start": ("jax._src.lax.parallel", (V0_10,)),
    "unreduced_reduce_scatter_start": ("jax._src.lax.parallel", (V0_10,)),
}
# A primitive some releases define in another module than the newest: name -> module.
# (``eval_jaxpr`` moved from ``jax._src.lax.eval_jaxpr`` to the loops module in 0.12.)
MODULE_MOVED = {"eval_jaxpr": "jax._src.lax.control_flow.loops"}


def installed_release() -> str:
    """The supported release line installed, as :data:`PRIMITIVES_BY_VERSION` names it."""
    return V0_12 if JAX_VERSION >= (0, 12) else V0_10


def _primitive_modules() -> Iterator:
    names = list(PRIMITIVE_MODULES)
    for package in PRIMITIVE_PACKAGES:
        pkg = importlib.import_module(package)
        names.append(package)
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
    for name in names:
        try:
            yield importlib.import_module(name)
        except ImportError:   # optional back ends (e.g. a GPU-only helper)
            continue


def defined_primitives(assigns: Callable[[Any, str], bool]) -> dict[str, str]:
    """Every primitive the installed JAX defines in :data:`PRIMITIVE_PACKAGES` and
    :data:`PRIMITIVE_MODULES`: name -> the module defining it (where several modules
    hold it, the one where ``assigns(module, attribute)``)."""
    found: dict[str, str] = {}
    for module in _primitive_modules():
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, Primitive) and (obj.name not in found
                                               or assigns(module, attr)):
                found[obj.name] = module.__name__
    return found


# -- the multi-process runtime --------------------------------------------------------------
def backends_started() -> bool:
    """JAX's backends are initialized (device counts can no longer change)."""
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def cluster_env_types() -> list:
    """The cluster environments JAX probes for (SLURM, Open MPI, Cloud TPU, ...)."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:   # pragma: no cover - a JAX without cluster detection
        return []
    return list(ClusterEnv._cluster_types)


def distributed_state():
    """``jax.distributed``'s state in this process: ``client`` (None when not
    initialized), ``process_id``, ``num_processes``, ``coordinator_address``."""
    from jax._src import distributed
    return distributed.global_state
