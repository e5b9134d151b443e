"""cost.grouping alone: ``group_nodes`` over small programs, checked against the
strategies it groups (``StrategySpace``), not against numbers it printed once."""

import jax
import jax.numpy as jnp
import numpy as np

from autoshard.cost import ReshardPrices, group_nodes
from autoshard.cost.strategies import build_strategies
from autoshard.frontend.trace import trace
from autoshard.target.hardware import Hardware

HW = Hardware(link_bandwidth={"a": 1e10, "b": 4e10})
SIZES = {"a": 2, "b": 4}
F32 = jnp.float32


def grouped(fn, *shapes):
    graph = trace(fn, *(jax.ShapeDtypeStruct(s, F32) for s in shapes))
    space = build_strategies(graph, SIZES, HW)
    return space, group_nodes(space, ReshardPrices(space), {})


def mlp(x, w1, w2):
    return jnp.tanh(x @ w1) * 2.0 @ w2


def test_an_elementwise_chain_joins_its_producers_group():
    space, groups = grouped(mlp, (64, 128), (128, 256), (256, 32))
    nodes = space.graph.nodes
    dot = next(n.id for n in nodes if n.primitive == "dot_general")
    chain = [n.id for n in nodes if n.primitive in ("tanh", "mul")]
    assert chain and all(groups.group_of_node[n] == groups.group_of_node[dot] for n in chain)
    for g, members in enumerate(groups.groups):
        assert all(groups.group_of_node[n] == g for n in members)
        assert members[0] == min(members)   # the root first: the earliest node


def test_a_follower_reads_its_operand_as_its_producer_writes_it():
    space, groups = grouped(mlp, (64, 128), (128, 256), (256, 32))
    graph = space.graph
    for node in graph.nodes:
        g = groups.group_of_node[node.id]
        if node.kind != "eqn" or groups.groups[g][0] == node.id:
            continue
        for i, v in enumerate(node.operands):
            value = graph.values[v] if v is not None else None
            if value is None or groups.group_of_node[value.producer] != g:
                continue
            for s in range(groups.group_size(g)):
                written = space.strategies[value.producer][groups.picks[value.producer][s]]
                read = space.strategies[node.id][groups.picks[node.id][s]]
                wanted = written.out_specs[value.index]
                if any(t.in_specs[i] == wanted for t in space.strategies[node.id]):
                    assert read.in_specs[i] == wanted


def test_a_root_may_take_each_of_its_strategies():
    space, groups = grouped(mlp, (64, 128), (128, 256), (256, 32))
    for members in groups.groups:
        root = members[0]
        assert list(groups.picks[root]) == list(range(len(space.strategies[root])))


def test_nodes_alike_share_one_menu_of_their_picked_strategies():
    # two layers of one shape: their nodes have the same strategies, picked alike
    def two_layers(x, w1, w2):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2)
    space, groups = grouped(two_layers, (64, 128), (128, 128), (128, 128))
    seen = {}
    for node in space.graph.nodes:
        menu, picks = groups.menus[node.id], groups.picks[node.id]
        strategies = space.strategies[node.id]
        assert np.array_equal(menu.seconds, [strategies[k].seconds for k in picks])
        for k, spec in enumerate(groups.out_specs(node.id, 0) if node.outputs else ()):
            assert spec == strategies[picks[k]].out_specs[0]
        key = (space.menu_ids[node.id], picks.tobytes())
        assert seen.setdefault(key, menu) is menu
    w1, w2 = space.graph.arg_nodes[1:]   # weights of one shape: one menu
    assert groups.menus[w1] is groups.menus[w2]
