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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.cost import build_cost_graph, reshard_collectives, reshard_seconds
from autoshard.cost.strategies import build_strategies
from autoshard.frontend import specs
from autoshard.frontend.trace import trace
from autoshard.report.hlo_report import hlo_report
from autoshard.target.hardware import Hardware
from autoshard.testing.reshards import compiled_reshard

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


def test_an_axis_swapped_for_a_smaller_one_permutes_then_gathers():
    # P(b) -> P(a): dim 0 split 4 ways becomes 2 ways, with shards on other devices.
    # XLA sends each 16384-byte shard (65536 / 4) to where it can be gathered, crossing
    # a and b (the slower link, 1e10): 1e-6 + 16384 / 1e10 = 2.6384 µs; then gathers
    # pairs of shards (4 / 2 = 2 devices) along b, the axis P(a) drops, into 32768
    # bytes: 1e-6 + 1/2 * 32768 / 4e10 = 1.4096 µs
    assert moves((("b",), ()), (("a",), ())) == [
        ("collective-permute", ("a", "b"), 16384, 2.6384e-6),
        ("all-gather", ("b",), 32768, 1.4096e-6)]


def test_an_axis_swapped_for_a_larger_one_slices_then_permutes():
    # P(a) -> P(b): each device holds half of dim 0, and the quarter it wants lies in
    # another device's half: sliced there and sent, 65536 / 4 = 16384 bytes across a
    # and b: 1e-6 + 16384 / 1e10 = 2.6384 µs
    assert moves((("a",), ()), (("b",), ())) == [
        ("collective-permute", ("a", "b"), 16384, 2.6384e-6)]


def test_axes_in_another_order_permute_the_shards():
    # P((a, b)) -> P((b, a)): the same 8 shards of 8192 bytes on other devices:
    # 1e-6 + 8192 / 1e10 = 1.8192 µs
    assert moves((("a", "b"), ()), (("b", "a"), ())) == [
        ("collective-permute", ("a", "b"), 8192, 1.8192e-6)]


def test_two_dims_exchanging_unlike_axes_is_an_all_to_all_then_a_permute():
    # P(a, b) -> P(b, a): dim 0 goes from 2 to 4 ways, dim 1 from 4 to 2. XLA exchanges
    # 8192-byte shards over groups of 4 / 2 = 2 along b, the axis leaving dim 1:
    # 1e-6 + 1/2 * 8192 / 4e10 = 1.1024 µs, plus the peer-major copy 2 * 8192 / 1e11
    # = 0.16384 µs: 1.26624 µs; then permutes them onto the devices P(b, a) wants:
    # 1e-6 + 8192 / 1e10 = 1.8192 µs
    assert moves((("a",), ("b",)), (("b",), ("a",))) == [
        ("all-to-all", ("b",), 8192, 1.26624e-6),
        ("collective-permute", ("a", "b"), 8192, 1.8192e-6)]


def test_a_gather_beside_a_slice_gathers_the_whole_array():
    # P(b) -> P(None, a): b leaves dim 0 while a joins dim 1. None of the partitioner's
    # ways applies: the shard counts (4, 1) and (1, 2) do not pair for an all-to-all,
    # slicing the copies (replicated over a) cannot take b off dim 0, and gathering onto
    # the target (replicated over b) cannot put a on dim 1. It gathers b, all 65536
    # bytes, and slices:
    # 1e-6 + 3/4 * 65536 / 4e10 = 2.2288 µs (not b's 32768 after slicing a first)
    assert moves((("b",), ()), ((), ("a",))) == [("all-gather", ("b",), 65536, 2.2288e-6)]


def test_moving_an_axis_out_of_a_dim_split_twice_gathers_everything():
    # P((a, b)) -> P(None, a): dim 0's 8 shards become 1 and dim 1's 1 become 2; the
    # counts do not pair for an all-to-all, nothing is replicated to slice from, and
    # gathering onto the target (replicated over b) cannot put a on dim 1, so the
    # partitioner gathers the whole array over all 8 devices, then slices:
    # 1e-6 + 7/8 * 65536 / 1e10 = 6.7344 µs
    assert moves((("a", "b"), ()), ((), ("a",))) == [
        ("all-gather", ("a", "b"), 65536, 6.7344e-6)]
    # the same with b on dim 1 (4 shards, not 2): still no pairing of 8, 1 with 1, 4
    assert moves((("a", "b"), ()), ((), ("b",))) == [
        ("all-gather", ("a", "b"), 65536, 6.7344e-6)]


