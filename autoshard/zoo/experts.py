"""Hand-written sharding plans, the way a practitioner writes them, for comparison.

A plan here is a list of rules ``(regex, PartitionSpec)`` matched against each leaf's path
(``"state['params']['blocks'][0]['attn']['query']['kernel']"``, the paths ``autoshard.plan``
prints); the first rule whose regex is found in the path gives the leaf's spec. Specs may
name mesh axes by *role*, so one rule list serves every mesh:

- ``BATCH``: every mesh axis (data parallel splits the batch over all devices);
- ``MODEL``: the tensor-parallel axis: the last axis of a 2-D mesh, or the only axis;
- ``DATA``: every axis but the model axis (none on a 1-D mesh).

Mesh axes that do not divide a dimension are dropped, so every plan is valid on any mesh.

Example::

    from autoshard.zoo import experts, models
    case = models.train_case("gpt", "tiny")
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    step = experts.jit_expert(case, mesh, "megatron")          # jax.jit with shardings
    compiled = experts.compile_expert(case, mesh, "fsdp")      # from abstract args
    report = autoshard.report.hlo_report.hlo_report(compiled, autoshard.H100, mesh)

    rules = [(r"\\['(query|key|value)'\\]\\['kernel'\\]", P(None, experts.MODEL)),
             (r".*", P())]
    shardings = experts.shardings_from_rules(params, mesh, rules, prefix="params")
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.units import axis_sizes

__all__ = [
    "BATCH", "DATA", "MODEL", "Expert", "Rule", "compile_expert", "constrain",
    "constrain_gradients", "constraints", "data_parallel", "expert_parallel", "fit_spec",
    "fsdp", "fsdp_tp", "inspect_expert", "jit_expert", "largest_dim_spec", "jit_gpipe",
    "leaf_paths", "megatron", "resolve_spec", "role_axes", "shardings_from_rules",
    "standard_experts", "zero1", "zero2",
]

BATCH = "<batch>"
"""Role: every mesh axis."""
MODEL = "<model>"
"""Role: the tensor-parallel axis (last axis of a 2-D mesh, or the only axis)."""
DATA = "<data>"
"""Role: every mesh axis but the model axis."""

Rule = tuple[str, P]
"""``(regex searched in the leaf path, PartitionSpec)``; the first match wins."""


# --------------------------------------------------------------------------- specs


def role_axes(mesh: Mesh, role: str) -> tuple[str, ...]:
    """The mesh axes a role names (a plain axis name names itself).

    Example::

        role_axes(mesh_2x4, MODEL) == ("model",); role_axes(mesh_2x4, DATA) == ("data",)
        role_axes(mesh_8, MODEL) == ("data",);    role_axes(mesh_8, DATA) == ()
    """
    names = tuple(mesh.axis_names)
    if role == BATCH:
        return names
    if role == MODEL:
        return names[-1:]
    if role == DATA:
        return names[:-1]
    if role not in names:
        raise ValueError(f"mesh has no axis {role!r} (axes: {names})")
    return (role,)


def resolve_spec(spec: P, mesh: Mesh) -> tuple[tuple[str, ...], ...]:
    """A spec's entries as tuples of mesh axis names, roles resolved."""
    out = []
    for entry in spec:
        entries = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(tuple(a for e in entries for a in role_axes(mesh, e)))
    return tuple(out)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """``spec`` with roles resolved and every axis that does not divide its dim dropped.

    Of the dim's axes (in order, skipping those used by an earlier dim), the subset with
    the largest product that divides the dim is kept; entries past the array's rank are
    ignored.

    Example::

        fit_spec(P(BATCH, None), (6, 16), mesh_2x4) == P("data", None)   # 4 does not divide 6
        fit_spec(P(BATCH), (12,), mesh_2x4) == P("model")                 # 4 beats 2
    """
    sizes = axis_sizes(mesh)
    used: set[str] = set()
    entries = []
    for dim, axes in zip(shape, resolve_spec(spec, mesh)):
        axes = [a for a in dict.fromkeys(axes) if a not in used and sizes[a] > 1]
        best, best_product = [], 1
        for mask in range(1, 2 ** len(axes)):
            subset = [a for i, a in enumerate(axes) if mask >> i & 1]
            product = math.prod(sizes[a] for a in subset)
            if dim % product == 0 and product > best_product:
                best, best_product = subset, product
        used.update(best)
        entries.append(None if not best else best[0] if len(best) == 1 else tuple(best))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def largest_dim_spec(shape: Sequence[int], mesh: Mesh, role: str = BATCH) -> P:
    """ZeRO-3 spec: the largest dim that the role's axes divide, split over them.

    When no dim takes all the axes, the dim taking the largest product of them wins.

    Example::

        largest_dim_spec((64, 256), mesh_2x4) == P(None, ("data", "model"))
    """
    axes = role_axes(mesh, role)
    best, best_devices = P(), 1
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        spec = fit_spec(P(*([None] * dim), axes), shape, mesh)
        devices = math.prod(axis_sizes(mesh)[a] for e in spec if e
                            for a in ((e,) if isinstance(e, str) else e))
        if devices > best_devices:
            best, best_devices = spec, devices
    return best


