"""strategies: the candidate specs of each node and what each costs, worked out by hand.

One device: 1e12 FLOP/s, 1e11 B/s of HBM; mesh axis "a" of 4 devices linked at 1e10 B/s
with 1e-6 s of latency per collective. Compute is the roofline max(flops / FLOP/s,
bytes touched / HBM B/s); a ring all-reduce of B bytes over n devices costs
latency + 2 (n-1)/n B / bandwidth, a reduce-scatter latency + (n-1)/n B / bandwidth.
"""

import jax
import jax.numpy as jnp
import pytest

from autoshard.cost import forget_prices, kept
from autoshard.cost.strategies import (
    KEPT_MENUS_MAX,
    build_strategies,
    plain,
    value_strategies,
)
from autoshard.frontend.trace import trace
from autoshard.target.hardware import Hardware

HW = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=1e9, link_bandwidth={"a": 1e10},
              link_latency=1e-6)
SIZES = {"a": 4}
A = ("a",)
WHOLE = ()


@pytest.fixture(scope="module")
def matmul_space():
    # x[64,128] @ w[128,256] in f32: 2*64*128*256 = 4,194,304 FLOPs; x is 32 KiB, w 128
    # KiB, the result 64 KiB.
    graph = trace(lambda x, w: x @ w, jax.ShapeDtypeStruct((64, 128), jnp.float32),
                  jax.ShapeDtypeStruct((128, 256), jnp.float32))
    return build_strategies(graph, SIZES, HW)


def by_specs(strategies):
    return {(s.in_specs, s.out_specs): s for s in strategies}


def test_the_dot_rule(matmul_space):
    assert str(matmul_space.einsums[2]) == "mk,kn->mn reduce={k}"


def test_matmul_strategies_and_their_costs(matmul_space):
    found = by_specs(matmul_space.strategies[2])
    # replicated: all 4,194,304 FLOPs on every device, 4.19 µs; it touches
    # 32768 + 131072 + 65536 bytes = 2.29 µs of HBM, so it is compute bound.
    s = found[((WHOLE, WHOLE), (WHOLE, WHOLE)), ((WHOLE, WHOLE),)]
    assert s.compute_s == pytest.approx(4.194304e-6) and s.comm_s == 0
    # n split 4 ways: a quarter of the FLOPs, 1.048576 µs; bytes 32768 + 32768 + 16384
    # = 0.82 µs: compute bound again.
    s = found[((WHOLE, WHOLE), (WHOLE, A)), ((WHOLE, A),)]
    assert s.compute_s == pytest.approx(1.048576e-6) and s.comm_s == 0
    # m split: the same FLOPs, but every device reads all of w: 8192 + 131072 + 16384
    # bytes = 1.55648 µs, memory bound.
    s = found[((A, WHOLE), (WHOLE, WHOLE)), ((A, WHOLE),)]
    assert s.compute_s == pytest.approx(1.55648e-6) and s.comm_s == 0


def test_a_split_contraction_reduces_its_partial_result(matmul_space):
    split_k = [s for s in matmul_space.strategies[2]
               if s.in_specs == ((WHOLE, A), (A, WHOLE))]
    # each device multiplies a quarter of k: 8192 + 32768 bytes in, the whole 65536-byte
    # partial result out = 1.06496 µs (memory bound over 1.048576 µs of FLOPs)
    assert [s.compute_s for s in split_k] == [pytest.approx(1.06496e-6)] * 3
    comm = {s.out_specs: (s.comm_s, [c.kind for c in s.collectives]) for s in split_k}
    # all-reduce of 65536 bytes over 4: 1e-6 + 2 * 3/4 * 65536 / 1e10 = 10.8304 µs
    assert comm[((WHOLE, WHOLE),)] == (pytest.approx(1.08304e-5), ["all-reduce"])
    # reduce-scatter onto either dim: 1e-6 + 3/4 * 65536 / 1e10 = 5.9152 µs
    assert comm[((A, WHOLE),)] == (pytest.approx(5.9152e-6), ["reduce-scatter"])
    assert comm[((WHOLE, A),)] == (pytest.approx(5.9152e-6), ["reduce-scatter"])
    assert len(split_k) == 3


def test_arguments_offer_every_spec_that_divides(matmul_space):
    # x[64,128] on one axis of 4: whole, rows split, or columns split; nothing to compute
    x = matmul_space.strategies[0]
    assert {s.out_specs[0] for s in x} == {(WHOLE, WHOLE), (A, WHOLE), (WHOLE, A)}
    assert all(s.seconds == 0 for s in x)


def test_value_strategies():
    # 31 x 33 = 1023 elements, under the 1024 kept whole
    assert [s.out_specs[0] for s in value_strategies((31, 33), SIZES)] == [(WHOLE, WHOLE)]
    # 6 rows do not divide over 4 devices; 256 columns do
    assert {s.out_specs[0] for s in value_strategies((6, 256), SIZES)} == {
        (WHOLE, WHOLE), (WHOLE, A)}
    # a pin is the only candidate
    assert [s.out_specs[0] for s in value_strategies((64, 64), SIZES, (A, WHOLE))] == [
        (A, WHOLE)]


