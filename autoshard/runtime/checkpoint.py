"""Sharded checkpoints of a train state with orbax, restorable onto another mesh.

A checkpoint holds the state pytree (parameters, optimizer state, step counter) as the
plan placed it, each process writing the shards its devices hold, plus a small JSON
record: the step, the data position (the index of the next batch), the mesh and the
plan hash. Restoring reads into any target shardings, so a state saved on a 2x4 mesh
restores on 8 or 4 devices: plan for the new mesh and restore into that plan's
``in_shardings`` (:func:`abstract_state`).

Saves are atomic. Orbax writes step ``N`` into ``N.orbax-checkpoint-tmp`` and renames it
to ``N`` only once every process has finished writing; :meth:`Checkpointer.latest_step`
and :meth:`Checkpointer.restore` only see renamed (complete) steps, and leftovers of a
crashed save are deleted when the next :class:`Checkpointer` opens the directory.

Example::

    ckpt = Checkpointer("/tmp/run", max_to_keep=3)
    ckpt.save(5, state, data_position=5)
    ckpt.wait_until_finished()
    target = abstract_state(state_like, new_plan.in_shardings[0])
    state, record = ckpt.restore(ckpt.latest_step(), target)
    record["data_position"]   # 5
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from autoshard.errors import CheckpointError
from autoshard.extras import require

require("orbax.checkpoint", "checkpoint", "autoshard.runtime.checkpoint")

STATE_ITEM = "state"
RECORD_ITEM = "record"


def abstract_state(state, shardings=None):
    """``jax.ShapeDtypeStruct`` s with shardings: the target a checkpoint restores into.

    ``shardings`` is a pytree matching ``state`` (e.g. ``plan.in_shardings[0]``) or one
    sharding; ``None`` keeps the shardings of ``state``'s arrays.

    Example::

        target = abstract_state(case.state, plan.in_shardings[0])
    """
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if shardings is None:
        shard_leaves = [getattr(x, "sharding", None) for x in leaves]
    elif isinstance(shardings, jax.sharding.Sharding):
        shard_leaves = [shardings] * len(leaves)
    else:
        shard_leaves = treedef.flatten_up_to(shardings)
    return treedef.unflatten([
        jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)
        for x, s in zip(leaves, shard_leaves)])


class Checkpointer:
    """Sharded, atomic, numbered checkpoints of a train state in one directory.

    Every process of a multi-process run creates one on the same directory (a shared
    file system on a cluster) and calls ``save``/``restore`` together.

    Example::

        ckpt = Checkpointer(directory, max_to_keep=2)
        for step in range(steps):
            state, loss = step_fn(state, batch(step))
            if (step + 1) % 5 == 0:
                ckpt.save(step + 1, state, data_position=step + 1)
        ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 async_save: bool = True):
        import orbax.checkpoint as ocp

        from autoshard.frontend import validate
        validate.directory_path("checkpoint directory", directory, create=True)
        validate.optional_count("max_to_keep", max_to_keep)
        validate.flag("async_save", async_save)
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={STATE_ITEM: ocp.StandardCheckpointHandler(),
                           RECORD_ITEM: ocp.JsonCheckpointHandler()})

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, state, *, data_position: int | None = None,
             record: Mapping[str, Any] | None = None, plan=None) -> bool:
        """Start saving ``state`` as checkpoint ``step`` (asynchronously by default).

        ``data_position`` is the index of the next batch to consume (default ``step``);
        ``record`` holds extra JSON values; ``plan`` adds its hash and mesh. Returns
        whether a save started (False if ``step`` exists already).
        """
        import orbax.checkpoint as ocp

        from autoshard.frontend import validate
        step = step_number("step", step)
        if data_position is not None:
            step_number("data_position", data_position)
        if record is not None:
            validate.mapping("record", record, allow_empty=True)
        if not any(hasattr(x, "shape") for x in jax.tree_util.tree_leaves(state)):
            raise CheckpointError(f"save: the state holds no arrays, got {type(state).__name__}")
        if step in self.all_steps():
            return False
        position = step if data_position is None else int(data_position)
        meta = {"step": step, "data_position": position,
                "process_count": jax.process_count(), "device_count": jax.device_count()}
        if plan is not None:
            from autoshard.planning.fingerprint import plan_hash
            meta["plan_hash"] = plan_hash(plan)
            meta["mesh"] = {"axis_names": list(plan.mesh.axis_names),
                            "shape": [int(d) for d in plan.mesh.devices.shape]}
        meta.update(record or {})
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state),
                                     RECORD_ITEM: ocp.args.JsonSave(meta)})
        return bool(self._manager.save(step, args=args, force=True))

    def wait_until_finished(self) -> None:
        """Block until the save in flight is written and renamed into place."""
        self._manager.wait_until_finished()

    # -- reading --------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step; ``None`` when there is none."""
        step = self._manager.latest_step()
        return None if step is None else int(step)

    def record(self, step: int | None = None) -> dict:
        """The JSON record saved beside the state (step, data position, mesh, plan hash)."""
        import orbax.checkpoint as ocp
        step = self._existing(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            **{RECORD_ITEM: ocp.args.JsonRestore()}))
        return dict(restored[RECORD_ITEM])

    def restore(self, step: int | None, target) -> tuple[Any, dict]:
        """Read checkpoint ``step`` (``None``: the latest) into ``target``'s shardings.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings
        (:func:`abstract_state`) or of arrays whose shardings to reuse; it may lay the
        state out on any mesh. Returns ``(state, record)``.
        """
        import orbax.checkpoint as ocp
        step = self._existing(step)
        target = abstract_state(target) if _has_arrays(target) else target
        self._check_structure(step, target)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardRestore(target),
               RECORD_ITEM: ocp.args.JsonRestore()}))
        return restored[STATE_ITEM], dict(restored[RECORD_ITEM])

    def _existing(self, step: int | None) -> int:
        if step is not None:
            step = step_number("step", step)
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointError(f"no complete checkpoint of step {step} in {self.directory} "
                                  f"(complete: {steps})")
        return int(step)

    def _check_structure(self, step: int, target) -> None:
        saved = self._manager.item_metadata(step)
        saved_state = getattr(saved, STATE_ITEM, None) if saved is not None else None
        if saved_state is None:
            return
        saved_leaves = dict(_shapes_by_path(saved_state))
        wanted = dict(_shapes_by_path(target))
        missing = sorted(set(wanted) - set(saved_leaves))
        extra = sorted(set(saved_leaves) - set(wanted))
        if missing or extra:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} holds another state: missing "
                f"{missing[:4]}, unexpected {extra[:4]}")
        for path, shape in wanted.items():
            if saved_leaves[path] is not None and tuple(saved_leaves[path]) != tuple(shape):
                raise CheckpointError(
                    f"checkpoint {step}: {path} has shape {tuple(saved_leaves[path])}, the "
                    f"target wants {tuple(shape)}")

    def close(self) -> None:
        """Finish the save in flight and release the directory."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def step_number(name: str, value) -> int:
    """A checkpoint step (or data position): a non-negative int."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise CheckpointError(f"{name} must be a non-negative int, got "
                              f"{type(value).__name__} {value!r}")
    return int(value)


