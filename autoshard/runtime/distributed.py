"""Multi-process runs on ``jax.distributed``: start-up, plan agreement, global inputs.

Every process runs the same program. Each one calls :func:`initialize` before JAX's
backend starts, plans the same function on the same global mesh (planning is
deterministic), and checks with :func:`plan` / :func:`check_same_plan` that every
process arrived at the same plan: the check goes through the coordination service's
key-value store with a timeout, so a process that traced a different program (another
batch size, another model) stops every process with an error naming the difference
instead of hanging in a collective of mismatched shapes.

Inputs are built per process from host data with :func:`put` (each process fills only
the shards its devices hold) or :func:`from_process_local` (each process passes only
its rows, see :func:`process_slice`); outputs stay global ``jax.Array`` s and
:func:`to_host` fetches them as numpy values on every process.

Example::

    from autoshard.runtime import distributed
    info = distributed.initialize()          # from AUTOSHARD_* variables, SLURM, ...
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    plan = distributed.plan(train_step, state, batch, mesh=mesh)
    state = distributed.put(state, plan.in_shardings[0])
    step = plan.jit()
    state, loss = step(state, distributed.put(batch, plan.in_shardings[1]))
    print(distributed.to_host(loss))

The launcher (``python -m autoshard.runtime.launch -n 2 --devices-per-process 4 -- CMD``) sets
the variables read here; on a cluster, one process per host, the coordinator comes from
the same variables or from SLURM / Open MPI through JAX's cluster detection.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autoshard.errors import DistributedError, PlanMismatchError
from autoshard.frontend import jax_compat, specs
from autoshard.planning.fingerprint import plan_hash
from autoshard.runtime.launch import (  # noqa: F401
    ENV_COORDINATOR_ADDRESS,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

KV_PREFIX = "autoshard"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the run."""

    process_id: int
    num_processes: int
    coordinator_address: str | None = None

    @property
    def is_primary(self) -> bool:
        return self.process_id == 0

    @property
    def is_distributed(self) -> bool:
        return self.num_processes > 1 or self.coordinator_address is not None


# -- start-up ---------------------------------------------------------------------------


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as e:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer") from e


def _backend_started() -> bool:
    return jax_compat.backends_started()


def detected_cluster() -> str | None:
    """The name of the cluster environment JAX detects (SLURM, Open MPI, ...), if any."""
    for env in jax_compat.cluster_env_types():
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return env.__name__
        except Exception:   # a probe that cannot run here is no cluster
            continue
    return None


def _set_cpu_device_count(devices_per_process: int) -> None:
    if _backend_started():
        have = jax.local_device_count()
        if jax.default_backend() == "cpu" and have != devices_per_process:
            raise DistributedError(
                f"JAX's backend already started with {have} local devices; set "
                f"{devices_per_process} devices per process before any JAX computation "
                "(call autoshard.runtime.distributed.initialize() first)")
        return
    jax.config.update("jax_num_cpu_devices", int(devices_per_process))


