"""accumulate: gradient accumulation over microbatches, written into the program before tracing.

``autoshard.value_and_grad`` is ``jax.value_and_grad`` with a mark: when ``autoshard.plan``
traces a program with ``microbatches=K``, the marked loss runs as a ``lax.scan`` over K
microbatches instead, and the planner plans that loop like any other. Which K (and which
pipeline and remat policy) is ``settings.py``'s search; this module is the rewrite.

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
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autoshard.errors import InputError
from autoshard.frontend import jax_compat
from autoshard.rewrite.pipeline import Pipelining, pipelined
from autoshard.rewrite.traces import Traces


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

    # per marked loss, its batch's rows (None: it takes no batch argument)
    batch_sizes: list[int | None] = dataclasses.field(default_factory=list)
    stack_layers: list[int] = dataclasses.field(default_factory=list)   # pipelined stacks


_SETTING: contextvars.ContextVar = contextvars.ContextVar("autoshard_microbatching",
                                                         default=None)
_RECORD: contextvars.ContextVar = contextvars.ContextVar("autoshard_trace_record",
                                                        default=None)
_MESH: contextvars.ContextVar = contextvars.ContextVar("autoshard_mesh", default=None)
_TRACES: contextvars.ContextVar = contextvars.ContextVar("autoshard_traces", default=None)


@contextlib.contextmanager
def microbatching(setting: Microbatching | None, record: TraceRecord | None = None,
                  mesh=None, traces: Traces | None = None):
    """Marked losses traced inside run as ``setting`` says (``None``: as written), a
    pipeline's stages on ``mesh``, their jaxprs kept in ``traces`` for the next setting."""
    variables = (_SETTING, _RECORD, _MESH, _TRACES)
    tokens = [var.set(value) for var, value in zip(variables, (setting, record, mesh, traces))]
    try:
        yield
    finally:
        for var, token in zip(variables, tokens):
            var.reset(token)


def active_setting() -> Microbatching | None:
    """The setting the program being planned is rewritten under (None: as written)."""
    return _SETTING.get()


def active_pipeline() -> Pipelining | None:
    """The pipeline the program being planned is rewritten into, if any."""
    setting = active_setting()
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
        traces = _TRACES.get()
        if traces is None:
            return rewritten(*args, **kwargs)
        return traces.marked_call(functools.partial(rewritten, **kwargs), args)

    def rewritten(*args, **kwargs):
        """The marked loss's value and gradient under the setting in force."""
        setting, record = _SETTING.get(), _RECORD.get()
        if record is not None:
            record.batch_sizes.append(batch_size(args, argnums))
        if setting is not None and (setting.pipeline is not None or setting.remat):
            staged = pipelined(fun, setting.pipeline, _MESH.get(),
                               lambda a: batch_size(a, argnums),
                               None if record is None else record.stack_layers.append,
                               setting.remat, _argnums(argnums), _TRACES.get())
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

    microbatch, (value_shape, _) = traced_once(
        jax.vmap(grad_fn), broadcast, jax.tree.map(lambda x: x[0], xs))

    def step(carry, batch_slices):
        grads_acc, value_acc = carry
        value, grads = microbatch(broadcast, batch_slices)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        value_acc = jax.tree.map(jnp.add, value_acc, value)   # per replica: no reduction
        return (grads_acc, value_acc), None

    value_zeros = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), value_shape)
    (grads_acc, value_acc), _ = lax.scan(step, (zeros, value_zeros), xs, length=k)
    count = k * r
    grads = [jax.tree.map(lambda g: (jnp.sum(g, axis=0) / count).astype(g.dtype), g_tree)
             for g_tree in grads_acc]
    value = jax.tree.map(lambda v: (jnp.sum(v, axis=0) / count).astype(v.dtype), value_acc)
    grads = grads[0] if isinstance(argnums, int) else tuple(grads)
    return value, grads


def traced_once(fn: Callable, *args) -> tuple[Callable, object]:
    """``fn`` traced once at ``args``: a function replaying its jaxpr on arguments shaped
    alike, and the shapes of its results. The loop's body needs its carry's shapes before
    it is traced; tracing the loss again for them doubles the cost of tracing it (the
    layers' Python and their autodiff)."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr, consts = jax_compat.split_closed(closed)
    out_tree = jax.tree.structure(shapes)

    def replay(*like):
        return jax.tree.unflatten(
            out_tree, jax_compat.eval_jaxpr(jaxpr, consts, *jax.tree.leaves(like)))
    return replay, shapes


def to_microbatches(x, k: int, r: int):
    """[B, ...] -> [K, R, B / (K R), ...]: rows of replica r stay where a split of the
    batch over R places them."""
    b = x.shape[0] // (k * r)
    return jnp.swapaxes(x.reshape((r, k, b) + x.shape[1:]), 0, 1)

