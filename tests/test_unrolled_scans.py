"""A scan unrolled whole is straight-line code to XLA: its one-trip loop is inlined, and
its ys are the iterations' results, which their readers read where they were written:
no stack is filled slice by slice."""

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.hlo_report import hlo_report

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