def process_info() -> ProcessInfo:
    """This process's id and the process count (1 process when not distributed)."""
    state = jax_compat.distributed_state()
    if state.client is None:
        return ProcessInfo(0, 1, None)
    return ProcessInfo(state.process_id, state.num_processes, state.coordinator_address)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, devices_per_process: int | None = None,
               local_device_ids: Sequence[int] | None = None, cpu_collectives: str = "gloo",
               timeout_s: int = 300, shutdown_timeout_s: int = 60) -> ProcessInfo:
    """Join the multi-process run this process belongs to, or run alone.

    Arguments left ``None`` come from ``AUTOSHARD_COORDINATOR_ADDRESS``,
    ``AUTOSHARD_NUM_PROCESSES``, ``AUTOSHARD_PROCESS_ID`` and
    ``AUTOSHARD_DEVICES_PER_PROCESS`` (set by ``python -m autoshard.runtime.launch``), then from
    the cluster JAX detects (SLURM, Open MPI, Cloud TPU). With none of them, the
    process runs alone and nothing is initialized. ``local_device_ids`` (or
    ``JAX_LOCAL_DEVICE_IDS``) picks the GPUs this process drives; under SLURM JAX
    otherwise gives each process the one GPU of its local rank. ``devices_per_process`` sets the
    number of simulated CPU devices (ignored by GPU and TPU backends); CPU collectives
    across processes use ``cpu_collectives`` (gloo over TCP). Call it before any JAX
    computation; calling it again returns the current state.

    Example::

        info = autoshard.runtime.distributed.initialize()   # under autoshard.runtime.launch or srun
        print(info.process_id, info.num_processes, jax.device_count())
    """
    if jax_compat.distributed_state().client is not None:
        return process_info()
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR_ADDRESS)
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if devices_per_process is None:
        devices_per_process = _env_int(ENV_DEVICES_PER_PROCESS)
    if devices_per_process is not None:
        _set_cpu_device_count(devices_per_process)
    if not _backend_started():
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)

    explicit = None not in (coordinator_address, num_processes, process_id)
    if not explicit and num_processes in (None, 1) and detected_cluster() is None:
        if coordinator_address is None:
            return ProcessInfo(0, 1, None)
    if _backend_started():
        raise DistributedError(
            "JAX's backend started before autoshard.runtime.distributed.initialize(); call it "
            "first, before any JAX computation")
    kwargs: dict[str, Any] = dict(initialization_timeout=int(timeout_s),
                                  shutdown_timeout_seconds=int(shutdown_timeout_s))
    if explicit:
        kwargs["cluster_detection_method"] = "deactivate"
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    except (ValueError, RuntimeError) as e:
        raise DistributedError(
            f"jax.distributed.initialize failed (coordinator {coordinator_address!r}, "
            f"{num_processes} processes, process id {process_id}): {e}") from e
    return process_info()


# -- agreement between processes ----------------------------------------------------------

class KeySequence:
    """Names the coordination service's keys. Every process makes the same calls in the
    same order, so the n-th call's key is the same on every process; a new run (a new
    coordination client) numbers from 0 again."""

    def __init__(self):
        self._client, self._calls = None, itertools.count()

    def key(self, client, *parts: str) -> str:
        if client is not self._client:
            self._client, self._calls = client, itertools.count()
        return "/".join((KV_PREFIX, *parts, str(next(self._calls))))


KEYS = KeySequence()    # this process's calls to exchange and barrier


def plan_description(plan) -> dict:
    """What processes compare: hash, fingerprint, mesh and each argument's shape and spec."""
    d = plan.to_dict()
    return {"hash": plan_hash(plan), "fingerprint": d["fingerprint"], "mesh": d["mesh"],
            "arguments": [[a["path"], a["shape"], a["dtype"], a["spec"]] for a in d["arguments"]],
            "outputs": d["outputs"]}


def _shape_str(shape) -> str:
    return str(tuple(shape))


def program_difference(mine: Mapping, theirs: Mapping, *, me: int, them: int) -> str | None:
    """How two processes' programs or meshes differ, in words; ``None`` when they agree.

    Example::

        program_difference(a, b, me=1, them=0)
        # "process 1 traced a different program: batch['inputs'] shape (4, 16) vs (8, 16)
        #  on process 0"
    """
    if mine["mesh"] != theirs["mesh"]:
        return (f"process {me} built a different mesh: "
                f"{dict(zip(mine['mesh']['axis_names'], mine['mesh']['shape']))} vs "
                f"{dict(zip(theirs['mesh']['axis_names'], theirs['mesh']['shape']))} "
                f"on process {them}")
    a_args = {a[0]: a for a in mine["arguments"]}
    b_args = {a[0]: a for a in theirs["arguments"]}
    only_a, only_b = sorted(set(a_args) - set(b_args)), sorted(set(b_args) - set(a_args))
    if only_a or only_b:
        return (f"process {me} traced a different program: arguments only on process {me}: "
                f"{only_a[:4]}, only on process {them}: {only_b[:4]}")
    for path, (_, shape, dtype, _) in a_args.items():
        _, other_shape, other_dtype, _ = b_args[path]
        if list(shape) != list(other_shape):
            return (f"process {me} traced a different program: {path} shape "
                    f"{_shape_str(shape)} vs {_shape_str(other_shape)} on process {them}")
        if dtype != other_dtype:
            return (f"process {me} traced a different program: {path} dtype {dtype} vs "
                    f"{other_dtype} on process {them}")
    if mine["fingerprint"] != theirs["fingerprint"]:
        return (f"process {me} traced a different program with the same argument shapes "
                f"(fingerprint {mine['fingerprint']} vs {theirs['fingerprint']} on process "
                f"{them}): the function itself differs")
    return None


