"""accumulate: gradient accumulation over microbatches, written into the program before tracing.

``autoshard.value_and_grad`` is ``jax.value_and_grad`` with a mark: when ``autoshard.plan``
traces a program with ``microbatches=K``, the marked loss runs as a ``lax.scan`` over K
microbatches instead, and the planner plans that loop like any other.

The gradient reduction must happen once per step, after the loop, not once per
microbatch. A gradient taken inside the loop on a batch split over the mesh's data axes is
a sum over those axes, which GSPMD reduces where it is taken, inside the loop. So each
microbatch is itself split into R replica slices (R: the size of the mesh axes the batch is
split over), the loss is ``vmap``-ed over them with the differentiated arguments broadcast
to ``[R, ...]``, and the loop accumulates per-replica gradients ``[R, ...]``: sharded over
the replica axes, they need no communication inside the loop. The sum over R after the
loop is the one reduction (an all-reduce, or a reduce-scatter where the plan shards the
gradients).

Batch rows are split as ``[B] -> [R, K, b]``: replica r holds the rows a batch split on the
replica axes already places on it, so slicing microbatches moves no data. For a loss that
is a mean over equal-sized rows, the mean of the K x R slice means is the batch mean, and
its gradient is the mean of theirs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autoshard.errors import InputError
from autoshard.pipeline import Pipelining, pipelined


@dataclasses.dataclass(frozen=True)
class Microbatching:
    """How a marked loss is accumulated: K microbatches, each split into ``replicas``
    slices along the batch (the size of the mesh axes ``replica_axes``)."""

    microbatches: int
    replica_axes: tuple[str, ...] = ()
    replicas: int = 1
    # the layer stack as a pipeline of its own microbatches; with ``microbatches`` K > 1,
    # each of the K accumulation steps runs the pipeline on B / K rows
    pipeline: Pipelining | None = None
    remat: str | None = None   # the stack's layers under jax.checkpoint with this policy


@dataclasses.dataclass
class TraceRecord:
    """What the marked losses saw while one program was traced."""

    batch_sizes: list[int] = dataclasses.field(default_factory=list)
    stack_layers: list[int] = dataclasses.field(default_factory=list)   # pipelined stacks


_SETTING: contextvars.ContextVar = contextvars.ContextVar("autoshard_microbatching",
                                                         default=None)
_RECORD: contextvars.ContextVar = contextvars.ContextVar("autoshard_trace_record",
                                                        default=None)
_MESH: contextvars.ContextVar = contextvars.ContextVar("autoshard_mesh", default=None)
_TO_BEAT: contextvars.ContextVar = contextvars.ContextVar("autoshard_seconds_to_beat",
                                                         default=None)


@contextlib.contextmanager
def microbatching(setting: Microbatching | None, record: TraceRecord | None = None,
                  mesh=None):
    """Marked losses traced inside run as ``setting`` says (``None``: as written), a
    pipeline's stages on ``mesh``."""
    tokens = _SETTING.set(setting), _RECORD.set(record), _MESH.set(mesh)
    try:
        yield
    finally:
        for var, token in zip((_SETTING, _RECORD, _MESH), tokens):
            var.reset(token)


def seconds_to_beat() -> float | None:
    """Step seconds of the best plan found so far for the program being planned under
    another setting: a plan no faster is not wanted (None: every plan is)."""
    return _TO_BEAT.get()


