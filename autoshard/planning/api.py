"""The public entry points: ``plan`` and the ``auto_shard`` decorator."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoshard.cost import CostGraph, build_cost_graph
from autoshard.cost.strategies import build_strategies
from autoshard.errors import MemoryBudgetError, PinError
from autoshard.frontend import specs, validate
from autoshard.frontend.trace import Program, build_graph, hold_static_leaves, trace_program
from autoshard.planning.cache import PLANS, cache_dir
from autoshard.planning.fingerprint import plan_key, program_fingerprint
from autoshard.planning.options import (
    PlanOptions,
    keyword_signature,
    known_keywords,
    plan_options,
)
from autoshard.planning.plan import Plan, PlannedProgram, Solution
from autoshard.planning.progress import PlanProgress
from autoshard.planning.settings import plan_settings
from autoshard.rewrite.accumulate import active_pipeline
from autoshard.rewrite.apply import collection_paused
from autoshard.rewrite.pipeline import constraint_pins
from autoshard.solver.request import Request, Touching, evaluation, group_seconds
from autoshard.solver.search import Solved, solve_copies
from autoshard.solver.solve import CannotBeat, InfeasibleBudget
from autoshard.target.hardware import Backend
from autoshard.units import axis_sizes

log = logging.getLogger(__name__)


def resolve_pins(pins: Mapping[str, Any] | None, graph, sizes) -> dict[int, specs.Spec]:
    """Map each pinned path (a leaf, or a prefix of leaves) to its arg node and spec."""
    resolved: dict[int, specs.Spec] = {}
    for path, pspec in pin_leaves(pins or {}):
        if isinstance(pspec, NamedSharding):
            pspec = pspec.spec
        if not isinstance(pspec, PartitionSpec):
            pspec = PartitionSpec(*pspec) if isinstance(pspec, (tuple, list)) else pspec
        if not isinstance(pspec, PartitionSpec):
            raise PinError(f"pin {path!r}: expected a PartitionSpec, got {type(pspec).__name__}")
        leaves = list(zip(graph.arg_paths, graph.arg_nodes)) + [
            (p, n) for p, n in zip(graph.out_paths, graph.output_nodes) if n is not None]
        matches = [(p, n) for p, n in leaves
                   if p == path or p.startswith(path) and p[len(path)] in "[."]
        if not matches:
            import difflib
            close = difflib.get_close_matches(path, [p for p, _ in leaves], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise PinError(f"pin names path {path!r}, which is no argument or output "
                           f"(outputs are 'out', 'out[0]', ...){hint}")
        for leaf_path, node_id in matches:
            shape = graph.values[graph.nodes[node_id].outputs[0]].shape
            resolved[node_id] = pin_spec(leaf_path, pspec, shape, sizes)
    return resolved


def pin_leaves(pins: Mapping[str, Any]):
    """(path, pin) of each pinned leaf. A dict, or a tuple or list holding
    PartitionSpecs or NamedShardings, pins the leaves under its path by key or position
    (None leaves one free): ``{"out": (P("data"), None)}`` pins ``out[0]``. Any other
    tuple is a spec's entries."""
    for path, pin in pins.items():
        if isinstance(pin, Mapping):
            yield from pin_leaves({f"{path}[{k!r}]": x for k, x in pin.items()
                                   if x is not None})
        elif _holds_pins(pin):
            yield from pin_leaves({f"{path}[{i}]": x for i, x in enumerate(pin)
                                   if x is not None})
        else:
            yield path, pin


def _holds_pins(x) -> bool:
    return isinstance(x, (tuple, list)) and not isinstance(x, PartitionSpec) and any(
        isinstance(e, (PartitionSpec, NamedSharding, Mapping)) or _holds_pins(e) for e in x)


