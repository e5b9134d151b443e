"""Transformer pieces shared by ``gpt``, ``moe`` and ``vit``: attention, MLP, block, rules.

Parameters carry Flax sharding metadata (``nnx.with_partitioning``) with the logical axis
names of :data:`LOGICAL_RULES`: ``embed`` (model width), ``heads``, ``kv`` (head width),
``mlp`` (hidden width), ``vocab``, ``expert``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from autoshard.zoo import experts as ex
from autoshard.zoo.experts import MODEL

LOGICAL_RULES = (("vocab", MODEL), ("heads", MODEL), ("mlp", MODEL), ("expert", MODEL),
                 ("embed", None), ("kv", None), ("layers", None))
"""Megatron's layout, by logical name: heads, MLP width and vocabulary on the model axis."""


def normal_init(names: tuple | None, std: float | None = None) -> Callable:
    """A normal initializer (std ``1/sqrt(fan_in)`` unless given), annotated with ``names``.

    The zoo fills parameters on the host (``common.init_params``); the initializer only
    fixes shapes and metadata."""
    init = nnx.initializers.normal(std or 0.02)
    return nnx.with_partitioning(init, names) if names else init


def zeros_init(names: tuple | None) -> Callable:
    init = nnx.initializers.zeros_init()
    return nnx.with_partitioning(init, names) if names else init


def ones_init(names: tuple | None) -> Callable:
    init = nnx.initializers.ones_init()
    return nnx.with_partitioning(init, names) if names else init


def _names(annotate: bool, *names):
    return tuple(names) if annotate else None


def norm(kind: str, d: int, annotate: bool, rngs: nnx.Rngs) -> nnx.Module:
    """``"rms"``: RMSNorm, ``"layer"``: LayerNorm; computed in f32."""
    scale = ones_init(_names(annotate, "embed"))
    if kind == "rms":
        return nnx.RMSNorm(d, epsilon=1e-6, scale_init=scale, rngs=rngs)
    if kind == "layer":
        return nnx.LayerNorm(d, epsilon=1e-6, scale_init=scale,
                             bias_init=zeros_init(_names(annotate, "embed")), rngs=rngs)
    raise ValueError(f"norm must be 'rms' or 'layer', got {kind!r}")


class MLP(nnx.Module):
    """``fc2(gelu(fc1(x)))``; ``fc1`` column-parallel, ``fc2`` row-parallel under Megatron."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, annotate: bool, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(d_model, d_ff, dtype=dtype, rngs=rngs,
                              kernel_init=normal_init(_names(annotate, "embed", "mlp")),
                              bias_init=zeros_init(_names(annotate, "mlp")))
        self.fc2 = nnx.Linear(d_ff, d_model, dtype=dtype, rngs=rngs,
                              kernel_init=normal_init(_names(annotate, "mlp", "embed")),
                              bias_init=zeros_init(_names(annotate, "embed")))

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = ex.constrain(self.fc1(x), ex.MLP_AXES)
        return self.fc2(jax.nn.gelu(hidden))


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Attention has no biases (a key bias only shifts softmax, so its gradient is rounding
    noise that Adam would blow up to +-lr). ``mlp`` is any module ``x -> (y, aux_loss)``
    or ``x -> y``; default the GELU :class:`MLP`.
    """

    def __init__(self, d_model: int, heads: int, d_ff: int, *, norm_kind: str = "rms",
                 dtype=None, annotate: bool = False, mlp: nnx.Module | None = None,
                 rngs: nnx.Rngs):
        self.ln1 = norm(norm_kind, d_model, annotate, rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=d_model, use_bias=False, decode=False,
            keep_rngs=False, dtype=dtype, rngs=rngs,
            kernel_init=normal_init(_names(annotate, "embed", "heads", "kv")),
            out_kernel_init=normal_init(_names(annotate, "heads", "kv", "embed")))
        self.ln2 = norm(norm_kind, d_model, annotate, rngs)
        self.mlp = mlp if mlp is not None else MLP(d_model, d_ff, dtype=dtype,
                                                   annotate=annotate, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None):
        """Returns ``(x, aux_loss)``: the MLP's auxiliary loss, 0 for a dense MLP."""
        h = self.ln1(x).astype(x.dtype)
        x = ex.constrain(x + self.attn(h, mask=mask).astype(x.dtype), ex.RESIDUAL_AXES)
        out = self.mlp(self.ln2(x).astype(x.dtype))
        out, aux = out if isinstance(out, tuple) else (out, jnp.zeros((), jnp.float32))
        return ex.constrain(x + out.astype(x.dtype), ex.RESIDUAL_AXES), aux


def transformer_fan_in(path: str, shape: tuple) -> int:
    """Fan-in of transformer weights: q/k/v kernels ``[(L,) d, heads, kv]`` read ``d``,
    the output projection ``[(L,) heads, kv, d]`` reads ``heads * kv``, stacked expert or
    layer kernels read their second-to-last dim."""
    if any(f"['{n}']['kernel']" in path for n in ("query", "key", "value")):
        return shape[-3]
    if "['out']['kernel']" in path:
        return shape[-3] * shape[-2]
    if "['patch_embed']['kernel']" in path:
        return math.prod(shape[:-1])
    return shape[-2] if len(shape) >= 2 else 1


def tp_rules(layer_dims: int = 0) -> list:
    """Megatron rules for these blocks: column-parallel q/k/v and ``fc1``, row-parallel
    ``out`` and ``fc2``, vocab-parallel embedding and head. ``layer_dims`` leading stacked
    dims (scan over layers) stay whole."""
    lead = (None,) * layer_dims
    block = [
        (r"\['attn'\]\['(query|key|value)'\]\['kernel'\]", P(*lead, None, MODEL, None)),
        (r"\['attn'\]\['out'\]\['kernel'\]", P(*lead, MODEL, None, None)),
        (r"\['fc1'\]\['kernel'\]", P(*lead, None, MODEL)),
        (r"\['fc1'\]\['bias'\]", P(*lead, MODEL)),
        (r"\['fc2'\]\['kernel'\]", P(*lead, MODEL, None)),
    ]
    return block + [
        (r"\['embed'\]\['embedding'\]", P(MODEL, None)),
        (r"\['head'\]\['kernel'\]", P(None, MODEL)),
        (r"\['head'\]\['bias'\]", P(MODEL)),
    ]