def compiled_moves(src, dst):
    """(kind, bytes) of each collective XLA compiles for resharding f32[64, 256] from
    ``src`` to ``dst`` on the 2x4 mesh, as ``hlo_report`` reads them; sorted."""
    mesh = autoshard.make_mesh((2, 4), ("a", "b"))
    return sorted((kind, num_bytes)
                  for kind, _, num_bytes in compiled_reshard(mesh, HW, SHAPE, src, dst))


def predicted_moves(src, dst):
    return sorted((c.kind, c.num_bytes)
                  for c in reshard_collectives(SHAPE, F32, src, dst, SIZES, HW))


WORKED = [((("b",), ()), (("a",), ())), ((("a",), ()), (("b",), ())),
          ((("a", "b"), ()), (("b", "a"), ())), ((("a",), ("b",)), (("b",), ("a",))),
          ((("b",), ()), ((), ("a",))), ((("a", "b"), ()), ((), ("a",))),
          ((("a", "b"), ()), ((), ("b",)))]


@pytest.mark.parametrize("src,dst", WORKED)
def test_the_worked_reshards_are_what_xla_compiles(src, dst):
    assert predicted_moves(src, dst) == compiled_moves(src, dst)


@pytest.mark.slow
def test_every_reshard_is_what_xla_compiles():
    # every pair of the nine specs of f32[64, 256] on the 2x4 mesh: the same collectives
    # with the same bytes as the compiled program
    options = list(specs.enumerate_specs(SHAPE, SIZES))
    apart = [(src, dst) for src, dst in itertools.product(options, repeat=2)
             if predicted_moves(src, dst) != compiled_moves(src, dst)]
    assert apart == []


def scatter_moves(axis):
    """The collectives of x f32[64, 128] split over ``axis`` on its contracted dim, times
    w f32[128, 256] split alike, reduce-scattered onto rows P(axis): as the strategy
    prices them, and as XLA compiles them on the 2x4 mesh."""
    x, w = jax.ShapeDtypeStruct((64, 128), F32), jax.ShapeDtypeStruct((128, 256), F32)
    graph = trace(lambda a, b: a @ b, x, w)
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    strategy = next(s for s in build_strategies(graph, SIZES, HW).strategies[dot.id]
                    if s.name.endswith(f"reduce-scatter({axis})->0")
                    and s.out_specs == (((axis,), ()),))
    mesh = autoshard.make_mesh((2, 4), ("a", "b"))
    fn = jax.jit(lambda a, b: a @ b,
                 in_shardings=(NamedSharding(mesh, P(None, axis)), NamedSharding(mesh, P(axis))),
                 out_shardings=NamedSharding(mesh, P(axis)))
    report = hlo_report(fn.lower(x, w).compile(), HW, mesh)
    return ([(c.kind, c.axes, c.num_bytes, pytest.approx(c.seconds)) for c in strategy.collectives],
            sorted((c.kind, c.num_bytes) for c in report.collectives))


def test_a_scatter_onto_rows_replicated_over_more_devices_all_reduces_then_permutes():
    # Scattered over a (2 devices), the rows stay replicated over b's 4: XLA splits the
    # 65536-byte partial result among the replicas, all-reduces each device's 32768-byte
    # half over a: 1e-6 + 2 * 1/2 * 32768 / 1e10 = 4.2768 µs, and sends it to the device
    # P(a) wants it on, across a and b: 1e-6 + 32768 / 1e10 = 4.2768 µs
    predicted, compiled = scatter_moves("a")
    assert predicted == [("all-reduce", ("a",), 32768, 4.2768e-6),
                         ("collective-permute", ("a", "b"), 32768, 4.2768e-6)]
    assert compiled == sorted((kind, num_bytes) for kind, _, num_bytes, _ in predicted)


def test_a_scatter_onto_rows_replicated_over_fewer_devices_reduce_scatters():
    # Scattered over b (4 devices), the rows replicated over a's 2: a reduce-scatter of
    # the 65536-byte partial result, 1e-6 + 3/4 * 65536 / 4e10 = 2.2288 µs
    predicted, compiled = scatter_moves("b")
    assert predicted == [("reduce-scatter", ("b",), 65536, 2.2288e-6)]
    assert compiled == [("reduce-scatter", 65536)]


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
            assert len(cg.picks[n]) == options
            assert all(0 <= s < len(space.strategies[n]) for s in cg.picks[n])
    for edge in cg.edges:   # seconds for every pair of the two groups' strategies
        assert edge.cost.shape == (len(cg.node_costs[edge.u]), len(cg.node_costs[edge.v]))
        assert (edge.cost >= 0).all()
