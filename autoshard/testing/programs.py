"""Small, realistic JAX programs for checking auto-sharded plans.

Each constructor returns a :class:`Program`: a pure function of pytrees of
arrays, concrete example arguments built deterministically from
``jax.random.key(0)``, and the absolute tolerance with which a sharded run
should match the unsharded one (the relative tolerance is always
``RTOL = 1e-5``).  The functions are written the way users write them (plain
``jnp``, a hand-written Adam, ``flax.nnx`` + ``optax``) and are *not* jitted:
the caller decides how to trace, shard and compile them.

Every default size is small enough to run quickly on CPU, and every array
dimension that is not inherent to the model (kernel windows, the scalar Adam
step count) is divisible by 8 so that 8 devices can shard any of them.

The tolerances assume full f32 matmuls: on CPU that is what ``jnp.dot`` does;
on GPUs with TF32 run the comparison under
``jax.default_matmul_precision("highest")``.

Example::

    from autoshard.testing import programs

    for p in programs.all_programs():
        expected = jax.jit(p.fn)(*p.args)
        ...  # run the sharded plan and compare with
        ...  # np.testing.assert_allclose(got, expected, rtol=programs.RTOL, atol=p.atol)

Note that ``args`` are shared: a caller that compiles with
``donate_argnums=p.donate_argnums`` must pass copies, or later calls will see
deleted buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

RTOL = 1e-5
"""Relative tolerance for comparing a sharded run with the unsharded one."""

__all__ = [
    "RTOL",
    "Program",
    "mlp_train_step",
    "transformer_train_step",
    "nnx_transformer_train_step",
    "moe_layer_train_step",
    "conv_train_step",
    "scan_transformer_train_step",
    "inference_mlp",
    "lm_1b_train_step_abstract",
    "all_programs",
    "param_count",
]


@dataclasses.dataclass(frozen=True)
class Program:
    """A pure function together with example arguments and a tolerance.

    Attributes:
      name: a short identifier, unique among the programs here.
      fn: a pure function of pytrees of arrays returning a pytree of arrays.
      args: example positional arguments for ``fn``: concrete ``jax.Array``
        leaves, or ``jax.ShapeDtypeStruct`` leaves for abstract-only programs.
      atol: absolute tolerance for comparing outputs of a sharded run with the
        unsharded one (relative tolerance is ``RTOL``).
      donate_argnums: arguments that a training loop would donate (the
        parameters and optimizer state it replaces).
    """

    name: str
    fn: Callable
    args: tuple
    atol: float
    donate_argnums: tuple = ()

    def abstract_args(self) -> tuple:
        """``args`` with every leaf replaced by a ``jax.ShapeDtypeStruct``."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.args)

    @property
    def is_abstract(self) -> bool:
        """Whether ``args`` hold only shapes (nothing to run)."""
        return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.args))


