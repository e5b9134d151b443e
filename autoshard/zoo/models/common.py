"""What every zoo model shares: parameter init, the pure train step, state and batches.

A model's state is a plain pytree ``{'params': ..., 'opt_state': ..., 'step': int32[]}``
(plus ``'batch_stats'`` for models with batch norm), where ``params`` is the nnx model's
``nnx.Param`` state as nested dicts (``nnx.to_pure_dict``), so paths read
``state['params']['blocks'][0]['attn']['query']['kernel']``. The train step merges the
params into the model with ``nnx.merge`` inside, so autoshard traces plain arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from autoshard.rewrite.accumulate import value_and_grad
from autoshard.zoo import experts as ex
from autoshard.zoo.models.case import TrainCase

LossFn = Callable[[nnx.Module, Any], jax.Array]


def abstract_model(build: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    """The model with ``ShapeDtypeStruct`` values: nothing is initialized or allocated."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: build(nnx.Rngs(0)))


def default_fan_in(path: str, shape: tuple) -> int:
    """Inputs feeding one output unit: every dim but the last."""
    return max(1, math.prod(shape[:-1]))


def init_params(abstract: Any, seed: int, fan_in: Callable[[str, tuple], int] = default_fan_in,
                embed_std: float = 0.02) -> Any:
    """Fill abstract params on the host: norms' ``scale`` 1, biases 0, ``embedding`` /
    position tables ``N(0, embed_std)``, other weights LeCun normal ``N(0, 1 / fan_in)``.

    Host numpy keeps this fast (every separate jax init op costs an XLA compile on CPU)
    and deterministic in ``seed``.
    """
    rng = np.random.default_rng(seed)

    def leaf(key_path, x):
        path = jax.tree_util.keystr(key_path)
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)
        if path.endswith("['scale']"):
            return jnp.asarray(np.ones(shape, dtype))
        if path.endswith("['bias']"):
            return jnp.asarray(np.zeros(shape, dtype))
        if "embed" in path.rsplit("[", 1)[-1] or path.endswith("['embedding']"):
            std = embed_std
        else:
            std = 1.0 / math.sqrt(fan_in(path, shape))
        return jnp.asarray((rng.standard_normal(shape, np.float32) * std).astype(dtype))

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def to_abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer ``labels``, computed in f32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def classifier_loss(model, batch) -> jax.Array:
    """Cross-entropy of ``model(batch["x"])`` against ``batch["y"]`` (mlp, resnet, vit)."""
    return cross_entropy(model(batch["x"]), batch["y"])


def adamw(lr: float, weight_decay: float = 0.01, eps: float = 1e-6) -> optax.GradientTransformation:
    """The zoo's optimizer. ``eps = 1e-6`` bounds how much Adam's first step amplifies
    reduction-order noise in near-zero gradients (see ``atol`` of each case)."""
    return optax.adamw(lr, b1=0.9, b2=0.95, eps=eps, weight_decay=weight_decay)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, loss_fn: LossFn,
                    batch_stats: bool = False) -> Callable:
    """``train_step(state, batch) -> (state, loss)``: one optimizer step, pure.

    ``loss_fn(model, batch)`` runs the merged model; with ``batch_stats`` the model's
    ``nnx.BatchStat`` state is merged in too and its updated value returned in the state.
    """

    def loss_and_stats(params, stats, batch):
        model = nnx.merge(graphdef, params, stats) if batch_stats else nnx.merge(graphdef, params)
        loss = loss_fn(model, batch)
        new_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)) if batch_stats else None
        return loss, new_stats

    def train_step(state, batch):
        (loss, stats), grads = value_and_grad(loss_and_stats, has_aux=True)(
            state["params"], state.get("batch_stats"), batch)
        grads = ex.constrain_gradients(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state, "step": state["step"] + 1}
        if batch_stats:
            new_state["batch_stats"] = stats
        return new_state, loss

    return train_step


def initial_state(params: Any, tx: optax.GradientTransformation, batch_stats: Any = None,
                  abstract: bool = False) -> dict:
    """``{'params', 'opt_state', 'step'}`` (and ``'batch_stats'``), or its shapes."""
    if abstract:
        state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
                 "step": jax.ShapeDtypeStruct((), jnp.int32)}
    else:
        # The adam family starts from zeros (count, moments); filling zeros on the host
        # avoids compiling one XLA program per parameter shape.
        opt_state = jax.tree.map(lambda x: jnp.asarray(np.zeros(x.shape, x.dtype)),
                                 jax.eval_shape(tx.init, params))
        state = {"params": params, "opt_state": opt_state,
                 "step": jnp.asarray(np.zeros((), np.int32))}
    if batch_stats is not None:
        state["batch_stats"] = batch_stats
    return state


def batch_maker(make: Callable[[jax.Array], Any], shapes: Any, seed: int,
                abstract: bool) -> Callable[[int], Any]:
    """``make_batch(step)``: ``make(key)`` jitted, with the key ``fold_in(key(seed), step)``;
    abstract cases return ``shapes`` for every step."""
    if abstract:
        return lambda step: shapes
    make = jax.jit(make)
    base = jax.random.key(seed)
    return lambda step: make(jax.random.fold_in(base, step))


def build_case(*, model: str, size: str, module: nnx.Module, tx: optax.GradientTransformation,
               loss_fn: LossFn, make: Callable[[jax.Array], Any],
               experts: Callable[[Any, Any], Mapping], atol: float, abstract: bool, seed: int,
               fan_in: Callable[[str, tuple], int] = default_fan_in, rtol: float = 1e-5,
               annotations: Mapping[str, tuple] | None = None,
               axis_rules: tuple = ()) -> TrainCase:
    """Split an abstract nnx ``module`` and assemble its :class:`TrainCase`."""
    has_stats = bool(jax.tree.leaves(nnx.state(module, nnx.BatchStat)))
    if has_stats:
        graphdef, params, stats = nnx.split(module, nnx.Param, nnx.BatchStat)
        stats = nnx.to_pure_dict(stats)
    else:
        graphdef, params = nnx.split(module, nnx.Param)
        stats = None
    params = nnx.to_pure_dict(params)
    if not abstract:
        params = init_params(params, seed, fan_in)
        if stats is not None:
            stats = jax.tree_util.tree_map_with_path(
                lambda k, x: jnp.asarray((np.ones if jax.tree_util.keystr(k).endswith(
                    "['var']") else np.zeros)(x.shape, x.dtype)), stats)
    state = initial_state(params, tx, stats, abstract)
    batch_shapes = jax.eval_shape(make, jax.random.key(0))
    make_batch = batch_maker(make, batch_shapes, seed + 1, abstract)
    return TrainCase(model=model, size=size,
                     train_step=make_train_step(graphdef, tx, loss_fn, has_stats),
                     state=state, make_batch=make_batch,
                     experts=experts(to_abstract(state), batch_shapes), atol=atol,
                     donate_argnums=(0,), abstract=abstract, rtol=rtol,
                     annotations=dict(annotations or {}), axis_rules=tuple(axis_rules))


def logical_annotations(module: nnx.Module) -> dict[str, tuple]:
    """``{"state['params']...": logical axis names}`` of params made with
    ``nnx.with_partitioning`` (Flax's sharding metadata)."""
    out = {}
    params = nnx.state(module, nnx.Param)
    for key_path, var in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        names = var.get_metadata().get("out_sharding") or var.get_metadata().get("sharding")
        if names:
            out["state['params']" + jax.tree_util.keystr(key_path)] = tuple(names)
    return out