def _has_arrays(tree) -> bool:
    return any(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(tree))


def _shapes_by_path(tree):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield _path_str(path), getattr(leaf, "shape", None)


def _path_str(path) -> str:
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        parts.append(str(name))
    return "/".join(parts)


def restore_latest(ckpt: Checkpointer, state) -> tuple[Any, int | None]:
    """The latest complete checkpoint read into ``state``'s shardings, and its data position.

    ``state`` holds arrays placed as the step function wants them (or a target of
    :func:`abstract_state`). Returns ``(state, None)`` unchanged when there is no checkpoint.

    Example::

        state, position = restore_latest(ckpt, state)
        start = 0 if position is None else position
    """
    step = ckpt.latest_step()
    if step is None:
        return state, None
    restored, record = ckpt.restore(step, state)
    return restored, int(record.get("data_position", step))


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete checkpoint's step in ``directory``; ``None`` when there is none.

    Example::

        start = latest_step("/tmp/run") or 0
    """
    from autoshard.frontend import validate
    if not validate.as_path("checkpoint directory", directory).is_dir():
        return None
    import orbax.checkpoint as ocp
    manager = ocp.CheckpointManager(os.path.abspath(os.fspath(directory)),
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        step = manager.latest_step()
    finally:
        manager.close()
    return None if step is None else int(step)
