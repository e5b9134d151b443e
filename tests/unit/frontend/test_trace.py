"""trace: small programs written by hand, and the graph each must become (node by node,
with the keys, weights and users worked out in comments)."""

import jax
import jax.numpy as jnp
import pytest

from autoshard.frontend.trace import trace

F32 = jnp.float32


def shapes(*dims):
    return [jax.ShapeDtypeStruct(d, F32) for d in dims]


def rows(graph):
    return [(n.kind, n.primitive, n.key) for n in graph.nodes]


def test_one_matmul():
    # x[4,16] @ w[16,8]: two arguments, one dot_general, one output; three values.
    graph = trace(lambda x, w: x @ w, *shapes((4, 16), (16, 8)))
    assert rows(graph) == [("arg", "arg", ("arg", 0)), ("arg", "arg", ("arg", 1)),
                           ("eqn", "dot_general", (0,)), ("output", "output", ("out", 0))]
    x, w, y = graph.values[:3]
    assert (x.shape, w.shape, y.shape) == ((4, 16), (16, 8), (4, 8))
    dot = graph.nodes[2]
    assert dot.operands == (x.id, w.id) and dot.outputs == (y.id,)
    assert graph.users[x.id] == ((2, 0),) and graph.users[w.id] == ((2, 1),)
    assert graph.users[y.id] == ((3, 0),)              # read by the output node only
    assert graph.arg_paths == ("x", "w") and graph.out_paths == ("out",)


def test_literals_constants_and_inlined_jit():
    table = jnp.arange(16.0)

    def f(x, w):
        y = jax.jit(lambda a: a * 2.0)(x)             # inlined: key (0, "jit", 0)
        return jnp.sin(y) @ w + table[:8].sum()       # table: a constant of the jaxpr

    graph = trace(f, *shapes((4, 16), (16, 8)))
    by_key = {n.key: n for n in graph.nodes}
    mul = by_key[(0, "jit", 0)]
    assert mul.primitive == "mul" and mul.operands[1] is None   # the literal 2.0
    assert mul.operand_shapes[1] == ()                          # shapes cover literals
    const = by_key[("const", 0)]
    assert const.kind == "const" and graph.values[const.outputs[0]].shape == (16,)
    assert [n.primitive for n in graph.nodes if n.kind == "eqn"] == [
        "mul", "sin", "dot_general", "slice", "reduce_sum", "add"]


def test_scan_seams_and_weights():
    # scan of length 5: carry c[8], xs[5, 8] -> (c, ys[5, 8]). The body's three equations
    # run 5 times (weight 5); the seams run once, but the carry's second operand (the
    # body's new carry) and the ys seam's operand are written every iteration (5).
    def f(c, xs):
        def body(c, x):
            return jnp.sin(c) + x, c * 2
        return jax.lax.scan(body, c, xs)

    graph = trace(f, *shapes((8,), (5, 8)))
    assert rows(graph)[2:8] == [
        ("boundary", "loop_carry", (0, "carry", 0)), ("boundary", "loop_xs", (0, "xs", 0)),
        ("eqn", "sin", (0, "body", 0)), ("eqn", "add", (0, "body", 1)),
        ("eqn", "mul", (0, "body", 2)), ("boundary", "loop_ys", (0, "ys", 0))]
    carry, xs, sin, add, mul, ys = graph.nodes[2:8]
    assert [n.weight for n in (sin, add, mul)] == [5.0] * 3
    assert carry.weight == 1.0 and carry.operand_weights == (1.0, 5.0)
    assert carry.operands == (graph.arg_nodes[0], add.outputs[0])   # init, then new carry
    assert ys.operand_weights == (5.0,)
    assert graph.values[xs.outputs[0]].shape == (8,)                # one slice of xs
    assert graph.values[ys.outputs[0]].shape == (5, 8)              # the stacked ys
    # the final carry is the seam's second result; the first feeds the body
    assert graph.outputs[0] == carry.outputs[1] and graph.users[carry.outputs[0]] == (
        (sin.id, 0), (mul.id, 0))


def test_while_loop_is_weighted_once():
    # A while loop's trip count is unknown: its body is priced as one iteration.
    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.cos(c[1])),
                                  (0, x))[1]

    graph = trace(f, *shapes((8,)))
    body = [n for n in graph.nodes if "body" in n.key]
    assert {n.primitive for n in body} == {"add", "cos"}
    assert all(n.weight == 1.0 for n in graph.nodes)
    assert sum(n.primitive == "loop_carry" for n in graph.nodes) == 2


def test_cond_branches_share_their_seams():
    def f(p, x):
        return jax.lax.cond(p.sum() > 0, jnp.sin, jnp.cos, x)

    graph = trace(f, *shapes((4,), (8,)))
    by_key = {n.key: n for n in graph.nodes}
    seam_in, seam_out = by_key[(3, "in", 0)], by_key[(3, "out", 0)]
    # lax.cond holds its branches as (false, true): branch0 is cos
    cos, sin = by_key[(3, "branch0", 0)], by_key[(3, "branch1", 0)]
    assert (cos.primitive, sin.primitive) == ("cos", "sin")
    assert sin.operands == cos.operands == seam_in.outputs      # both read one seam
    assert seam_out.operands == (cos.outputs[0], sin.outputs[0])  # one operand per branch


def test_dead_equations_are_not_live():
    def f(x):
        unused = jnp.exp(x)     # noqa: F841  jax.jit drops it
        return jnp.sin(x)

    graph = trace(f, *shapes((8,)))
    exp = next(n for n in graph.nodes if n.primitive == "exp")
    sin = next(n for n in graph.nodes if n.primitive == "sin")
    live = graph.live_values()
    assert exp.outputs[0] not in live and sin.outputs[0] in live


@pytest.mark.parametrize("fn", [lambda x: x, lambda x: (x, 2.0 * x)])
def test_every_value_has_one_producer_and_its_users_read_it(fn):
    graph = trace(fn, *shapes((8,)))
    for value in graph.values:
        producer = graph.nodes[value.producer]
        assert producer.outputs[value.index] == value.id
        for user, i in graph.users[value.id]:
            assert graph.nodes[user].operands[i] == value.id
