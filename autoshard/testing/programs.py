"""Small, realistic JAX programs for checking auto-sharded plans.

Each constructor returns a :class:`Program`: a pure function of pytrees of
arrays, example arguments drawn deterministically from ``jax.random.key(0)``
(all f32 apart from integer labels, token ids and step counts), and the
absolute tolerance with which a sharded run should match the unsharded one
(the relative tolerance is always ``RTOL = 1e-5``).  The functions are written
the way users write them (plain ``jnp`` with a hand-written Adam, ``flax.nnx``
with ``optax``) and are *not* jitted: the caller decides how to trace, shard
and compile them.

The default sizes run in about a second on CPU, and every array dimension not
fixed by the model (3x3 conv windows, the scalar Adam step count) is divisible
by 8, so 8 devices can shard any of them.

The tolerances assume full-f32 matmuls.  That is what CPUs do; on GPUs that
use TF32 for f32 matmuls, compare under
``jax.default_matmul_precision("highest")``.

Example::

    from autoshard.testing import programs

    for p in programs.all_programs():
        expected = jax.jit(p.fn)(*p.args)
        got = ...  # run the sharded plan on p.args
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            a, b, rtol=programs.RTOL, atol=p.atol), got, expected)

``args`` are shared by every user of a Program: a caller that compiles with
``donate_argnums=p.donate_argnums`` must pass copies, or later calls will see
deleted buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

RTOL = 1e-5
"""Relative tolerance for comparing a sharded run with the unsharded one."""

__all__ = [
    "RTOL",
    "Program",
    "all_programs",
    "mlp_adam_abstract",
    "conv_train_step",
    "inference_mlp",
    "lm_1b_train_step_abstract",
    "mlp_train_step",
    "moe_layer_train_step",
    "nnx_transformer_train_step",
    "param_count",
    "scan_transformer_train_step",
    "transformer_train_step",
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
        unsharded one (the relative tolerance is ``RTOL``).
      donate_argnums: the arguments a training loop would donate (the
        parameters and optimizer state that ``fn`` returns updated).
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
        """Whether ``args`` hold only shapes (the program can be traced, not run)."""
        return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.args))


def param_count(tree: Any) -> int:
    """Number of scalars in a pytree of arrays or ``ShapeDtypeStruct`` s."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------
# Initialization
#
# Parameters are described by templates whose leaves say how to fill each
# array, then materialized in one go.  All normal samples of a program come
# from a single PRNG call that is sliced up on the host: XLA:CPU spends
# ~0.05-0.3 s compiling every separate PRNG call or small init op, which
# otherwise dominates building these small programs.  Abstract programs turn
# the same templates into ShapeDtypeStructs without allocating anything.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Normal:
    """Template leaf: ``std * N(0, 1)`` samples (f32)."""

    shape: tuple
    std: float = 1.0


@dataclasses.dataclass(frozen=True)
class _Full:
    """Template leaf: an array filled with ``value``."""

    shape: tuple
    value: float = 0.0
    dtype: Any = jnp.float32


def _fan_in(shape: tuple, fan_in: int | None = None) -> _Normal:
    """LeCun-normal leaf: std ``1 / sqrt(fan_in)``, ``fan_in`` defaulting to ``shape[0]``."""
    return _Normal(tuple(shape), 1.0 / math.sqrt(shape[0] if fan_in is None else fan_in))


def _zeros(*shape: int) -> _Full:
    return _Full(shape, 0.0)


def _ones(*shape: int) -> _Full:
    return _Full(shape, 1.0)


def _is_leaf_spec(x) -> bool:
    return isinstance(x, (_Normal, _Full))


def _materialize(key, template, abstract: bool = False):
    """The arrays a template describes (``ShapeDtypeStruct`` s if ``abstract``)."""
    leaves, treedef = jax.tree.flatten(template, is_leaf=_is_leaf_spec)
    if abstract:
        out = [jax.ShapeDtypeStruct(leaf.shape, getattr(leaf, "dtype", jnp.float32))
               for leaf in leaves]
        return jax.tree.unflatten(treedef, out)
    total = sum(math.prod(leaf.shape) for leaf in leaves if isinstance(leaf, _Normal))
    samples = np.asarray(jax.random.normal(key, (total,), jnp.float32))
    out, start = [], 0
    for leaf in leaves:
        size = math.prod(leaf.shape)
        if isinstance(leaf, _Normal):
            chunk = samples[start:start + size].reshape(leaf.shape) * np.float32(leaf.std)
            start += size
        else:
            chunk = np.full(leaf.shape, leaf.value, np.dtype(leaf.dtype))
        out.append(jnp.asarray(chunk))
    return jax.tree.unflatten(treedef, out)


