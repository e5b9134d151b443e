"""ResNet: a ResNet-style conv net (basic blocks) with batch norm.

Batch norm runs in train mode: it normalises with the batch's statistics and updates the
running averages, which live in the state as ``state['batch_stats']`` (``nnx.BatchStat``)
and come back updated from every step.

Example::

    case = autoshard.zoo.models.train_case("resnet", "tiny")
    state, loss = jax.jit(case.train_step)(*case.args)
    state["batch_stats"]["stem_bn"]["mean"]                 # updated running mean
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


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Sizes of the ResNet (NHWC images) and its training run."""

    image: int = 16
    in_channels: int = 3
    widths: tuple = (8, 16)
    blocks: tuple = (1, 1)          # basic blocks per stage; stages after the first stride 2
    stem_stride: int = 1
    classes: int = 16
    batch: int = 16
    lr: float = 3e-3


SIZES = {
    "tiny": ResNetConfig(),
    "small": ResNetConfig(image=32, widths=(16, 32, 64), blocks=(2, 2, 2), batch=32),
    # ResNet-34 layout (21.8e6 params) on 224x224 ImageNet-sized batches of 256.
    "large": ResNetConfig(image=224, widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3),
                          stem_stride=4, classes=1000, batch=256),
}


def conv(c_in: int, c_out: int, kernel: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
    return nnx.Conv(c_in, c_out, kernel_size=(kernel, kernel), strides=(stride, stride),
                    padding="SAME", use_bias=False, rngs=rngs)


def batch_norm(c: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
    return nnx.BatchNorm(c, use_running_average=False, momentum=0.9, epsilon=1e-5, rngs=rngs)


class BasicBlock(nnx.Module):
    """``relu(x + bn(conv(relu(bn(conv(x))))))``; a strided 1x1 conv projects the residual
    when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, *, rngs: nnx.Rngs):
        self.conv1, self.bn1 = conv(c_in, c_out, 3, stride, rngs), batch_norm(c_out, rngs)
        self.conv2, self.bn2 = conv(c_out, c_out, 3, 1, rngs), batch_norm(c_out, rngs)
        if stride != 1 or c_in != c_out:
            self.proj, self.proj_bn = conv(c_in, c_out, 1, stride, rngs), batch_norm(c_out, rngs)
        else:
            self.proj = self.proj_bn = None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        residual = x if self.proj is None else self.proj_bn(self.proj(x))
        return jax.nn.relu(h + residual)


class ResNet(nnx.Module):
    """Stem conv + BN, stages of :class:`BasicBlock` s, global mean pool, dense head."""

    def __init__(self, cfg: ResNetConfig, *, rngs: nnx.Rngs):
        self.stem = conv(cfg.in_channels, cfg.widths[0], 3, cfg.stem_stride, rngs)
        self.stem_bn = batch_norm(cfg.widths[0], rngs)
        blocks, c_in = [], cfg.widths[0]
        for stage, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(c_in, width, stride, rngs=rngs))
                c_in = width
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(c_in, cfg.classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.stem_bn(self.stem(images)))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def train_case(size: str = "tiny", *, abstract: bool = False, seed: int = 0,
               config: ResNetConfig | None = None) -> TrainCase:
    """The ResNet train step (adamw, batch norm in train mode) of a named size."""
    cfg = config or SIZES[size]
    module = common.abstract_model(lambda rngs: ResNet(cfg, rngs=rngs))
    return common.build_case(
        model="resnet", size=size, module=module, tx=common.adamw(cfg.lr),
        loss_fn=common.classifier_loss,
        make=class_batch(cfg.batch, (cfg.image, cfg.image, cfg.in_channels), cfg.classes,
                         seed),
        experts=lambda state, batch: ex.standard_experts(state, batch),
        # Kernel gradients sum over batch x pixels and batch statistics over the batch;
        # Adam's first step bounds their reordering noise to ~0.1 lr (see gpt.lm_atol).
        atol=0.1 * cfg.lr, abstract=abstract, seed=seed)
