"""pipeline: a marked loss's layer stack rewritten into a GSPMD pipeline, with the GPipe or
the circular (interleaved) schedule.

The repeated layers are the loss's ``lax.scan`` over stacked layer weights (``[L, ...]``
leaves of its ``xs``), the one with the most iterations; without one, a Python loop over a
list of layers, rolled into such a scan first (``unrolled``). The rewrite, before the
gradient is taken (so autodiff writes the backward pass):

- the stack is reshaped to ``[V, S, L / (S V), ...]`` (V repeats: 1 for GPipe) and its
  stage dim sharded over the stage axis (a ``with_sharding_constraint`` the planner keeps,
  other dims left to it): stage s holds layers ``r S Lr + s Lr + j`` for repeat r;
- the scan's batch-shaped carries and constants (leading dim B) are split into M
  microbatches ``[M, B / M, ...]``;
- a loop of M V + S - 1 iterations runs one stage step ``vmap``-ed over the S stages
  (with ``spmd_axis_name``: each layer's activations and weights stay on the stage's
  devices): stage s applies its L / (S V) layers of the repeat it is in (unrolled) to the
  microbatch it holds; then the buffer ``[S, B / M, ...]`` shifts by one stage
  (``stage_shift``, a roll of the stage-sharded dim: a collective-permute), the last
  stage's result wrapping round to stage 0.

Every stage holds a store of M microbatch slots, at first the microbatches themselves:
stage 0 takes its input from slot ``t mod M`` of its store, and after the shift each
stage writes what arrived into slot ``(t - S + 1) mod M`` of its own, so stage 0's store
keeps the last stage's results until their next repeat, and at the end holds the
outputs. Inside the loop only the shift crosses the stage axis, in the forward pass and in
the backward pass autodiff writes.

With ``replicas`` R > 1 each microbatch is split again into R slices over the replica axes
(``[M, R, B / (M R), ...]``; data parallel inside a stage) and the stage step is ``vmap``-ed
over them too. The stage's layers are broadcast to one copy a slice before the loop: the
backward pass then accumulates each slice's weight gradient on that slice's devices and
sums the copies once, after the loop. With one copy read by every slice, the gradient of
each iteration is a sum over the replica axes that GSPMD reduces inside the loop, once
per iteration.

Stage s at iteration t runs pass k = t - s (idle unless 0 <= k < M V): microbatch k mod M
in repeat k // M. Microbatch m leaves the last stage at iteration (r M + m) + S - 1 and
re-enters stage 0 at ((r + 1) M + m), so the circular schedule needs M >= S. The bubble
is (S - 1) / (M V + S - 1) of each stage's time: V times more, V times smaller steps
shrink it, for V times more stage transfers. Carries without a batch dim (an auxiliary
loss summed over layers) run per microbatch and are averaged over microbatches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.errors import InputError
from autoshard.frontend import jax_compat
from autoshard.frontend.interpret import INLINED, bind, run_inlined, run_jaxpr
from autoshard.rewrite import unrolled
from autoshard.rewrite.traces import Traces, function_key

# -- the stage shift -----------------------------------------------------------------------
#
# ``jnp.roll`` traces to two slices and a concatenate, whose rules keep the rolled dim
# whole: the planner would gather the stage buffer to roll it. As one primitive the shift
# keeps its operand's spec, and its rule prices the collective-permute XLA emits for a
# roll of a dim split over the stage axis (its lowering is the same roll).

def stage_shift(x, shift: int = 1, dimension: int = 0):
    """``jnp.roll(x, shift, dimension)``: entry i moves to i + shift along ``dimension``."""
    return stage_shift_p.bind(x, shift=int(shift), dimension=int(dimension))


def _roll(x, *, shift, dimension):
    return jnp.roll(x, shift, axis=dimension)


def _shift_batched(args, dims, *, shift, dimension):
    (x,), (d,) = args, dims
    return stage_shift(x, shift, dimension + (d is not None and d <= dimension)), d


stage_shift_p = jax_compat.linear_primitive(
    "stage_shift", _roll,
    transpose=lambda ct, *, shift, dimension: stage_shift(ct, -shift, dimension),
    batch=_shift_batched)


SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class Pipelining:
    """A pipeline: ``stages`` stages over mesh axis ``axis``, ``microbatches`` in flight,
    ``layers`` repeated layers (``layers / stages`` a stage). ``schedule="gpipe"`` passes
    each microbatch through the stages once; ``"circular"`` passes it ``repeats`` times,
    a stage running ``layers / (stages * repeats)`` layers a pass."""

    axis: str
    stages: int
    microbatches: int
    layers: int = 0
    schedule: str = "gpipe"
    repeats: int = 1
    # each microbatch split into ``replicas`` slices over the mesh axes ``replica_axes``
    # (data parallel inside a stage), the stage's layers broadcast to one copy a slice
    replica_axes: tuple[str, ...] = ()
    replicas: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise InputError(f"pipeline schedule must be one of {SCHEDULES}, not "
                             f"{self.schedule!r}")
        if (self.schedule == "gpipe") != (self.repeats == 1) or self.repeats < 1:
            raise InputError(f"the {self.schedule} schedule takes "
                             f"{'1 repeat' if self.schedule == 'gpipe' else 'repeats >= 2'}, "
                             f"not {self.repeats}")
        if self.schedule == "circular" and self.microbatches < self.stages:
            raise InputError(f"the circular schedule needs at least as many microbatches as "
                             f"stages ({self.stages}), not {self.microbatches}")

    @property
    def layers_per_stage(self) -> int:
        return self.layers // self.stages

    @property
    def layers_per_pass(self) -> int:
        """Layers a stage runs on one microbatch in one loop iteration: L / (S V)."""
        return self.layers // (self.stages * self.repeats)

    @property
    def passes(self) -> int:
        """Stage passes of each stage: every microbatch once a repeat, M V."""
        return self.microbatches * self.repeats

    @property
    def iterations(self) -> int:
        return self.passes + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The share of each stage's loop spent idle: (S - 1) / (M V + S - 1)."""
        return (self.stages - 1) / self.iterations

    def describe(self) -> str:
        """One line for ``Plan.summary``."""
        laps = (f" x {self.repeats} repeats of {self.layers_per_pass} layers"
                if self.repeats > 1 else "")
        split = (f" (each in {self.replicas} slices over {','.join(self.replica_axes)})"
                 if self.replicas > 1 else "")
        return (f"pipeline over {self.axis!r}: {self.stages} stages x {self.layers_per_stage} "
                f"layers{laps}, {self.microbatches} microbatches{split}, {self.schedule} "
                f"schedule, {self.iterations} steps, bubble {self.bubble_fraction:.1%}")

    def work(self, stage: int, step: int) -> tuple[int, int] | None:
        """(microbatch, repeat) stage ``stage`` works on at loop iteration ``step`` (None:
        idle): its pass k = step - stage is microbatch k mod M in repeat k // M."""
        k = step - stage
        return divmod(k, self.microbatches)[::-1] if 0 <= k < self.passes else None

    def busy(self, stage: int, step: int) -> int | None:
        """The microbatch stage ``stage`` works on at loop iteration ``step`` (None: idle)."""
        found = self.work(stage, step)
        return None if found is None else found[0]