def describe_difference(mine: Mapping, theirs: Mapping, *, me: int, them: int) -> str | None:
    """The first way two plan descriptions differ, in words; ``None`` when they agree."""
    if mine["hash"] == theirs["hash"]:
        return None
    difference = program_difference(mine, theirs, me=me, them=them)
    if difference:
        return difference
    b_args = {a[0]: a for a in theirs["arguments"]}
    for path, _, _, spec in mine["arguments"]:
        other = b_args[path][3]
        if spec != other:
            return (f"process {me} planned differently for the same program: {path} spec "
                    f"{specs.spec_str(specs_from_json(spec))} vs "
                    f"{specs.spec_str(specs_from_json(other))} on process {them}")
    if mine["outputs"] != theirs["outputs"]:
        return (f"process {me} planned different output specs for the same program than "
                f"process {them}")
    return (f"process {me} planned different internal constraints for the same program than "
            f"process {them} (plan hash {mine['hash']} vs {theirs['hash']})")


def specs_from_json(obj):
    return tuple(tuple(axes) for axes in obj)


def _client():
    return jax_compat.distributed_state().client


def exchange(name: str, value: str, *, timeout_s: float = 60.0) -> list[str]:
    """Publish ``value`` under ``name`` and return every process's value, by process id.

    Goes through the coordination service's key-value store, so it works before any
    collective and never hangs: a process that does not publish within ``timeout_s``
    raises ``DistributedError`` naming it. Every process must call it the same number
    of times (keys are numbered per call). Alone, returns ``[value]``.

    Example::

        hashes = exchange("plan", plan_hash(plan))
    """
    info = process_info()
    client = _client()
    if client is None or info.num_processes == 1:
        return [value]
    key = KEYS.key(client, name)
    client.key_value_set(f"{key}/{info.process_id}", value)
    values = []
    for pid in range(info.num_processes):
        if pid == info.process_id:
            values.append(value)
            continue
        try:
            values.append(client.blocking_key_value_get(f"{key}/{pid}", int(timeout_s * 1000)))
        except Exception as e:   # jax raises XlaRuntimeError on DEADLINE_EXCEEDED
            raise DistributedError(
                f"process {pid} did not publish {name!r} within {timeout_s:g} s (it may have "
                f"crashed or be stuck before reaching this point): {e}") from e
    return values


def _exchange_descriptions(result, timeout_s: float) -> list[dict]:
    mine = plan_description(result)
    described = [json.loads(v) for v in exchange("plan", json.dumps(mine), timeout_s=timeout_s)]
    problems = [d for pid, theirs in enumerate(described) if pid
                for d in [program_difference(theirs, described[0], me=pid, them=0)] if d]
    if problems:
        raise PlanMismatchError("; ".join(problems) +
                                f" (seen from process {process_info().process_id})")
    return described


def check_same_plan(plan, *, timeout_s: float = 60.0) -> str:
    """Check every process holds the same plan; returns the plan hash.

    Raises ``PlanMismatchError`` on every process when any two differ, naming the
    first difference (another batch shape, mesh, program or spec).

    Example::

        plan = autoshard.plan(train_step, state, batch, mesh=mesh)
        check_same_plan(plan)   # PlanMismatchError: process 1 traced a different program: ...
    """
    described = _exchange_descriptions(plan, timeout_s)
    problems = [d for pid, theirs in enumerate(described) if pid
                for d in [describe_difference(theirs, described[0], me=pid, them=0)] if d]
    if problems:
        raise PlanMismatchError("; ".join(problems) +
                                f" (seen from process {process_info().process_id})")
    return described[0]["hash"]


