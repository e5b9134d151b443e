"""Train steps written in plain JAX, the way people write them without a framework.

No flax, no optax: parameters are nested dicts of f32 arrays, Adam is a handful of
``jax.tree.map`` calls, the loss is ``log_softmax`` and ``take_along_axis``. Each
constructor returns a :class:`autoshard.zoo.models.case.TrainCase` (``train_step(state,
batch) -> (state, loss)``, ``state = {'params', 'opt_state', 'step'}``) with the expert
layouts a practitioner would write for it (data parallel, FSDP, Megatron, FSDP x TP,
expert parallel for the MoE), so tests and benchmarks treat them as they treat the zoo.

Example::

    from autoshard.testing import plain
    case = plain.lm("tiny")
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh,
                          pins=case.experts["megatron"](mesh))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from autoshard.zoo import experts as ex
from autoshard.zoo.models.case import TrainCase

__all__ = ["CASES", "adam", "clip_by_global_norm", "cnn", "lm", "lm_clipped", "moe",
           "train_case"]


# --------------------------------------------------------------------------- pieces


def adam(params, grads, opt_state, step, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step as tree maps: ``(new params, new opt_state)``."""
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt_state["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt_state["nu"], grads)
    t = (step + 1).astype(jnp.float32)
    scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, mu, nu)
    return params, {"mu": mu, "nu": nu}


