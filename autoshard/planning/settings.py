"""settings: the search over how a marked loss is rewritten before tracing.

``autoshard.plan(..., microbatches=, pipeline=, remat=, repeats=)`` plans the program under
each setting the options leave open (``accumulate.Microbatching``: K microbatches over
some replica axes, a pipeline over a mesh axis with its microbatches and schedule, the
layer stack's remat policy) and keeps the fastest plan within the budget. Each setting's
program is traced under it (``accumulate.microbatching``) and planned by a function of
``(fn, args, options)`` (``api.plan_program``); every setting tried is listed in the
kept plan's ``solver["settings"]``.

Settings are tried fastest first. A setting whose memory floor exceeds the budget is
rejected before solving, and once a plan fits, one that cannot beat it is dropped after
one LP: the options carry the seconds to beat (``PlanOptions.seconds_to_beat``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from autoshard.errors import InputError, MemoryBudgetError
from autoshard.frontend.specs import dim_shards
from autoshard.planning.options import PlanOptions
from autoshard.rewrite.accumulate import Microbatching, TraceRecord, microbatching
from autoshard.rewrite.pipeline import PASS_THE_BATCH, Pipelining
from autoshard.rewrite.traces import Traces
from autoshard.solver.solve import CannotBeat
from autoshard.units import axis_sizes

if TYPE_CHECKING:
    from autoshard.frontend.trace import Program
    from autoshard.planning.plan import Plan

# plans one traced program: (fn, args, options, a function tracing fn at args) -> Plan
PlanProgram = Callable[[Callable, tuple, PlanOptions, Callable[[], "Program"]], "Plan"]

AUTO_MAX_MICROBATCHES = 64

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Search:
    """The program whose settings are searched: ``fn`` at ``args`` planned with
    ``options``, each setting's program by ``plan_program(fn, args, options, trace)``;
    the marked loss's jaxprs, and the program around it, kept across settings in
    ``traces`` (``trace()`` reads it)."""

    plan_program: PlanProgram
    fn: Callable
    args: tuple
    options: PlanOptions
    traces: Traces = dataclasses.field(default_factory=Traces, compare=False)

    @property
    def sizes(self) -> dict[str, int]:
        return axis_sizes(self.options.mesh)

    def plan(self, setting: Microbatching | None, record: TraceRecord | None = None,
             beat: float | None = None, mesh=None) -> Plan:
        """The program traced under ``setting`` (its marked losses heard by ``record``, a
        pipeline's stages on ``mesh``) and planned; ``CannotBeat`` where no plan is
        faster than ``beat`` seconds."""
        options = dataclasses.replace(self.options, seconds_to_beat=beat)
        with microbatching(setting, record, mesh, self.traces):
            return self.plan_program(self.fn, self.args, options,
                                     lambda: self.traces.program(self.fn, self.args))


def plan_settings(plan_program: PlanProgram, fn: Callable, args: tuple,
                  options: PlanOptions) -> Plan:
    """The fastest plan of ``fn`` at ``args`` within the budget over the settings
    ``options`` leaves open (``options.searches_settings``)."""
    search = Search(plan_program, fn, tuple(args), options)
    if options.pipeline is not None:
        return plan_with_pipeline(search)
    return plan_with_microbatches(search)


def remat_choices(remat) -> list:
    """The remat policies to weigh: ``"auto"``: none, dots saved, nothing saved."""
    if remat == "auto":
        return [None, "dots_saveable", "nothing_saveable"]
    return [remat]


def plan_with_microbatches(search: Search):
    """The plan with the marked loss accumulated over ``options.microbatches`` (an int K,
    or ``"auto"``: the fastest plan within the budget over K = 1, 2, 4, ...), its layer
    stack rematerialized as ``options.remat`` says (``"auto"``: each policy and none,
    jointly).

    The replica axes are those the plan without microbatches splits the batch over; when
    that plan does not fit, each choice of axes is tried.

    Settings are tried fastest first (fewer microbatches, less recomputed); one whose
    memory floor exceeds the budget is rejected before solving, and once a plan fits,
    one that cannot beat it regardless of memory is dropped before solving under the
    budget. From K = 2 on, the policies are tried holding least first: where that one
    fits no plan within the budget, those saving more are rejected unplanned.
    ``"auto"`` stops at the first K none of whose settings beats the best of
    fewer microbatches, unless memory rejected some of them; then only those are tried at
    more microbatches. A setting that cannot beat the best regardless of memory is not
    tried again at more: splitting the batch further adds loop steps, and repeats the
    work on weights in each, on the same compute.
    """
    microbatches = 1 if search.options.microbatches is None else search.options.microbatches
    remats = remat_choices(search.options.remat)
    record = TraceRecord()
    base, failure, best = None, None, None
    trail: list[dict] = []   # every setting tried, as plan.stats.settings lists them
    for policy in remats:   # K = 1
        setting = None if policy is None else Microbatching(1, remat=policy)
        candidate, failure, _ = plan_within_budget(search, setting, failure, record,
                                                   _seconds(best), trail)
        if candidate is None:
            continue
        candidate = dataclasses.replace(candidate, microbatching=setting)
        base = base if policy is not None and base is not None else candidate
        if best is None or candidate.cost.total_s < best.cost.total_s:
            best = candidate
    if not record.batch_sizes:
        raise InputError("microbatches need a loss marked by autoshard.value_and_grad in "
                         "the program (a function under jax.jit traced before keeps its "
                         "first trace: mark it or call it unjitted)")
    size = record.batch_sizes[0]
    if size is None and microbatches != 1:
        raise InputError("microbatches split the marked loss's batch, and the loss takes "
                         f"none: {PASS_THE_BATCH}")
    sizes = search.sizes
    candidates = replica_candidates(base, size, sizes)
    counts = [int(microbatches)] if microbatches != "auto" else \
        [k for k in (2 ** n for n in range(1, 7)) if k <= AUTO_MAX_MICROBATCHES]
    if microbatches not in ("auto", 1):
        best = None
    if microbatches == 1:
        counts = []
    outpaced_at = set()   # (axes, policy) no faster than the best at some K, regardless
    #                       of memory: at more microbatches, no faster either
    for k in counts:
        found, outpaced, rejected = None, False, False
        for axes in candidates:
            replicas = dim_shards(axes, sizes)
            if size % (k * replicas):
                continue
            held = None   # the budget failure of a policy holding less, at these K, axes
            for policy in reversed(remats):   # least held first
                if (axes, policy) in outpaced_at:
                    continue
                setting = Microbatching(k, axes, replicas, remat=policy)
                if held is not None:   # saves more of what the rejected policy remakes
                    implied_over_budget(setting, held, trail)
                    rejected = True
                    continue
                candidate, failure, slower = plan_within_budget(
                    search, setting, failure, None, _seconds(found, best), trail)
                if candidate is None and not slower:
                    held = (policy, failure)
                if slower:
                    outpaced_at.add((axes, policy))
                outpaced = outpaced or slower
                rejected = rejected or candidate is None and not slower
                if candidate is None:
                    continue
                candidate = dataclasses.replace(candidate, microbatching=setting)
                if found is None or candidate.cost.total_s < found.cost.total_s:
                    found = candidate
        if found is not None and (best is None or found.cost.total_s < best.cost.total_s):
            best = found
        elif (found is not None or outpaced and not rejected) and microbatches == "auto":
            break   # a fitting plan no faster than fewer microbatches: more only add loops
    if best is None:
        if failure is not None:
            raise failure
        raise InputError(f"batch of {size} rows does not split into {microbatches} "
                         f"microbatches on mesh {sizes}")
    return best.with_stats(settings=tuple(trail))


def _seconds(*plans) -> float | None:
    """Step seconds of the fastest of ``plans`` (None where every one is None)."""
    found = [p.cost.total_s for p in plans if p is not None]
    return min(found) if found else None


def plan_within_budget(search: Search, setting, failure, record=None, beat=None,
                       trail: list | None = None):
    """The program planned under ``setting``, and the last budget failure: (the plan,
    ``failure``, False), or (None, the ``MemoryBudgetError``, False) where no plan fits,
    or (None, ``failure``, True) where no plan is faster than ``beat`` seconds.
    ``trail`` hears the setting, the outcome and the seconds it took."""
    started = time.perf_counter()
    found, outcome, stages = None, "fits", None
    try:
        found = search.plan(setting, record, beat)
        stages = found.stats.stage_seconds()
    except MemoryBudgetError as e:
        failure, outcome = e, f"over budget: at least {e.smallest_bytes:.4g} bytes"
        stages = getattr(e, "stage_seconds", None)
    except CannotBeat as e:
        outcome = f"cannot beat {beat:.6g} s: at least {e.lower_bound:.6g} s"
        stages = getattr(e, "stage_seconds", None)
    log.debug("setting %s: %s (%s s step, planned in %.2f s)", describe(setting), outcome,
              None if found is None else f"{found.cost.total_s:.6g}",
              time.perf_counter() - started)
    if trail is not None:
        trail.append(tried(setting, outcome, None if found is None else found.cost.total_s,
                           time.perf_counter() - started, stages))
    return found, failure, outcome.startswith("cannot beat")


def tried(setting: Microbatching | None, outcome: str, step_s: float | None,
          plan_s: float, stage_s: dict | None) -> dict:
    """A setting tried, as ``plan.stats.settings`` lists it."""
    return {"setting": describe(setting), "outcome": outcome,
            "microbatches": 1 if setting is None else setting.microbatches,
            "replica_axes": [] if setting is None else list(setting.replica_axes),
            "remat": None if setting is None else setting.remat,
            "step_s": step_s, "plan_s": plan_s, "stage_s": stage_s}


def implied_over_budget(setting: Microbatching, held: tuple, trail: list) -> None:
    """``setting`` rejected unplanned: at its microbatches and axes, ``held`` = (a remat
    policy saving less, its budget failure) found no plan within the budget. A policy
    saves a subset of what one saving more saves (none: every residual; dots: the dots'
    results; nothing: the layers' inputs), and its backward remakes one layer at a
    time what the other held all along."""
    policy, failure = held
    trail.append(tried(setting, f"over budget: holds more than remat {policy}, at least "
                                f"{failure.smallest_bytes:.4g} bytes", None, 0.0, None))


def describe(setting: Microbatching | None) -> str:
    """A setting in a few words: microbatches, the axes they split over, remat."""
    if setting is None:
        return "K=1, no remat"
    axes = f" over {','.join(setting.replica_axes)}" if setting.replica_axes else ""
    return f"K={setting.microbatches}{axes}, remat {setting.remat or 'none'}"


def replica_candidates(base, size: int, sizes: dict) -> list[tuple[str, ...]]:
    """Mesh axes to split each microbatch over: those the plan without microbatches splits
    the batch over and every axis; without such a plan, also each axis alone, and none."""
    axes = tuple(a for a in sizes if sizes[a] > 1)
    if base is not None:
        for a in base.arguments:
            if a.shape and a.shape[0] == size:
                return list(dict.fromkeys([tuple(a.spec[0]) if a.spec else (), axes]))
    out = [axes] + [(a,) for a in sorted(axes, key=lambda a: -sizes[a])] + [()]
    return list(dict.fromkeys(out))


def plan_with_pipeline(search: Search):
    """The plan with the marked loss's layer stack pipelined over mesh axis
    ``options.pipeline`` (``"auto"``: each axis, and no pipeline), the whole axis a stage
    each, in ``options.microbatches`` microbatches (``"auto"`` or ``None``: S, 2S and 4S
    for S stages), each passing the stages ``options.repeats`` times (1: GPipe; V >= 2:
    the circular schedule; ``"auto"``, and ``None`` under ``pipeline="auto"``: GPipe and
    every power of two V dividing L / S), each microbatch whole or split over the other
    axes inside the stages (``replica_splits``). The fastest plan within the budget wins; where
    no pipeline fits, the step accumulates gradients over K = 2, 4, ... pipelined steps of
    B / K rows each (the fewest that fit)."""
    pipeline, sizes = search.options.pipeline, search.sizes
    repeats = search.options.repeats
    repeats = "auto" if repeats is None and pipeline == "auto" else repeats or 1
    axes = [pipeline] if pipeline != "auto" else [a for a in sizes if sizes[a] > 1]
    best, failure, trail = None, None, []
    if pipeline == "auto":
        try:
            best = plan_with_microbatches(search)
            trail = list(best.stats.settings)
        except MemoryBudgetError as e:
            failure = e
    for steps in (2 ** n for n in range(7)):   # accumulation steps K = 1, 2, 4, ...
        staged, failure, divided = fastest_pipeline(search, axes, steps, failure,
                                                    strict=pipeline != "auto" and steps == 1,
                                                    repeats=repeats, trail=trail,
                                                    beat=_seconds(best))
        if staged is not None and (best is None or staged.cost.total_s < best.cost.total_s):
            best = staged
        if best is not None or not divided or not isinstance(failure, MemoryBudgetError):
            break
    if best is None:
        if failure is not None:
            raise failure
        raise InputError(f"no layer stack of the marked loss pipelines over {axes}")
    return best.with_stats(settings=tuple(trail))


def circular_repeats(layers: int, stages: int, microbatches: int) -> list[int]:
    """The circular schedule's repeats to weigh: powers of two V >= 2 dividing L / S (a
    stage runs L / (S V) layers a pass), where there are as many microbatches as stages."""
    if microbatches < stages or not layers:
        return []
    per_stage = layers // stages
    return [v for v in (2 ** n for n in range(1, per_stage.bit_length()))
            if per_stage % v == 0]


def pipelining(axis: str, stages: int, microbatches: int, repeats: int,
               replica_axes: tuple[str, ...] = (), sizes: dict | None = None) -> Pipelining:
    """GPipe (one repeat) or the circular schedule (``repeats`` >= 2), each microbatch
    split over ``replica_axes`` (of ``sizes``) or whole."""
    return Pipelining(axis, stages, microbatches, schedule="gpipe" if repeats == 1 else
                      "circular", repeats=repeats, replica_axes=tuple(replica_axes),
                      replicas=dim_shards(replica_axes, sizes or {}))


def replica_splits(axis: str, sizes: dict) -> list[tuple[str, ...]]:
    """How to split each microbatch inside a stage over ``axis``: whole (the planner
    places its rows), or over every other axis (data parallel inside the stage, each
    slice's gradient reduced once after the loop)."""
    others = tuple(a for a in sizes if a != axis and sizes[a] > 1)
    return [(), others] if others else [()]


def fastest_pipeline(search: Search, axes, steps: int, failure, strict: bool, repeats=1,
                     trail: list | None = None, beat: float | None = None):
    """The fastest plan within the budget pipelined over one of ``axes``, accumulated over
    ``steps`` pipelined steps; the last budget failure; and whether any setting traced (a
    stack the stages and microbatches divide). ``strict``: a setting that finds no such
    stack raises (the one setting asked for), rather than being skipped. ``repeats="auto"``
    weighs GPipe, then the circular schedule's repeats the stack's layers divide.
    ``trail`` hears each setting planned, as ``plan.stats.settings`` lists them. A
    setting that cannot beat ``beat`` seconds or the fastest so far is dropped after one
    LP (``PlanOptions.seconds_to_beat``)."""
    microbatches, sizes = search.options.microbatches, search.sizes
    best, divided = None, False
    for axis in axes:
        stages = sizes[axis]
        counts = ([int(microbatches)] if microbatches not in (None, "auto")
                  else [stages, 2 * stages, 4 * stages])
        for count, policy, split in [(c, r, a) for c in counts
                                     for r in remat_choices(search.options.remat)
                                     for a in replica_splits(axis, sizes)]:
            laps = [1 if repeats == "auto" else int(repeats)]
            while laps:
                record = TraceRecord()
                setting = Microbatching(steps, pipeline=pipelining(axis, stages, count,
                                                                   laps.pop(0), split, sizes),
                                        remat=policy)
                started, outcome = time.perf_counter(), "fits"
                to_beat = _seconds(best) if beat is None else min(beat, _seconds(best) or beat)
                try:
                    candidate = search.plan(setting, record, to_beat, search.options.mesh)
                    stage_s = candidate.stats.stage_seconds()
                except MemoryBudgetError as e:
                    failure, divided = e, True
                    candidate, stage_s = None, getattr(e, "stage_seconds", None)
                    outcome = f"over budget: at least {e.smallest_bytes:.4g} bytes"
                except CannotBeat as e:
                    candidate, divided = None, True
                    stage_s = getattr(e, "stage_seconds", None)
                    outcome = f"cannot beat {to_beat:.6g} s: at least {e.lower_bound:.6g} s"
                except InputError:
                    if not strict or len(counts) > 1 or split:
                        continue   # no stack these stages and microbatch slices divide
                    raise
                layers = record.stack_layers[0] if record.stack_layers else 0
                if trail is not None:
                    trail.append(pipeline_trail(setting, layers, outcome, candidate,
                                                time.perf_counter() - started, stage_s))
                if repeats == "auto" and setting.pipeline.repeats == 1:
                    laps = circular_repeats(layers, stages, count)
                if candidate is None:
                    continue
                divided = True
                candidate = dataclasses.replace(candidate, microbatching=dataclasses.replace(
                    setting, pipeline=dataclasses.replace(setting.pipeline, layers=layers)))
                if best is None or candidate.cost.total_s < best.cost.total_s:
                    best = candidate
    return best, failure, divided


def pipeline_trail(setting: Microbatching, layers: int, outcome: str, found,
                   plan_s: float, stage_s: dict | None) -> dict:
    """A pipelined setting tried, as ``plan.stats.settings`` lists settings."""
    staged = dataclasses.replace(setting.pipeline, layers=layers)
    return {"setting": f"{describe(setting)}; {staged.describe()}", "outcome": outcome,
            "microbatches": setting.microbatches,
            "replica_axes": list(staged.replica_axes),
            "remat": setting.remat, "pipeline": staged.axis, "schedule": staged.schedule,
            "repeats": staged.repeats, "pipeline_microbatches": staged.microbatches,
            "step_s": None if found is None else found.cost.total_s, "plan_s": plan_s,
            "stage_s": stage_s}