def _is_pin_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def pin_paths(pins, paths: Sequence[str], args: tuple) -> dict[str, Any]:
    """Pins in the path form: ``{path: PartitionSpec}``. ``pins`` is that form already,
    or a pytree like ``jax.jit``'s ``in_shardings``: a ``PartitionSpec``, ``NamedSharding``
    or ``None`` (free) per argument leaf, or one for a whole subtree (a prefix of the
    arguments' tree; a single one for every argument)."""
    if pins is None or isinstance(pins, Mapping) and all(
            isinstance(k, str) for k in pins):
        return dict(pins or {})
    if _is_pin_leaf(pins):
        pins = (pins,) * len(args)
    elif isinstance(pins, list):
        pins = tuple(pins)
    if not isinstance(pins, tuple):
        raise PinError(f"pins: expected {{path: PartitionSpec}} or a tuple with one entry per "
                       f"argument (like jax.jit's in_shardings), got {type(pins).__name__}")
    flat, prefix = jax.tree_util.tree_flatten(pins, is_leaf=_is_pin_leaf)
    bad = [x for x in flat if not _is_pin_leaf(x)]
    if bad:
        raise PinError(f"pins: every leaf must be a PartitionSpec, NamedSharding or None, "
                       f"got {type(bad[0]).__name__}")
    try:
        subtrees = prefix.flatten_up_to(tuple(args))
    except (ValueError, TypeError) as e:
        raise PinError(f"pins do not match the arguments' tree: {e}") from e
    out, start = {}, 0
    for pin, subtree in zip(flat, subtrees):
        count = len(jax.tree_util.tree_leaves(subtree))
        if pin is not None:
            spec = pin.spec if isinstance(pin, NamedSharding) else pin
            out.update((path, spec) for path in paths[start:start + count])
        start += count
    return out


def pin_spec(path, pspec, shape, sizes) -> specs.Spec:
    try:
        spec = specs.from_partition_spec(pspec, len(shape))
    except ValueError as e:
        raise PinError(f"pin {path!r}: {pspec} has more entries than the array's "
                       f"{len(shape)} dims {shape}") from e
    for axis in specs.spec_axes(spec):
        if axis not in sizes:
            raise PinError(f"pin {path!r}: mesh has no axis {axis!r} (axes: {list(sizes)})")
    spec = tuple(tuple(a for a in axes if sizes[a] > 1) for axes in spec)
    if not specs.is_valid(shape, spec, sizes):
        raise PinError(f"pin {path!r}: {pspec} does not divide shape {shape} on mesh {sizes}")
    return spec


def local_costs(request: Request, choice, groups: Sequence[int] | None = None
                ) -> dict[int, np.ndarray]:
    """Per group of ``groups`` (every group if None): the plan's seconds as a function of
    that group's strategy alone, the others held at ``choice`` (the solver's
    ``group_seconds``: ``evaluation`` of the moved choice, less the part no move of the
    group changes)."""
    if groups is None:
        groups = range(len(request.node_costs))
    touching = Touching.of(request, groups)
    return {g: group_seconds(request, choice, g, touching) for g in groups}


def donated_pairs(graph, donate_argnums: Sequence[int]) -> list[tuple[int, int]]:
    """(output index, argument node) pairs XLA can alias: an output written into a donated
    argument's buffer of the same shape and dtype, first unused argument first."""
    if not donate_argnums:
        return []
    numbered = jax.tree_util.tree_unflatten(graph.in_tree, list(range(len(graph.arg_nodes))))
    leaves_per_arg = [len(jax.tree_util.tree_leaves(sub)) for sub in numbered]
    starts = np.cumsum([0] + leaves_per_arg)
    pool = [graph.arg_nodes[i] for a in donate_argnums for i in range(starts[a], starts[a + 1])]

    def key(value):
        return value.shape, str(value.dtype)
    pairs = []
    for k, value_id in enumerate(graph.outputs):
        if value_id is None:
            continue
        want = key(graph.values[value_id])
        match = next((n for n in pool
                      if key(graph.values[graph.nodes[n].outputs[0]]) == want), None)
        if match is not None:
            pool.remove(match)
            pairs.append((k, match))
    return pairs


