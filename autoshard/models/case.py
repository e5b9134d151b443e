"""TrainCase: one zoo model's train step, its state, its data and its expert plans.

Every model in the zoo builds a ``TrainCase``; the CLI, the training loop, the
checkpoints, the plan-quality benchmark and the notebooks all consume this one shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class TrainCase:
    """A train step ready to plan, run and compare.

    ``train_step(state, batch) -> (state, loss)`` is pure and jit-able; ``state`` is a
    pytree of arrays (or ``jax.ShapeDtypeStruct`` when ``abstract``) holding parameters,
    optimizer state and the step counter; ``make_batch(step)`` returns the synthetic batch
    of that step, deterministically (the data position of a run is its step index).
    ``experts`` maps a plan name ("data_parallel", "fsdp", "megatron", ...) to a function
    of the mesh returning the in_shardings pytree for ``(state, batch)``.
    """

    model: str
    size: str
    train_step: Callable[[Any, Any], tuple[Any, jax.Array]]
    state: Any
    make_batch: Callable[[int], Any]
    experts: Mapping[str, Callable[[Mesh], Any]] = dataclasses.field(default_factory=dict)
    atol: float = 1e-6           # absolute tolerance beside rtol 1e-5 for numerics checks
    donate_argnums: tuple[int, ...] = (0,)
    abstract: bool = False

    @property
    def name(self) -> str:
        return f"{self.model}/{self.size}"

    @property
    def args(self) -> tuple:
        """``(state, batch)`` of step 0: what to plan with."""
        return (self.state, self.make_batch(0))