def active_pipeline() -> Pipelining | None:
    """The pipeline the program being planned is rewritten into, if any."""
    setting = _SETTING.get()
    return None if setting is None else setting.pipeline


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0,
                   has_aux: bool = False) -> Callable:
    """``jax.value_and_grad(fun, argnums, has_aux)``, marked for ``autoshard.plan``.

    Outside ``autoshard.plan`` (eagerly, under ``jax.jit``, anywhere) it is exactly
    ``jax.value_and_grad``. Planned with ``microbatches=K``, the loss runs over K
    microbatches of its batch (the leading dim of the array arguments that are not
    differentiated, found as ``batch_size`` says), gradients accumulate, and they are
    reduced once per step. ``fun``
    should return a mean over the batch's rows; ``aux`` leaves are averaged over
    microbatches.

    Example::

        def train_step(params, batch):
            loss, grads = autoshard.value_and_grad(loss_fn)(params, batch)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

        plan = autoshard.plan(train_step, params, batch, mesh=mesh, microbatches=4)
    """
    plain = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fun)
    def marked(*args, **kwargs):
        setting, record = _SETTING.get(), _RECORD.get()
        if record is not None:
            size = batch_size(args, argnums)
            if size is not None:
                record.batch_sizes.append(size)
        if setting is not None and (setting.pipeline is not None or setting.remat):
            staged = pipelined(fun, setting.pipeline, _MESH.get(),
                               lambda a: batch_size(a, argnums),
                               None if record is None else record.stack_layers.append,
                               setting.remat, _argnums(argnums))
            if setting.microbatches == 1:
                return jax.value_and_grad(staged, argnums=argnums, has_aux=has_aux)(
                    *args, **kwargs)
            # K > 1 with a pipeline: K accumulation steps, each a pipeline of M microbatches
            return accumulated(staged, argnums, has_aux, setting, args, kwargs)
        if setting is None or setting.microbatches == 1:
            return plain(*args, **kwargs)
        return accumulated(fun, argnums, has_aux, setting, args, kwargs)

    marked.autoshard_marked = True
    return marked


def _argnums(argnums) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def batch_size(args, argnums) -> int | None:
    """The batch's row count: the leading dim of the first array leaf of the last argument
    that is not differentiated and holds arrays (``loss(params, batch)``,
    ``loss(params, stats, batch)``)."""
    diff = set(_argnums(argnums))
    for i in reversed(range(len(args))):
        if i in diff:
            continue
        for leaf in jax.tree.leaves(args[i]):
            if np.ndim(leaf) >= 1:
                return int(np.shape(leaf)[0])
    return None


def accumulated(fun, argnums, has_aux, setting: Microbatching, args, kwargs):
    """The marked loss as a scan over microbatches; returns what value_and_grad returns."""
    nums = _argnums(argnums)
    size = batch_size(args, argnums)
    k, r = setting.microbatches, setting.replicas
    if size is None:
        raise InputError("microbatches need a batch: an array argument of the marked loss "
                         "that is not differentiated")
    if size % (k * r):
        raise InputError(f"batch of {size} rows does not split into {k} microbatches of "
                         f"{r} replica slices")
    # leaves split along the batch: non-differentiated arrays whose leading dim is the batch
    flat, tree = jax.tree.flatten(list(args))
    owner = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    split = [j for j, x in enumerate(flat)
             if owner[j] not in nums and np.ndim(x) >= 1 and np.shape(x)[0] == size]
    xs = [to_microbatches(flat[j], k, r) for j in split]
    diff_args = [args[i] for i in nums]

    def replica_loss(diff_values, batch_slices):
        leaves = list(flat)
        for j, x in zip(split, batch_slices):
            leaves[j] = x
        full = jax.tree.unflatten(tree, leaves)
        for n, i in enumerate(nums):
            full[i] = diff_values[n]
        return fun(*full, **kwargs)

    grad_fn = jax.value_and_grad(replica_loss, argnums=0, has_aux=has_aux)
    # per-replica gradients: the differentiated values broadcast to [R, ...]
    broadcast = jax.tree.map(lambda x: jnp.broadcast_to(x, (r,) + jnp.shape(x)), diff_args)
    zeros = jax.tree.map(jnp.zeros_like, broadcast)

    def step(carry, batch_slices):
        grads_acc, value_acc = carry
        value, grads = jax.vmap(grad_fn)(broadcast, batch_slices)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        value_acc = jax.tree.map(jnp.add, value_acc, value)   # per replica: no reduction
        return (grads_acc, value_acc), None

    value_shape = jax.eval_shape(
        lambda d, b: jax.vmap(grad_fn)(d, b)[0], broadcast,
        jax.tree.map(lambda x: x[0], xs))
    value_zeros = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), value_shape)
    (grads_acc, value_acc), _ = lax.scan(step, (zeros, value_zeros), xs, length=k)
    count = k * r
    grads = [jax.tree.map(lambda g: (jnp.sum(g, axis=0) / count).astype(g.dtype), g_tree)
             for g_tree in grads_acc]
    value = jax.tree.map(lambda v: (jnp.sum(v, axis=0) / count).astype(v.dtype), value_acc)
    grads = grads[0] if isinstance(argnums, int) else tuple(grads)
    return value, grads


