"""The backend compiled for: CPU XLA reduces bf16 in f32, so its collectives move 2x."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import autoshard
from autoshard.hlo_report import hlo_report


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
