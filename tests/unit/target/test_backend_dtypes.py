"""The backend compiled for: CPU XLA moves bf16 in f32 (a convert before every collective
and after), so its collectives move 2x the program's bytes; and it runs bf16 dots in f32,
so what a dot reads and writes is stored in f32."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from xla_habits import CPU_WIDENS_NARROW_DOTS

import autoshard
from autoshard.cost.strategies import build_strategies
from autoshard.frontend.trace import trace
from autoshard.report.hlo_report import hlo_report
from autoshard.target import xla
from autoshard.target.hardware import Backend


def matmul(x, w):
    return x @ w


ARGS = (jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16))
PINS = {"x": P(None, "data"), "w": P("data"), "out": P()}   # a contraction all-reduced


def test_cpu_reduction_of_bf16_is_priced_at_f32_width(mesh_1d):
    plan = autoshard.plan(matmul, *ARGS, mesh=mesh_1d, pins=PINS, cache=False, progress=False)
    report = hlo_report(plan.jit().lower(*ARGS).compile(), plan.hardware, mesh_1d)
    (reduce,) = report.collectives
    assert reduce.kind == "all-reduce" and reduce.num_bytes == 64 * 256 * 4
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=1e-6)


def test_inspect_says_where_compiled_bytes_differ_from_the_program(mesh_1d):
    shardings = (NamedSharding(mesh_1d, P(None, "data")), NamedSharding(mesh_1d, P("data")))
    compiled = jax.jit(matmul, in_shardings=shardings,
                       out_shardings=NamedSharding(mesh_1d, P())).lower(*ARGS).compile()
    report = hlo_report(compiled, autoshard.H100, mesh_1d)
    notes = [w for w in report.warnings if "converted from the program's bf16" in w]
    assert len(notes) == 1 and f"{64 * 256 * 4} bytes" in notes[0]
    assert f"has {64 * 256 * 2}" in notes[0]


def test_f32_reductions_carry_no_note(mesh_1d):
    args = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in ARGS)
    shardings = (NamedSharding(mesh_1d, P(None, "data")), NamedSharding(mesh_1d, P("data")))
    compiled = jax.jit(matmul, in_shardings=shardings,
                       out_shardings=NamedSharding(mesh_1d, P())).lower(*args).compile()
    assert not hlo_report(compiled, autoshard.H100, mesh_1d).warnings


def double(x):
    return x * 2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cpu_gathers_are_priced_at_f32_width(mesh_1d, dtype):
    # x is [64, 1024], split over 8 devices and wanted whole: each device receives 7/8 of
    # it, and in f32 whatever the program's dtype (64 * 1024 * 4 * 7/8 bytes), so a bf16
    # gather is priced as an f32 one, as compiled
    x = jax.ShapeDtypeStruct((64, 1024), dtype)
    plan = autoshard.plan(double, x, mesh=mesh_1d, pins={"x": P("data"), "out": P()},
                          cache=False, progress=False)
    report = hlo_report(plan.jit().lower(x).compile(), plan.hardware, mesh_1d)
    (gather,) = report.collectives
    assert gather.kind == "all-gather" and gather.num_bytes == 64 * 1024 * 4
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=1e-6)


def test_cpu_reduce_scatter_of_bf16_reads_as_one_through_its_converts(mesh_1d):
    # the contraction's partial results all-reduced in f32, converted back to bf16, and
    # each device keeps its 1/8 of the rows: how CPU spells a reduce-scatter of bf16
    shardings = (NamedSharding(mesh_1d, P(None, "data")), NamedSharding(mesh_1d, P("data")))
    compiled = jax.jit(matmul, in_shardings=shardings,
                       out_shardings=NamedSharding(mesh_1d, P("data"))).lower(*ARGS).compile()
    report = hlo_report(compiled, autoshard.H100, mesh_1d)
    assert [c.kind for c in report.collectives] == ["reduce-scatter"]
    assert report.collectives[0].num_bytes == 64 * 256 * 4


def mlp_loss(params, x):   # the dots in x's dtype
    h = jax.nn.gelu(x @ params["w1"].astype(x.dtype))
    y = h @ params["w2"].astype(x.dtype)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def mlp_step(params, x):
    grads = jax.grad(mlp_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


@CPU_WIDENS_NARROW_DOTS
@pytest.mark.parametrize("pins", [None, {"x": P("data")},
                                  {"params['w1']": P(None, "data"), "params['w2']": P("data")}])
def test_cpu_bf16_dots_read_and_write_f32(mesh_1d, pins):
    # mixed precision as people write it: f32 weights cast to bf16 for the dots. CPU XLA
    # writes each dot's operands (the casts, gelu and its gradient) and results in f32;
    # priced at bf16 width the compute came out 24-27 % short of the compiled program's
    params = {"w1": jax.ShapeDtypeStruct((1024, 4096), jnp.float32),
              "w2": jax.ShapeDtypeStruct((4096, 1024), jnp.float32)}
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
    plan = autoshard.plan(mlp_step, params, x, mesh=mesh_1d, pins=pins, cache=False,
                          progress=False)
    report = hlo_report(plan.jit().lower(params, x).compile(), plan.hardware, mesh_1d)
    assert plan.cost.compute_s == pytest.approx(report.compute_s, rel=0.05)


def scanned_loss(ws, x):
    def layer(h, w):
        return jax.nn.gelu(h @ w.astype(jnp.bfloat16)), None
    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))


def scanned_step(ws, x):
    return ws - 1e-3 * jax.grad(scanned_loss)(ws, x)


@CPU_WIDENS_NARROW_DOTS
def test_cpu_stacks_the_residuals_of_bf16_dots_in_f32(mesh_1d):
    # a scanned stack of layers: the forward scan stacks each layer's input for the
    # backward dots, and CPU XLA keeps that stack, and the backward scan's slices of it,
    # in f32 as the dots read them; priced at bf16 width the compute came out 23 % short
    ws = jax.ShapeDtypeStruct((4, 1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
    plan = autoshard.plan(scanned_step, ws, x, mesh=mesh_1d, cache=False, progress=False)
    report = hlo_report(plan.jit().lower(ws, x).compile(), plan.hardware, mesh_1d)
    assert plan.cost.compute_s == pytest.approx(report.compute_s, rel=0.1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_only_narrow_floats_are_stored_wider(dtype):
    # the same program priced for a backend with f32 dots and for one with dots of the
    # program's width: bf16 values around the dots cost more, f32 ones the same
    params = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
              "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    graph = trace(mlp_step, params, jax.ShapeDtypeStruct((32, 64), dtype))
    native = Backend.bare()   # dots at the program's width

    def seconds(backend):
        space = build_strategies(graph, {"data": 8}, autoshard.H100, backend=backend)
        return [s.compute_s for found in space.strategies for s in found]
    wide, own = seconds(dataclasses.replace(native, contraction_itemsize=4)), seconds(native)
    if dtype == jnp.float32:
        assert wide == own
    else:
        assert all(w >= o for w, o in zip(wide, own)) and sum(wide) > sum(own)


def row_parallel(x, w):
    return jnp.sum(jnp.square((x @ w).astype(jnp.float32)))


def row_parallel_costs(mesh, shape) -> tuple[float, float, float]:
    """The row-parallel dot's predicted and compiled compute, and its compiled rounding
    passes, with x of ``shape`` and w split over their contracted dim."""
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 64), jnp.bfloat16)
    pins = {"x": P(*[None] * (len(shape) - 1), "data"), "w": P("data")}
    plan = autoshard.plan(row_parallel, x, w, mesh=mesh, pins=pins, cache=False,
                          progress=False)
    report = hlo_report(plan.jit().lower(x, w).compile(), plan.hardware, mesh)
    assert report.count("all-reduce") == 1   # of the dot's partial result
    return plan.cost.compute_s, report.compute_s, report.rounding_s


@CPU_WIDENS_NARROW_DOTS
def test_cpu_rounds_a_reshaped_bf16_dot_result_before_reducing_it(mesh_1d):
    # CPU rounds the dot's f32 partial result to bf16 and back before the all-reduce.
    # Next to each other, XLA drops the converts; split by the reshape that unflattens a
    # dot of several free dims (batch and tokens), they stay, a fusion of their own. The
    # same dot over tokens flattened and unflattened: what the reshaped one costs more
    predicted_3d, compiled_3d, rounding_3d = row_parallel_costs(mesh_1d, (8, 256, 1024))
    predicted_2d, compiled_2d, rounding_2d = row_parallel_costs(mesh_1d, (2048, 1024))
    assert rounding_3d > 0 and rounding_2d == 0
    assert predicted_3d - predicted_2d == pytest.approx(compiled_3d - compiled_2d, rel=0.1)


def _node(graph, primitive: str, index: int = 0):
    return [n for n in graph.nodes if n.kind == "eqn" and n.primitive == primitive][index]


def test_cpu_runs_a_bf16_matrix_vector_dot_in_f32_and_a_matrix_product_as_it_runs_dots():
    """Read from compiled dots: a matrix-vector bf16 dot is run in f32 by either jax's
    XLA:CPU; a 64 x 64 x 64 matrix product as that XLA runs bf16 dots (f32 on jax 0.10's,
    bf16 on 0.12's)."""
    bf16 = jnp.bfloat16
    vector = trace(lambda w, x: x @ w, jax.ShapeDtypeStruct((16, 6), bf16),
                   jax.ShapeDtypeStruct((16,), bf16))
    square = trace(lambda w, x: x @ w, *[jax.ShapeDtypeStruct((64, 64), bf16)] * 2)
    assert xla.cpu_dot_widened(_node(vector, "dot_general"))
    assert xla.cpu_dot_widened(_node(square, "dot_general")) == bool(
        xla.cpu_contraction_itemsize())


def test_a_conv_and_its_kernel_gradient_read_the_input_in_two_orders():
    """A grouped convolution's kernel gradient reads the input with batch and features
    swapped, so XLA:CPU copies the input once per order; with 3 batch groups over a
    batch of 3 and 3 output features, XLA:CPU computes it 3 times its size; XLA:GPU not."""
    def loss(x, kernel):
        return jnp.sum(jax.lax.conv_general_dilated(
            x, kernel, (1, 1), "VALID", feature_group_count=3,
            dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)

    graph = trace(jax.grad(loss, argnums=1), jax.ShapeDtypeStruct((6, 5, 3, 3), jnp.float32),
                  jax.ShapeDtypeStruct((3, 2, 1, 12), jnp.float32))
    forward, gradient = _node(graph, "conv_general_dilated", 0), _node(
        graph, "conv_general_dilated", 1)
    assert gradient.params["batch_group_count"] == 3
    assert xla.read_order(forward, 0) != xla.read_order(gradient, 0)
    assert xla.transposed_operands(forward) == (False, False)
    assert xla.transposed_operands(gradient)[0]
    assert xla.cpu_batch_groups_expanded(forward, "cpu") == 1
    assert xla.cpu_batch_groups_expanded(gradient, "cpu") == 1   # 12 output features


def test_batch_groups_as_many_as_the_batch_and_the_features_are_expanded_on_cpu():
    def conv(x, kernel):
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "VALID", batch_group_count=3,
                                            dimension_numbers=("NCHW", "OIHW", "NCHW"))

    graph = trace(conv, jax.ShapeDtypeStruct((3, 2, 8, 8), jnp.float32),
                  jax.ShapeDtypeStruct((3, 2, 3, 3), jnp.float32))
    node = _node(graph, "conv_general_dilated")
    assert xla.cpu_batch_groups_expanded(node, "cpu") == 3
    assert xla.cpu_batch_groups_expanded(node, "gpu") == 1


def test_cpu_writes_a_batched_scatters_indices_with_an_iota_per_batching_dim():
    """The sort gradient's scatter-add into [b, n, d] along n has batching dims b and d:
    XLA:CPU writes each index with two iotas beside it (3 times the index bytes);
    XLA:GPU computes them in its scatter fusion."""
    graph = trace(jax.grad(lambda x: jnp.sum(jnp.sort(x, axis=1) ** 2)),
                  jax.ShapeDtypeStruct((4, 16, 8), jnp.float32))
    node = _node(graph, "scatter-add")
    assert xla.cpu_batched_scatter_indices(node, "cpu") == 3
    assert xla.cpu_batched_scatter_indices(node, "gpu") == 0