def to_microbatches(x, k: int, r: int):
    """[B, ...] -> [K, R, B / (K R), ...]: rows of replica r stay where a split of the
    batch over R places them."""
    b = x.shape[0] // (k * r)
    return jnp.swapaxes(x.reshape((r, k, b) + x.shape[1:]), 0, 1)


# -- planning with microbatches ------------------------------------------------------------

AUTO_MAX_MICROBATCHES = 64


def remat_choices(remat) -> list:
    """The remat policies to weigh: ``"auto"``: none, dots saved, nothing saved."""
    from autoshard.pipeline import REMAT_POLICIES
    if remat == "auto":
        return [None, "dots_saveable", "nothing_saveable"]
    if remat is not None and remat not in REMAT_POLICIES:
        raise InputError(f"remat must be None, 'auto' or one of {sorted(REMAT_POLICIES)}, "
                         f"not {remat!r}")
    return [remat]


def plan_with_microbatches(plan_fn: Callable, fn: Callable, args, mesh, microbatches,
                           remat=None):
    """The plan of ``fn`` with its marked loss accumulated over ``microbatches`` (an int K,
    or ``"auto"``: the fastest plan within the budget over K = 1, 2, 4, ...), its layer
    stack rematerialized as ``remat`` says (``"auto"``: each policy and none, jointly).

    ``plan_fn(fn, *args)`` plans one traced program (``autoshard.plan`` with the caller's
    options). The replica axes are those the plan without microbatches splits the batch
    over; when that plan does not fit, each choice of axes is tried.

    Settings are tried fastest first (fewer microbatches, less recomputed); one whose
    memory floor exceeds the budget is rejected before solving, and once a plan fits,
    one that cannot beat it regardless of memory is dropped before solving under the
    budget (``seconds_to_beat``). ``"auto"`` stops at the first K none of whose settings
    beats the best of fewer microbatches, unless memory rejected some of them.
    """
    check_count("microbatches", microbatches)
    microbatches = 1 if microbatches is None else microbatches
    remats = remat_choices(remat)
    record = TraceRecord()
    base, failure, best = None, None, None
    trail: list[dict] = []   # every setting tried, as plan.solver["settings"] lists them
    for policy in remats:   # K = 1
        setting = None if policy is None else Microbatching(1, remat=policy)
        candidate, failure, _ = plan_within_budget(plan_fn, fn, args, setting, failure,
                                                   record, _seconds(best), trail)
        if candidate is None:
            continue
        candidate.microbatching = setting
        base = base if policy is not None and base is not None else candidate
        if best is None or candidate.cost.total_s < best.cost.total_s:
            best = candidate
    if not record.batch_sizes:
        raise InputError("microbatches need a loss marked by autoshard.value_and_grad in "
                         "the program (a function under jax.jit traced before keeps its "
                         "first trace: mark it or call it unjitted)")
    size = record.batch_sizes[0]
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    candidates = replica_candidates(base, size, sizes)
    counts = [int(microbatches)] if microbatches != "auto" else \
        [k for k in (2 ** n for n in range(1, 7)) if k <= AUTO_MAX_MICROBATCHES]
    if microbatches not in ("auto", 1):
        best = None
    if microbatches == 1:
        counts = []
    for k in counts:
        found, outpaced, rejected = None, False, False
        for axes in candidates:
            replicas = int(np.prod([sizes[a] for a in axes], dtype=int))
            if size % (k * replicas):
                continue
            for policy in remats:
                setting = Microbatching(k, axes, replicas, remat=policy)
                candidate, failure, slower = plan_within_budget(
                    plan_fn, fn, args, setting, failure, None, _seconds(found, best), trail)
                outpaced = outpaced or slower
                rejected = rejected or candidate is None and not slower
                if candidate is None:
                    continue
                candidate.microbatching = setting
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
    best.solver["settings"] = trail
    return best


def _seconds(*plans) -> float | None:
    """Step seconds of the fastest of ``plans`` (None where every one is None)."""
    found = [p.cost.total_s for p in plans if p is not None]
    return min(found) if found else None