# --------------------------------------------------------------------------- rules


def leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    """Each leaf's path as ``autoshard.plan`` prints it: ``prefix + keystr``."""
    return [prefix + jax.tree_util.keystr(k) for k, _ in
            jax.tree_util.tree_flatten_with_path(tree)[0]]


def _map_with_path(fn: Callable[[str, Any], Any], tree: Any, prefix: str) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda k, x: fn(prefix + jax.tree_util.keystr(k), x), tree)


def shardings_from_rules(tree: Any, mesh: Mesh, rules: Iterable[Rule | tuple[str, Callable]],
                         *, prefix: str = "", default: P | Callable = P()) -> Any:
    """A pytree of ``NamedSharding`` for ``tree`` from ``(regex, spec)`` rules.

    A rule's spec may also be a function ``shape -> PartitionSpec``. Leaves no rule
    matches get ``default``. Each spec is fitted to its leaf (see :func:`fit_spec`).

    Example::

        shardings_from_rules(params, mesh, [(r"\\['kernel'\\]$", P(None, MODEL))],
                             prefix="params")
    """
    compiled = [(re.compile(pattern), spec) for pattern, spec in rules]

    def one(path: str, leaf) -> NamedSharding:
        spec = next((s for r, s in compiled if r.search(path)), default)
        shape = tuple(leaf.shape)
        if callable(spec):
            spec = spec(shape)
        return NamedSharding(mesh, fit_spec(spec, shape, mesh))

    return _map_with_path(one, tree, prefix)


def batch_shardings(batch: Any, mesh: Mesh, role: str = BATCH) -> Any:
    """Every batch leaf split on its leading dim over the role's axes."""
    return shardings_from_rules(batch, mesh, [], prefix="batch", default=P(role))


# --------------------------------------------------------------------------- constraints
#
# Practitioners do not stop at input shardings: MaxText-style code names the logical axes
# of its activations (``constrain(x, ("activation_batch", "activation_length",
# "activation_mlp"))``) and a layout maps those names to mesh axes, so XLA's propagation
# cannot drift to another layout inside the step. Models call ``constrain`` and
# ``constrain_gradients``; outside ``constraints(...)`` both return their input untouched
# (no equation is traced), so the programs autoshard plans are the same with or without.

ACTIVATION_BATCH = "activation_batch"
ACTIVATION_LENGTH = "activation_length"
ACTIVATION_EMBED = "activation_embed"
ACTIVATION_HEADS = "activation_heads"
ACTIVATION_KV = "activation_kv"
ACTIVATION_MLP = "activation_mlp"
ACTIVATION_VOCAB = "activation_vocab"

# the logical axes of a transformer's activations, as its code names them
RESIDUAL_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_EMBED)   # [b, s, d_model]
HEAD_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_HEADS, ACTIVATION_KV)
MLP_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_MLP)          # [b, s, d_ff]
VOCAB_AXES = (ACTIVATION_BATCH, ACTIVATION_LENGTH, ACTIVATION_VOCAB)      # logits