def agree_on_plan(result, fn, *args, timeout_s: float = 60.0):
    """Process 0's plan on every process, after checking all traced the same program.

    Mismatched programs or meshes raise ``PlanMismatchError`` on every process. Where
    the programs agree but the solver broke a tie between equally cheap plans
    differently, the other processes adopt process 0's plan (sent as JSON through the
    key-value store and bound to ``fn`` here), so every process compiles one program.

    Example::

        plan = agree_on_plan(autoshard.plan(fn, *args, mesh=mesh), fn, *args)
    """
    described = _exchange_descriptions(result, timeout_s)
    if all(d["hash"] == described[0]["hash"] for d in described):
        return result
    info = process_info()
    text = exchange("plan-json", result.to_json(indent=None) if info.is_primary else "",
                    timeout_s=timeout_s)[0]
    if described[info.process_id]["hash"] == described[0]["hash"]:
        return result
    from autoshard.planning.plan import Plan
    adopted = Plan.from_json(text, mesh=result.mesh).bind(fn, *args)
    if plan_hash(adopted) != described[0]["hash"]:
        raise PlanMismatchError(f"process {info.process_id} could not adopt process 0's plan "
                                f"(hash {plan_hash(adopted)} vs {described[0]['hash']})")
    import warnings
    warnings.warn(f"process {info.process_id} adopted process 0's plan: same program, but the "
                  f"solver chose another plan of equal cost (hash "
                  f"{described[info.process_id]['hash']} vs {described[0]['hash']})",
                  stacklevel=2)
    return adopted


def plan(fn, *args, mesh, timeout_s: float = 60.0, **plan_kwargs):
    """``autoshard.plan`` on every process, checked to agree across processes.

    Example::

        plan = autoshard.runtime.distributed.plan(train_step, state, batch, mesh=mesh)
    """
    from autoshard.planning.api import plan as make_plan
    result = make_plan(fn, *args, mesh=mesh, **plan_kwargs)
    return agree_on_plan(result, fn, *args, timeout_s=timeout_s)


def carried_pins(first_plan, argnum: int = 0, outnum: int = 0) -> dict:
    """Pins that give output ``outnum`` the specs argument ``argnum`` has in ``first_plan``.

    Keys are output paths (``"out[0]['params']['w']"``), values PartitionSpecs.
    """
    pins = {}
    indices = _arg_indices(first_plan, argnum)
    for key_path, index in jax.tree_util.tree_flatten_with_path(indices)[0]:
        pins[f"out[{outnum}]" + jax.tree_util.keystr(key_path)] = specs.to_partition_spec(
            first_plan.arguments[index].spec)
    return pins


def _arg_indices(result, argnum: int):
    """Argument ``argnum``'s pytree with each leaf replaced by its flat argument index."""
    tree = result.require_program("argument tree").in_tree
    return jax.tree_util.tree_unflatten(tree, list(range(len(result.arguments))))[argnum]


def _out_indices(result, outnum: int):
    tree = result.require_program("output tree").out_tree
    return jax.tree_util.tree_unflatten(tree, list(range(len(result.out_specs))))[outnum]


def carried_specs_agree(result, argnum: int = 0, outnum: int = 0) -> bool:
    """Whether output ``outnum`` leaves the plan with the specs argument ``argnum`` came in."""
    ins = _arg_indices(result, argnum)
    outs = _out_indices(result, outnum)
    if jax.tree_util.tree_structure(ins) != jax.tree_util.tree_structure(outs):
        return False
    return all(result.arguments[i].spec == result.out_specs[o]
               for i, o in zip(jax.tree_util.tree_leaves(ins), jax.tree_util.tree_leaves(outs)))