def _randint(key, shape: tuple, high: int, abstract: bool = False):
    """Uniform int32 ids in ``[0, high)`` as a host array (or a ShapeDtypeStruct)."""
    if abstract:
        return jax.ShapeDtypeStruct(shape, jnp.int32)
    return np.asarray(jax.random.randint(key, shape, 0, high, jnp.int32))


# ---------------------------------------------------------------------------
# Layers, losses and optimizers shared by the programs
# ---------------------------------------------------------------------------


def _dense_template(d_in: int, d_out: int) -> dict:
    return {"w": _fan_in((d_in, d_out)), "b": _zeros(d_out)}


def _dense(p: dict, x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


def _layer_norm_template(d: int) -> dict:
    return {"scale": _ones(d), "bias": _zeros(d)}


def _layer_norm(p: dict, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer ``labels``."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def _sgd(params, grads, lr: float):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def _adam_template(params_template) -> dict:
    """Fresh Adam state: zero moments shaped like the params, zero steps taken."""
    zeros = lambda leaf: _Full(leaf.shape, 0.0)
    return {
        "m": jax.tree.map(zeros, params_template, is_leaf=_is_leaf_spec),
        "v": jax.tree.map(zeros, params_template, is_leaf=_is_leaf_spec),
        "count": _Full((), 0, jnp.int32),
    }


def _adam_update(params, grads, state: dict, *, lr: float, b1: float = 0.9,
                 b2: float = 0.999, eps: float = 1e-6):
    """One bias-corrected Adam step written in plain JAX."""
    count = state["count"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    t = count.astype(jnp.float32)
    m_hat_scale = 1 / (1 - b1**t)
    v_hat_scale = 1 / (1 - b2**t)
    params = jax.tree.map(
        lambda p, m, v: p - lr * (m * m_hat_scale) / (jnp.sqrt(v * v_hat_scale) + eps),
        params, m, v)
    return params, {"m": m, "v": v, "count": count}


# Adam's epsilon for the LM programs: 1e-6 (BERT's and RoBERTa's choice)
# rather than 1e-8 keeps them checkable.  On its first step Adam moves each
# parameter by lr * g / (|g| + eps), whose slope in g is lr / eps at g = 0, and
# a sharded run's reordered f32 sums perturb gradients by ~1e-7 (at most
# 6.6e-7 seen, on the largest, O(1), entries).  So an entry whose gradient
# happens to sit near zero can move its update by up to lr * 1e-7 / eps:
# 1e-2 with eps = 1e-8 (2.6e-5 seen in five shardings of the small LM at
# lr = 1e-3), 1e-4 with eps = 1e-6.
_ADAM_EPS = 1e-6

# Learning rate of the small LM programs (the common 3e-4): the Adam noise
# bound above scales with it.
_LM_LR = 3e-4

# Tolerance of the LM programs.  Their outputs are the loss (~log vocab ~ 5),
# params (~0.02..1, each moved by ~lr by the first Adam step), m (~0.1 g) and
# v (~1e-3 g^2).  Reordered sums move the loss and gradients by ~1e-7
# relative, and an Adam update by at most lr * 1e-7 / eps = 3e-5 (see
# _ADAM_EPS; at most 3.3e-6 beyond rtol seen over 8-12 random 1-D and 2-D
# shardings of each small LM).  1e-4 covers that, while a wrong gradient
# reduction changes m by ~1e-3 and flips updates by 2 * lr = 6e-4.
_LM_ADAM_ATOL = 1e-4


# ---------------------------------------------------------------------------
# MLP classifier, SGD
# ---------------------------------------------------------------------------


def mlp_train_step(batch: int = 64, d_in: int = 64, d_hidden: int = 128, d_out: int = 16,
                   depth: int = 3, lr: float = 0.1) -> Program:
    """A deep ReLU MLP classifier trained with SGD on softmax cross-entropy.

    ``fn(params, batch) -> (new_params, loss)`` with
    ``params = {'layers': [{'w': [d_a, d_b], 'b': [d_b]}, ...]}`` (``depth``
    hidden layers and the output layer) and
    ``batch = {'x': f32[batch, d_in], 'y': int32[batch]}``.
    """

    def loss_fn(params, batch):
        h = batch["x"]
        *hidden, last = params["layers"]
        for layer in hidden:
            h = jax.nn.relu(_dense(layer, h))
        return _cross_entropy(_dense(last, h), batch["y"])

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return _sgd(params, grads, lr), loss

    widths = [d_in] + [d_hidden] * depth + [d_out]
    k_floats, k_labels = jax.random.split(jax.random.key(0))
    params, x = _materialize(k_floats, (
        {"layers": [_dense_template(a, b) for a, b in zip(widths[:-1], widths[1:])]},
        _Normal((batch, d_in)),
    ))
    data = {"x": x, "y": jnp.asarray(_randint(k_labels, (batch,), d_out))}
    # Outputs are O(1) (loss ~ log 16, weights ~ 1 / sqrt(fan_in)) and the sums
    # run over <= 128 terms, so reordering them moves outputs by ~1e-7 (2.4e-7
    # seen); 1e-5 leaves ample margin, while a missing or doubled reduction is
    # off by >= 1e-3.
    return Program("mlp_train_step", train_step, (params, data), atol=1e-5,
                   donate_argnums=(0,))


# ---------------------------------------------------------------------------
# Decoder-only transformer LM in plain JAX, hand-written Adam
# ---------------------------------------------------------------------------


def _block_template(d_model: int, d_ff: int, layers: tuple = ()) -> dict:
    """Weights of one pre-LN decoder block, or of ``layers`` stacked ones."""
    normal = lambda d_in, d_out: _fan_in((*layers, d_in, d_out), fan_in=d_in)
    return {
        "ln1": {"scale": _ones(*layers, d_model), "bias": _zeros(*layers, d_model)},
        "wq": normal(d_model, d_model),
        "wk": normal(d_model, d_model),
        "wv": normal(d_model, d_model),
        "wo": normal(d_model, d_model),
        "ln2": {"scale": _ones(*layers, d_model), "bias": _zeros(*layers, d_model)},
        "w1": normal(d_model, d_ff),
        "b1": _zeros(*layers, d_ff),
        "w2": normal(d_ff, d_model),
        "b2": _zeros(*layers, d_model),
    }


def _lm_template(*, vocab: int, seq: int, d_model: int, layers: int, d_ff: int,
                 stacked: bool = False) -> dict:
    """LM parameters; with ``stacked`` the layer weights share a leading axis."""
    if stacked:
        blocks = _block_template(d_model, d_ff, layers=(layers,))
    else:
        blocks = [_block_template(d_model, d_ff) for _ in range(layers)]
    return {
        "embed": _Normal((vocab, d_model), 0.02),
        "pos_embed": _Normal((seq, d_model), 0.02),
        "layers": blocks,
        "ln_f": _layer_norm_template(d_model),
        "head": _fan_in((d_model, vocab)),
    }


def _causal_attention(p: dict, x: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention of ``x[batch, seq, d_model]``."""
    b, s, d = x.shape
    split_heads = lambda t: t.reshape(b, s, heads, d // heads)
    q, k, v = split_heads(x @ p["wq"]), split_heads(x @ p["wk"]), split_heads(x @ p["wv"])
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


def _lm_loss(params: dict, batch: dict, *, heads: int, scan_layers: bool = False) -> jax.Array:
    """Next-token cross-entropy of ``batch['targets']`` given ``batch['inputs']``."""
    tokens = batch["inputs"]
    x = jnp.take(params["embed"], tokens, axis=0) + params["pos_embed"][: tokens.shape[1]]
    if scan_layers:
        def apply_layer(x, layer):
            return _block(layer, x, heads), None

        x, _ = jax.lax.scan(apply_layer, x, params["layers"])
    else:
        for layer in params["layers"]:
            x = _block(layer, x, heads)
    logits = _layer_norm(params["ln_f"], x) @ params["head"]
    return _cross_entropy(logits, batch["targets"])


def _lm_batch(key, batch: int, seq: int, vocab: int, abstract: bool = False) -> dict:
    """Random token streams: ``inputs`` and the same streams shifted by one."""
    if abstract:
        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return {"inputs": ids, "targets": ids}
    tokens = _randint(key, (batch, seq + 1), vocab)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def _lm_adam_program(name: str, *, batch: int, seq: int, vocab: int, d_model: int, heads: int,
                     layers: int, d_ff: int, lr: float, scan_layers: bool,
                     abstract: bool) -> Program:
    """The plain-JAX LM train step with Adam, per-layer or scanned."""
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
    loss_fn = functools.partial(_lm_loss, heads=heads, scan_layers=scan_layers)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, opt_state = _adam_update(params, grads, opt_state, lr=lr, eps=_ADAM_EPS)
        return params, opt_state, loss

    k_params, k_data = jax.random.split(jax.random.key(0))
    template = _lm_template(vocab=vocab, seq=seq, d_model=d_model, layers=layers, d_ff=d_ff,
                            stacked=scan_layers)
    params, opt_state = _materialize(k_params, (template, _adam_template(template)), abstract)
    data = _lm_batch(k_data, batch, seq, vocab, abstract)
    return Program(name, train_step, (params, opt_state, data), atol=_LM_ADAM_ATOL,
                   donate_argnums=(0, 1))


def transformer_train_step(batch: int = 8, seq: int = 16, vocab: int = 128, d_model: int = 64,
                           heads: int = 4, layers: int = 2, d_ff: int = 256,
                           lr: float = _LM_LR) -> Program:
    """A decoder-only LM train step in plain JAX with a hand-written Adam.

    Token embedding via ``jnp.take``, learned position embedding, pre-LN blocks
    with causal multi-head attention (separate ``wq/wk/wv/wo``) and a GELU MLP,
    a final LayerNorm, an untied output head and next-token cross-entropy
    (``jnp.take_along_axis`` on ``log_softmax``).

    ``fn(params, opt_state, batch) -> (params, opt_state, loss)`` where
    ``params['layers'][i]['wq']`` etc. hold per-layer weights,
    ``opt_state = {'m': <like params>, 'v': <like params>, 'count': int32[]}``
    and ``batch = {'inputs': int32[batch, seq], 'targets': int32[batch, seq]}``.
    """
    return _lm_adam_program(
        "transformer_train_step", batch=batch, seq=seq, vocab=vocab, d_model=d_model,
        heads=heads, layers=layers, d_ff=d_ff, lr=lr, scan_layers=False, abstract=False)


def scan_transformer_train_step(batch: int = 8, seq: int = 16, vocab: int = 128,
                                d_model: int = 64, heads: int = 4, layers: int = 8,
                                d_ff: int = 256, lr: float = _LM_LR) -> Program:
    """The LM of :func:`transformer_train_step` with layers applied by ``lax.scan``.

    Per-layer weights are stacked along a leading ``layers`` axis, e.g.
    ``params['layers']['wq']`` has shape ``[layers, d_model, d_model]``; the
    default of 8 layers keeps that axis shardable 8 ways.
    """
    return _lm_adam_program(
        "scan_transformer_train_step", batch=batch, seq=seq, vocab=vocab, d_model=d_model,
        heads=heads, layers=layers, d_ff=d_ff, lr=lr, scan_layers=True, abstract=False)


def lm_1b_train_step_abstract(batch: int = 8, seq: int = 1024, vocab: int = 32000,
                              d_model: int = 2048, heads: int = 16, layers: int = 20,
                              d_ff: int = 8192, lr: float = _LM_LR) -> Program:
    """A 1.14e9-parameter LM train step with Adam, with abstract args only.

    The model and ``fn`` signature of :func:`transformer_train_step`; ``args``
    are ``jax.ShapeDtypeStruct`` s, so nothing is allocated.  For planning and
    ``jax.make_jaxpr``, not for running on CPU (params and Adam state alone
    take 13.7 GB).
    """
    return _lm_adam_program(
        "lm_1b_train_step", batch=batch, seq=seq, vocab=vocab, d_model=d_model, heads=heads,
        layers=layers, d_ff=d_ff, lr=lr, scan_layers=False, abstract=True)


# ---------------------------------------------------------------------------
# The same LM with flax.nnx modules and optax.adamw
# ---------------------------------------------------------------------------


class _NnxBlock(nnx.Module):
    """Pre-LN decoder block built from nnx layers."""

    def __init__(self, d_model: int, heads: int, d_ff: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        # No q/k/v/o biases, as in most current LMs.  A key bias would also be a
        # trap for numerics checks: softmax ignores a shift shared by all keys,
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
        self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, d_model)))
        self.blocks = nnx.List([_NnxBlock(d_model, heads, d_ff, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos_embed[: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def _gpt2_template(abstract_params: nnx.State) -> nnx.State:
    """GPT-2-style init for an nnx param State: LN scales 1, biases 0, weights N(0, 0.02)."""

    def leaf(path, x):
        name = jax.tree_util.keystr(path)
        if "['scale']" in name:
            return _Full(x.shape, 1.0)
        if "['bias']" in name:
            return _Full(x.shape, 0.0)
        return _Normal(x.shape, 0.02)

    return jax.tree_util.tree_map_with_path(leaf, abstract_params)


def nnx_transformer_train_step(batch: int = 8, seq: int = 16, vocab: int = 128,
                               d_model: int = 64, heads: int = 8, layers: int = 2,
                               d_ff: int = 256, lr: float = _LM_LR,
                               weight_decay: float = 1e-4) -> Program:
    """The LM written with ``flax.nnx`` modules and trained with ``optax.adamw``.

    ``fn(state, opt_state, batch) -> (state, opt_state, loss)`` where ``state``
    is the ``nnx.State`` of the model's ``nnx.Param`` s from ``nnx.split`` (the
    graphdef is closed over, e.g. ``state['blocks'][0]['attn']['query']['kernel']``)
    and ``opt_state`` is ``optax.adamw(...).init(state)``.  ``batch`` is as in
    :func:`transformer_train_step`.  Attention kernels have a heads axis
    (``[d_model, heads, d_model // heads]``), hence 8 heads by default.
    """
    tx = optax.adamw(lr, eps=_ADAM_EPS, weight_decay=weight_decay)
    # Build the model shape-only (running nnx's per-parameter initializers
    # costs seconds of XLA compilation) and fill its params GPT-2 style.
    # Splitting on nnx.Param alone fails loudly if the model holds other state.
    abstract_model = nnx.eval_shape(lambda: _NnxLM(
        vocab=vocab, seq=seq, d_model=d_model, heads=heads, layers=layers, d_ff=d_ff,
        rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)

    def loss_fn(state, batch):
        model = nnx.merge(graphdef, state)
        return _cross_entropy(model(batch["inputs"]), batch["targets"])

    def train_step(state, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    k_params, k_data = jax.random.split(jax.random.key(0))
    state = _materialize(k_params, _gpt2_template(abstract_params))
    data = _lm_batch(k_data, batch, seq, vocab)
    # As for the plain-JAX LM (see _LM_ADAM_ATOL); weight decay only adds the
    # elementwise lr * wd * p ~ 1e-9.
    return Program("nnx_transformer_train_step", train_step, (state, tx.init(state), data),
                   atol=_LM_ADAM_ATOL, donate_argnums=(0, 1))


# ---------------------------------------------------------------------------
# Mixture-of-experts MLP layer, top-1 routing with capacity, SGD
# ---------------------------------------------------------------------------


def _top1_routing(router_probs: jax.Array, capacity: int):
    """Switch-Transformer top-1 routing of ``router_probs[tokens, experts]``.

    Returns ``dispatch[tokens, experts, capacity]`` (1 where a token goes to a
    slot of its expert; tokens past an expert's capacity are dropped),
    ``combine`` (``dispatch`` scaled by the chosen expert's probability) and
    the kept ``expert_mask[tokens, experts]``.
    """
    experts = router_probs.shape[-1]
    expert_mask = jax.nn.one_hot(jnp.argmax(router_probs, axis=-1), experts)
    # Slot of each token in its expert's buffer, in token order.
    position = jnp.sum(jnp.cumsum(expert_mask, axis=0) * expert_mask, axis=-1) - 1
    expert_mask = expert_mask * (position < capacity)[:, None]
    slot = jax.nn.one_hot(position.astype(jnp.int32), capacity)
    dispatch = expert_mask[:, :, None] * slot[:, None, :]
    gate = jnp.sum(router_probs * expert_mask, axis=-1)
    return dispatch, dispatch * gate[:, None, None], expert_mask


def _load_balancing_loss(router_probs: jax.Array, expert_mask: jax.Array) -> jax.Array:
    """Switch-Transformer auxiliary loss ``E * sum_e f_e * P_e``; 1 when balanced."""
    experts = router_probs.shape[-1]
    fraction_routed = jnp.mean(expert_mask, axis=0)
    mean_prob = jnp.mean(router_probs, axis=0)
    return experts * jnp.sum(fraction_routed * mean_prob)


def moe_layer_train_step(batch: int = 8, seq: int = 16, d_model: int = 64, experts: int = 8,
                         d_ff: int = 128, capacity_factor: float = 1.5, aux_weight: float = 0.01,
                         lr: float = 0.1) -> Program:
    """A residual MoE MLP layer regressed onto a target, trained with SGD.

    The router picks one expert per token (argmax of its softmax), tokens are
    dispatched into ``[experts, capacity, d_model]`` buffers with a one-hot
    einsum, each expert runs a GELU MLP, and the outputs are combined weighted
    by the gate probability.  The loss is the mean squared error plus
    ``aux_weight`` times the load-balancing loss.  ``capacity`` is
    ``capacity_factor * tokens / experts`` rounded up to a multiple of 8.

    ``fn(params, batch) -> (params, loss)`` with ``params = {'router':
    [d_model, E], 'w1': [E, d_model, d_ff], 'b1': [E, d_ff], 'w2': [E, d_ff,
    d_model], 'b2': [E, d_model]}`` and ``batch = {'x', 'target'}``, both
    ``f32[batch, seq, d_model]``.
    """
    capacity = math.ceil(capacity_factor * batch * seq / experts)
    capacity = -(-capacity // 8) * 8

    def moe_layer(params, x):
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        router_probs = jax.nn.softmax(tokens @ params["router"], axis=-1)
        dispatch, combine, expert_mask = _top1_routing(router_probs, capacity)
        expert_in = jnp.einsum("tec,td->ecd", dispatch, tokens)
        h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", expert_in, params["w1"])
                        + params["b1"][:, None, :])
        expert_out = jnp.einsum("ecf,efd->ecd", h, params["w2"]) + params["b2"][:, None, :]
        out = jnp.einsum("tec,ecd->td", combine, expert_out)
        return x + out.reshape(b, s, d), _load_balancing_loss(router_probs, expert_mask)

    def loss_fn(params, batch):
        y, aux_loss = moe_layer(params, batch["x"])
        return jnp.mean(jnp.square(y - batch["target"])) + aux_weight * aux_loss

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return _sgd(params, grads, lr), loss

    params, data = _materialize(jax.random.key(0), (
        {
            "router": _fan_in((d_model, experts)),
            "w1": _fan_in((experts, d_model, d_ff), fan_in=d_model),
            "b1": _zeros(experts, d_ff),
            "w2": _fan_in((experts, d_ff, d_model), fan_in=d_ff),
            "b2": _zeros(experts, d_model),
        },
        {"x": _Normal((batch, seq, d_model)), "target": _Normal((batch, seq, d_model))},
    ))
    # O(1) values and sums over <= 128 terms: reordering moves outputs by
    # ~1e-7 (2.4e-7 seen), so 1e-5 leaves margin.  Routing is an argmax, so a
    # near-tie between router logits (gap < ~1e-6; none in the default data)
    # could send a token elsewhere, which no tolerance would absorb.
    return Program("moe_layer_train_step", train_step, (params, data), atol=1e-5,
                   donate_argnums=(0,))


# ---------------------------------------------------------------------------
# Small conv net, SGD
# ---------------------------------------------------------------------------


def _conv3x3(x: jax.Array, kernel: jax.Array, stride: int = 1) -> jax.Array:
    """3x3 SAME convolution of NHWC ``x`` with an HWIO ``kernel``."""
    return jax.lax.conv_general_dilated(
        x, kernel, window_strides=(stride, stride), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_train_step(batch: int = 16, hw: int = 16, channels: tuple = (8, 16), classes: int = 16,
                    in_channels: int = 8, lr: float = 0.1) -> Program:
    """A small conv-net classifier trained with SGD on softmax cross-entropy.

    ``len(channels)`` 3x3 conv + bias + ReLU layers (NHWC; the first with
    stride 1, the rest stride 2), global mean pooling and a dense head.

    ``fn(params, batch) -> (params, loss)`` with ``params = {'convs': [{'w':
    [3, 3, c_in, c_out], 'b': [c_out]}, ...], 'head': {'w', 'b'}}`` and
    ``batch = {'images': f32[batch, hw, hw, in_channels], 'labels': int32[batch]}``.
    """

    def loss_fn(params, batch):
        x = batch["images"]
        for i, layer in enumerate(params["convs"]):
            x = jax.nn.relu(_conv3x3(x, layer["w"], stride=1 if i == 0 else 2) + layer["b"])
        features = jnp.mean(x, axis=(1, 2))
        return _cross_entropy(_dense(params["head"], features), batch["labels"])

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return _sgd(params, grads, lr), loss

    channels = tuple(channels)
    convs = [{"w": _Normal((3, 3, c_in, c_out), math.sqrt(2 / (9 * c_in))),  # He init
              "b": _zeros(c_out)}
             for c_in, c_out in zip((in_channels,) + channels, channels)]
    k_floats, k_labels = jax.random.split(jax.random.key(0))
    params, images = _materialize(k_floats, (
        {"convs": convs, "head": _dense_template(channels[-1], classes)},
        _Normal((batch, hw, hw, in_channels)),
    ))
    data = {"images": images, "labels": jnp.asarray(_randint(k_labels, (batch,), classes))}
    # O(1) activations; kernel gradients sum over batch * hw * hw = 4096
    # positions, and each shard may pick a different conv algorithm, so outputs
    # move by up to ~1e-6 (4.8e-7 seen); 1e-5 leaves margin.
    return Program("conv_train_step", train_step, (params, data), atol=1e-5,
                   donate_argnums=(0,))


# ---------------------------------------------------------------------------
# Large inference MLP
# ---------------------------------------------------------------------------


def mlp_adam_abstract(batch: int, d: int, depth: int) -> tuple[Callable, tuple]:
    """A wide tanh-MLP regression step with optax Adam, from abstract arguments: the
    weights and both moments dominate memory, activations are small.

    Returns ``(fn, (params, opt_state, batch))``; ``fn(params, opt_state, batch) ->
    (params, opt_state, loss)``.
    """
    params = {"layers": [{"w": jax.ShapeDtypeStruct((d, d), jnp.float32),
                          "b": jax.ShapeDtypeStruct((d,), jnp.float32)} for _ in range(depth)]}
    opt = optax.adam(1e-3)
    opt_state = jax.eval_shape(opt.init, params)
    batch_args = {"x": jax.ShapeDtypeStruct((batch, d), jnp.float32),
                  "y": jax.ShapeDtypeStruct((batch, d), jnp.float32)}

    def step(params, opt_state, batch):
        def loss(params):
            h = batch["x"]
            for layer in params["layers"]:
                h = jnp.tanh(h @ layer["w"] + layer["b"])
            return ((h - batch["y"]) ** 2).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step, (params, opt_state, batch_args)


def inference_mlp(batch: int = 16, d: int = 8192, abstract: bool = False) -> Program:
    """``y = gelu(x @ W1) @ W2`` with ``x[batch, d]`` and ``W1, W2[d, d]``.

    The defaults are the large sizes (two 256 MiB weights): pass
    ``abstract=True`` for ``ShapeDtypeStruct`` args that allocate nothing, or
    smaller sizes to run it cheaply.  ``fn(params, x) -> y`` with
    ``params = {'w1', 'w2'}``.
    """

    def forward(params, x):
        return jax.nn.gelu(x @ params["w1"]) @ params["w2"]

    params, x = _materialize(jax.random.key(0), (
        {"w1": _fan_in((d, d)), "w2": _fan_in((d, d))},
        _Normal((batch, d)),
    ), abstract)
    # Outputs are O(1) (unit-variance x, 1 / sqrt(d) weights; |y| <= 3).  Each
    # is a dot over d = 8192 terms, and splitting that contraction across
    # devices reorders it: at most 9.5e-7 seen on CPU for contraction-split,
    # Megatron-style and 2-D shardings.  1e-4 also leaves room for GPU
    # libraries picking other algorithms for the per-shard shapes, while a
    # missing or doubled partial sum is off by O(0.1).
    return Program("inference_mlp", forward, (params, x), atol=1e-4)


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