def check_count(name: str, value, meaning: str = "") -> None:
    """``value`` of option ``name`` is None, ``"auto"`` or a positive int, or
    ``InputError`` (``meaning``: what its values mean, for the message)."""
    if value in (None, "auto"):
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be None, a positive int{meaning} or 'auto', "
                         f"not {value!r}")


def plan_within_budget(plan_fn, fn, args, setting, failure, record=None, beat=None,
                       trail: list | None = None):
    """``plan_fn(fn, *args)`` traced under ``setting``, and the last budget failure: (the
    plan, ``failure``, False), or (None, the ``MemoryBudgetError``, False) where no plan
    fits, or (None, ``failure``, True) where no plan is faster than ``beat`` seconds.
    ``trail`` hears the setting, the outcome and the seconds it took."""
    from autoshard.errors import MemoryBudgetError
    from autoshard.solve import CannotBeat
    token = _TO_BEAT.set(beat)
    started = time.perf_counter()
    found, outcome, stages = None, "fits", None
    try:
        with microbatching(setting, record):
            found = plan_fn(fn, *args)
        stages = {stage: found.solver.get(f"{stage}_s") for stage in STAGES}
    except MemoryBudgetError as e:
        failure, outcome = e, f"over budget: at least {e.smallest_bytes:.4g} bytes"
        stages = getattr(e, "stage_seconds", None)
    except CannotBeat as e:
        outcome = f"cannot beat {beat:.6g} s: at least {e.lower_bound:.6g} s"
        stages = getattr(e, "stage_seconds", None)
    finally:
        _TO_BEAT.reset(token)
    if trail is not None:
        trail.append({"setting": describe(setting), "outcome": outcome,
                      "microbatches": 1 if setting is None else setting.microbatches,
                      "replica_axes": [] if setting is None else list(setting.replica_axes),
                      "remat": None if setting is None else setting.remat,
                      "step_s": None if found is None else found.cost.total_s,
                      "plan_s": time.perf_counter() - started, "stage_s": stages})
    return found, failure, outcome.startswith("cannot beat")


STAGES = ("trace", "cost", "coarsen", "solve")   # the planning stages a setting's seconds
#                                                   split into (``plan.solver["settings"]``)


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