def test_a_scanned_stack_keeps_its_layer_dim_whole():
    # ws[4, 64, 64] is sliced by the scan one layer at a time: splitting its leading dim
    # would gather the whole stack before the loop
    def f(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    graph = trace(f, jax.ShapeDtypeStruct((64, 64), jnp.float32),
                  jax.ShapeDtypeStruct((4, 64, 64), jnp.float32))
    space = build_strategies(graph, SIZES, HW)
    ws = space.strategies[graph.arg_nodes[1]]
    assert all(s.out_specs[0][0] == WHOLE for s in ws) and len(ws) == 3


def test_every_strategy_fits_its_node():
    # Over a few programs: one spec per operand (None for literals) and per result, each
    # with one entry per dim, and costs that are finite and not negative.
    def programs():
        yield lambda x, w: jnp.tanh(x @ w).sum(0), ((64, 128), (128, 256))
        yield lambda x: jnp.cumsum(x, 1) * 2.0, ((64, 128),)
        yield lambda x: x.reshape(8, 8, 128).transpose(2, 0, 1), ((64, 128),)

    for fn, dims in programs():
        graph = trace(fn, *[jax.ShapeDtypeStruct(d, jnp.float32) for d in dims])
        space = build_strategies(graph, SIZES, HW)
        for node, strategies in zip(graph.nodes, space.strategies):
            assert strategies, node
            for s in strategies:
                if node.kind in ("eqn", "boundary", "output"):
                    assert len(s.in_specs) == len(node.operands)
                    for spec, v, shape in zip(s.in_specs, node.operands, node.operand_shapes):
                        assert (spec is None) == (v is None) and (
                            spec is None or len(spec) == len(shape))
                assert [len(o) for o in s.out_specs] == [
                    len(graph.values[v].shape) for v in node.outputs]
                assert 0 <= s.compute_s < float("inf") and 0 <= s.comm_s < float("inf")


def test_a_contraction_scattered_onto_a_split_batch_dim_gathers_it_whole():
    """XLA all-reduces, all-gathers the batch dim whole and slices (``regathered_scatter``)
    for a batched dot; a reduce op scattered onto a kept dim already split slices."""
    sizes = {"a": 2, "b": 4}
    dot = trace(lambda h, w: jnp.einsum("ebd,edf->ebf", h, w),
                jax.ShapeDtypeStruct((16, 32, 64), jnp.float32),
                jax.ShapeDtypeStruct((16, 64, 32), jnp.float32))
    reduce = trace(lambda x: x.sum(1), jax.ShapeDtypeStruct((16, 64, 32), jnp.float32))

    def scattered(graph, in_specs, out_spec):
        space = build_strategies(graph, sizes, HW)
        node = next(n for n in graph.nodes if n.kind == "eqn")
        found = [s for s in space.strategies[node.id]
                 if s.in_specs[:len(in_specs)] == in_specs and s.out_specs == (out_spec,)]
        return [[c.kind for c in s.collectives] for s in found]
    split = ((("a",), (), ("b",)), (("a",), ("b",), ()))
    assert scattered(dot, split, (("a", "b"), (), ())) == [["all-reduce", "all-gather"]]
    assert scattered(dot, split, (("a",), ("b",), ())) == [["reduce-scatter"]]
    assert scattered(reduce, ((("a",), ("b",), ()),), (("a", "b"), ())) == [["reduce-scatter"]]


def test_strategies_kept_from_programs_built_before_are_those_built_afresh():
    # a process keeps each node's strategies per hardware, mesh and node: a node alike
    # in a later program (a remat or microbatch setting repeats most of its equations)
    # gets the strategies it would get in a fresh process, and nodes differing in shape,
    # dtype, mesh or hardware get their own
    slow = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=1e9,
                    link_bandwidth={"a": 1e9, "b": 1e9}, link_latency=1e-5)
    programs = [
        (lambda x, w: x @ w, ((64, 128), (128, 256)), jnp.float32),
        (lambda x, w: jnp.tanh(x @ w).sum(0), ((64, 128), (128, 256)), jnp.float32),
        (lambda x, w: jnp.tanh(x @ w).sum(0), ((64, 128), (128, 256)), jnp.bfloat16),
        (lambda x, w: jnp.tanh(x @ w).sum(0), ((32, 128), (128, 256)), jnp.float32),
        (lambda x, w: jax.nn.relu(x @ w) @ w.T, ((64, 128), (128, 256)), jnp.float32),
        # a scatter-add's params hold a jaxpr: not kept past its program
        (lambda x, w: x.at[jnp.arange(8)].add(1.0) @ w, ((64, 128), (128, 256)), jnp.float32),
    ]
    settings = [(SIZES, HW), ({"a": 2, "b": 2}, HW), (SIZES, slow)]

    cases = [(trace(fn, *[jax.ShapeDtypeStruct(d, dtype) for d in dims]), sizes, hw)
             for fn, dims, dtype in programs for sizes, hw in settings]
    forget_prices()
    built = [build_strategies(*case).strategies for case in cases]
    for case, found in zip(cases, built):
        forget_prices()
        assert build_strategies(*case).strategies == found
    # the dot of the first program is the dot of the second: one menu, kept
    assert any(a is b for a in built[0] for b in built[len(settings)])
    # what the last case (the scatter-add on the slow hardware) left kept
    signatures = [key[0] for key in kept.kept("strategies", slow, KEPT_MENUS_MAX)]
    assert signatures and all(plain(signature) for signature in signatures)
    assert not any("scatter" in str(signature[1]) for signature in signatures)
