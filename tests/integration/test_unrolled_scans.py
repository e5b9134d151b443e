"""A scan unrolled whole is straight-line code to XLA: its one-trip loop is inlined, and
its ys are the iterations' results, which their readers read where they were written:
no stack is filled slice by slice."""

import jax
import jax.numpy as jnp
import pytest
from xla_habits import CPU_WIDENS_NARROW_DOTS

import autoshard
from autoshard.cost.strategies import build_strategies
from autoshard.frontend.trace import build_graph, trace_program
from autoshard.report.hlo_report import hlo_report
from autoshard.target.hardware import Backend
from autoshard.target.xla import hoisted_runs
from autoshard.units import axis_sizes

F32 = jnp.float32
ARGS = (jax.ShapeDtypeStruct((256, 4, 512), F32), jax.ShapeDtypeStruct((4, 256, 512), F32),
        jax.ShapeDtypeStruct((512, 512), F32))


def stacked_layers(unroll: int):
    """Four applications of one layer over a stack of inputs, their results added to an
    accumulator laid out [rows, layers, d] (a transpose of the ys)."""
    def fn(acc, xs, w):
        def body(count, x):
            return count + 1.0, jnp.tanh(x @ w)
        _, ys = jax.lax.scan(body, 0.0, xs, unroll=unroll)
        return acc + jnp.swapaxes(ys, 0, 1)
    return fn


@pytest.mark.parametrize("unroll", [1, 4])
def test_a_scans_compute_is_priced_as_compiled_rolled_or_unrolled(mesh_1d, unroll):
    # unrolled, the stack's slice-by-slice copies were priced on top: 1.22x compiled
    plan = autoshard.plan(stacked_layers(unroll), *ARGS, mesh=mesh_1d, cache=False,
                          progress=False)
    compiled = plan.jit().lower(*ARGS).compile()
    assert (" while(" in compiled.as_text()) == (unroll == 1)
    report = hlo_report(compiled, plan.hardware, mesh_1d)
    assert plan.cost.compute_s == pytest.approx(report.compute_s, rel=0.08)


def microbatched_layers(weight_dtype=None):
    """An outer loop over microbatches whose body runs a stack of layers as a scan
    unrolled whole, the stack entering the outer loop as a constant (how a pipeline's
    stage step reads its layers); each layer's weight cast to ``weight_dtype`` if given
    (f32 weights, bf16 dots), a cast that is loop-invariant too."""
    def fn(xs, ws):
        def microbatch(total, x):
            def layer(h, w):
                w = w if weight_dtype is None else w.astype(weight_dtype)
                return jnp.tanh(h @ w), None
            h, _ = jax.lax.scan(layer, x, ws, unroll=True)
            return total + jnp.sum(h.astype(F32)), None
        total, _ = jax.lax.scan(microbatch, 0.0, xs)
        return total
    return fn


@pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=CPU_WIDENS_NARROW_DOTS),
                                   F32])
def test_static_slices_of_a_stack_the_outer_loop_keeps(mesh_1d, dtype):
    # CPU widens each bf16 layer for its dot, and XLA hoists the slice with its convert
    # out of the microbatch loop: it runs once, not once a trip (priced once a trip
    # before). An f32 slice alone is not worth hoisting: it stays in the loop.
    args = (jax.ShapeDtypeStruct((8, 64, 512), dtype), jax.ShapeDtypeStruct((4, 512, 512), dtype))
    compiled = jax.jit(microbatched_layers()).lower(*args).compile().as_text()
    entry = compiled[compiled.index("ENTRY"):]
    hoisted = dtype == jnp.bfloat16
    assert ("f32[512,512]" in entry) == hoisted

    graph = build_graph(trace_program(microbatched_layers(), *args))
    hw, backend = autoshard.H100, Backend.of(mesh_1d)
    space = build_strategies(graph, axis_sizes(mesh_1d), hw, {}, backend)
    slices = [n for n in graph.nodes if n.primitive == "loop_xs" and n.params.get("static")]
    assert len(slices) == 1 and slices[0].weight == 8
    layer_bytes = 512 * 512 * 4   # read and written at f32, the width its dot reads
    runs = 1 if hoisted else 8
    whole = [s for s in space.strategies[slices[0].id] if not any(s.out_specs[0])]
    assert whole   # each device slices whole layers
    assert whole[0].compute_s == pytest.approx(hw.compute_seconds(0.0, 2 * layer_bytes) * 4 * runs)


@CPU_WIDENS_NARROW_DOTS
def test_casts_of_the_layers_an_outer_loop_keeps_run_once_a_layer():
    # XLA hoists each layer's slice and cast out of the microbatch loop
    args = (jax.ShapeDtypeStruct((8, 64, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 512, 512), F32))
    mixed_precision = microbatched_layers(jnp.bfloat16)
    compiled = jax.jit(mixed_precision).lower(*args).compile().as_text()
    assert compiled[compiled.index("ENTRY"):].count("f32[512,512]") >= 4
    graph = build_graph(trace_program(mixed_precision, *args))
    runs = hoisted_runs(graph, [1.0] * len(graph.values))
    casts = [n for n in graph.nodes if n.primitive == "convert_element_type"
             and n.operand_shapes[0] == (512, 512)]
    assert [n.weight for n in casts] == [32.0]    # 8 microbatches x 4 layers
    assert [runs[n.id] for n in casts] == [4.0]   # once a layer


def stage_loop(xs, w):
    """An outer loop over microbatches whose body runs its trip's slab of inputs
    ``[layers, rows, d]`` through a scan unrolled whole, each layer's slice read only by
    elementwise ops (how a pipeline's backward stage step reads its residuals)."""
    def microbatch(total, x):
        def layer(h, x_l):
            return jnp.tanh(h + x_l), None
        h, _ = jax.lax.scan(layer, jnp.zeros(x.shape[1:], x.dtype), x, unroll=True)
        return total + jnp.sum(h @ w), None
    total, _ = jax.lax.scan(microbatch, 0.0, xs)
    return total


def test_static_slices_read_only_by_elementwise_ops_fuse_into_them(mesh_1d):
    # XLA fuses each layer's static slice into the fusion reading it: no pass of its own
    # (priced as a copy before, the plan's compute was 1.25x compiled)
    args = (jax.ShapeDtypeStruct((8, 4, 256, 512), F32), jax.ShapeDtypeStruct((512, 512), F32))
    plan = autoshard.plan(stage_loop, *args, mesh=mesh_1d, cache=False, progress=False)
    report = hlo_report(plan.jit().lower(*args).compile(), plan.hardware, mesh_1d)
    assert plan.cost.compute_s == pytest.approx(report.compute_s, rel=0.1)

    graph = build_graph(trace_program(stage_loop, *args))
    space = build_strategies(graph, axis_sizes(mesh_1d), autoshard.H100, {},
                             Backend.of(mesh_1d))
    static = [n for n in graph.nodes if n.primitive == "loop_xs" and n.params.get("static")]
    assert len(static) == 1
    assert all(s.compute_s == 0.0 for s in space.strategies[static[0].id])
    rolled = [n for n in graph.nodes if n.primitive == "loop_xs" and not n.params.get("static")]
    assert all(s.compute_s > 0.0 for n in rolled for s in space.strategies[n.id])