def plan_train_step(train_step, state, batch, *, mesh, timeout_s: float = 60.0,
                    **plan_kwargs):
    """Plan ``train_step(state, batch) -> (state, ...)`` so the state keeps its shardings.

    A loop feeds each step's state into the next, so the new state must come out with
    the shardings the old one went in with (across processes JAX refuses to reshard a
    mismatched argument implicitly). Plans once; where the state would come out laid
    out differently, plans again with the state outputs pinned to the chosen input
    specs. Every process ends up with process 0's plan (:func:`agree_on_plan`).
    ``plan_kwargs`` are ``autoshard.plan``'s, ``microbatches``, ``pipeline`` and ``remat``
    included.

    Example::

        plan = plan_train_step(case.train_step, case.state, case.make_batch(0), mesh=mesh)
        step = plan.jit(donate_argnums=(0,))
        staged = plan_train_step(step_fn, state, batch, mesh=mesh, pipeline="auto")
    """
    from autoshard.planning.api import plan as make_plan
    result = make_plan(train_step, state, batch, mesh=mesh, **plan_kwargs)
    if not carried_specs_agree(result):
        pins = dict(plan_kwargs.pop("pins", None) or {})
        pins.update(carried_pins(result))
        result = make_plan(train_step, state, batch, mesh=mesh, pins=pins, **plan_kwargs)
    return agree_on_plan(result, train_step, state, batch, timeout_s=timeout_s)


# -- global arrays from host data ---------------------------------------------------------


def _flat_shardings(treedef, shardings) -> list:
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * treedef.num_leaves
    return treedef.flatten_up_to(shardings)


def put(tree, shardings):
    """Global arrays from host values that every process holds in full.

    Each process copies only the slices its own devices hold
    (``jax.make_array_from_callback``). ``shardings`` is a pytree matching ``tree``
    (e.g. ``plan.in_shardings[0]``) or one sharding for every leaf.

    Example::

        state = put(state, plan.in_shardings[0])
    """
    def leaf(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef.unflatten([leaf(x, s) for x, s in
                              zip(leaves, _flat_shardings(treedef, shardings))])


def process_slice(sharding, global_shape: Sequence[int]) -> tuple[slice, ...]:
    """The block of a global array this process's devices hold, one slice per dim.

    A data loader reads ``global_batch[process_slice(sharding, shape)]`` and passes it to
    :func:`from_process_local`.

    Example::

        rows = process_slice(plan.in_shardings[1]["inputs"], (8, 16))  # (slice(0, 4), ...)
    """
    global_shape = tuple(int(d) for d in global_shape)
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    out = []
    for dim, size in enumerate(global_shape):
        starts = [idx[dim].indices(size)[0] for idx in indices]
        stops = [idx[dim].indices(size)[1] for idx in indices]
        out.append(slice(min(starts), max(stops)))
    return tuple(out)


def from_process_local(local_tree, shardings, global_shapes):
    """Global arrays from the block of each array this process holds.

    ``local_tree`` leaves are the blocks :func:`process_slice` names
    (``jax.make_array_from_process_local_data``).

    Example::

        local = {k: v[process_slice(s[k], v.shape)] for k, v in batch.items()}
        batch = from_process_local(local, s, {k: v.shape for k, v in batch.items()})
    """
    leaves, treedef = jax.tree_util.tree_flatten(local_tree)
    shapes = treedef.flatten_up_to(global_shapes)
    return treedef.unflatten([
        jax.make_array_from_process_local_data(s, np.asarray(x), tuple(shape))
        for x, s, shape in zip(leaves, _flat_shardings(treedef, shardings), shapes)])


def put_batch(batch, shardings):
    """A global batch from the full host batch, each process passing only its rows.

    Example::

        batch = put_batch(case.make_batch(step), plan.in_shardings[1])
    """
    def leaf(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(
            sharding, x[process_slice(sharding, x.shape)], x.shape)

    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef.unflatten([leaf(x, s) for x, s in
                              zip(leaves, _flat_shardings(treedef, shardings))])


def to_host(tree):
    """Numpy values of (possibly multi-process) global arrays, on every process.

    Fully replicated arrays are read from a local shard; others are gathered across
    processes (``multihost_utils.process_allgather``), a collective every process must
    join.

    Example::

        loss = float(to_host(loss))
    """
    def leaf(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree_util.tree_map(leaf, tree)


def barrier(name: str, *, timeout_s: float = 300.0) -> None:
    """Wait until every process reaches the barrier ``name`` (no-op when alone)."""
    client = _client()
    if client is None or process_info().num_processes == 1:
        return
    key = KEYS.key(client, "barrier", name)
    try:
        client.wait_at_barrier(key, int(timeout_s * 1000))
    except Exception as e:
        raise DistributedError(f"barrier {name!r} not reached by every process within "
                               f"{timeout_s:g} s: {e}") from e
