"""MoE: the GPT with every block's MLP replaced by top-k routed experts.

Routing (GShard / Switch style) is per sequence: each token picks its ``top_k`` experts
(gates renormalised over the k picks when k > 1); the tokens of a sequence fill each
expert's ``capacity = ceil(capacity_factor * top_k * seq / experts)`` slots first-choices
first, in token order, and overflowing picks are dropped. Dispatch and combine are one-hot
einsums, so an expert-parallel plan makes XLA move tokens with all-to-all. The loss adds
``aux_weight`` times the Switch load-balancing loss ``experts * sum_e f_e * P_e``.

Expert weights are stacked with a leading expert dim:
``state['params']['blocks'][i]['mlp']['wi']['kernel']`` is ``[experts, d_model, d_ff]``.

Example::

    case = autoshard.zoo.models.train_case("moe", "tiny")       # top-2; "tiny_top1": top-1
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from autoshard.zoo import experts as ex
from autoshard.zoo.models import common
from autoshard.zoo.models.case import TrainCase
from autoshard.zoo.models.gpt import GPT, GPTConfig, lm_atol, lm_batch, lm_loss, lm_rtol
from autoshard.zoo.models.transformer import (
    LOGICAL_RULES,
    normal_init,
    tp_rules,
    transformer_fan_in,
    zeros_init,
)


@dataclasses.dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """A :class:`GPTConfig` plus the expert layer's options."""

    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_weight: float = 0.01

    def capacity(self) -> int:
        return max(1, math.ceil(self.capacity_factor * self.top_k * self.seq / self.experts))


SIZES = {
    "tiny": MoEConfig(),
    "tiny_top1": MoEConfig(top_k=1, capacity_factor=1.5),
    "tiny_bf16": MoEConfig(dtype="bfloat16"),
    "small": MoEConfig(vocab=1024, seq=64, d_model=256, heads=8, layers=4, d_ff=512,
                       batch=16),
    # 16 experts x 12 layers: 1.7e9 params, ~0.3e9 active per token; bf16 compute.
    "large": MoEConfig(vocab=32000, seq=1024, d_model=1024, heads=16, layers=12, d_ff=4096,
                       batch=16, experts=16, dtype="bfloat16", lr=3e-4),
}


