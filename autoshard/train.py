"""The training loop: run a (sharded) train step over a case's synthetic batches.

Example::

    case = autoshard.models.train_case("gpt", "tiny")
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh)
    losses = autoshard.train.run(case, plan.jit(), case.state, steps=20)
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from autoshard.models.case import TrainCase


def run(case: TrainCase, step_fn: Callable[[Any, Any], tuple[Any, jax.Array]], state: Any, *,
        steps: int, start_step: int = 0, log: Callable[[str], None] | None = print,
        shardings: Any = None) -> list[float]:
    """Run ``steps`` steps from ``start_step``; step ``i`` sees ``case.make_batch(i)``.

    ``step_fn(state, batch) -> (state, loss)`` (e.g. ``plan.jit()``); ``log`` gets one line
    per step (``None``: silent). ``shardings`` (e.g. ``plan.in_shardings``) places
    ``(state, batch)`` before every step: a plan may return the state sharded otherwise
    than it takes it, and a jitted step refuses arguments sharded unlike its
    ``in_shardings``. Returns the losses as floats; :func:`run_with_state` also returns
    the final state.
    """
    return run_with_state(case, step_fn, state, steps=steps, start_step=start_step,
                          log=log, shardings=shardings)[1]


def run_with_state(case: TrainCase, step_fn, state, *, steps: int, start_step: int = 0,
                   log: Callable[[str], None] | None = print,
                   shardings: Any = None) -> tuple[Any, list[float]]:
    """As :func:`run`, returning ``(final_state, losses)``."""
    losses = []
    for step in range(start_step, start_step + steps):
        args = (state, case.make_batch(step))
        if shardings is not None:
            args = jax.device_put(args, shardings)
        state, loss = step_fn(*args)
        losses.append(float(loss))
        if log is not None:
            log(f"step {step:>5}  loss {losses[-1]:.6f}")
    return state, losses
