"""cost: the price of moving an array from one spec to another, worked out by hand, and
the shape of the cost graph over a small program.

Mesh {"a": 2, "b": 4}; links: "a" 1e10 B/s, "b" 4e10 B/s, 1e-6 s of latency each; HBM
1e11 B/s. The array is f32[64, 256]: 65536 bytes whole. A ring all-gather whose result
is B bytes per device costs latency + (n-1)/n B / bandwidth; an all-to-all of B bytes
per device latency + (n-1)/n B / bandwidth, plus reading and writing B to put the
chunks in peer order.
"""

import itertools

import jax
import jax.numpy as jnp
import pytest

from autoshard import specs
from autoshard.cost import build_cost_graph, reshard_collectives, reshard_seconds
from autoshard.hardware import Hardware
from autoshard.strategies import build_strategies
from autoshard.trace import trace

HW = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=1e9,
              link_bandwidth={"a": 1e10, "b": 4e10}, link_latency=1e-6)
SIZES = {"a": 2, "b": 4}
SHAPE, F32 = (64, 256), jnp.float32


def moves(src, dst):
    return [(c.kind, c.axes, c.num_bytes, pytest.approx(c.seconds))
            for c in reshard_collectives(SHAPE, F32, src, dst, SIZES, HW)]


def test_gather_to_whole():
    # rows split over a -> whole: all-gather over a, 65536 bytes out per device:
    # 1e-6 + 1/2 * 65536 / 1e10 = 4.2768 µs
    assert moves((("a",), ()), ((), ())) == [("all-gather", ("a",), 65536, 4.2768e-6)]


def test_gathers_off_two_dims_run_one_per_dim_last_dim_first():
    # P(a, b) -> whole: XLA gathers one dim at a time, the last first, each along the
    # major dim of its buffer. b off dim 1: the 8192-byte shard is copied so dim 1 is
    # major (read and write: 2 * 8192 / 1e11 = 0.16384 µs), then gathered over b's 4
    # devices to 32768 bytes: 1e-6 + 3/4 * 32768 / 4e10 + 0.16384 µs = 1.77824 µs.
    # a off dim 0: copied back so dim 0 is major (2 * 32768 / 1e11 = 0.65536 µs), then
    # gathered over a's 2 to 65536 bytes: 1e-6 + 1/2 * 65536 / 1e10 + 0.65536 µs
    # = 4.93216 µs
    assert moves((("a",), ("b",)), ((), ())) == [
        ("all-gather", ("b",), 32768, 1.77824e-6), ("all-gather", ("a",), 65536, 4.93216e-6)]


def test_gather_one_axis_of_two():
    # P((a, b)) -> P(a): b leaves; what is left is split over a: 32768 bytes per device
    # after the gather over b's 4 devices: 1e-6 + 3/4 * 32768 / 4e10 = 1.6144 µs
    assert moves((("a", "b"), ()), (("a",), ())) == [("all-gather", ("b",), 32768, 1.6144e-6)]


def test_an_axis_moving_dims_is_an_all_to_all():
    # P(a, None) -> P(None, a): 32768 bytes per device, 1e-6 + 1/2 * 32768 / 1e10
    # = 2.6384 µs, plus 2 * 32768 / 1e11 = 0.65536 µs of copying: 3.29376 µs
    assert moves((("a",), ()), ((), ("a",))) == [("all-to-all", ("a",), 32768, 3.29376e-6)]


def test_an_axis_swapped_for_another_gathers_then_slices():
    # P(b) -> P(a): b is gathered (65536 bytes at 4e10 over 4: 1e-6 + 3/4 * 65536 / 4e10
    # = 2.2288 µs); joining a is a local slice, free
    assert moves((("b",), ()), (("a",), ())) == [("all-gather", ("b",), 65536, 2.2288e-6)]


def test_slicing_is_free():
    assert moves(((), ()), (("a",), ())) == []
    assert moves((("a",), ()), (("a", "b"), ())) == []
    assert moves((("a",), ("b",)), (("a",), ("b",))) == []


def test_only_a_reshard_that_adds_axes_is_free():
    # Over every pair of specs: free exactly when each dim of the destination extends
    # the source's (a local slice); anything else moves bytes and pays a latency.
    options = list(specs.enumerate_specs(SHAPE, SIZES))
    assert len(options) == 9   # whole; a, b or (a, b) on either dim; a and b on one each
    for src, dst in itertools.product(options, repeat=2):
        extends = all(d[:len(s)] == s for s, d in zip(src, dst))
        seconds = reshard_seconds(SHAPE, F32, src, dst, SIZES, HW)
        assert (seconds == 0) == extends, (src, dst, seconds)
        assert extends or seconds >= HW.link_latency


def test_the_cost_graph_covers_every_node_once():
    graph = trace(lambda x, w: jnp.tanh(x @ w) + 1.0, jax.ShapeDtypeStruct((64, 128), F32),
                  jax.ShapeDtypeStruct((128, 256), F32))
    space = build_strategies(graph, {"a": 4}, Hardware(link_bandwidth={"a": 1e10}))
    cg = build_cost_graph(space)
    members = sorted(n for group in cg.groups for n in group)
    assert members == list(range(len(graph.nodes)))
    for g, group in enumerate(cg.groups):
        assert all(cg.group_of_node[n] == g for n in group)
        options = len(cg.node_costs[g])
        for n in group:     # each group strategy picks one strategy of every member
            assert len(cg.choice[n]) == options
            assert all(0 <= s < len(space.strategies[n]) for s in cg.choice[n])
    for edge in cg.edges:   # seconds for every pair of the two groups' strategies
        assert edge.cost.shape == (len(cg.node_costs[edge.src]), len(cg.node_costs[edge.dst]))
        assert (edge.cost >= 0).all()