LogicalRules = dict[str, "str | tuple[str, ...] | None"]
"""Logical activation axis name -> mesh axis, role, tuple of them, or None (whole)."""

GradientLayout = Callable[[tuple[int, ...], Mesh], P]
"""A gradient leaf's shape and the mesh -> its spec."""

TENSOR_PARALLEL_ACTIVATIONS: LogicalRules = {
    ACTIVATION_BATCH: DATA, ACTIVATION_HEADS: MODEL, ACTIVATION_MLP: MODEL,
    ACTIVATION_VOCAB: MODEL}
"""Megatron: the batch over the data axes, heads, MLP width and vocabulary over the model
axis, the residual stream whole on each model shard (MaxText's default logical rules)."""

DATA_PARALLEL_ACTIVATIONS: LogicalRules = {ACTIVATION_BATCH: BATCH}
"""Data parallel and FSDP: every activation split on its batch dim over every axis."""


@dataclasses.dataclass(frozen=True)
class _Constraints:
    mesh: Mesh
    activations: LogicalRules
    gradients: GradientLayout | None


_active: contextvars.ContextVar[_Constraints | None] = contextvars.ContextVar(
    "autoshard_expert_constraints", default=None)


@contextlib.contextmanager
def constraints(mesh: Mesh, activations: LogicalRules | None = None,
                gradients: GradientLayout | None = None) -> Iterator[None]:
    """Within the block, ``constrain`` and ``constrain_gradients`` emit
    ``with_sharding_constraint`` by these rules (while tracing a step for ``mesh``).

    Example::

        with experts.constraints(mesh, experts.TENSOR_PARALLEL_ACTIVATIONS):
            compiled = jax.jit(step, in_shardings=...).lower(*args).compile()
    """
    token = _active.set(_Constraints(mesh, dict(activations or {}), gradients))
    try:
        yield
    finally:
        _active.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``x`` constrained to the active rules' layout of its logical axes (one name per
    dim; a name the rules do not map stays whole, as with MaxText's rules); ``x`` itself
    outside ``constraints``."""
    active = _active.get()
    if active is None:
        return x
    entries = [active.activations.get(name) if name else None for name in logical_axes]
    spec = fit_spec(P(*entries), x.shape, active.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


def constrain_gradients(grads: Any) -> Any:
    """Every gradient leaf constrained to the active gradient layout (ZeRO-2: split as the
    optimizer state is); ``grads`` itself outside ``constraints`` or without one."""
    active = _active.get()
    if active is None or active.gradients is None:
        return grads
    return jax.tree.map(lambda g: jax.lax.with_sharding_constraint(
        g, NamedSharding(active.mesh, active.gradients(tuple(g.shape), active.mesh))), grads)


# --------------------------------------------------------------------------- plans

ExpertFn = Callable[[Mesh], Any]


@dataclasses.dataclass(frozen=True)
class Expert:
    """An expert layout: ``in_shardings(mesh)`` plus the constraints it puts inside the
    step (activation rules, a gradient layout). Calling it gives the in_shardings, so an
    ``Expert`` serves wherever an ``ExpertFn`` does (``pins=``, ``jax.device_put``).

    Example::

        expert = experts.megatron(state, batch, tp_rules)
        step = expert.jit(train_step, mesh, donate_argnums=(0,))
    """

    in_shardings: ExpertFn
    activations: LogicalRules | None = None
    gradients: GradientLayout | None = None

    def __call__(self, mesh: Mesh) -> Any:
        return self.in_shardings(mesh)

    def wrap(self, fn: Callable, mesh: Mesh) -> Callable:
        """``fn`` traced under this expert's constraints for ``mesh``."""
        if self.activations is None and self.gradients is None:
            return fn

        def constrained(*args, **kwargs):
            with constraints(mesh, self.activations, self.gradients):
                return fn(*args, **kwargs)

        return constrained


def as_expert(plan: Expert | ExpertFn) -> Expert:
    """An ``Expert`` from an expert or a bare ``mesh -> in_shardings`` function."""
    return plan if isinstance(plan, Expert) else Expert(plan)


