"""MLP: a deep ReLU MLP classifier.

Example::

    case = autoshard.zoo.models.train_case("mlp", "tiny")
    state, loss = jax.jit(case.train_step)(*case.args)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from autoshard.zoo import experts as ex
from autoshard.zoo.models import common
from autoshard.zoo.models.case import TrainCase


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of the MLP and its training run."""

    d_in: int = 64
    d_hidden: int = 128
    classes: int = 16
    depth: int = 4              # hidden layers
    batch: int = 32
    lr: float = 1e-3


SIZES = {
    "tiny": MLPConfig(),
    "small": MLPConfig(d_in=256, d_hidden=1024, classes=64, depth=8, batch=64),
    # 16 x 8192^2: 1.1e9 params.
    "large": MLPConfig(d_in=8192, d_hidden=8192, classes=1024, depth=16, batch=1024,
                       lr=3e-4),
}


class MLP(nnx.Module):
    """``depth`` ReLU hidden layers, then a linear classifier ``out``."""

    def __init__(self, cfg: MLPConfig, *, rngs: nnx.Rngs):
        widths = [cfg.d_in] + [cfg.d_hidden] * cfg.depth
        self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                for a, b in zip(widths[:-1], widths[1:])])
        self.out = nnx.Linear(cfg.d_hidden, cfg.classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.hidden:
            x = jax.nn.relu(layer(x))
        return self.out(x)


def class_batch(cfg_batch: int, shape: tuple, classes: int, seed: int, noise: float = 1.0):
    """``make(key) -> {'x', 'y'}``: ``x = prototype[y] + noise * N(0, 1)`` with fixed random
    class prototypes, so the classes are learnable from the first steps. Image prototypes
    (``shape`` of rank 3, HWC) also carry a per-class colour shared by all pixels, which
    survives global pooling."""

    def make(key):
        k_proto, k_colour = jax.random.split(jax.random.key(seed + 104729))
        prototypes = jax.random.normal(k_proto, (classes, *shape))
        if len(shape) == 3:
            prototypes = prototypes + jax.random.normal(k_colour, (classes, 1, 1, shape[-1]))
        k_y, k_x = jax.random.split(key)
        y = jax.random.randint(k_y, (cfg_batch,), 0, classes)
        x = prototypes[y] + noise * jax.random.normal(k_x, (cfg_batch, *shape))
        return {"x": x.astype(jnp.float32), "y": y.astype(jnp.int32)}

    return make


# Megatron for an MLP: alternate column- and row-parallel layers, so each pair needs one
# all-reduce (even layers split their output features, odd layers their input features).
def tp_rules(cfg: MLPConfig) -> list:
    rules = []
    for i in range(cfg.depth):
        column = i % 2 == 0
        rules.append((rf"\['hidden'\]\[{i}\]\['kernel'\]", P(None, ex.MODEL) if column
                      else P(ex.MODEL, None)))
        rules.append((rf"\['hidden'\]\[{i}\]\['bias'\]", P(ex.MODEL) if column else P()))
    last_column = (cfg.depth - 1) % 2 == 0
    rules.append((r"\['out'\]\['kernel'\]", P(ex.MODEL, None) if last_column else P()))
    return rules


def train_case(size: str = "tiny", *, abstract: bool = False, seed: int = 0,
               config: MLPConfig | None = None) -> TrainCase:
    """The MLP train step (adamw) of a named size."""
    cfg = config or SIZES[size]
    module = common.abstract_model(lambda rngs: MLP(cfg, rngs=rngs))
    return common.build_case(
        model="mlp", size=size, module=module, tx=common.adamw(cfg.lr),
        loss_fn=common.classifier_loss,
        make=class_batch(cfg.batch, (cfg.d_in,), cfg.classes, seed),
        experts=lambda state, batch: ex.standard_experts(state, batch, tp_rules(cfg)),
        # Adam's first step bounds reduction-order noise to ~0.1 lr (see gpt.lm_atol).
        atol=0.1 * cfg.lr, abstract=abstract, seed=seed)