class ExpertLinear(nnx.Module):
    """``experts`` independent dense layers: ``kernel[E, d_in, d_out]``, ``bias[E, d_out]``."""

    def __init__(self, experts: int, d_in: int, d_out: int, names: tuple | None,
                 *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(normal_init(names)(rngs.params(), (experts, d_in, d_out)))
        self.bias = nnx.Param(zeros_init(names and (names[0], names[2]))(
            rngs.params(), (experts, d_out)))


class MoEMLP(nnx.Module):
    """Router + expert GELU MLPs; ``__call__(x[b, s, d]) -> (y, load_balancing_loss)``."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        names = (lambda *n: n) if cfg.annotate else (lambda *n: None)
        self.router = nnx.Linear(cfg.d_model, cfg.experts, use_bias=False, rngs=rngs,
                                 kernel_init=normal_init(names("embed", None)))
        self.wi = ExpertLinear(cfg.experts, cfg.d_model, cfg.d_ff,
                               names("expert", "embed", "mlp"), rngs=rngs)
        self.wo = ExpertLinear(cfg.experts, cfg.d_ff, cfg.d_model,
                               names("expert", "mlp", "embed"), rngs=rngs)

    def route(self, probs: jax.Array):
        """``dispatch, combine [b, s, E, C]`` and the top-1 mask ``[b, s, E]``."""
        cfg = self.cfg
        b, s, e = probs.shape
        k, capacity = cfg.top_k, cfg.capacity()
        gates, index = jax.lax.top_k(probs, k)                        # [b, s, k]
        if k > 1:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        picks = jax.nn.one_hot(index, e, dtype=jnp.float32)           # [b, s, k, E]
        # First choices of every token take slots before second choices.
        ordered = picks.transpose(0, 2, 1, 3).reshape(b, k * s, e)
        position = (jnp.cumsum(ordered, axis=1) - 1.0) * ordered
        kept = ordered * (position < capacity)
        slot = jax.nn.one_hot(jnp.sum(position * kept, axis=-1).astype(jnp.int32), capacity,
                              dtype=jnp.float32)                      # [b, k*s, C]
        kept = kept.reshape(b, k, s, e)
        slot = slot.reshape(b, k, s, capacity)
        dispatch = jnp.einsum("bkse,bksc->bsec", kept, slot)
        combine = jnp.einsum("bkse,bksc,bsk->bsec", kept, slot, gates)
        return dispatch, combine, picks[:, :, 0, :]

    def __call__(self, x: jax.Array):
        cfg = self.cfg
        dtype = cfg.compute_dtype
        probs = jax.nn.softmax(self.router(x.astype(jnp.float32)), axis=-1)
        dispatch, combine, top1 = self.route(probs)
        expert_in = jnp.einsum("bsec,bsd->ebcd", dispatch.astype(dtype), x.astype(dtype))
        h = jnp.einsum("ebcd,edf->ebcf", expert_in, self.wi.kernel[...].astype(dtype))
        h = jax.nn.gelu(h + self.wi.bias[...].astype(dtype)[:, None, None, :])
        out = jnp.einsum("ebcf,efd->ebcd", h, self.wo.kernel[...].astype(dtype))
        out = out + self.wo.bias[...].astype(dtype)[:, None, None, :]
        y = jnp.einsum("bsec,ebcd->bsd", combine.astype(dtype), out)
        fraction_routed = jnp.mean(top1, axis=(0, 1))
        mean_prob = jnp.mean(probs, axis=(0, 1))
        return y, cfg.experts * jnp.sum(fraction_routed * mean_prob)


class MoE(GPT):
    """The :class:`GPT` with :class:`MoEMLP` blocks."""

    def make_mlp(self, rngs: nnx.Rngs) -> nnx.Module:
        return MoEMLP(self.cfg, rngs=rngs)


EXPERT_RULES = [(r"\['mlp'\]\['(wi|wo)'\]", P(ex.MODEL))]
"""Expert parallel: expert-stacked weights split on the expert dim."""


def moe_tp_rules(layer_dims: int = 0) -> list:
    """Megatron inside each expert: ``wi`` column-, ``wo`` row-parallel on ``d_ff``."""
    lead = (None,) * layer_dims
    return [
        (r"\['mlp'\]\['wi'\]\['kernel'\]", P(*lead, None, None, ex.MODEL)),
        (r"\['mlp'\]\['wi'\]\['bias'\]", P(*lead, None, ex.MODEL)),
        (r"\['mlp'\]\['wo'\]\['kernel'\]", P(*lead, None, ex.MODEL, None)),
    ] + tp_rules(layer_dims)


def train_case(size: str = "tiny", *, abstract: bool = False, seed: int = 0,
               config: MoEConfig | None = None) -> TrainCase:
    """The MoE train step (adamw) of a named size."""
    cfg = config or SIZES[size]
    module = common.abstract_model(lambda rngs: MoE(cfg, rngs=rngs))
    return common.build_case(
        model="moe", size=size, module=module, tx=common.adamw(cfg.lr),
        loss_fn=lm_loss(cfg.aux_weight), make=lm_batch(cfg, seed),
        experts=lambda state, batch: ex.standard_experts(
            state, batch, tp_rules=moe_tp_rules(), expert_rules=EXPERT_RULES),
        # As gpt's; routing is a top-k, so a near-tie of router probabilities (< ~1e-6
        # apart; none in the synthetic data) would send a token elsewhere.
        atol=lm_atol(cfg), rtol=lm_rtol(cfg), abstract=abstract, seed=seed,
        fan_in=transformer_fan_in,
        annotations=common.logical_annotations(module) if cfg.annotate else None,
        axis_rules=LOGICAL_RULES)
