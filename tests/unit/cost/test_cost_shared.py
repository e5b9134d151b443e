"""cost.shared alone: the copies several readers share (``share_copies``) and the
latencies of combined collectives, over small programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.cost import (
    ReshardPrices,
    chained_latencies,
    combined_latencies,
    combining,
    group_nodes,
    share_copies,
    shared,
)
from autoshard.cost.strategies import build_strategies
from autoshard.frontend.trace import trace
from autoshard.target.hardware import Backend, Hardware
from autoshard.target.xla import loop_scope

HW = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=1e9,
              link_bandwidth={"a": 1e10, "b": 4e10}, link_latency=1e-6)
SIZES = {"a": 2, "b": 4}
F32 = jnp.float32


def three_readers(w, x1, x2, x3):
    return x1 @ w, x2 @ w, x3 @ w


def rooms(fn, *shapes, backend=None):
    graph = trace(fn, *(jax.ShapeDtypeStruct(s, F32) for s in shapes))
    space = build_strategies(graph, SIZES, HW, backend=backend)
    prices = ReshardPrices(space)
    return space, prices, group_nodes(space, prices, {})


SHAPES = ((128, 256), (64, 128), (64, 128), (64, 128))


def test_many_readers_pay_for_one_copy_once():
    space, prices, groups = rooms(three_readers, *SHAPES)
    w = space.graph.nodes[space.graph.arg_nodes[0]].outputs[0]
    gw = groups.group_of_node[space.graph.values[w].producer]
    readers = {groups.group_of_node[u] for u, _ in space.graph.users[w]}
    copies = share_copies(space, groups, prices)
    paid = [c for c in copies.reshards if c.seconds > 0]
    assert paid
    for copy in paid:
        members = copy.members
        assert len(members) >= 2 and {u for u, _, _ in members} == {gw}
        assert {v for _, v, _ in members} <= readers
        for _, v, marked in members:   # every marked pair moves w at the copy's price
            reader = groups.groups[v][0]
            srcs = groups.out_specs(space.graph.values[w].producer, 0)
            dsts = groups.in_specs(reader, space.graph.nodes[reader].operands.index(w))
            for s, t in zip(*np.nonzero(marked)):
                assert prices.reshard(w, srcs[s], dsts[t]) == pytest.approx(copy.seconds)
    assert set(copies.reads) == {(u, i) for u, i in space.graph.users[w]}


def test_a_copy_is_held_once_and_up_to_its_last_sharing_reader():
    space, prices, groups = rooms(three_readers, *SHAPES)
    copies = share_copies(space, groups, prices)
    w = space.graph.nodes[space.graph.arg_nodes[0]].outputs[0]
    last = max(u for u, _ in space.graph.users[w])
    for value, num_bytes, until in copies.held:
        assert value == w and num_bytes > 0
        nodes = [node for _, node in until]
        assert nodes == sorted(nodes) and nodes[-1] == last
        # the copy's seconds are paid at its first reader, nothing at the later ones
        assert all(copies.reshards[k].seconds == 0 for k, _ in until[1:])


def test_past_the_cap_reads_pay_alone_and_hold_per_read_without_sharing(monkeypatch):
    monkeypatch.setattr(shared, "MAX_SHARED_COPIES", 0)
    space, prices, groups = rooms(three_readers, *SHAPES)
    held = share_copies(space, groups, prices, share_held_copies=True)
    assert held.held and all(c.seconds == 0 for c in held.reshards)
    assert not held.reads and not held.held_per_read   # each read pays its own seconds
    alone = share_copies(space, groups, prices, share_held_copies=False)
    assert alone.held_per_read and not alone.held and not alone.reshards


def data_parallel(w1, w2, x):
    def loss(w1, w2):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)
    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def test_a_combined_collective_pays_one_latency_per_computation():
    space, _, groups = rooms(data_parallel, (128, 256), (256, 32), (64, 128),
                             backend=Backend.of(autoshard.make_mesh((2, 4), ("a", "b"))))
    combined = combining(space)
    assert any(combined.combines)
    assert all(c for c, j in zip(combined.combines, combined.joins) if j)
    nodes = space.graph.nodes
    for scope, node in combined.points.items():   # after the last node that joins
        assert combined.joins[node]
        assert not any(combined.joins[n.id] for n in nodes[node + 1:] if loop_scope(n) == scope)
    latencies = combined_latencies(space, groups, combined)
    assert latencies
    for cost in latencies:   # one latency for every strategy that makes the collective
        assert cost.seconds == pytest.approx(HW.link_latency)
        assert len(cost.members) >= 1
    for chained in chained_latencies(space, groups, combined):
        assert chained.seconds == pytest.approx(HW.link_latency)
