"""apply constrains a result only where XLA's propagation could lay it out otherwise."""

import contextlib
import gc

import jax
import numpy as np
import pytest

import autoshard
from autoshard import cli, models
from autoshard.apply import collection_paused, constraining_every_result
from autoshard.inspect import inspect


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
    step = [inspect(p.jit(()).lower(*args).compile(), hw, mesh_2d) for p in (pruned, full)]
    assert step[0].total_s == pytest.approx(step[1].total_s, rel=1e-6)
    assert step[0].count() == step[1].count()         # the same collectives
    got = jax.device_get(pruned.jit(())(*case.args))
    want = jax.device_get(jax.jit(case.train_step)(*case.args))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=case.rtol, atol=case.atol)


def test_collection_paused_nests_and_restores():
    enabled = gc.isenabled()
    gc.enable()
    try:
        with collection_paused():
            assert not gc.isenabled()
            with collection_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()        # the inner pause leaves the outer one be
        assert gc.isenabled()
        with pytest.raises(ValueError), collection_paused():
            raise ValueError
        assert gc.isenabled()
        gc.disable()
        with collection_paused():
            pass
        assert not gc.isenabled()            # a collector paused before stays paused
    finally:
        (gc.enable if enabled else gc.disable)()


def test_tracing_the_plan_pauses_the_collector(mesh_2d, monkeypatch):
    case = models.train_case("gpt", "tiny")
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh_2d, cache=False,
                          progress=False)

    def collections() -> int:
        """Collections the cyclic collector starts while jax.jit traces the plan."""
        started = []
        callback = lambda phase, info: phase == "start" and started.append(phase)  # noqa: E731
        gc.collect()
        gc.callbacks.append(callback)
        try:
            plan.jit(()).trace(*case.abstract_args())
        finally:
            gc.callbacks.remove(callback)
        assert gc.isenabled()
        return len(started)

    assert gc.isenabled()
    paused = collections()
    monkeypatch.setattr(autoshard.apply, "collection_paused", contextlib.nullcontext)
    assert paused < collections() / 2   # the re-interpreted equations run paused