def pin_donated_arguments(graph, pinned: dict[int, specs.Spec],
                          donated: Sequence[tuple[int, int]]) -> dict[int, specs.Spec]:
    """A donated argument and the output written into its buffer keep one spec, so a pin
    on either holds for both: the argument takes its output's pin (even where it is too
    small to be split on its own). Pins that differ on such a pair raise ``PinError``."""
    pinned = dict(pinned)
    for k, arg_node in donated:
        out_node = graph.output_nodes[k]
        out_pin, arg_pin = pinned.get(out_node), pinned.get(arg_node)
        if out_pin is None:
            continue
        if arg_pin is not None and arg_pin != out_pin:
            arg_path = graph.arg_paths[graph.arg_nodes.index(arg_node)]
            raise PinError(
                f"pins {arg_path!r} {specs.spec_str(arg_pin)} and {graph.out_paths[k]!r} "
                f"{specs.spec_str(out_pin)} differ, but the donated argument {arg_path!r} is "
                f"written back as {graph.out_paths[k]!r}, and XLA aliases only buffers "
                "sharded alike: pin both alike or leave the argument undonated")
        pinned[arg_node] = out_pin
    return pinned


def unkept_donations(cg: CostGraph, donated: Sequence[tuple[int, int]],
                     user_pinned: Mapping[int, specs.Spec]) -> list[tuple[int, int]]:
    """Donated pairs whose argument the user pinned (and not its output) that no plan
    can keep tied: the group writing their outputs has no strategy giving each output
    its argument's spec. A small argument (kept whole unless pinned) pinned split, say
    Adam's first moment of a norm scale, whose output is computed in one group with the
    second moment's, which stays whole: the user's pin wins, and that buffer is not
    aliased (XLA aliases only buffers sharded alike; jax warns that the donated buffer
    was not usable). Pairs are dropped in order until the rest fit together."""
    graph = cg.space.graph
    tied = [(k, a) for k, a in donated if graph.output_nodes[k] is not None]
    by_group: dict[int, list] = {}
    for pair, tie in zip(tied, cg.ties):   # one tie per pair with an output node
        allowed = np.isin(tie.keys_v, tie.keys_u)
        by_group.setdefault(tie.v, []).append((pair, allowed))
    pinned_alone = {(k, a) for k, a in tied
                    if a in user_pinned and graph.output_nodes[k] not in user_pinned}
    unkept = []
    for entries in by_group.values():
        kept = np.ones(len(entries[0][1]), bool)
        for pair, allowed in entries:
            if pair not in pinned_alone:
                kept &= allowed
        if not kept.any():
            continue   # not the pins' doing: the solver reports it
        for pair, allowed in entries:
            if pair in pinned_alone:
                if (kept & allowed).any():
                    kept &= allowed
                else:
                    unkept.append(pair)
    return sorted(unkept)


def warn_unaliased(graph, unkept: Sequence[tuple[int, int]], pinned) -> None:
    for k, arg_node in unkept:
        arg_path = graph.arg_paths[graph.arg_nodes.index(arg_node)]
        warnings.warn(
            f"the donated argument {arg_path!r} is pinned to "
            f"{specs.spec_str(pinned[arg_node])}, but no plan writes {graph.out_paths[k]!r} "
            "back in that spec (the outputs computed with it keep their own donated "
            "arguments' specs): XLA will not alias that buffer (jax warns the donated "
            "buffer was not usable), and the plan counts the output's own bytes; pin the "
            "output too, or those other arguments, to keep it aliased", stacklevel=4)


def donation_budget_error(graph, donated, budget: float, smallest_bytes: float,
                          sizes) -> MemoryBudgetError:
    """No plan fits the budget once each donated argument keeps its output's spec, though
    plans without that tie would: the error names the donated arguments."""
    names = [graph.arg_paths[graph.arg_nodes.index(a)] for _, a in donated]
    shown = ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")
    return MemoryBudgetError(
        f"no plan fits the memory budget of {budget:.4g} bytes per device on mesh {sizes} "
        f"while each donated argument keeps its output's spec (donated: {shown}); plans "
        f"without that tie reach {smallest_bytes:.4g} bytes: raise the budget or leave "
        "those arguments undonated", budget, smallest_bytes)


