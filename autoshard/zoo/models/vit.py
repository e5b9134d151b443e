"""ViT: a vision transformer with a conv patch embedding and mean-pooled tokens.

Example::

    case = autoshard.zoo.models.train_case("vit", "tiny")
    state, loss = jax.jit(case.train_step)(*case.args)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from autoshard.zoo import experts as ex
from autoshard.zoo.models import common
from autoshard.zoo.models.case import TrainCase
from autoshard.zoo.models.mlp import class_batch
from autoshard.zoo.models.transformer import Block, norm, tp_rules, transformer_fan_in


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Sizes of the ViT (NHWC images, square patches) and its training run."""

    image: int = 16
    patch: int = 4
    in_channels: int = 3
    d_model: int = 64
    heads: int = 8
    layers: int = 2
    d_ff: int = 256
    classes: int = 16
    batch: int = 16
    lr: float = 1e-3

    @property
    def tokens(self) -> int:
        return (self.image // self.patch) ** 2


SIZES = {
    "tiny": ViTConfig(),
    "small": ViTConfig(image=32, patch=4, d_model=256, heads=8, layers=4, d_ff=1024,
                       batch=32),
    # ViT-B/16 (86e6 params) on 224x224 batches of 256.
    "large": ViTConfig(image=224, patch=16, d_model=768, heads=12, layers=12, d_ff=3072,
                       classes=1000, batch=256),
}


class ViT(nnx.Module):
    """Patchify conv, learned position embedding, pre-LN blocks, mean pool, head."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        p = cfg.patch
        self.patch_embed = nnx.Conv(cfg.in_channels, cfg.d_model, kernel_size=(p, p),
                                    strides=(p, p), padding="VALID", rngs=rngs)
        self.pos_embed = nnx.Param(jnp.zeros((cfg.tokens, cfg.d_model), jnp.float32))
        self.blocks = nnx.List([Block(cfg.d_model, cfg.heads, cfg.d_ff, norm_kind="layer",
                                      rngs=rngs) for _ in range(cfg.layers)])
        self.ln_f = norm("layer", cfg.d_model, False, rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patch_embed(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1]) + self.pos_embed[...]
        for block in self.blocks:
            x, _ = block(x)
        return self.head(jnp.mean(self.ln_f(x), axis=1))


def train_case(size: str = "tiny", *, abstract: bool = False, seed: int = 0,
               config: ViTConfig | None = None) -> TrainCase:
    """The ViT train step (adamw) of a named size."""
    cfg = config or SIZES[size]
    module = common.abstract_model(lambda rngs: ViT(cfg, rngs=rngs))
    return common.build_case(
        model="vit", size=size, module=module, tx=common.adamw(cfg.lr),
        loss_fn=common.classifier_loss,
        make=class_batch(cfg.batch, (cfg.image, cfg.image, cfg.in_channels), cfg.classes,
                         seed),
        experts=lambda state, batch: ex.standard_experts(state, batch, tp_rules=tp_rules()),
        # As gpt's (see gpt.lm_atol).
        atol=0.1 * cfg.lr, abstract=abstract, seed=seed, fan_in=transformer_fan_in)