def data_parallel(state: Any, batch: Any) -> Expert:
    """Parameters and optimizer state replicated; the batch split over every axis."""
    return Expert(lambda mesh: (shardings_from_rules(state, mesh, [], prefix="state"),
                                batch_shardings(batch, mesh, BATCH)))


def fsdp(state: Any, batch: Any) -> Expert:
    """ZeRO-3: every state leaf split on its largest divisible dim over every axis;
    activations split on their batch dim over every axis."""
    return Expert(lambda mesh: (
        shardings_from_rules(state, mesh, [], prefix="state",
                             default=lambda shape: largest_dim_spec(shape, mesh, BATCH)),
        batch_shardings(batch, mesh, BATCH)), DATA_PARALLEL_ACTIVATIONS)


def zero1(state: Any, batch: Any) -> Expert:
    """ZeRO-1: parameters replicated, the optimizer state (every leaf under
    ``['opt_state']``) split on its largest divisible dim over every axis; batch split
    over every axis. XLA all-reduces the gradients and updates each shard of the
    moments; the new parameters are gathered whole."""
    return Expert(lambda mesh: (
        shardings_from_rules(state, mesh, [
            (r"\['opt_state'\]", lambda shape: largest_dim_spec(shape, mesh, BATCH))],
            prefix="state"),
        batch_shardings(batch, mesh, BATCH)))


def zero2(state: Any, batch: Any) -> Expert:
    """ZeRO-2: ZeRO-1 with the gradients constrained to the optimizer state's layout
    (the step calls ``constrain_gradients``): XLA reduce-scatters them instead of
    all-reducing, and holds them as shards until the update. The activations stay split
    on their batch dim: without that constraint XLA's propagation carries the gradients'
    split back into the backward pass and gathers activation gradients instead."""
    return dataclasses.replace(zero1(state, batch), activations=DATA_PARALLEL_ACTIVATIONS,
                               gradients=lambda shape, mesh: largest_dim_spec(shape, mesh))


def megatron(state: Any, batch: Any, tp_rules: Sequence[Rule]) -> Expert:
    """Tensor parallel by ``tp_rules`` (specs naming ``MODEL``); other leaves replicated;
    the batch split over the remaining (``DATA``) axes; activations constrained by
    :data:`TENSOR_PARALLEL_ACTIVATIONS`."""
    return Expert(lambda mesh: (shardings_from_rules(state, mesh, tp_rules, prefix="state"),
                                batch_shardings(batch, mesh, DATA)),
                  TENSOR_PARALLEL_ACTIVATIONS)


def fsdp_tp(state: Any, batch: Any, tp_rules: Sequence[Rule]) -> Expert:
    """``tp_rules`` on the model axis, then each leaf's largest dim still free split over
    the ``DATA`` axes (ZeRO-3 across data-parallel replicas); batch split on ``DATA``;
    activations constrained by :data:`TENSOR_PARALLEL_ACTIVATIONS`."""

    def spec_for(mesh, path, shape):
        tp = next((s for pattern, s in tp_rules if re.search(pattern, path)), P())
        tp = fit_spec(tp, shape, mesh)
        free = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d])
                if d >= len(tp) or tp[d] is None]
        entries = list(tp) + [None] * (len(shape) - len(tp))
        for d in free:
            candidate = list(entries)
            candidate[d] = DATA
            fitted = fit_spec(P(*candidate), shape, mesh)
            if fitted != fit_spec(P(*entries), shape, mesh):
                return fitted
        return fit_spec(P(*entries), shape, mesh)

    def build(mesh):
        state_sh = _map_with_path(
            lambda path, x: NamedSharding(mesh, spec_for(mesh, path, tuple(x.shape))),
            state, "state")
        return state_sh, batch_shardings(batch, mesh, DATA)

    return Expert(build, TENSOR_PARALLEL_ACTIVATIONS)


def expert_parallel(state: Any, batch: Any, expert_rules: Sequence[Rule]) -> Expert:
    """Expert-stacked weights split on their expert dim over ``MODEL`` (``expert_rules``),
    everything else replicated, the batch split over every axis: XLA moves tokens to
    their experts' devices with all-to-all."""
    return Expert(lambda mesh: (shardings_from_rules(state, mesh, expert_rules,
                                                     prefix="state"),
                                batch_shardings(batch, mesh, BATCH)))


