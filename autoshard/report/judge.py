"""judge: compile plans and price the compiled programs, the way a plan is judged.

:func:`compare` compiles each candidate (a Plan, an expert's ``in_shardings``, a program
already compiled) and prices its partitioned HLO with ``autoshard.report.hlo_report``;
:func:`what_if` plans one program on several mesh shapes. Both hand back views from
``autoshard.report.viz`` to print or plot.

Example::

    from autoshard.report import judge
    view = judge.compare(train_step, *args, candidates={"auto": plan, "fsdp": fsdp_shardings})
    view.best, view.plot()
    judge.what_if(train_step, *args, mesh_shapes=[(1, 8), (2, 4), (4, 2), (8, 1)]).plot()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoshard.errors import AutoshardError, MeshError, PlanError
from autoshard.frontend import validate
from autoshard.planning.api import plan as make_plan
from autoshard.planning.plan import Plan
from autoshard.report.hlo_report import Report, hlo_report
from autoshard.report.viz import CompareView, WhatIfView, is_sharding_leaf
from autoshard.target.hardware import H100
from autoshard.target.mesh import make_mesh
from autoshard.units import mesh_str

MESH_SHAPES_8 = ((1, 8), (2, 4), (4, 2), (8, 1))


def compile_report(fn: Callable, args: Sequence, candidate, mesh: Mesh | None, hardware,
                   name: str = "candidate"):
    """(compiled Report, predicted seconds or None) of a candidate (called ``name``): a
    Plan, an in_shardings pytree, a ``jax.stages.Compiled`` or an
    ``autoshard.report.hlo_report.Report``."""
    if isinstance(candidate, Plan):
        return candidate.report(*args).compiled, candidate.cost.total_s
    if isinstance(candidate, Report):
        return candidate, None
    if isinstance(candidate, jax.stages.Compiled):
        return hlo_report(candidate, hardware, mesh), None
    leaves = [x for x in jax.tree.leaves(candidate, is_leaf=is_sharding_leaf)
              if isinstance(x, NamedSharding)]
    if mesh is None:
        if not leaves:
            raise PlanError("compare: in_shardings of PartitionSpecs need mesh=")
        mesh = leaves[0].mesh
    shardings = shardings_on(mesh, candidate, name)
    try:
        compiled = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
    except (ValueError, TypeError) as e:
        raise PlanError(f"compare: in_shardings do not fit the arguments: {e}") from e
    return hlo_report(compiled, hardware, mesh), None


def shardings_on(mesh: Mesh, candidate, name: str):
    """A candidate's in_shardings with each PartitionSpec made a NamedSharding on ``mesh``,
    after checking that every axis it names is one of the mesh's."""
    def on_mesh(path, s):
        if not isinstance(s, PartitionSpec):
            return s
        for entry in s:
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if isinstance(axis, str) and axis not in mesh.axis_names:
                    raise PlanError(
                        f"compare: candidate {name!r} in_shardings"
                        f"{jax.tree_util.keystr(path)} = {s} names mesh axis {axis!r}, which "
                        f"the mesh does not have (axes: {list(mesh.axis_names)})")
        return NamedSharding(mesh, s)
    return jax.tree_util.tree_map_with_path(on_mesh, candidate, is_leaf=is_sharding_leaf)


def compare(fn: Callable, *args, candidates: Mapping[str, Any], mesh: Mesh | None = None,
            hardware=None) -> CompareView:
    """Compile every candidate and price its program: the way a plan is judged.

    ``candidates`` maps a name to a Plan, to an ``in_shardings`` pytree (an expert's
    plan), or to a program already compiled (``jax.stages.Compiled``) or priced
    (``autoshard.report.hlo_report.Report``). Arguments may be abstract (``jax.ShapeDtypeStruct``):
    nothing runs.

    Example::

        view = judge.compare(train_step, *args, candidates={
            "auto": plan, "data parallel": dp_shardings, "fsdp": fsdp_shardings})
        view.best
        view.plot()
    """
    validate.function(fn, "judge.compare fn")
    validate.mapping("judge.compare candidates", candidates)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise MeshError(f"judge.compare mesh must be a jax.sharding.Mesh, got "
                        f"{type(mesh).__name__}")
    plans = [c for c in candidates.values() if isinstance(c, Plan)]
    hw = hardware or (plans[0].hardware if plans else H100)
    if mesh is None and plans:
        mesh = plans[0].mesh
    reports, predicted = {}, {}
    for name, candidate in candidates.items():
        reports[name], pred = compile_report(fn, args, candidate, mesh, hw, name)
        if pred is not None:
            predicted[name] = pred
    budget = plans[0].memory_budget if plans else None
    title = f"plans compared on mesh {mesh_str(mesh)}" if mesh is not None else "plans compared"
    return CompareView(reports, predicted, budget, title)


def what_if(fn: Callable, *args, mesh_shapes: Iterable[Sequence[int]] = MESH_SHAPES_8,
            axis_names: Sequence[str] = ("data", "model"), compile: bool = False,
            **plan_kwargs) -> WhatIfView:
    """Plan ``fn`` on each mesh shape and put the predictions side by side.

    ``plan_kwargs`` go to ``autoshard.plan`` (``hardware``, ``memory_budget``, ``pins``,
    ...). With ``compile=True`` each plan is also compiled and priced (``plan.report``).

    Example::

        view = judge.what_if(train_step, params, opt_state, batch,
                           mesh_shapes=[(1, 8), (2, 4), (4, 2), (8, 1)])
        view.best, view[(2, 4)]           # the fastest shape that fits, one plan
        view.plot()
    """
    validate.function(fn, "judge.what_if fn")
    validate.flag("judge.what_if compile", compile)
    plans, reports = {}, {}
    for shape in mesh_shapes:
        shape = tuple(int(n) for n in shape)
        if len(shape) != len(axis_names):
            raise AutoshardError(f"mesh shape {shape} has {len(shape)} axes; axis names "
                                 f"{tuple(axis_names)} have {len(axis_names)}")
        name = "×".join(map(str, shape))
        plans[name] = make_plan(fn, *args, mesh=make_mesh(shape, axis_names), **plan_kwargs)
        if compile:
            reports[name] = plans[name].report(*args)
    return WhatIfView(plans, reports)