def plan(fn: Callable, *args, **keywords) -> Plan:
    """Plan how to shard ``fn`` at ``args`` over ``mesh``.

    Args:
      fn: a function of pytrees of arrays (e.g. a train step).
      args: example arguments: arrays or ``jax.ShapeDtypeStruct`` pytrees (nothing of
        their size is allocated).
      mesh: a ``jax.sharding.Mesh``; Explicit axes are converted to Auto with a warning.
      hardware: per-device speeds (default: the profile of the mesh's device kind,
        ``hardware.DEVICE_KINDS``; an H100 node on CPU).
      memory_budget: bytes per device (default ``hardware.memory``), counted as XLA does:
        arguments + outputs + temporaries - donated, the temporaries as live at the
        peak (XLA's packing of them can take a few percent more; see docs/planning.md).
      pins: ``{"params['wq']": PartitionSpec(None, "model")}``: specs the plan must keep,
        for arguments (by path, or a path prefix for a whole subtree) and for outputs
        (``"out"``, ``"out[0]"``, ...), a spec or a tree of them as the path holds
        (``{"out": (P("data"), None)}``); or, like ``jax.jit``'s ``in_shardings``, a tuple
        with one entry per argument: a pytree (or prefix) of ``PartitionSpec``,
        ``NamedSharding`` or ``None`` (left free).
      donate_argnums: arguments whose buffers the outputs may reuse.
      reuse: solve repeated structure (the layers of an unrolled model) once and give every
        copy that solution; ``False`` solves every group on its own.
      cache: look the plan up by a hash of the program, mesh, hardware and these options,
        and keep it: in memory, and on disk under ``cache_directory`` (default: the
        ``AUTOSHARD_CACHE_DIR`` environment variable; none if unset).
      progress: show the planning stages on the terminal when planning takes more than a
        second (default: when stderr is a terminal).
      microbatches: gradient accumulation for a loss marked by ``autoshard.value_and_grad``:
        ``K`` runs it as a loop over K microbatches whose gradients are reduced once per
        step; ``"auto"`` takes the fastest K within the budget; ``None`` (default) plans
        the program as written.
      pipeline: a mesh axis to run the marked loss's layer stack (its longest ``lax.scan``
        over stacked layers) as a pipeline over, a stage per device of that axis, in
        ``microbatches`` microbatches; ``"auto"`` also weighs each axis against no
        pipeline, and GPipe against the circular schedule. See ``plan.pipeline``.
      repeats: the pipeline's schedule: ``1`` is GPipe (each microbatch passes the S stages
        once); ``V >= 2`` the circular schedule (V passes of L / (S V) layers a stage, a
        bubble of (S - 1) / (M V + S - 1), V times the stage transfers; needs M >= S);
        ``"auto"`` weighs GPipe and each power of two V dividing L / S. ``None``
        (default): GPipe for a named axis, ``"auto"`` under ``pipeline="auto"``.
      remat: the marked loss's layer stack under ``jax.checkpoint``: ``"dots_saveable"``
        (keep dot outputs), ``"nothing_saveable"`` (recompute all), or ``"auto"`` (each and
        neither, priced jointly with ``microbatches`` and ``pipeline``).

    Example::

        mesh = autoshard.make_mesh((2, 4), ("data", "model"))
        plan = autoshard.plan(train_step, params, batch, mesh=mesh)
        new_params, loss = plan.jit()(params, batch)
    """
    validate.function(fn)
    options = PlanOptions.build(num_args=len(args), **keywords)
    if options.searches_settings:
        return plan_settings(plan_program, fn, args, options)
    return plan_program(fn, args, options)


plan.__signature__ = keyword_signature(
    inspect.Parameter("fn", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Callable"),
    inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL))


