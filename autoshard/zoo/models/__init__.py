"""The model zoo: Flax nnx models with adamw train steps, synthetic data and expert plans.

Each model has sizes ``tiny`` (tests: seconds on CPU), ``small`` (plannable and compilable
on 8 simulated CPU devices in well under a minute) and ``large`` (realistic; plan it from
abstract args). Mixed precision (bf16 compute over f32 master weights) is a size suffix:
``gpt`` ``tiny_bf16``, ``moe`` ``tiny_bf16``.

Example::

    import autoshard
    from autoshard.zoo import models

    models.names()                        # ['gpt', 'gpt_scan', 'mlp', 'moe', 'resnet', 'vit']
    case = models.train_case("gpt", "tiny")
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh)
    state, loss = plan.jit()(*case.args)
    big = models.train_case("gpt", "large", abstract=True)   # ShapeDtypeStructs only
"""

from __future__ import annotations

import dataclasses
import importlib

from autoshard.errors import UnknownModelError
from autoshard.extras import require

require("flax", "zoo", "autoshard.zoo.models")
require("optax", "zoo", "autoshard.zoo.models")

from autoshard.zoo.models.case import TrainCase  # noqa: E402  (after the extras check)

__all__ = ["Model", "TrainCase", "UnknownModelError", "get", "names", "train_case"]


@dataclasses.dataclass(frozen=True)
class Model:
    """A zoo entry: its module (model class, config dataclass, ``SIZES``) and builder."""

    name: str
    module_name: str
    options: tuple = ()       # keyword arguments for the module's train_case

    @property
    def module(self):
        return importlib.import_module(f"autoshard.zoo.models.{self.module_name}")

    @property
    def sizes(self) -> dict:
        """Size name -> config dataclass."""
        return dict(self.module.SIZES)

    def train_case(self, size: str = "tiny", *, abstract: bool = False,
                   seed: int = 0) -> TrainCase:
        if size not in self.sizes:
            raise UnknownModelError(f"model {self.name!r} has no size {size!r}; sizes: "
                                    f"{', '.join(self.sizes)}")
        return self.module.train_case(size, abstract=abstract, seed=seed, **dict(self.options))


_MODELS = {m.name: m for m in [
    Model("mlp", "mlp"),
    Model("gpt", "gpt"),
    Model("gpt_scan", "gpt", (("scan_layers", True),)),
    Model("moe", "moe"),
    Model("resnet", "resnet"),
    Model("vit", "vit"),
]}


def names() -> list[str]:
    """The zoo's model names, sorted."""
    return sorted(_MODELS)


def get(name: str) -> Model:
    """The zoo entry called ``name``; an unknown name raises :class:`UnknownModelError`.

    Example::

        models.get("gpt").sizes["small"].d_model    # 256
    """
    if name not in _MODELS:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(names())}")
    return _MODELS[name]


def train_case(name: str, size: str = "tiny", *, abstract: bool = False,
               seed: int = 0) -> TrainCase:
    """Build the :class:`TrainCase` of model ``name`` at ``size``.

    ``abstract=True`` gives ``jax.ShapeDtypeStruct`` state and batches (nothing allocated:
    plan and compile, do not run). ``seed`` fixes the initial params and the data.

    Example::

        case = train_case("moe", "tiny")
        state, loss = jax.jit(case.train_step)(*case.args)
    """
    return get(name).train_case(size, abstract=abstract, seed=seed)
