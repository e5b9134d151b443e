"""GPT: a decoder-only transformer LM (causal attention, RMSNorm or LayerNorm, GELU MLP).

Variants by config: ``tie_embeddings`` (the head reuses the embedding table),
``scan_layers`` (the blocks' params stacked on a leading ``layers`` dim by ``nnx.vmap``
and applied with ``jax.lax.scan``; registered as model ``gpt_scan``) and ``dtype``
(``"bfloat16"``: bf16 compute over f32 master weights; sizes ending ``_bf16``).

Parameters carry Flax sharding annotations (Megatron layout, see
``transformer.LOGICAL_RULES``): ``autoshard zoo gpt --respect-annotations`` pins them.

Example::

    case = autoshard.zoo.models.train_case("gpt", "tiny")
    state, loss = jax.jit(case.train_step)(*case.args)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from autoshard.zoo import experts as ex
from autoshard.zoo.models import common
from autoshard.zoo.models.case import TrainCase
from autoshard.zoo.models.transformer import (
    LOGICAL_RULES,
    Block,
    norm,
    normal_init,
    tp_rules,
    transformer_fan_in,
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes and options of a GPT and its training run."""

    vocab: int = 128
    seq: int = 16
    d_model: int = 64
    heads: int = 8
    layers: int = 2
    d_ff: int = 256
    batch: int = 8
    norm: str = "rms"               # "rms" or "layer"
    tie_embeddings: bool = False
    scan_layers: bool = False
    dtype: str = "float32"          # compute dtype; params stay f32 ("bfloat16": mixed)
    lr: float = 1e-3
    annotate: bool = True           # nnx.with_partitioning metadata on params

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def param_count(self) -> int:
        d, block = self.d_model, 4 * self.d_model ** 2 + 2 * self.d_model * self.d_ff
        head = 0 if self.tie_embeddings else d * self.vocab
        return self.vocab * d + self.seq * d + self.layers * block + head


SIZES = {
    "tiny": GPTConfig(),
    "tiny_bf16": GPTConfig(dtype="bfloat16"),
    "tiny_tied": GPTConfig(tie_embeddings=True, norm="layer"),
    "small": GPTConfig(vocab=1024, seq=64, d_model=256, heads=8, layers=4, d_ff=1024,
                       batch=16),
    "small_bf16": GPTConfig(vocab=1024, seq=64, d_model=256, heads=8, layers=4, d_ff=1024,
                            batch=16, dtype="bfloat16"),
    # ~1.0e9 params (GPT-2 XL-like width, 16 layers), bf16 compute over f32 master weights.
    "large": GPTConfig(vocab=32000, seq=1024, d_model=2048, heads=16, layers=16, d_ff=8192,
                       batch=16, dtype="bfloat16", lr=3e-4),
}


class GPT(nnx.Module):
    """Token + position embeddings, ``layers`` pre-norm causal blocks, final norm, head.

    ``__call__(tokens) -> (logits, aux_loss)``; ``aux_loss`` is the blocks' MLP auxiliary
    loss (0 for dense MLPs), averaged over layers.
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        names = (lambda *n: n) if cfg.annotate else (lambda *n: None)
        dtype = cfg.compute_dtype
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, rngs=rngs,
                               embedding_init=normal_init(names("vocab", "embed")))
        self.pos_embed = nnx.Param(jnp.zeros((cfg.seq, cfg.d_model), jnp.float32))
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs):
                return self.make_block(rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([self.make_block(rngs) for _ in range(cfg.layers)])
        self.ln_f = norm(cfg.norm, cfg.d_model, cfg.annotate, rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=dtype,
                                   kernel_init=normal_init(names("embed", "vocab")), rngs=rngs)

    def make_mlp(self, rngs: nnx.Rngs) -> nnx.Module | None:
        """The blocks' MLP; ``None``: the dense GELU MLP."""
        return None

    def make_block(self, rngs: nnx.Rngs) -> Block:
        cfg = self.cfg
        return Block(cfg.d_model, cfg.heads, cfg.d_ff, norm_kind=cfg.norm,
                     dtype=cfg.compute_dtype, annotate=cfg.annotate, mlp=self.make_mlp(rngs),
                     rngs=rngs)

    def __call__(self, tokens: jax.Array):
        cfg = self.cfg
        x = self.embed(tokens) + self.pos_embed[: tokens.shape[1]].astype(cfg.compute_dtype)
        x = ex.constrain(x, ex.RESIDUAL_AXES)
        mask = nnx.make_causal_mask(tokens)
        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)

            def layer(carry, params):
                x, aux = carry
                x, layer_aux = nnx.merge(graphdef, params)(x, mask)
                return (x, aux + layer_aux), None

            (x, aux), _ = jax.lax.scan(layer, (x, jnp.zeros((), jnp.float32)), stacked)
        else:
            aux = jnp.zeros((), jnp.float32)
            for block in self.blocks:
                x, layer_aux = block(x, mask)
                aux = aux + layer_aux
        h = self.ln_f(x).astype(cfg.compute_dtype)
        logits = self.embed.attend(h) if cfg.tie_embeddings else self.head(h)
        logits = ex.constrain(logits, ex.VOCAB_AXES)
        return logits, aux / cfg.layers


