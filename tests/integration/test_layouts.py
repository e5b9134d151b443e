"""Transposes XLA does not make: the gradient of ``x @ w`` with respect to ``w`` is a dot
whose result JAX transposes, and XLA computes the dot with its operands swapped instead;
a transpose that on one device's shard only moves dims of one element is a bitcast.
Between two buffers in memory either moves nothing (a fusion reading or writing through
one still reads or writes its buffer)."""

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.frontend.trace import trace
from autoshard.report.hlo_report import hlo_report
from autoshard.target.xla import moves_no_data, transposes_dot_result

F32 = jnp.float32


def mlp_step(params, x):
    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


MLP_ARGS = ({"w1": jax.ShapeDtypeStruct((1024, 4096), F32),
             "w2": jax.ShapeDtypeStruct((4096, 1024), F32)},
            jax.ShapeDtypeStruct((256, 1024), F32))


def test_a_weight_gradients_transpose_is_its_dot_with_operands_swapped():
    graph = trace(mlp_step, *MLP_ARGS)
    transposes = [n for n in graph.nodes if n.primitive == "transpose"]
    assert transposes and all(transposes_dot_result(graph, n) for n in transposes)
    # a transpose of anything else is not
    other = trace(lambda x: jnp.tanh(x).T, jax.ShapeDtypeStruct((64, 128), F32))
    assert not any(transposes_dot_result(other, n) for n in other.nodes)


def test_a_transpose_moving_only_one_element_dims_of_a_shard_moves_nothing():
    # a stage-sharded stack [stages, layers, ...] read as [layers, stages, ...]: on one
    # stage's devices the stage dim has one element, so the layers keep their order
    graph = trace(lambda w: jnp.swapaxes(w, 0, 1) * 2.0,
                  jax.ShapeDtypeStruct((2, 4, 8, 64), F32))
    (node,) = [n for n in graph.nodes if n.primitive == "transpose"]
    sizes = {"data": 2, "model": 4}
    assert moves_no_data(node, ((("data",), (), ("model",), ()),), sizes)
    assert not moves_no_data(node, (((), (), ("model",), ()),), sizes)   # 2 and 4 swap
    assert moves_no_data(node, ((("data",), ("model",), (), ()),), sizes)   # both one
    (mul,) = [n for n in graph.nodes if n.primitive == "mul"]
    assert not moves_no_data(mul, ((("data",), (), ("model",), ()), None), sizes)


def weight_gradient(x, dy):
    return jax.lax.dot_general(dy, x, (((0,), (0,)), ((), ()))).T   # [d, f], as JAX's w.r.t. w


def test_a_transposed_dot_result_in_memory_is_written_by_the_dot(mesh_1d):
    # the program's result: XLA's dot writes it in the transposed order, no copy follows;
    # priced as a copy, the prediction was 1.57x the compiled compute
    args = (jax.ShapeDtypeStruct((512, 1024), F32), jax.ShapeDtypeStruct((512, 2048), F32))
    plan = autoshard.plan(weight_gradient, *args, mesh=mesh_1d, cache=False, progress=False)
    compiled = plan.jit().lower(*args).compile()
    assert not [line for line in compiled.as_text().splitlines()
                if " transpose(" in line or " copy(" in line]
    report = hlo_report(compiled, plan.hardware, mesh_1d)
    assert plan.cost.compute_s == pytest.approx(report.compute_s, rel=0.05)