def layer_scans(jaxpr) -> list:
    """Scan equations of ``jaxpr`` and of the bodies it inlines, outermost first."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            found.append(eqn)
        elif name in INLINED:
            found += layer_scans(jax_compat.inlined_body(eqn)[0])
    return found


def stack_scan(jaxpr, batch: int | None, stages: int, microbatches: int):
    """The scan to pipeline: the longest with stacked xs, no ys, a carry of ``batch``
    rows, and a length ``stages`` (the stages times the repeats) divides; None if there is
    none. Rematerialized alone, a stack needs no batch: with ``batch`` None, any carry."""
    best = None
    for eqn in layer_scans(jaxpr):
        p = jax_compat.scan_params(eqn.params)
        nc, ncarry, length = p.num_consts, p.num_carry, p.length
        carries = [v.aval for v in eqn.invars[nc:nc + ncarry]]
        carries_batch = batch is None or (
            any(a.ndim >= 1 and a.shape[0] == batch for a in carries)
            and batch % microbatches == 0)
        if (len(eqn.invars) == nc + ncarry or len(eqn.outvars) != ncarry
                or length % stages or length < stages or p.reverse or not carries_batch):
            continue
        if best is None or length > jax_compat.scan_params(best.params).length:
            best = eqn
    return best


# how a loss that closes over its batch gets one a pipeline or microbatches can split
PASS_THE_BATCH = ("pass the batch to it as an argument that is not differentiated "
                  "(value_and_grad(loss)(params, batch)), not closed over")

REMAT_POLICIES = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
                  "dots_saveable": jax.checkpoint_policies.dots_saveable}


def remat_layer(layer: Callable, remat: str | None) -> Callable:
    """``layer`` under ``jax.checkpoint`` with policy ``remat`` (None: as it is)."""
    if remat is None:
        return layer
    if remat not in REMAT_POLICIES:
        raise InputError(f"remat must be None, 'auto' or one of {sorted(REMAT_POLICIES)}, "
                         f"not {remat!r}")
    return jax.checkpoint(layer, policy=REMAT_POLICIES[remat])


def pipelined(fun: Callable, setting: Pipelining | None, mesh, batch_of: Callable,
              found: Callable | None = None, remat: str | None = None,
              differentiated: tuple[int, ...] = (), traces: Traces | None = None) -> Callable:
    """``fun`` with its layer stack run as ``setting``'s pipeline (None: as a scan), each
    layer rematerialized as ``remat`` says. ``batch_of(args)`` gives the batch's row count;
    ``found(layers)`` hears how many layers the stack has; the arguments numbered in
    ``differentiated`` (parameters) are never split into microbatches; ``traces`` keeps
    ``fun``'s jaxprs for the next setting of the same plan (None: nothing is kept).

    A jaxpr holds its shapes, so the stack's layer is traced again on one microbatch:
    ``fun`` at arguments whose batch leaves have B / M rows gives the scan body the stages
    run, and tells which of the scan's operands are batch-shaped (their shapes differ).
    """
    stages, count = (1, 1) if setting is None else (setting.stages * setting.repeats,
                                                    setting.microbatches * setting.replicas)

    def run(*args, **kwargs):
        flat, tree = jax.tree.flatten(args)

        def flat_fun(*f):
            return fun(*jax.tree.unflatten(tree, f), **kwargs)
        kept = traces or Traces()
        key = function_key(fun, tree, kwargs) if traces is not None else None
        closed, out_shape = kept.jaxpr(key, flat_fun, flat)
        batch = batch_of(args)
        if batch is None and setting is not None:
            raise InputError(
                "a pipeline splits the marked loss's batch into microbatches, and the loss "
                f"takes none: {PASS_THE_BATCH}")
        target = stack_scan(closed.jaxpr, batch, stages, count)
        layout = None if target is not None else layers_of(kept, key, flat, closed.jaxpr)
        if layout is not None:   # a loop over a list of layers: rolled into a scan
            flat_fun = unrolled.rolled(flat_fun, layout, traced(kept, key, flat_fun, layout))
            key = None if key is None else ("rolled", key)   # the key of flat_fun, rolled
            closed = kept.jaxpr(key, flat_fun, flat)[0]
            target = stack_scan(closed.jaxpr, batch, stages, count)
        if target is None:
            raise InputError(
                f"no layer stack to {'pipeline' if setting else 'rematerialize'}: the marked "
                f"loss has no lax.scan over stacked layers, nor a loop over a list of "
                f"repeated layers, whose length {stages} "
                f"{'stage passes' if setting is not None and setting.repeats > 1 else 'stages'} "
                f"divide and whose carry holds the batch of {batch} rows in {count} "
                "microbatch slices"
                + (f" (the repeated layers found: {layout.count})" if layout else ""))
        micro_target = None
        if setting is not None:
            rows = batch // count
            owner = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
            micro_args = [jax.ShapeDtypeStruct((rows,) + tuple(jnp.shape(x)[1:]), x.dtype)
                          if (owner[j] not in differentiated and jnp.ndim(x) >= 1
                              and jnp.shape(x)[0] == batch) else x
                          for j, x in enumerate(flat)]
            micro = kept.jaxpr(key, flat_fun, micro_args)[0]
            index = [id(e) for e in layer_scans(closed.jaxpr)].index(id(target))
            micro_target = layer_scans(micro.jaxpr)[index]
        if found is not None:
            found(jax_compat.scan_params(target.params).length)
        outs = Interpreter(target, micro_target, setting, mesh, remat).run(
            closed.jaxpr, closed.consts, flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return run


def layers_of(kept: Traces, key, args, jaxpr):
    """The run of repeated layers in ``jaxpr``, the jaxpr of the loss ``key`` at
    ``args``: the run found at other shapes of the same loss (one microbatch's rows, the
    whole batch) where its blocks are layers here too, else one found afresh."""
    layout = kept.remembered("layout", key)
    if layout is None or roll_of(kept, key, args, jaxpr, layout) is None:
        layout = kept.read("layout", key, args, lambda: unrolled.find_layout(jaxpr))
        kept.remember("layout", key, layout)
    return layout


def traced(kept: Traces, key, fun: Callable, layout) -> Callable:
    """``unrolled.rolled``'s reading of ``fun`` at some arguments: its jaxpr, the shape
    of its results and the roll of its run at ``layout``, kept in ``kept``."""
    def read(args):
        closed, out_shape = kept.jaxpr(key, fun, args)
        return closed, out_shape, roll_of(kept, key, args, closed.jaxpr, layout)
    return read


def roll_of(kept: Traces, key, args, jaxpr, layout):
    """``unrolled.read_run`` of ``jaxpr``, the loss ``key``'s at ``args``, at ``layout``:
    read once, whether to check a layout found at other shapes or to roll it."""
    return kept.read(("roll", layout), key, args, lambda: unrolled.read_run(jaxpr, layout))


class Interpreter:
    """``eval_jaxpr`` with one scan equation replaced by the pipeline, or by the same scan
    with its layer rematerialized."""

    def __init__(self, target, micro_target, setting: Pipelining | None, mesh,
                 remat: str | None = None):
        self.target, self.micro_target = target, micro_target
        self.setting, self.mesh, self.remat = setting, mesh, remat

    def run(self, jaxpr, consts, args) -> list:
        return run_jaxpr(jaxpr, consts, args, self.eqn)

    def eqn(self, eqn, ins, key=()) -> list:
        if eqn is self.target:
            return self.pipeline(eqn, ins) if self.setting else self.remat_scan(eqn, ins)
        if eqn.primitive.name in INLINED:
            return run_inlined(eqn, ins, self.run)
        return bind(eqn, ins)

    def remat_scan(self, eqn, ins) -> list:
        """The scan as written, its body under ``jax.checkpoint``."""
        p = jax_compat.scan_params(eqn.params)
        nc, ncarry = p.num_consts, p.num_carry
        consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]

        def layer(carry, x):
            return jax_compat.eval_jaxpr(p.body, p.body_consts, *consts, *carry, *x)
        layer = remat_layer(layer, self.remat)

        def step(carry, x):
            outs = layer(carry, x)
            return outs[:ncarry], outs[ncarry:]
        final, ys = lax.scan(step, list(init), list(xs), length=p.length, unroll=p.unroll)
        return [*final, *ys]

    def constrain_stages(self, x, replica_dim: int | None = None):
        """``x``'s leading (stage) dim on the stage axis, its ``replica_dim`` (a
        microbatch's slices) on the replica axes, its other dims left free."""
        spec = [self.setting.axis] + [PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)
        if replica_dim is not None and self.setting.replicas > 1:
            spec[replica_dim] = self.setting.replica_axes
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def to_slices(self, x):
        """[B, ...] -> [M, B / M, ...], or with R replicas [M, R, B / (M R), ...]: slice r
        of every microbatch holds rows that a split of B over the replica axes already
        places on replica r, so slicing moves no data."""
        m, r = self.setting.microbatches, self.setting.replicas
        if r == 1:
            return to_microbatches(x, m)
        rows = x.shape[0] // (m * r)
        return jnp.swapaxes(x.reshape((r, m, rows) + x.shape[1:]), 0, 1)

    def from_slices(self, x, shape):
        """``to_slices`` undone: [M, (R,) rows, ...] -> ``shape``."""
        if self.setting.replicas > 1:
            x = jnp.swapaxes(x, 0, 1)
        return x.reshape(shape)

    def stage_local(self, xs) -> list:
        """Inside the stage step (``vmap``-ed with ``spmd_axis_name``, which puts the stage
        dim on the stage axis): ``xs`` constrained to keep that dim there, others free."""
        free = PartitionSpec.UNCONSTRAINED
        return [lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, PartitionSpec(*[free] * jnp.ndim(x))))
            for x in xs]

    def stage_layers(self, x, length: int):
        """A stacked layer leaf ``[L, ...]`` as each stage's layers, stage dim first on the
        stage axis: ``[S, L / S, ...]`` (GPipe), or ``[S, V, L / (S V), ...]`` (circular:
        stage s's layers of repeat r are ``r S Lr + s Lr + j``)."""
        s, v = self.setting.stages, self.setting.repeats
        if v == 1:
            return self.constrain_stages(x.reshape((s, length // s) + x.shape[1:]))
        laps = x.reshape((v, s, length // (s * v)) + x.shape[1:])
        return self.constrain_stages(jnp.swapaxes(laps, 0, 1))

    def pipeline(self, eqn, ins) -> list:
        p = jax_compat.scan_params(eqn.params)
        micro = jax_compat.scan_params(self.micro_target.params)
        nc, ncarry, length = p.num_consts, p.num_carry, p.length
        s, m, v = self.setting.stages, self.setting.microbatches, self.setting.repeats
        consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        split = [a.aval.shape != b.aval.shape
                 for a, b in zip(eqn.invars, self.micro_target.invars)]

        r = self.setting.replicas
        lead = (m,) if r == 1 else (m, r)   # a microbatch's slices: one, or R replicas'
        # the microbatch travels with its batch-shaped constants (a mask); others stay put
        riding = [k for k in range(nc) if split[k]]
        fixed = [k for k in range(nc) if k not in riding]
        carried = [self.to_slices(c) if split[nc + k] else
                   jnp.broadcast_to(c, lead + jnp.shape(c)) for k, c in enumerate(init)]
        travel = carried + [self.to_slices(consts[k]) for k in riding]
        stage_xs = [self.stage_layers(x, length) for x in xs]
        if r > 1:
            # one copy of each stage's layers a replica, made before the loop: the
            # backward pass accumulates each replica's gradient on its own devices and
            # sums the copies once, after the loop (where a gradient of one copy read by
            # every replica would be reduced over them in every iteration)
            stage_xs = [self.constrain_stages(jnp.broadcast_to(x[:, None], (s, r) + x.shape[1:]),
                                              1) for x in stage_xs]

        def stage_step(state, stage_layers, repeat):
            """One stage's layers of its repeat on the microbatch it holds."""
            carry, ride = state[:ncarry], state[ncarry:]
            if v > 1:   # this repeat's layers of the stage's [V, Lr, ...]: a gather
                # indexing V alone (not a dynamic slice, whose zero starts on the layer's
                # own dims would keep them whole), so each layer keeps its split
                stage_layers = [jnp.take(x, repeat, axis=0, mode="clip")
                                for x in stage_layers]
            all_consts = [None] * nc
            for k, c in zip(riding, ride):
                all_consts[k] = c
            for k in fixed:
                all_consts[k] = consts[k]

            def layer(c, x):
                return jax_compat.eval_jaxpr(micro.body, micro.body_consts, *all_consts, *c,
                                             *x)
            layer = remat_layer(layer, self.remat)

            def one_layer(c, x):   # the stage's activations and weights stay on its devices
                return self.stage_local(layer(self.stage_local(c), self.stage_local(x))), None
            # unrolled: each layer's residuals go straight into the pipeline loop's stack
            # for the backward pass, not through a per-stage stack copied in and out of it
            final, _ = lax.scan(one_layer, list(carry), list(stage_layers), unroll=True)
            return list(final) + list(ride)

        # every stage holds a store of M microbatch slots, at first the microbatches, so
        # that inside the loop nothing but the buffer's shift crosses the stage axis: stage
        # 0 takes slot t mod M of its store, and each stage writes what the shift brought
        # it into its own store; stage 0's store keeps the last stage's results for their
        # next repeat, and after the loop holds the outputs
        store = [self.constrain_stages(jnp.broadcast_to(x, (s,) + x.shape), 2)
                 for x in travel]
        buffer = [self.constrain_stages(jnp.zeros((s,) + t.shape[1:], t.dtype), 1)
                  for t in travel]
        stage_ids = jnp.arange(s)
        run_stage = stage_step if r == 1 else jax.vmap(
            stage_step, in_axes=(0, 0, None), spmd_axis_name=self.setting.replica_axes)

        def step(loop, t):
            buffer, store = loop
            # constrained where read and written, so that the backward pass accumulates
            # their cotangents split over stages too
            entering = [lax.dynamic_index_in_dim(self.constrain_stages(q, 2), t % m, 1,
                                                 keepdims=False) for q in store]
            buffer = [self.constrain_stages(jnp.where(first_stage(stage_ids, b.ndim), e, b), 1)
                      for b, e in zip(buffer, entering)]
            repeats = jnp.clip((t - stage_ids) // m, 0, v - 1)
            done = jax.vmap(run_stage, spmd_axis_name=self.setting.axis)(
                buffer, stage_xs, repeats)
            shifted = [self.constrain_stages(stage_shift(self.constrain_stages(d, 1)), 1)
                       for d in done]
            # what left the last stage at pass t - S + 1 goes to its microbatch's slot;
            # before step S - 1 the idle result lands in slot 0, which microbatch 0 has
            # left and its first result overwrites: no select over the slots
            out_index = jnp.maximum(t - (s - 1), 0) % m
            store = [self.constrain_stages(lax.dynamic_update_slice_in_dim(
                self.constrain_stages(q, 2), d[:, None], out_index, 1), 2)
                for q, d in zip(store, shifted)]
            return (shifted, store), None

        (_, store), _ = lax.scan(step, (buffer, store), jnp.arange(self.setting.iterations))
        # stage 0's slots, as a masked sum over stages: its transpose broadcasts the
        # cotangent to every stage (where slicing one stage out would pad it, unsplit)
        outputs = [jnp.sum(jnp.where(first_stage(stage_ids, o.ndim), o,
                                     jnp.zeros((), o.dtype)), axis=0).astype(o.dtype)
                   for o in store[:ncarry]]
        finals = []
        for k, (c, out) in enumerate(zip(init, outputs)):
            if split[nc + k]:
                finals.append(self.from_slices(out, jnp.shape(c)))
            else:   # a per-slice accumulator (an auxiliary loss): their mean
                finals.append((c + jnp.mean(out - c, axis=tuple(range(len(lead)))))
                              .astype(out.dtype))
        return finals


def first_stage(stage_ids, ndim: int):
    return (stage_ids == 0).reshape((-1,) + (1,) * (ndim - 1))


def to_microbatches(x, m: int):
    """[B, ...] -> [M, B / M, ...]: microbatch i is rows i B/M .. (i+1) B/M - 1."""
    return x.reshape((m, x.shape[0] // m) + x.shape[1:])


def constraint_pins(graph, setting: Pipelining) -> dict:
    """Pins for the planner: each ``with_sharding_constraint`` the pipeline wrote (a stage
    dim on ``setting.axis``, wherever ``vmap`` put it, and a microbatch's slice dim on its
    replica axes; other dims free) keeps those dims there."""
    kept = {(setting.axis,)} | ({tuple(setting.replica_axes)} if setting.replicas > 1
                                else set())
    pins = {}
    for node in graph.nodes:
        sharding = node.params.get("sharding") if node.primitive == "sharding_constraint" \
            else None
        entries = [(e,) if isinstance(e, str) else tuple(e) if isinstance(e, tuple) else None
                   for e in (getattr(sharding, "spec", None) or ())]
        if (setting.axis,) not in entries:
            continue
        rank = len(graph.values[node.outputs[0]].shape)
        pins[node.id] = tuple(entries[d] if d < len(entries) and entries[d] in kept else None
                              for d in range(rank))
    return pins