def plan_with_pipeline(plan_fn: Callable, fn: Callable, args, mesh, pipeline: str,
                       microbatches, remat=None, repeats=None):
    """The plan of ``fn`` with its marked loss's layer stack pipelined over mesh axis
    ``pipeline`` (``"auto"``: each axis, and no pipeline), the whole axis a stage each, in
    ``microbatches`` microbatches (``"auto"`` or ``None``: S, 2S and 4S for S stages), each
    passing the stages ``repeats`` times (1: GPipe; V >= 2: the circular schedule;
    ``"auto"``, and ``None`` under ``pipeline="auto"``: GPipe and every power of two V
    dividing L / S). The fastest plan within the budget wins; where no pipeline fits, the
    step accumulates gradients over K = 2, 4, ... pipelined steps of B / K rows each (the
    fewest that fit)."""
    from autoshard.errors import MemoryBudgetError
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if pipeline != "auto" and pipeline not in sizes:
        raise InputError(f"pipeline names mesh axis {pipeline!r}; the mesh has "
                         f"{list(sizes)} (or pass 'auto')")
    check_count("microbatches", microbatches)
    check_count("repeats", repeats, " (1: GPipe, V >= 2: the circular schedule)")
    repeats = "auto" if repeats is None and pipeline == "auto" else repeats or 1
    axes = [pipeline] if pipeline != "auto" else [a for a in sizes if sizes[a] > 1]
    best, failure, trail = None, None, []
    if pipeline == "auto":
        try:
            best = plan_with_microbatches(plan_fn, fn, args, mesh, microbatches, remat)
            trail = best.solver.get("settings", [])
        except MemoryBudgetError as e:
            failure = e
    for steps in (2 ** n for n in range(7)):   # accumulation steps K = 1, 2, 4, ...
        staged, failure, divided = fastest_pipeline(plan_fn, fn, args, mesh, axes, sizes,
                                                    microbatches, remat, steps, failure,
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
    best.solver["settings"] = trail
    return best


def circular_repeats(layers: int, stages: int, microbatches: int) -> list[int]:
    """The circular schedule's repeats to weigh: powers of two V >= 2 dividing L / S (a
    stage runs L / (S V) layers a pass), where there are as many microbatches as stages."""
    if microbatches < stages or not layers:
        return []
    per_stage = layers // stages
    return [v for v in (2 ** n for n in range(1, per_stage.bit_length()))
            if per_stage % v == 0]


def pipelining(axis: str, stages: int, microbatches: int, repeats: int) -> Pipelining:
    """GPipe (one repeat) or the circular schedule (``repeats`` >= 2)."""
    return Pipelining(axis, stages, microbatches, schedule="gpipe" if repeats == 1 else
                      "circular", repeats=repeats)


def fastest_pipeline(plan_fn, fn, args, mesh, axes, sizes, microbatches, remat, steps: int,
                     failure, strict: bool, repeats=1, trail: list | None = None,
                     beat: float | None = None):
    """The fastest plan within the budget pipelined over one of ``axes``, accumulated over
    ``steps`` pipelined steps; the last budget failure; and whether any setting traced (a
    stack the stages and microbatches divide). ``strict``: a setting that finds no such
    stack raises (the one setting asked for), rather than being skipped. ``repeats="auto"``
    weighs GPipe, then the circular schedule's repeats the stack's layers divide.
    ``trail`` hears each setting planned, as ``plan.solver["settings"]`` lists them. A
    setting that cannot beat ``beat`` seconds or the fastest so far is dropped after one
    LP (``seconds_to_beat``)."""
    from autoshard.errors import MemoryBudgetError
    from autoshard.solve import CannotBeat
    best, divided = None, False
    for axis in axes:
        stages = sizes[axis]
        counts = ([int(microbatches)] if microbatches not in (None, "auto")
                  else [stages, 2 * stages, 4 * stages])
        for count, policy in [(c, r) for c in counts for r in remat_choices(remat)]:
            laps = [1 if repeats == "auto" else int(repeats)]
            while laps:
                record = TraceRecord()
                setting = Microbatching(steps, pipeline=pipelining(axis, stages, count,
                                                                   laps.pop(0)),
                                        remat=policy)
                started, outcome = time.perf_counter(), "fits"
                to_beat = _seconds(best) if beat is None else min(beat, _seconds(best) or beat)
                token = _TO_BEAT.set(to_beat)
                with microbatching(setting, record, mesh):
                    try:
                        candidate = plan_fn(fn, *args)
                    except MemoryBudgetError as e:
                        failure, divided = e, True
                        candidate = None
                        outcome = f"over budget: at least {e.smallest_bytes:.4g} bytes"
                    except CannotBeat as e:
                        candidate, divided = None, True
                        outcome = f"cannot beat {to_beat:.6g} s: at least {e.lower_bound:.6g} s"
                    except InputError:
                        if not strict or len(counts) > 1:
                            continue   # no stack these stages and microbatches divide
                        raise
                    finally:
                        _TO_BEAT.reset(token)
                layers = record.stack_layers[0] if record.stack_layers else 0
                if trail is not None:
                    trail.append(pipeline_trail(setting, layers, outcome, candidate,
                                                time.perf_counter() - started))
                if repeats == "auto" and setting.pipeline.repeats == 1:
                    laps = circular_repeats(layers, stages, count)
                if candidate is None:
                    continue
                divided = True
                candidate.microbatching = dataclasses.replace(
                    setting, pipeline=dataclasses.replace(setting.pipeline, layers=layers))
                if best is None or candidate.cost.total_s < best.cost.total_s:
                    best = candidate
    return best, failure, divided


def pipeline_trail(setting: Microbatching, layers: int, outcome: str, found,
                   plan_s: float) -> dict:
    """A pipelined setting tried, as ``plan.solver["settings"]`` lists settings."""
    staged = dataclasses.replace(setting.pipeline, layers=layers)
    return {"setting": f"{describe(setting)}; {staged.describe()}", "outcome": outcome,
            "microbatches": setting.microbatches, "replica_axes": [],
            "remat": setting.remat, "pipeline": staged.axis, "schedule": staged.schedule,
            "repeats": staged.repeats, "pipeline_microbatches": staged.microbatches,
            "step_s": None if found is None else found.cost.total_s, "plan_s": plan_s}
