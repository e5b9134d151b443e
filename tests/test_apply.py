"""apply constrains a result only where XLA's propagation could lay it out otherwise."""

import jax
import numpy as np
import pytest

import autoshard
from autoshard import cli, models
from autoshard.apply import constraining_every_result
from autoshard.hlo_report import hlo_report


def constraint_count(plan) -> int:
    return sum(len(d.out_specs) + sum(s is not None for s in d.in_specs)
               for d in plan.decisions.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_pruned_constraints_keep_the_compiled_step(name, mesh_2d):
    case = models.train_case(name, "tiny")
    hw = cli.cpu_hardware(mesh_2d)        # a plan that splits parameters and activations
    kwargs = dict(mesh=mesh_2d, hardware=hw, donate_argnums=case.donate_argnums,
                  cache=False, progress=False)
    pruned = autoshard.plan(case.train_step, *case.args, **kwargs)
    with constraining_every_result():   # the same layouts (pinned: ties may break otherwise)
        full = autoshard.plan(case.train_step, *case.args, pins=pruned.in_shardings, **kwargs)
    assert pruned.in_specs == full.in_specs
    assert pruned.cost.total_s == pytest.approx(full.cost.total_s, rel=1e-9)
    assert constraint_count(pruned) < 0.5 * constraint_count(full)
    args = case.abstract_args()
    step = [hlo_report(p.jit(()).lower(*args).compile(), hw, mesh_2d) for p in (pruned, full)]
    assert step[0].total_s == pytest.approx(step[1].total_s, rel=1e-6)
    assert step[0].count() == step[1].count()         # the same collectives
    got = jax.device_get(pruned.jit(())(*case.args))
    want = jax.device_get(jax.jit(case.train_step)(*case.args))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=case.rtol, atol=case.atol)