def plan_program(fn: Callable, args: tuple, options: PlanOptions,
                 trace: Callable[[], Program] | None = None) -> Plan:
    """The plan of ``fn`` at ``args`` as traced (under the settings search's rewrite, if
    any; ``trace()`` traces it where given): looked up in the cache, or solved
    (``solve_program``) and kept there."""
    started = time.perf_counter()
    with PlanProgress(options.progress) as show, collection_paused():
        program = trace_program(fn, *args) if trace is None else trace()
        jaxpr_s = time.perf_counter() - started
        options = dataclasses.replace(options, pins=pin_paths(options.pins, program.paths, args))
        fingerprint = program_fingerprint(program.closed_jaxpr, program.leaves)
        key = plan_key(fingerprint, program.paths, options)
        directory = cache_dir(options.cache_directory)
        found = PLANS.get(key, directory) if options.cache else None
        log.debug("program %s: %d equations, %d arguments, budget %.4g B per device, "
                  "cache %s", fingerprint[:12], program.num_eqns, len(program.leaves),
                  options.memory_budget, "hit" if found else "miss")
        if found is not None:
            plan_ = cached_plan(found, options.mesh, program, started)
        else:
            plan_ = solve_program(program, options, fingerprint, show, started)
            if options.cache:
                PLANS.put(key, plan_.to_json(indent=None), directory)
        return plan_.with_stats(jaxpr_s=jaxpr_s)   # this call's make_jaxpr, also on a hit


def cached_plan(found: tuple[str, str], mesh: Mesh, program, started: float) -> Plan:
    text, where = found
    plan_ = Plan.from_json(text, mesh).with_stats(cache=where,
                                                  plan_s=time.perf_counter() - started)
    return dataclasses.replace(
        plan_, program=PlannedProgram(program.closed_jaxpr, program.in_tree, program.out_tree))


def solve_program(program, options: PlanOptions, fingerprint: str, show,
                  started: float) -> Plan:
    """The stages after tracing: graph, strategies, costs, coarsening, solving; the plan
    (``Plan.from_solution``). ``options.pins`` in the path form; ``show`` hears each
    stage; ``started``: ``time.perf_counter()`` when planning began."""
    mesh, hw, budget = options.mesh, options.hardware, options.memory_budget
    sizes = axis_sizes(mesh)
    show.stage(f"building the graph of {program.num_eqns} equations")
    graph = build_graph(program)
    traced = time.perf_counter()
    show.stage(f"enumerating strategies for {len(graph.nodes)} nodes")
    pinned = resolve_pins(options.pins, graph, sizes)
    if active_pipeline() is not None:   # the stage dims the pipeline put on its axis
        pinned.update(constraint_pins(graph, active_pipeline()))
    donated = donated_pairs(graph, options.donate_argnums)
    user_pinned = pinned
    pinned = pin_donated_arguments(graph, pinned, donated)
    backend = Backend.of(mesh)
    space = build_strategies(graph, sizes, hw, pinned, backend)
    enumerated = time.perf_counter()
    show.stage(f"pricing {space.num_strategies()} strategies")

    def price(share: bool):
        nonlocal donated
        cg = build_cost_graph(space, donated, backend.native_reduce_scatter, share, budget)
        unkept = unkept_donations(cg, donated, user_pinned)
        if unkept:   # not aliased: each such output takes its own buffer
            warn_unaliased(graph, unkept, pinned)
            donated = [pair for pair in donated if pair not in unkept]
            cg = build_cost_graph(space, donated, backend.native_reduce_scatter, share, budget)
        return cg, cg.request(budget, options.time_limit_s)

    stages = {"trace": traced - started, "cost": enumerated - traced}   # seconds each
    try:
        solved = solve_copies(price, budget, options.reuse, options.seconds_to_beat,
                              show.stage, stages)
    except CannotBeat as e:
        e.stage_seconds = stages
        raise
    if isinstance(solved.result, InfeasibleBudget):
        error = budget_error(solved, graph, donated, budget, sizes)
        log.debug("no plan within %.4g B: %s", budget, error)
        error.stage_seconds = stages
        raise error
    result = solved.result
    log.debug("solved: %s, %.6g s (bound %.6g s), %d classes, %s", result.status,
              result.objective, result.lower_bound, solved.coarse.num_classes,
              ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()))
    show.stage("writing the plan")
    return Plan.from_solution(solution_of(solved, stages), options, fingerprint, started)


