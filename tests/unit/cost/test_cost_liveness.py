"""cost.liveness alone: ``Liveness`` over small programs: what is always resident, how
long a temporary lives, and what the copies add."""

import jax
import jax.numpy as jnp
import numpy as np

from autoshard.cost import (
    Liveness,
    ReshardPrices,
    combining,
    group_nodes,
    share_copies,
)
from autoshard.cost.strategies import build_strategies
from autoshard.frontend import specs
from autoshard.frontend.trace import trace
from autoshard.solver.request import GroupTerm
from autoshard.target.hardware import Hardware

HW = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=1e9,
              link_bandwidth={"a": 1e10, "b": 4e10}, link_latency=1e-6)
SIZES = {"a": 2, "b": 4}
F32 = jnp.float32


def two_readers(x, w1, w2, w3, w4):
    # h is read by a dot, then by another dot after a third one
    h = jnp.tanh(x @ w1)
    return (h @ w2) @ w3 + h @ w4


SHAPES = ((64, 128), (128, 256), (256, 256), (256, 32), (256, 32))


def rooms(fn, *shapes, donated_outputs=()):
    graph = trace(fn, *(jax.ShapeDtypeStruct(s, F32) for s in shapes))
    space = build_strategies(graph, SIZES, HW)
    prices = ReshardPrices(space)
    groups = group_nodes(space, prices, {})
    return space, prices, groups, Liveness(space, groups, prices, combining(space),
                                           donated_outputs)


def value_bytes(space, groups, value):
    return np.array([specs.per_device_bytes(value.shape, value.dtype, spec, SIZES)
                     for spec in groups.out_specs(value.producer, value.index)])


def test_a_temporary_lives_from_its_producer_to_its_last_reader():
    space, _, groups, liveness = rooms(two_readers, *SHAPES)
    graph = space.graph
    h = graph.values[next(n.outputs[0] for n in graph.nodes if n.primitive == "tanh")]
    readers = sorted(u for u, _ in graph.users[h.id])
    assert len(readers) == 2 and readers[1] > readers[0] + 1   # a dot runs in between
    spans = liveness.uncopied().spans
    mine = [(first, last) for term, first, last in spans
            if isinstance(term, GroupTerm) and term.group == groups.group_of_node[h.producer]
            and np.array_equal(term.num_bytes, value_bytes(space, groups, h))]
    assert (h.producer, readers[1]) in mine


def test_arguments_and_outputs_are_resident_and_a_donated_output_is_not():
    space, _, groups, liveness = rooms(two_readers, *SHAPES)
    graph = space.graph
    found = liveness.uncopied()
    fixed = [found.terms[t] for t in found.fixed]
    resident = [graph.values[graph.nodes[n].outputs[0]] for n in graph.arg_nodes]
    resident += [graph.values[v] for v in graph.outputs]
    assert len(fixed) == len(resident)   # one output: no table of pointers
    for term, value in zip(fixed, resident):
        assert term.group == groups.group_of_node[value.producer]
        np.testing.assert_array_equal(term.num_bytes, value_bytes(space, groups, value))
    _, _, _, donating = rooms(two_readers, *SHAPES, donated_outputs={0})
    assert len(donating.uncopied().fixed) == len(fixed) - 1


def test_the_copies_come_after_what_is_counted_before_pricing():
    # the memory before pricing is the memory less the resharded copies: the same
    # terms first, then those of the copies, each live somewhere
    space, prices, groups, liveness = rooms(two_readers, *SHAPES)
    before = liveness.memory_before_pricing()
    memory = liveness.memory(share_copies(space, groups, prices))
    assert all(a is b for a, b in zip(memory.terms, before.terms))
    assert memory.fixed == before.fixed
    assert len(memory.terms) > len(before.terms)
    copies = range(len(before.terms), len(memory.terms))
    assert set(copies) <= set(memory.rows.terms.tolist())
    assert all(s <= e for s, e in zip(memory.rows.starts, memory.rows.ends))