def param_count(tree: Any) -> int:
    """Number of scalars in a pytree of arrays or ``ShapeDtypeStruct`` s."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------
# Shared building blocks
# ---------------------------------------------------------------------------


def _normal(key, shape: tuple, std: float = 1.0) -> jax.Array:
    """``std * N(0, 1)`` samples of the given shape, in f32.

    Drawn flat and reshaped: XLA:CPU compiles the PRNG over rank >= 3 shapes
    several times slower, which dominated building these programs.
    """
    return (std * jax.random.normal(key, (math.prod(shape),), jnp.float32)).reshape(shape)


def _dense_init(key, d_in: int, d_out: int) -> dict:
    """A dense layer ``{'w': [d_in, d_out], 'b': [d_out]}`` with LeCun init."""
    return {"w": _normal(key, (d_in, d_out), 1 / math.sqrt(d_in)),
            "b": jnp.zeros((d_out,), jnp.float32)}


def _dense(p: dict, x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def _sgd(params, grads, lr: float):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def _adam_init(params) -> dict:
    """Adam state: first and second moments and the number of steps taken."""
    zeros = lambda p: jnp.zeros_like(p)
    return {
        "m": jax.tree.map(zeros, params),
        "v": jax.tree.map(zeros, params),
        "count": jnp.zeros((), jnp.int32),
    }


def _adam_update(params, grads, state, *, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One bias-corrected Adam step written in plain JAX."""
    count = state["count"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    t = count.astype(jnp.float32)
    m_scale = 1.0 / (1 - b1**t)
    v_scale = 1.0 / (1 - b2**t)
    new_params = jax.tree.map(
        lambda p, m, v: p - lr * (m * m_scale) / (jnp.sqrt(v * v_scale) + eps), params, m, v
    )
    return new_params, {"m": m, "v": v, "count": count}


def _build(init: Callable, abstract: bool = False) -> tuple:
    """Example args from ``init(jax.random.key(0))``.

    The initializer runs as one jitted computation (much faster than eager
    op-by-op on CPU); with ``abstract`` it is only shape-evaluated, so nothing
    is allocated.
    """
    key = jax.random.key(0)
    return tuple(jax.eval_shape(init, key) if abstract else jax.jit(init)(key))


# ---------------------------------------------------------------------------
# MLP classifier, SGD
# ---------------------------------------------------------------------------


def mlp_train_step(batch: int = 64, d_in: int = 64, d_hidden: int = 128, d_out: int = 16,
                   depth: int = 3, lr: float = 0.1) -> Program:
    """A deep ReLU MLP classifier trained with SGD on softmax cross-entropy.

    ``fn(params, batch) -> (new_params, loss)`` with
    ``params = {'layers': [{'w', 'b'}, ...]}`` (``depth`` hidden layers and an
    output layer) and ``batch = {'x': [batch, d_in], 'y': int32[batch]}``.
    """
    widths = [d_in] + [d_hidden] * depth + [d_out]

    def init(key):
        k_params, k_x, k_y = jax.random.split(key, 3)
        layer_keys = jax.random.split(k_params, len(widths) - 1)
        params = {"layers": [_dense_init(k, a, b)
                             for k, a, b in zip(layer_keys, widths[:-1], widths[1:])]}
        data = {
            "x": _normal(k_x, (batch, d_in)),
            "y": jax.random.randint(k_y, (batch,), 0, d_out, jnp.int32),
        }
        return params, data

    def loss_fn(params, batch):
        h = batch["x"]
        *hidden, last = params["layers"]
        for layer in hidden:
            h = jax.nn.relu(_dense(layer, h))
        return _cross_entropy(_dense(last, h), batch["y"])

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return _sgd(params, grads, lr), loss

    # Outputs are O(1) (loss ~ log(16), weights ~ 1/sqrt(fan_in)); reordering
    # f32 sums over <= 128 terms moves them by ~1e-7, so 1e-5 leaves 100x margin
    # while a wrong reduction (missing all-reduce, wrong slice) is off by >1e-3.
    return Program("mlp_train_step", train_step, _build(init), atol=1e-5, donate_argnums=(0,))


# ---------------------------------------------------------------------------
# Decoder-only transformer LM in plain JAX, hand-written Adam
# ---------------------------------------------------------------------------


def _layer_norm_init(d: int) -> dict:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _layer_norm(p: dict, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _block_init(key, d_model: int, d_ff: int) -> dict:
    """Weights of one pre-LN decoder block."""
    kq, kk, kv, ko, k1, k2 = jax.random.split(key, 6)
    normal = lambda k, shape, fan_in: _normal(k, shape, 1 / math.sqrt(fan_in))
    return {
        "ln1": _layer_norm_init(d_model),
        "wq": normal(kq, (d_model, d_model), d_model),
        "wk": normal(kk, (d_model, d_model), d_model),
        "wv": normal(kv, (d_model, d_model), d_model),
        "wo": normal(ko, (d_model, d_model), d_model),
        "ln2": _layer_norm_init(d_model),
        "w1": normal(k1, (d_model, d_ff), d_model),
        "b1": jnp.zeros((d_ff,), jnp.float32),
        "w2": normal(k2, (d_ff, d_model), d_ff),
        "b2": jnp.zeros((d_model,), jnp.float32),
    }


def _causal_attention(p: dict, x: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention of ``x[batch, seq, d_model]``."""
    b, s, d = x.shape
    split = lambda t: t.reshape(b, s, heads, d // heads)
    q, k, v = split(x @ p["wq"]), split(x @ p["wk"]), split(x @ p["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
    return out @ p["wo"]


def _block(p: dict, x: jax.Array, heads: int) -> jax.Array:
    """One pre-LN decoder block: attention then a GELU MLP, both residual."""
    x = x + _causal_attention(p, _layer_norm(p["ln1"], x), heads)
    h = jax.nn.gelu(_layer_norm(p["ln2"], x) @ p["w1"] + p["b1"])
    return x + h @ p["w2"] + p["b2"]


def _lm_init(key, *, vocab: int, seq: int, d_model: int, layers: int, d_ff: int,
             stacked: bool = False) -> dict:
    """LM parameters; with ``stacked`` the layer weights share a leading axis."""
    k_embed, k_pos, k_head, k_layers = jax.random.split(key, 4)
    blocks = [_block_init(k, d_model, d_ff) for k in jax.random.split(k_layers, layers)]
    if stacked:
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return {
        "embed": _normal(k_embed, (vocab, d_model), 0.02),
        "pos_embed": _normal(k_pos, (seq, d_model), 0.02),
        "layers": blocks,
        "ln_f": _layer_norm_init(d_model),
        "head": _normal(k_head, (d_model, vocab), 1 / math.sqrt(d_model)),
    }


def _lm_loss(params: dict, batch: dict, *, heads: int, scan_layers: bool = False) -> jax.Array:
    """Next-token cross-entropy of ``batch['targets']`` given ``batch['inputs']``."""
    tokens = batch["inputs"]
    x = jnp.take(params["embed"], tokens, axis=0) + params["pos_embed"][: tokens.shape[1]]
    if scan_layers:
        def body(x, layer):
            return _block(layer, x, heads), None

        x, _ = jax.lax.scan(body, x, params["layers"])
    else:
        for layer in params["layers"]:
            x = _block(layer, x, heads)
    logits = _layer_norm(params["ln_f"], x) @ params["head"]
    return _cross_entropy(logits, batch["targets"])


def _lm_batch(key, batch: int, seq: int, vocab: int) -> dict:
    """Random token ids: ``inputs`` and the same stream shifted by one."""
    tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab, jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _lm_adam_program(name: str, *, batch, seq, vocab, d_model, heads, layers, d_ff, lr,
                     scan_layers: bool, abstract: bool, atol: float) -> Program:
    """Shared construction of the plain-JAX LM train steps."""
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")

    def make_args(key):
        k_params, k_data = jax.random.split(key)
        params = _lm_init(k_params, vocab=vocab, seq=seq, d_model=d_model, layers=layers,
                          d_ff=d_ff, stacked=scan_layers)
        return params, _adam_init(params), _lm_batch(k_data, batch, seq, vocab)

    loss_fn = functools.partial(_lm_loss, heads=heads, scan_layers=scan_layers)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, opt_state = _adam_update(params, grads, opt_state, lr=lr)
        return params, opt_state, loss

    return Program(name, train_step, _build(make_args, abstract), atol=atol, donate_argnums=(0, 1))


# The first Adam step moves every parameter by lr * g / (|g| + eps), i.e. by
# about lr * sign(g).  Reordering f32 sums perturbs a gradient g ~ 1e-3..1e-1 by
# ~1e-7 |g|, which changes that update by lr * eps * dg / (|g| + eps)^2 ~ 1e-12;
# only a gradient within ~1e-8 of zero (rare) can move by up to lr * 0.1 ~ 1e-4.
# The loss (~log(vocab) ~ 5) and second moments (~g^2 >= 0) are far tighter.
# 1e-4 bounds that worst case while a wrong gradient reduction flips signs and
# shows up as differences of ~2 * lr = 2e-3.
_LM_ADAM_ATOL = 1e-4


def transformer_train_step(batch: int = 8, seq: int = 16, vocab: int = 128, d_model: int = 64,
                           heads: int = 4, layers: int = 2, d_ff: int = 256,
                           lr: float = 1e-3) -> Program:
    """A decoder-only LM train step in plain JAX with a hand-written Adam.

    Token embedding via ``jnp.take``, learned position embedding, pre-LN blocks
    with causal multi-head attention (separate ``wq/wk/wv/wo``) and a GELU MLP,
    a final LayerNorm, an untied output head and next-token cross-entropy.

    ``fn(params, opt_state, batch) -> (params, opt_state, loss)`` where
    ``params['layers'][i]['wq']`` etc. hold per-layer weights,
    ``opt_state = {'m', 'v', 'count'}`` and
    ``batch = {'inputs': int32[batch, seq], 'targets': int32[batch, seq]}``.
    """
    return _lm_adam_program(
        "transformer_train_step", batch=batch, seq=seq, vocab=vocab, d_model=d_model,
        heads=heads, layers=layers, d_ff=d_ff, lr=lr, scan_layers=False, abstract=False,
        atol=_LM_ADAM_ATOL)


def scan_transformer_train_step(batch: int = 8, seq: int = 16, vocab: int = 128,
                                d_model: int = 64, heads: int = 4, layers: int = 2,
                                d_ff: int = 256, lr: float = 1e-3) -> Program:
    """The LM of :func:`transformer_train_step` with layers applied by ``lax.scan``.

    Per-layer weights are stacked along a leading ``layers`` axis, e.g.
    ``params['layers']['wq']`` has shape ``[layers, d_model, d_model]``.
    """
    return _lm_adam_program(
        "scan_transformer_train_step", batch=batch, seq=seq, vocab=vocab, d_model=d_model,
        heads=heads, layers=layers, d_ff=d_ff, lr=lr, scan_layers=True, abstract=False,
        atol=_LM_ADAM_ATOL)


def lm_1b_train_step_abstract(batch: int = 8, seq: int = 1024, vocab: int = 32000,
                              d_model: int = 2048, heads: int = 16, layers: int = 20,
                              d_ff: int = 8192, lr: float = 3e-4) -> Program:
    """A ~1.14e9-parameter LM train step with Adam, with abstract args only.

    Same model and ``fn`` signature as :func:`transformer_train_step`; ``args``
    are ``jax.ShapeDtypeStruct`` s built with ``jax.eval_shape``, so nothing is
    allocated.  Use it for planning and ``jax.make_jaxpr``, not for running.
    """
    return _lm_adam_program(
        "lm_1b_train_step", batch=batch, seq=seq, vocab=vocab, d_model=d_model, heads=heads,
        layers=layers, d_ff=d_ff, lr=lr, scan_layers=False, abstract=True,
        # Not run in numerics tests; the same reasoning as the small LM applies,
        # with sums over up to 8192 terms instead of 256.
        atol=_LM_ADAM_ATOL)


# ---------------------------------------------------------------------------
# The same LM with flax.nnx modules and optax.adamw
# ---------------------------------------------------------------------------


class _NnxBlock(nnx.Module):
    """Pre-LN decoder block built from nnx layers."""

    def __init__(self, d_model: int, heads: int, d_ff: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        # No q/k/v/o biases (as in most current LMs).  A key bias would also be
        # a trap for numerics checks: softmax ignores a shift shared by all keys,
        # so its gradient is pure rounding noise, which Adam scales up to +-lr.
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d_model, use_bias=False,
                                           decode=False, keep_rngs=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.fc1 = nnx.Linear(d_model, d_ff, rngs=rngs)
        self.fc2 = nnx.Linear(d_ff, d_model, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class _NnxLM(nnx.Module):
    """Decoder-only LM: embeddings, ``layers`` blocks, final LN, untied head."""

    def __init__(self, *, vocab: int, seq: int, d_model: int, heads: int, layers: int,
                 d_ff: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos_embed = nnx.Param(_normal(rngs.params(), (seq, d_model), 0.02))
        self.blocks = nnx.List([_NnxBlock(d_model, heads, d_ff, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        seq = tokens.shape[1]
        x = self.embed(tokens) + self.pos_embed[:seq]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def nnx_transformer_train_step(batch: int = 8, seq: int = 16, vocab: int = 128,
                               d_model: int = 64, heads: int = 4, layers: int = 2,
                               d_ff: int = 256, lr: float = 1e-3,
                               weight_decay: float = 1e-4) -> Program:
    """The LM written with ``flax.nnx`` modules and trained with ``optax.adamw``.

    ``fn(state, opt_state, batch) -> (state, opt_state, loss)`` where ``state``
    is the ``nnx.State`` of the model's ``nnx.Param`` s from ``nnx.split`` (the
    graphdef is closed over) and ``opt_state`` is ``optax.adamw(...).init(state)``.
    ``batch`` is as in :func:`transformer_train_step`.
    """
    tx = optax.adamw(lr, weight_decay=weight_decay)
    create = lambda key: _NnxLM(vocab=vocab, seq=seq, d_model=d_model, heads=heads,
                                layers=layers, d_ff=d_ff, rngs=nnx.Rngs(params=key))
    # The graphdef comes from a shape-only model; the arrays from one jitted init.
    graphdef, _, rest = nnx.split(nnx.eval_shape(create, jax.random.key(0)), nnx.Param, ...)

    def init(key):
        k_model, k_data = jax.random.split(key)
        state = nnx.state(create(k_model), nnx.Param)
        return state, tx.init(state), _lm_batch(k_data, batch, seq, vocab)

    def loss_fn(state, batch):
        model = nnx.merge(graphdef, state, rest)
        return _cross_entropy(model(batch["inputs"]), batch["targets"])

    def train_step(state, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    # Same first-Adam-step reasoning as the plain-JAX LM (see _LM_ADAM_ATOL);
    # weight decay adds lr * wd * p ~ 1e-7, which is computed elementwise.
    return Program("nnx_transformer_train_step", train_step, _build(init),
                   atol=_LM_ADAM_ATOL, donate_argnums=(0, 1))


# ---------------------------------------------------------------------------
# Mixture-of-experts MLP layer, top-1 routing with capacity, SGD
# ---------------------------------------------------------------------------


def _moe_dispatch(router_probs: jax.Array, capacity: int):
    """Top-1 (Switch) routing with a per-expert capacity.

    Returns ``dispatch[tokens, experts, capacity]`` (0/1, which slot a token
    goes to; tokens over capacity are dropped) and ``combine`` (the same
    scaled by the chosen expert's probability).
    """
    experts = router_probs.shape[-1]
    expert = jnp.argmax(router_probs, axis=-1)
    expert_mask = jax.nn.one_hot(expert, experts, dtype=router_probs.dtype)
    # Slot of each token within its expert, in token order.
    position = jnp.cumsum(expert_mask, axis=0) * expert_mask - 1.0
    position = jnp.sum(position, axis=-1).astype(jnp.int32)
    expert_mask = expert_mask * (position < capacity)[:, None]
    dispatch = expert_mask[:, :, None] * jax.nn.one_hot(position, capacity, dtype=expert_mask.dtype)[:, None, :]
    gate = jnp.sum(router_probs * expert_mask, axis=-1)
    return dispatch, dispatch * gate[:, None, None], expert_mask


def _load_balancing_loss(router_probs: jax.Array, expert_mask: jax.Array) -> jax.Array:
    """Switch-Transformer auxiliary loss: ``E * sum_e f_e * P_e``."""
    experts = router_probs.shape[-1]
    tokens_per_expert = jnp.mean(expert_mask, axis=0)
    prob_per_expert = jnp.mean(router_probs, axis=0)
    return experts * jnp.sum(tokens_per_expert * prob_per_expert)


def moe_layer_train_step(batch: int = 8, seq: int = 16, d_model: int = 64, experts: int = 8,
                         d_ff: int = 128, capacity_factor: float = 1.5, aux_weight: float = 0.01,
                         lr: float = 0.1) -> Program:
    """A residual MoE MLP layer regressed onto a target, trained with SGD.

    The router picks one expert per token (argmax of the softmax), tokens are
    dispatched into ``[experts, capacity, d_model]`` buffers with a one-hot
    einsum, each expert runs a GELU MLP, and outputs are combined weighted by
    the gate probability.  Loss is mean squared error plus the load-balancing
    auxiliary loss.

    ``fn(params, batch) -> (params, loss)`` with ``params = {'router',
    'w1': [E, d_model, d_ff], 'b1', 'w2': [E, d_ff, d_model], 'b2'}`` and
    ``batch = {'x', 'target'}`` of shape ``[batch, seq, d_model]``.
    """
    tokens = batch * seq
    capacity = int(math.ceil(capacity_factor * tokens / experts))
    capacity = -(-capacity // 8) * 8  # keep it shardable 8 ways

    def init(key):
        k_router, k_w1, k_w2, k_x, k_t = jax.random.split(key, 5)
        normal = lambda k, shape, fan_in: _normal(k, shape, 1 / math.sqrt(fan_in))
        params = {
            "router": normal(k_router, (d_model, experts), d_model),
            "w1": normal(k_w1, (experts, d_model, d_ff), d_model),
            "b1": jnp.zeros((experts, d_ff), jnp.float32),
            "w2": normal(k_w2, (experts, d_ff, d_model), d_ff),
            "b2": jnp.zeros((experts, d_model), jnp.float32),
        }
        data = {
            "x": _normal(k_x, (batch, seq, d_model)),
            "target": _normal(k_t, (batch, seq, d_model)),
        }
        return params, data

    def moe_layer(params, x):
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        router_probs = jax.nn.softmax(flat @ params["router"], axis=-1)
        dispatch, combine, expert_mask = _moe_dispatch(router_probs, capacity)
        expert_in = jnp.einsum("tec,td->ecd", dispatch, flat)
        h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", expert_in, params["w1"]) + params["b1"][:, None])
        expert_out = jnp.einsum("ecf,efd->ecd", h, params["w2"]) + params["b2"][:, None]
        out = jnp.einsum("tec,ecd->td", combine, expert_out)
        return x + out.reshape(b, s, d), _load_balancing_loss(router_probs, expert_mask)

    def loss_fn(params, batch):
        y, aux = moe_layer(params, batch["x"])
        return jnp.mean(jnp.square(y - batch["target"])) + aux_weight * aux

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return _sgd(params, grads, lr), loss

    # Values are O(1) and sums run over <= 128 terms, so reordering moves
    # outputs by ~1e-7; 1e-5 leaves margin.  Routing is an argmax: if a sharded
    # router matmul flipped a near-tie (gap < ~1e-6, ~1e-3 chance for the
    # default data) a whole token would differ, which no atol can absorb.
    return Program("moe_layer_train_step", train_step, _build(init), atol=1e-5,
                   donate_argnums=(0,))


# ---------------------------------------------------------------------------
# Small conv net, SGD
# ---------------------------------------------------------------------------


def _conv(x: jax.Array, kernel: jax.Array, stride: int = 1) -> jax.Array:
    """3x3 SAME convolution, NHWC input and HWIO kernel."""
    return jax.lax.conv_general_dilated(
        x, kernel, window_strides=(stride, stride), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_train_step(batch: int = 16, hw: int = 16, channels: tuple = (8, 16), classes: int = 16,
                    in_channels: int = 8, lr: float = 0.1) -> Program:
    """A small conv net classifier trained with SGD on softmax cross-entropy.

    ``len(channels)`` 3x3 conv + bias + ReLU layers (NHWC, the second and
    later with stride 2), global mean pooling and a dense head.
    ``fn(params, batch) -> (params, loss)`` with ``params = {'convs': [{'w':
    [3, 3, c_in, c_out], 'b'}, ...], 'head': {'w', 'b'}}`` and ``batch =
    {'images': [batch, hw, hw, in_channels], 'labels': int32[batch]}``.
    """
    channels = tuple(channels)

    def init(key):
        k_params, k_x, k_y = jax.random.split(key, 3)
        keys = jax.random.split(k_params, len(channels) + 1)
        convs = []
        for k, c_in, c_out in zip(keys, (in_channels,) + channels, channels):
            he = math.sqrt(2.0 / (9 * c_in))
            convs.append({"w": _normal(k, (3, 3, c_in, c_out), he),
                          "b": jnp.zeros((c_out,), jnp.float32)})
        params = {"convs": convs, "head": _dense_init(keys[-1], channels[-1], classes)}
        data = {
            "images": _normal(k_x, (batch, hw, hw, in_channels)),
            "labels": jax.random.randint(k_y, (batch,), 0, classes, jnp.int32),
        }
        return params, data

    def loss_fn(params, batch):
        x = batch["images"]
        for i, layer in enumerate(params["convs"]):
            x = jax.nn.relu(_conv(x, layer["w"], stride=1 if i == 0 else 2) + layer["b"])
        features = jnp.mean(x, axis=(1, 2))
        return _cross_entropy(_dense(params["head"], features), batch["labels"])

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return _sgd(params, grads, lr), loss

    # O(1) activations; kernel gradients sum over batch * hw * hw = 4096
    # positions, so reordering (and a different conv algorithm per shard) moves
    # outputs by ~1e-6 at most; 1e-5 leaves margin.
    return Program("conv_train_step", train_step, _build(init), atol=1e-5, donate_argnums=(0,))


# ---------------------------------------------------------------------------
# Large inference MLP
# ---------------------------------------------------------------------------


def inference_mlp(batch: int = 16, d: int = 8192, abstract: bool = False) -> Program:
    """``y = gelu(x @ W1) @ W2`` with ``x[batch, d]``, ``W1, W2[d, d]``.

    The defaults are the large sizes (two 256 MiB weights); pass
    ``abstract=True`` to get ``ShapeDtypeStruct`` args without allocating, or
    smaller sizes to run it.  ``fn(params, x) -> y`` with ``params = {'w1', 'w2'}``.
    """

    def make_args(key):
        k1, k2, kx = jax.random.split(key, 3)
        params = {
            "w1": _normal(k1, (d, d), 1 / math.sqrt(d)),
            "w2": _normal(k2, (d, d), 1 / math.sqrt(d)),
        }
        return params, _normal(kx, (batch, d))

    def forward(params, x):
        return jax.nn.gelu(x @ params["w1"]) @ params["w2"]

    # Outputs are O(1) (unit-variance x, 1/sqrt(d) weights).  Each output is a
    # dot over d = 8192 terms; splitting that contraction across devices and
    # summing partials reorders it, an error of ~sqrt(d) * 6e-8 * 1/sqrt(d) per
    # level, ~1e-6 in all; 1e-4 covers both matmuls with margin.
    return Program("inference_mlp", forward, _build(make_args, abstract), atol=1e-4)


# ---------------------------------------------------------------------------


def all_programs() -> list[Program]:
    """The small concrete training programs used by the numerics tests."""
    return [
        mlp_train_step(),
        transformer_train_step(),
        nnx_transformer_train_step(),
        moe_layer_train_step(),
        conv_train_step(),
        scan_transformer_train_step(),
    ]