def cross_entropy(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def layer_norm(p, x, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def attention(p, x, heads):
    b, s, d = x.shape
    q, k, v = (ex.constrain(jnp.reshape(x @ p[n], (b, s, heads, d // heads)), ex.HEAD_AXES)
               for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
    return out @ p["wo"]


def clip_by_global_norm(grads, max_norm: float = 1.0):
    """The gradients scaled down to a global norm of at most ``max_norm``: one norm over
    every leaf, read before any update."""
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads)


def make_train_step(loss_fn: Callable, clip_norm: float | None = None) -> Callable:
    """``train_step(state, batch)``: the loss's gradients, clipped to a global norm of
    ``clip_norm`` if given, then Adam."""
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        grads = ex.constrain_gradients(grads)
        if clip_norm is not None:
            grads = clip_by_global_norm(grads, clip_norm)
        params, opt_state = adam(state["params"], grads, state["opt_state"], state["step"])
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss
    return train_step


def initial_state(params) -> dict:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "opt_state": {"mu": zeros, "nu": jax.tree.map(jnp.zeros_like,
                                                                             params)},
            "step": jnp.zeros((), jnp.int32)}


class _Init:
    """Draws each parameter from its own key, scaled by its fan-in."""

    def __init__(self, seed: int):
        self.key = jax.random.key(seed)

    def normal(self, *shape, fan_in=None):
        self.key, key = jax.random.split(self.key)
        return jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in or shape[-2])


def _norm(d):
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _case(model, size, train_step, params, make_batch, experts, atol) -> TrainCase:
    state = initial_state(params)
    abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    batch_shapes = jax.eval_shape(make_batch, 0)
    return TrainCase(model=model, size=size, train_step=train_step, state=state,
                     make_batch=make_batch, experts=experts(abstract_state, batch_shapes),
                     atol=atol, donate_argnums=(0,))


# --------------------------------------------------------------------------- LM


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 128
    seq: int = 16
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256
    batch: int = 8
    experts: int = 0          # > 0: every block's MLP is a top-1 routed MoE
    capacity_factor: float = 2.0


LM_SIZES = {"tiny": LMConfig(vocab=256, seq=32, d_model=128, heads=4, d_ff=512, batch=16),
            "small": LMConfig(vocab=1024, seq=128, d_model=256, heads=8, layers=4,
                              d_ff=1024, batch=16)}
MOE_SIZES = {"tiny": LMConfig(vocab=256, seq=32, d_model=128, heads=4, d_ff=256, batch=16,
                               experts=8),
             "small": LMConfig(vocab=1024, seq=128, d_model=256, heads=8, layers=2,
                               d_ff=512, batch=16, experts=8)}

LM_TP_RULES = [
    (r"\['(wq|wk|wv)'\]$", P(None, ex.MODEL)),
    (r"\['wo'\]$", P(ex.MODEL, None)),
    (r"\['w1'\]$", P(None, ex.MODEL)),
    (r"\['b1'\]$", P(ex.MODEL)),
    (r"\['w2'\]$", P(ex.MODEL, None)),
    (r"\['embed'\]$", P(ex.MODEL, None)),
    (r"\['head'\]$", P(None, ex.MODEL)),
]
MOE_EXPERT_RULES = [(r"\['(wi|wout)'\]$", P(ex.MODEL))]


def _lm_params(cfg: LMConfig, seed: int) -> dict:
    init = _Init(seed)
    d, f = cfg.d_model, cfg.d_ff
    blocks = []
    for _ in range(cfg.layers):
        block = {"ln1": _norm(d), "wq": init.normal(d, d), "wk": init.normal(d, d),
                 "wv": init.normal(d, d), "wo": init.normal(d, d), "ln2": _norm(d)}
        if cfg.experts:
            e = cfg.experts
            block.update(router=init.normal(d, e), wi=init.normal(e, d, f),
                         wout=init.normal(e, f, d))
        else:
            block.update(w1=init.normal(d, f), b1=jnp.zeros((f,), jnp.float32),
                         w2=init.normal(f, d), b2=jnp.zeros((d,), jnp.float32))
        blocks.append(block)
    return {"embed": init.normal(cfg.vocab, d, fan_in=1) * 0.02,
            "pos": init.normal(cfg.seq, d, fan_in=1) * 0.02, "blocks": blocks,
            "ln_f": _norm(d), "head": init.normal(d, cfg.vocab)}


def moe_mlp(p, x, cfg: LMConfig):
    """Top-1 routing per sequence with a capacity, as GShard's dispatch and combine
    einsums (an expert-parallel layout moves tokens with all-to-all)."""
    s = x.shape[1]
    e = cfg.experts
    capacity = max(1, int(math.ceil(cfg.capacity_factor * s / e)))
    probs = jax.nn.softmax(x @ p["router"], axis=-1)                   # [b, s, e]
    gate = jnp.max(probs, axis=-1)
    chosen = jax.nn.one_hot(jnp.argmax(probs, axis=-1), e, dtype=x.dtype)
    position = (jnp.cumsum(chosen, axis=1) - 1.0) * chosen           # slot in its expert
    kept = chosen * (position < capacity)
    dispatch = kept[..., None] * jax.nn.one_hot(position.astype(jnp.int32), capacity,
                                                dtype=x.dtype)       # [b, s, e, c]
    tokens = jnp.einsum("bsd,bsec->becd", x, dispatch)
    hidden = jax.nn.gelu(jnp.einsum("becd,edf->becf", tokens, p["wi"]))
    out = jnp.einsum("becf,efd->becd", hidden, p["wout"])
    combined = jnp.einsum("becd,bsec->bsd", out, dispatch) * gate[..., None]
    fraction = jnp.mean(chosen, axis=(0, 1))
    balance = e * jnp.sum(fraction * jnp.mean(probs, axis=(0, 1)))
    return combined, balance


def lm_loss(cfg: LMConfig):
    def loss_fn(params, batch):
        tokens = batch["tokens"]
        x = ex.constrain(params["embed"][tokens] + params["pos"][None], ex.RESIDUAL_AXES)
        aux = 0.0
        for p in params["blocks"]:
            x = ex.constrain(x + attention(p, layer_norm(p["ln1"], x), cfg.heads), ex.RESIDUAL_AXES)
            h = layer_norm(p["ln2"], x)
            if cfg.experts:
                y, balance = moe_mlp(p, h, cfg)
                aux = aux + balance
            else:
                hidden = ex.constrain(h @ p["w1"] + p["b1"], ex.MLP_AXES)
                y = jax.nn.gelu(hidden) @ p["w2"] + p["b2"]
            x = ex.constrain(x + y, ex.RESIDUAL_AXES)
        logits = ex.constrain(layer_norm(params["ln_f"], x) @ params["head"], ex.VOCAB_AXES)
        return cross_entropy(logits, batch["labels"]) + 0.01 * aux
    return loss_fn


def _token_batch(cfg: LMConfig):
    def make_batch(step: int) -> dict:
        tokens = jax.random.randint(jax.random.key(1000 + step), (cfg.batch, cfg.seq + 1),
                                    0, cfg.vocab)
        return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    return make_batch


def lm(size: str = "tiny", seed: int = 0, config: LMConfig | None = None) -> TrainCase:
    """A GPT-style LM (pre-norm blocks, untied head) trained with tree-map Adam."""
    cfg = config or LM_SIZES[size]
    return _case("plain_lm", size, make_train_step(lm_loss(cfg)), _lm_params(cfg, seed),
                 _token_batch(cfg),
                 lambda state, batch: ex.standard_experts(state, batch, LM_TP_RULES),
                 atol=2e-5)


def lm_clipped(size: str = "tiny", seed: int = 0, config: LMConfig | None = None
               ) -> TrainCase:
    """The LM with its gradients clipped to a global norm of 1 before Adam."""
    cfg = config or LM_SIZES[size]
    return _case("plain_lm_clip", size, make_train_step(lm_loss(cfg), clip_norm=1.0),
                 _lm_params(cfg, seed), _token_batch(cfg),
                 lambda state, batch: ex.standard_experts(state, batch, LM_TP_RULES),
                 atol=2e-5)


def moe(size: str = "tiny", seed: int = 0, config: LMConfig | None = None) -> TrainCase:
    """The LM with every block's MLP a top-1 routed mixture of experts."""
    cfg = config or MOE_SIZES[size]
    return _case("plain_moe", size, make_train_step(lm_loss(cfg)), _lm_params(cfg, seed),
                 _token_batch(cfg),
                 lambda state, batch: ex.standard_experts(state, batch, LM_TP_RULES[:2],
                                                          MOE_EXPERT_RULES),
                 atol=2e-5)


# --------------------------------------------------------------------------- CNN


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    image: int = 16
    channels: tuple[int, ...] = (16, 32, 64)
    classes: int = 16
    batch: int = 16


CNN_SIZES = {"tiny": CNNConfig(image=16, channels=(32, 64, 128), classes=32, batch=32),
             "small": CNNConfig(image=32, channels=(64, 128, 256), classes=64, batch=64)}
CNN_TP_RULES = [(r"\['conv\d+'\]\['kernel'\]$", P(None, None, None, ex.MODEL)),
                (r"\['conv\d+'\]\['bias'\]$", P(ex.MODEL)),
                (r"\['dense'\]\['kernel'\]$", P(ex.MODEL, None))]


def _cnn_params(cfg: CNNConfig, seed: int) -> dict:
    init = _Init(seed)
    params, c_in = {}, 3
    for i, c in enumerate(cfg.channels):
        params[f"conv{i}"] = {"kernel": init.normal(3, 3, c_in, c, fan_in=9 * c_in),
                              "bias": jnp.zeros((c,), jnp.float32)}
        c_in = c
    params["dense"] = {"kernel": init.normal(c_in, cfg.classes),
                       "bias": jnp.zeros((cfg.classes,), jnp.float32)}
    return params


def cnn_loss(cfg: CNNConfig):
    def loss_fn(params, batch):
        x = batch["images"]
        for i in range(len(cfg.channels)):
            p = params[f"conv{i}"]
            x = jax.lax.conv_general_dilated(x, p["kernel"], (1, 1) if i == 0 else (2, 2),
                                             "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jax.nn.relu(x + p["bias"])
        pooled = jnp.mean(x, axis=(1, 2))
        logits = pooled @ params["dense"]["kernel"] + params["dense"]["bias"]
        return cross_entropy(logits, batch["labels"])
    return loss_fn


def cnn(size: str = "tiny", seed: int = 0, config: CNNConfig | None = None) -> TrainCase:
    """A three-layer strided CNN classifier (NHWC) trained with tree-map Adam."""
    cfg = config or CNN_SIZES[size]

    def make_batch(step: int) -> dict:
        k1, k2 = jax.random.split(jax.random.key(2000 + step))
        return {"images": jax.random.normal(k1, (cfg.batch, cfg.image, cfg.image, 3)),
                "labels": jax.random.randint(k2, (cfg.batch,), 0, cfg.classes)}
    return _case("plain_cnn", size, make_train_step(cnn_loss(cfg)), _cnn_params(cfg, seed),
                 make_batch,
                 lambda state, batch: ex.standard_experts(state, batch, CNN_TP_RULES),
                 atol=2e-5)


CASES: dict[str, Callable[..., TrainCase]] = {"plain_lm": lm, "plain_lm_clip": lm_clipped,
                                               "plain_moe": moe, "plain_cnn": cnn}


def train_case(name: str, size: str = "tiny", seed: int = 0) -> TrainCase:
    """One of ``CASES`` by name."""
    return CASES[name](size, seed)