def lm_batch(cfg: GPTConfig, seed: int):
    """``make(key) -> {'inputs', 'targets'}``: token chains that follow a fixed random
    permutation of the vocabulary (``next = perm[token]``), with 10% random tokens, so
    the loss can fall well below ``log(vocab)``."""
    perm = np.random.default_rng(seed + 7919).permutation(cfg.vocab).astype(np.int32)

    def make(key):
        k_start, k_noise, k_rand = jax.random.split(key, 3)
        start = jax.random.randint(k_start, (cfg.batch,), 0, cfg.vocab)
        noise = jax.random.bernoulli(k_noise, 0.1, (cfg.seq, cfg.batch))
        rand = jax.random.randint(k_rand, (cfg.seq, cfg.batch), 0, cfg.vocab)

        def step(token, xs):
            is_noise, r = xs
            nxt = jnp.where(is_noise, r, jnp.asarray(perm)[token])
            return nxt, nxt

        _, rest = jax.lax.scan(step, start, (noise, rand))
        tokens = jnp.concatenate([start[None], rest], axis=0).T.astype(jnp.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    return make


def lm_loss(aux_weight: float = 0.0):
    """``loss(model, batch)``: next-token cross-entropy (+ ``aux_weight`` * aux loss)."""

    def loss(model, batch):
        logits, aux = model(batch["inputs"])
        return common.cross_entropy(logits, batch["targets"]) + aux_weight * aux

    return loss


def lm_atol(cfg) -> float:
    """Absolute tolerance of a sharded first step against one device.

    f32: the loss (~log vocab) and gradients move by ~1e-7 relative when sums are
    reordered; Adam's first update ``lr * g / (|g| + eps)`` turns a gradient error δ
    into an update error of at most ``lr * δ / eps`` (1e-7 / 1e-6 = 0.1 lr), so
    ``0.1 * lr`` bounds every output (params move by ~lr, moments are ~0.1 g and ~1e-3 g²).
    A wrong reduction flips updates by ~2 lr.

    bf16: one bf16 rounding of a partial sum is 2^-8 ≈ 4e-3 relative; gradients of
    weights can differ by that much, and Adam's first update can flip for gradients
    within that noise of zero: 2 lr.
    """
    return 2.0 * cfg.lr if cfg.dtype == "bfloat16" else 0.1 * cfg.lr


def lm_rtol(cfg) -> float:
    return 2e-2 if cfg.dtype == "bfloat16" else 1e-5


def experts_for(cfg: GPTConfig):
    rules = tp_rules(layer_dims=1 if cfg.scan_layers else 0)

    def build(state, batch):
        return ex.standard_experts(state, batch, tp_rules=rules)

    return build


def train_case(size: str = "tiny", *, abstract: bool = False, seed: int = 0,
               scan_layers: bool = False, config: GPTConfig | None = None) -> TrainCase:
    """The GPT train step (adamw) of a named size."""
    cfg = config or SIZES[size]
    if scan_layers:
        cfg = dataclasses.replace(cfg, scan_layers=True)
    module = common.abstract_model(lambda rngs: GPT(cfg, rngs=rngs))
    return common.build_case(
        model="gpt_scan" if cfg.scan_layers else "gpt", size=size, module=module,
        tx=common.adamw(cfg.lr), loss_fn=lm_loss(), make=lm_batch(cfg, seed),
        experts=experts_for(cfg), atol=lm_atol(cfg), rtol=lm_rtol(cfg), abstract=abstract,
        seed=seed, fan_in=transformer_fan_in,
        annotations=common.logical_annotations(module) if cfg.annotate else None,
        axis_rules=LOGICAL_RULES)
