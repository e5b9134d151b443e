"""TrainCase: one zoo model's train step, its state, its data and its expert plans.

Every model in the zoo builds a ``TrainCase``; the CLI, the training loop, the
checkpoints, the plan-quality benchmark and the notebooks all consume this one shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec


@dataclasses.dataclass(frozen=True)
class TrainCase:
    """A train step ready to plan, run and compare.

    ``train_step(state, batch) -> (state, loss)`` is pure and jit-able; ``state`` is a
    pytree of arrays (or ``jax.ShapeDtypeStruct`` when ``abstract``) holding parameters,
    optimizer state and the step counter; ``make_batch(step)`` returns the synthetic batch
    of that step, deterministically (the data position of a run is its step index).
    ``experts`` maps a plan name ("data_parallel", "fsdp", "megatron", ...) to a function
    of the mesh returning the in_shardings pytree for ``(state, batch)``.

    ``annotations`` maps parameter paths to the logical axis names the model declared
    with ``nnx.with_partitioning``; ``axis_rules`` maps logical names to mesh axes or roles
    of :mod:`autoshard.zoo.experts` (``(("mlp", experts.MODEL), ("embed", None), ...)``).
    """

    model: str
    size: str
    train_step: Callable[[Any, Any], tuple[Any, jax.Array]]
    state: Any
    make_batch: Callable[[int], Any]
    experts: Mapping[str, Callable[[Mesh], Any]] = dataclasses.field(default_factory=dict)
    atol: float = 1e-6           # absolute tolerance beside rtol for numerics checks
    donate_argnums: tuple[int, ...] = (0,)
    abstract: bool = False
    rtol: float = 1e-5           # relative tolerance for numerics checks (wider for bf16)
    annotations: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    axis_rules: tuple = ()

    @property
    def name(self) -> str:
        return f"{self.model}/{self.size}"

    @property
    def args(self) -> tuple:
        """``(state, batch)`` of step 0: what to plan with."""
        return (self.state, self.make_batch(0))

    def abstract_args(self) -> tuple:
        """``args`` as ``jax.ShapeDtypeStruct`` pytrees."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.args)

    def annotation_pins(self, mesh: Mesh) -> dict[str, PartitionSpec]:
        """The model's sharding annotations as ``autoshard.plan`` pins on ``mesh``.

        Logical names map to mesh axes through ``axis_rules``; axes that do not divide a
        dim are dropped.  Example::

            plan = autoshard.plan(case.train_step, *case.args, mesh=mesh,
                                  pins=case.annotation_pins(mesh))
        """
        from autoshard.zoo.experts import fit_spec
        rules = dict(self.axis_rules)
        shapes = {p: x.shape for p, x in zip(_paths(self.state, "state"),
                                               jax.tree.leaves(self.state))}
        pins = {}
        for path, names in self.annotations.items():
            spec = PartitionSpec(*(rules.get(n) if n is not None else None for n in names))
            pins[path] = fit_spec(spec, shapes[path], mesh)
        return pins


def _paths(tree: Any, prefix: str) -> list[str]:
    return [prefix + jax.tree_util.keystr(k)
            for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
