"""The training loop: run a (sharded) train step over a case's synthetic batches.

Example::

    case = autoshard.zoo.models.train_case("gpt", "tiny")
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh)
    losses = autoshard.runtime.train.run(case, plan.jit(), case.state, steps=20)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from autoshard.zoo.models.case import TrainCase


def run(case: TrainCase, step_fn: Callable[[Any, Any], tuple[Any, jax.Array]], state: Any, *,
        steps: int, start_step: int = 0, log: Callable[[str], None] | None = print,
        shardings: Any = None, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
        resume: bool = False) -> list[float]:
    """Run ``steps`` steps from ``start_step``; step ``i`` sees ``case.make_batch(i)``.

    ``step_fn(state, batch) -> (state, loss)`` (e.g. ``plan.jit()``); ``log`` gets one line
    per step (``None``: silent). ``shardings`` (e.g. ``plan.in_shardings``) places
    ``(state, batch)`` before every step: a plan may return the state sharded otherwise
    than it takes it, and a jitted step refuses arguments sharded unlike its
    ``in_shardings``. Returns the losses as floats; :func:`run_with_state` also returns
    the final state.

    With ``checkpoint_dir``, the state is saved there (sharded, atomically) after every
    ``checkpoint_every`` steps, with the index of the next batch; ``resume`` continues
    from the latest complete checkpoint, restored into the shardings of ``state`` (or of
    ``shardings[0]``), up to the same last step ``start_step + steps - 1``; the losses
    returned are those of the steps run.
    """
    return run_with_state(case, step_fn, state, steps=steps, start_step=start_step,
                          log=log, shardings=shardings, checkpoint_dir=checkpoint_dir,
                          checkpoint_every=checkpoint_every, resume=resume)[1]


def run_with_state(case: TrainCase, step_fn, state, *, steps: int, start_step: int = 0,
                   log: Callable[[str], None] | None = print,
                   shardings: Any = None, checkpoint_dir: str | None = None,
                   checkpoint_every: int = 0, resume: bool = False) -> tuple[Any, list[float]]:
    """As :func:`run`, returning ``(final_state, losses)``."""
    end_step = start_step + steps
    ckpt = None
    if checkpoint_dir is not None:
        from autoshard.runtime.checkpoint import Checkpointer, abstract_state, restore_latest
        ckpt = Checkpointer(checkpoint_dir)
        if resume:
            target = abstract_state(state, None if shardings is None else shardings[0])
            restored, position = restore_latest(ckpt, target)
            if position is not None:
                state, start_step = restored, position
                if log is not None:
                    log(f"resumed from checkpoint {ckpt.latest_step()} (next step {position})")
    try:
        state, losses = _steps(case, step_fn, state, start_step, end_step, log, shardings,
                               ckpt, checkpoint_every)
    finally:
        if ckpt is not None:
            ckpt.close()
    return state, losses


def _steps(case, step_fn, state, start_step, end_step, log, shardings, ckpt, checkpoint_every):
    losses = []
    for step in range(start_step, end_step):
        args = (state, case.make_batch(step))
        if shardings is not None:
            args = jax.device_put(args, shardings)
        state, loss = step_fn(*args)
        losses.append(float(loss))
        if log is not None:
            log(f"step {step:>5}  loss {losses[-1]:.6f}")
        if ckpt is not None and checkpoint_every and (step + 1) % checkpoint_every == 0:
            ckpt.save(step + 1, state, data_position=step + 1)
    return state, losses