def solution_of(solved: Solved, stage_seconds: dict[str, float]) -> Solution:
    """What the plan stage reads of the solve stage's outcome: the solver's choice expanded
    to every group, its evaluation and the local seconds of the arguments' groups (their
    runner-ups)."""
    request, result, cg = solved.request, solved.result, solved.cost_graph
    choice = solved.coarse.expand(result.choice)
    arguments = dict.fromkeys(cg.group_of_node[n] for n in cg.space.graph.arg_nodes)
    return Solution(cg, choice, evaluation(request, choice),
                    local_costs(request, choice, list(arguments)), result.status,
                    result.objective, result.lower_bound, solved.coarse.num_classes,
                    stage_seconds)


def budget_error(solved, graph, donated, budget: float, sizes) -> Exception:
    """Why no plan fits: a donation that rules every plan out, or the budget."""
    smallest = solved.result.smallest_bytes
    if smallest <= budget and donated:   # memory alone rules nothing out
        return donation_budget_error(graph, donated, budget, smallest, sizes)
    reached = ("every plan holds at least" if solved.floor > budget else
               "the smallest the planner reached is")
    return MemoryBudgetError(
        f"no plan fits the memory budget of {budget:.4g} bytes per device on mesh {sizes}; "
        f"{reached} {smallest:.4g} bytes", budget, smallest)


def tiebreak_seconds(request: Request, choice) -> float:
    """The part of the solver's objective that is no time: a price per byte held, which
    breaks ties between plans of equal time (``request.TIEBREAK_SECONDS_PER_BYTE``). The
    objective is the plan's ``cost.total_s`` plus this."""
    return evaluation(request, choice).tiebreak_s


def abstract_signature(args) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves))


class AutoSharded:
    """A function that plans itself on first call and caches per abstract signature."""

    def __init__(self, fn: Callable, **plan_kwargs):
        self.fn = fn
        self.plan_kwargs = plan_kwargs
        self._plans: dict = {}
        self._jitted: dict = {}
        functools.update_wrapper(self, fn)

    def plan_for(self, *args) -> Plan:
        """The plan for these arguments (planned now if not cached)."""
        key = abstract_signature(hold_static_leaves(args))
        if key not in self._plans:
            self._plans[key] = plan(self.fn, *args, **self.plan_kwargs)
        return self._plans[key]

    def __call__(self, *args):
        key = abstract_signature(hold_static_leaves(args))
        if key not in self._jitted:
            plan_ = self.plan_for(*args)
            self._jitted[key] = (plan_.jit(), jax.tree_util.tree_leaves(plan_.in_shardings))
        jitted, in_shardings = self._jitted[key]
        # arrays placed otherwise (e.g. last step's outputs) move to the plan's shardings;
        # jit refuses committed arguments sharded differently from in_shardings
        flat, tree = jax.tree_util.tree_flatten(hold_static_leaves(args))
        return jitted(*jax.tree_util.tree_unflatten(tree, jax.device_put(flat, in_shardings)))


def auto_shard(fn: Callable | None = None, **keywords):
    """Decorator: shard ``fn`` automatically over ``mesh``; plans on the first call.
    Every keyword is ``autoshard.plan``'s (``microbatches``, ``pipeline``, ``repeats``
    and ``remat`` apply to a loss marked by ``autoshard.value_and_grad``).

    Example::

        @autoshard.auto_shard(mesh=mesh)
        def train_step(params, opt_state, batch): ...

        params, opt_state, loss = train_step(params, opt_state, batch)
        train_step.plan_for(params, opt_state, batch).summary()

        @autoshard.auto_shard(mesh=mesh, pipeline="auto", microbatches="auto")
        def pipelined_step(params, batch): ...
    """
    plan_options(PlanOptions(**known_keywords(keywords)))
    if fn is None:
        return lambda f: AutoSharded(validate.function(f), **keywords)
    return AutoSharded(validate.function(fn), **keywords)


auto_shard.__signature__ = keyword_signature(
    inspect.Parameter("fn", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                      annotation="Callable | None"))
