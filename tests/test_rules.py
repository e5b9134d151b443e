"""Rule golden strings: each primitive's einsum factors."""

import jax
import jax.numpy as jnp
import pytest

from autoshard.rules import rule_for
from autoshard.trace import trace


def einsum_of(fn, *shapes, primitive=None):
    graph = trace(fn, *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    nodes = [n for n in graph.nodes if n.kind == "eqn"
             and (primitive is None or n.primitive == primitive)]
    node = nodes[0]
    return str(rule_for(node, [graph.values[v].shape for v in node.outputs]))


@pytest.mark.parametrize("fn,shapes,primitive,golden", [
    (lambda x, w: x @ w, [(8, 16), (16, 32)], "dot_general", "mk,kn->mn reduce={k}"),
    (lambda x, w: jnp.einsum("bmk,bkn->bmn", x, w), [(2, 8, 16), (2, 16, 4)], "dot_general",
     "bmk,bkn->bmn reduce={k}"),
    (lambda x: jnp.tanh(x), [(8, 16)], "tanh", "ab->ab"),
    (lambda x, y: x * y, [(8, 16), (8, 16)], "mul", "ab,ab->ab"),
    # jnp broadcasts size-1 dims inside the primitive: the kept dim still splits
    (lambda x, y: x - y, [(8, 16), (8, 1)], "sub", "ab,a.->ab"),
    (lambda x: x.sum(axis=1), [(8, 16)], "reduce_sum", "ab->a reduce={b}"),
    (lambda x: x.max(axis=0), [(8, 16)], "reduce_max", "ab->b reduce={a}"),
    (lambda x: jnp.argmax(x, axis=1), [(8, 16)], "argmax", "a.->a"),
    (lambda x: x.reshape(4, 2, 16), [(8, 16)], "reshape", "ab->a.b"),
    (lambda x: x.reshape(128), [(8, 16)], "reshape", "a.->a"),
    (lambda x: x.T, [(8, 16)], "transpose", "ab->ba"),
    (lambda x: jnp.broadcast_to(x, (4, 8, 16)), [(8, 16)], "broadcast_in_dim", "bc->abc"),
    (lambda x: jnp.concatenate([x, x], axis=0), [(8, 16)], "concatenate", ".a,.a->.a"),
    (lambda x: jnp.cumsum(x, axis=1), [(8, 16)], "cumsum", "a.->a."),
    (lambda x: jnp.sort(x, axis=1), [(8, 16)], "sort", "a.->a."),
    (lambda x: x[:, :4], [(8, 16)], "slice", "a.->a."),
    (lambda x: jnp.pad(x, ((0, 0), (1, 1))), [(8, 16)], "pad", "a.,->a."),
])
def test_golden(fn, shapes, primitive, golden):
    assert einsum_of(fn, *shapes, primitive=primitive) == golden


def test_embedding_gather_is_vocab_parallel():
    def fn(table, ids):
        return jnp.take(table, ids, axis=0)
    graph = trace(fn, jax.ShapeDtypeStruct((128, 32), jnp.float32),
                  jax.ShapeDtypeStruct((4, 8), jnp.int32))
    node = next(n for n in graph.nodes if n.primitive == "gather")
    einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    # table [vocab, d] split on vocab gives partial sums; ids' batch dims split with output
    assert str(einsum) == "dc,ab.->abc reduce={d}"


def test_scatter_splits_the_indexed_operand_dim():
    """The gradient of take_along_axis scatters into the vocabulary: each device applies
    the updates that land in its rows, so the vocabulary splits with nothing to sum."""
    def fn(log_probs, labels):
        return jax.grad(lambda lp: jnp.take_along_axis(lp, labels[..., None], axis=-1).sum())(
            log_probs)
    graph = trace(fn, jax.ShapeDtypeStruct((4, 16, 512), jnp.float32),
                  jax.ShapeDtypeStruct((4, 16), jnp.int32))
    node = next(n for n in graph.nodes if n.primitive == "scatter-add")
    einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "abc,ab..,ab.->abc"


def test_conv_batch_and_features():
    def fn(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    graph = trace(fn, jax.ShapeDtypeStruct((8, 16, 16, 4), jnp.float32),
                  jax.ShapeDtypeStruct((3, 3, 4, 16), jnp.float32))
    node = next(n for n in graph.nodes if n.primitive == "conv_general_dilated")
    einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "a..c,..cb->a..b reduce={c}"


def test_unknown_primitive_warns_and_replicates():
    import autoshard.rules as rules
    from jax.extend.core import Primitive
    unknown = Primitive("made_up_for_this_test")
    unknown.def_abstract_eval(lambda x: x)
    graph = trace(lambda x: unknown.bind(x), jax.ShapeDtypeStruct((8, 8), jnp.float32))
    node = next(n for n in graph.nodes if n.primitive == "made_up_for_this_test")
    rules._warned.discard("made_up_for_this_test")
    with pytest.warns(UserWarning, match="made_up_for_this_test"):
        einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "..->.."


def test_replicated_on_purpose_does_not_warn():
    """A primitive of the replicated table (with its reason) stays whole, silently."""
    import warnings
    from autoshard.rules.replicated import REPLICATED
    graph = trace(lambda x: jnp.linalg.cholesky(x), jax.ShapeDtypeStruct((8, 8), jnp.float32))
    node = next(n for n in graph.nodes if n.primitive == "cholesky")
    assert "cholesky" in REPLICATED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "..->.."