def standard_experts(state: Any, batch: Any, tp_rules: Sequence[Rule] | None = None,
                     expert_rules: Sequence[Rule] | None = None) -> dict[str, Expert]:
    """``data_parallel`` and ``fsdp``, plus ``megatron`` and ``fsdp_tp`` given tensor-parallel
    rules, plus ``expert_parallel`` given expert rules."""
    plans = {"data_parallel": data_parallel(state, batch), "fsdp": fsdp(state, batch)}
    if tp_rules:
        plans["megatron"] = megatron(state, batch, tp_rules)
        plans["fsdp_tp"] = fsdp_tp(state, batch, tp_rules)
    if expert_rules:
        plans["expert_parallel"] = expert_parallel(state, batch, expert_rules)
    return plans


# --------------------------------------------------------------------------- running


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def jit_expert(case, mesh: Mesh, name: str, donate: bool = True):
    """``jax.jit(case.train_step)`` with the expert's in_shardings and out_shardings
    ``(state shardings, replicated loss)``, traced under the expert's constraints.

    Example::

        step = jit_expert(case, mesh, "fsdp")
        state, loss = step(*jax.device_put(case.args, case.experts["fsdp"](mesh)))
    """
    if name not in case.experts:
        from autoshard.errors import InputError
        raise InputError(f"{case.name} has no expert plan {name!r}; it has "
                         f"{', '.join(case.experts)}")
    expert = as_expert(case.experts[name])
    in_shardings = expert(mesh)
    out_shardings = (in_shardings[0], NamedSharding(mesh, P()))
    return jax.jit(expert.wrap(case.train_step, mesh), in_shardings=in_shardings,
                   out_shardings=out_shardings,
                   donate_argnums=tuple(case.donate_argnums) if donate else ())


def compile_expert(case, mesh: Mesh, name: str, args: tuple | None = None,
                   donate: bool = True):
    """The expert plan compiled for ``args`` (default: ``case.args`` made abstract)."""
    args = _abstract(case.args) if args is None else args
    return jit_expert(case, mesh, name, donate).lower(*args).compile()


def inspect_expert(case, mesh: Mesh, name: str, hardware=None, args: tuple | None = None):
    """``autoshard.report.hlo_report.hlo_report`` of the compiled expert plan."""
    from autoshard.report.hlo_report import hlo_report
    from autoshard.target.hardware import H100
    return hlo_report(compile_expert(case, mesh, name, args), hardware or H100, mesh)


def jit_gpipe(case, mesh: Mesh, microbatches: int, stage_axis: str | None = None,
              stack: str = r"\['blocks'\]", donate: bool = True):
    """A hand-written GSPMD pipeline of a case whose loss is marked by
    ``autoshard.value_and_grad`` and scans a layer stack (``gpt_scan``): the stack's
    leaves (paths matching ``stack``) split on their layer dim over ``stage_axis`` (default:
    the first mesh axis, the one across nodes), the rest replicated, the batch split over
    the other axes (data parallel inside a stage), GPipe over ``microbatches``.

    Example::

        compiled = experts.jit_gpipe(case, mesh, microbatches=8).lower(*args).compile()
    """
    from autoshard.rewrite.accumulate import Microbatching, microbatching
    from autoshard.rewrite.pipeline import Pipelining
    stage_axis = stage_axis or mesh.axis_names[0]
    stages = axis_sizes(mesh)[stage_axis]
    inner = tuple(a for a in mesh.axis_names if a != stage_axis) or None
    setting = Microbatching(1, pipeline=Pipelining(stage_axis, stages, microbatches))
    state, batch = case.args
    state_sh = shardings_from_rules(state, mesh, [(stack, P(stage_axis))], prefix="state")
    batch_sh = shardings_from_rules(batch, mesh, [], prefix="batch", default=P(inner))

    def step(*args):
        with microbatching(setting, mesh=mesh):
            return case.train_step(*args)

    return jax.jit(step, in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, NamedSharding(mesh, P())),
                   donate_argnums=tuple(case.donate_argnums) if donate else ())
