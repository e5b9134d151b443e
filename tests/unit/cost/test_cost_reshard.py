"""cost.reshard alone: ``ReshardPrices`` and ``price_groups`` over small programs.

Mesh {"a": 2, "b": 4}; links: "a" 1e10 B/s, "b" 4e10 B/s, 1e-6 s of latency each. A ring
all-gather whose result is B bytes per device costs latency + (n-1)/n B / bandwidth.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.cost import ReshardPrices, group_nodes, price_groups, reshard_collectives
from autoshard.cost.strategies import build_strategies
from autoshard.frontend.trace import trace
from autoshard.target.hardware import Hardware

HW = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=1e9,
              link_bandwidth={"a": 1e10, "b": 4e10}, link_latency=1e-6)
SIZES = {"a": 2, "b": 4}
F32 = jnp.float32


def space_of(fn, *shapes):
    graph = trace(fn, *(jax.ShapeDtypeStruct(s, F32) for s in shapes))
    return build_strategies(graph, SIZES, HW)


def test_an_all_gather_is_priced_as_the_hardware_says():
    space = space_of(lambda x: x * 2.0, (64, 256))
    prices = ReshardPrices(space)
    x = space.graph.nodes[space.graph.arg_nodes[0]].outputs[0]
    whole = 64 * 256 * 4
    for axis, n in SIZES.items():
        ring = HW.link_latency + (n - 1) / n * whole / HW.link_bandwidth[axis]
        assert prices.reshard(x, ((axis,), ()), ((), ())) == pytest.approx(ring)
    assert prices.reshard(x, ((), ()), (("a",), ())) == 0.0   # a slice is free


def mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def test_edges_and_groups_sum_the_reshards_of_their_reads():
    # with no copies shared, an edge [s, t] is the reshard of every read from group u's
    # strategy s to group v's t; a group's seconds are its members' own plus the
    # reshards of the reads inside it
    space = space_of(mlp, (64, 128), (128, 256), (256, 32))
    prices = ReshardPrices(space)
    groups = group_nodes(space, prices, {})
    costs = price_groups(space.graph, groups, prices, {})
    graph, of = space.graph, groups.group_of_node
    edges = {(e.u, e.v): e.cost for e in costs.edges}
    want = {key: np.zeros_like(m) for key, m in edges.items()}
    inside = [np.zeros(groups.group_size(g)) for g in range(len(groups.groups))]
    for node in graph.nodes:
        for i, v in enumerate(node.operands):
            if v is None:
                continue
            value = graph.values[v]
            srcs = groups.out_specs(value.producer, value.index)
            dsts = groups.in_specs(node.id, i)
            gu, gv = of[value.producer], of[node.id]
            if gu == gv:
                inside[gu] += [prices.reshard(v, a, b) for a, b in zip(srcs, dsts)]
            else:
                want[gu, gv] += [[prices.reshard(v, a, b) for b in dsts] for a in srcs]
    assert edges and set(edges) == set(want)
    for key, matrix in edges.items():
        np.testing.assert_allclose(matrix, want[key], rtol=1e-12)
    for g, members in enumerate(groups.groups):
        own = sum(groups.menus[n].seconds for n in members)
        np.testing.assert_allclose(costs.node_costs[g], own + inside[g], rtol=1e-12)
        np.testing.assert_allclose(costs.node_costs[g], costs.compute[g]
                                   + costs.collectives[g] + costs.reshard[g], rtol=1e-9)


def test_a_read_a_shared_copy_pays_for_leaves_its_edge():
    # the specs a shared copy pays for (``paid_once``) drop out of the read's edge
    space = space_of(mlp, (64, 128), (128, 256), (256, 32))
    graph, prices = space.graph, ReshardPrices(space)
    groups = group_nodes(space, prices, {})
    full = {(e.u, e.v): e.cost for e in price_groups(graph, groups, prices, {}).edges}
    reads = [(node.id, i, graph.values[v]) for node in graph.nodes
             for i, v in enumerate(node.operands) if v is not None
             and groups.group_of_node[graph.values[v].producer] != groups.group_of_node[node.id]]
    assert reads
    for node_id, i, value in reads:
        gu, gv = groups.group_of_node[value.producer], groups.group_of_node[node_id]
        dsts = groups.in_specs(node_id, i)
        paid = np.array([k % 2 == 0 for k in range(len(dsts))])   # every other spec
        costs = price_groups(graph, groups, prices, {(node_id, i): (None, paid, paid)})
        edge = next(e.cost for e in costs.edges if (e.u, e.v) == (gu, gv))
        read = np.array([[prices.reshard(value.id, a, b) for b in dsts]
                         for a in groups.out_specs(value.producer, value.index)])
        np.testing.assert_allclose(edge, full[gu, gv] - np.where(paid[None, :], read, 0.0),
                                   rtol=1e-9, atol=1e-15)


def test_an_array_of_prng_keys_is_priced_as_its_words():
    # a stack of typed keys (an equinox loop's key per layer) has no numpy dtype: an
    # all-gather of it moves its key words, as one of uint32 pairs does
    hw = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=16e9,
                  link_bandwidth={"a": 1e10}, link_latency=1e-6)
    keys = jax.random.split(jax.random.key(0), 8)
    src, dst = (("a",), ()), ((), ())
    typed = reshard_collectives((8,), keys.dtype, src, dst, {"a": 4}, hw)
    words = reshard_collectives((8, 2), jnp.uint32, (("a",), ()), ((), ()), {"a": 4}, hw)
    assert [c.kind for c in typed] == ["all-gather"]
    assert typed[0].num_bytes == words[0].num_bytes
