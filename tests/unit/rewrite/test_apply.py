"""apply constrains a result only where XLA's propagation could lay it out otherwise, and
puts each decision's constraints where its node key says."""

import contextlib
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.report.hlo_report import hlo_report
from autoshard.rewrite.apply import collection_paused, constraining_every_result
from autoshard.runtime import cli
from autoshard.zoo import models


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


@pytest.mark.slow
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
    monkeypatch.setattr(autoshard.rewrite.apply, "collection_paused", contextlib.nullcontext)
    assert paused < collections() / 2   # the re-interpreted equations run paused


# -- the rewriter on hand-written decisions ---------------------------------------------------

def constraints(jaxpr) -> list:
    """The specs of every with_sharding_constraint in ``jaxpr`` and the jaxprs nested in
    it, in program order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            found.append(eqn.params["sharding"].spec)
        for value in eqn.params.values():
            for inner in (value if isinstance(value, (tuple, list)) else [value]):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += constraints(inner)
    return found


def rewritten(fn, decisions, mesh, *dims):
    from autoshard.frontend.trace import trace
    from autoshard.rewrite.apply import rewrite
    avals = [jax.ShapeDtypeStruct(d, jnp.float32) for d in dims]
    closed = trace(fn, *avals).closed_jaxpr
    return jax.make_jaxpr(rewrite(closed, decisions, mesh))(*avals).jaxpr


def test_a_decision_constrains_where_its_key_says(mesh_1d):
    from autoshard.rewrite.apply import Decision
    split = (("data",),)
    fn = lambda x: jnp.cos(jnp.sin(x))                                     # noqa: E731
    # no decisions: the program as written
    assert constraints(rewritten(fn, {}, mesh_1d, (64,))) == []
    # eqn 0 (sin): its result; eqn 1 (cos): its operand, then its result
    after_sin = rewritten(fn, {(0,): Decision(out_specs=(split,))}, mesh_1d, (64,))
    assert constraints(after_sin) == [P("data")]
    assert [e.primitive.name for e in after_sin.eqns] == ["sin", "sharding_constraint", "cos"]
    both = rewritten(fn, {(1,): Decision(in_specs=(split,), out_specs=(((),),))}, mesh_1d,
                     (64,))
    assert [e.primitive.name for e in both.eqns] == [
        "sin", "sharding_constraint", "cos", "sharding_constraint"]
    assert constraints(both) == [P("data"), P()]


def test_a_carry_seam_constrains_the_loop_at_each_crossing(mesh_1d):
    from autoshard.rewrite.apply import Decision

    def fn(c, xs):
        return jax.lax.scan(lambda c, x: (jnp.sin(c) + x, None), c, xs)[0]

    split = (("data",),)
    jaxpr = rewritten(fn, {(0, "carry", 0): Decision(out_specs=(split,))}, mesh_1d,
                      (64,), (3, 64))
    # the init on the way in, the carry entering and leaving the body, the final carry
    assert constraints(jaxpr) == [P("data")] * 4


def test_a_dynamic_slice_at_a_traced_start_is_kept_apart(mesh_1d):
    fn = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i.astype(jnp.int32)[0], 8)   # noqa: E731
    jaxpr = rewritten(fn, {}, mesh_1d, (64,), (1,))
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.index("optimization_barrier") == names.index("dynamic_slice") + 1


# -- the rewrite written as a jaxpr ----------------------------------------------------------

def written(fn, decisions, mesh, *dims):
    from autoshard.frontend.trace import trace
    from autoshard.rewrite.apply import JaxprWriter
    avals = [jax.ShapeDtypeStruct(d, jnp.float32) for d in dims]
    return JaxprWriter(decisions, mesh).write(trace(fn, *avals).closed_jaxpr).jaxpr


def test_the_written_rewrite_holds_the_interpreted_ones_equations(mesh_1d):
    from autoshard.rewrite.apply import Decision
    split = (("data",),)

    @jax.jit
    def inner(x):   # an inlined call, its equations keyed under it
        return jnp.cos(x)

    fn = lambda x, i: inner(jnp.sin(x)) + jax.lax.dynamic_slice_in_dim(   # noqa: E731
        x, i.astype(jnp.int32)[0], 64)
    decisions = {(0,): Decision(out_specs=(split,)),
                 (1, "jit", 0): Decision(in_specs=(split,), out_specs=(((),),))}
    for got, want in ((written(fn, decisions, mesh_1d, (64,), (1,)),
                       rewritten(fn, decisions, mesh_1d, (64,), (1,))),
                      (written(fn, {}, mesh_1d, (64,), (1,)),
                       rewritten(fn, {}, mesh_1d, (64,), (1,)))):
        assert [e.primitive.name for e in got.eqns] == [e.primitive.name for e in want.eqns]
        assert constraints(got) == constraints(want)
    assert "optimization_barrier" in [e.primitive.name for e in got.eqns]


def test_a_loop_is_left_to_the_interpreter(mesh_1d):
    from autoshard.frontend.trace import trace
    from autoshard.rewrite.apply import Decision, JaxprWriter, Unwritten, rewritten_function

    def fn(c, xs):
        return jax.lax.scan(lambda c, x: (jnp.sin(c) + x, None), c, xs)[0]

    avals = [jax.ShapeDtypeStruct(d, jnp.float32) for d in ((64,), (3, 64))]
    closed = trace(fn, *avals).closed_jaxpr
    decisions = {(0, "carry", 0): Decision(out_specs=((("data",),),))}
    with pytest.raises(Unwritten):
        JaxprWriter(decisions, mesh_1d).write(closed)
    jaxpr = jax.make_jaxpr(rewritten_function(closed, decisions, mesh_1d))(*avals).jaxpr
    assert constraints(jaxpr) == [P("data")] * 4


@pytest.mark.slow
def test_the_written_rewrite_compiles_to_the_interpreted_program(mesh_2d, monkeypatch):
    """The zoo GPT's plan, lowered as one written call and re-interpreted primitive by
    primitive: the same compiled program, where the written one's trace is a fraction."""
    import re
    case = models.train_case("gpt", "tiny")
    hw = cli.cpu_hardware(mesh_2d)
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh_2d, hardware=hw,
                          donate_argnums=case.donate_argnums, cache=False, progress=False)
    args = case.abstract_args()

    def compiled_text() -> str:
        jax.clear_caches()
        text = plan.jit(case.donate_argnums).lower(*args).compile().as_text()
        text = text.split("\n\nFileNames")[0]           # where in the source, aside
        return re.sub(r",? ?stack_frame_id=\d+|metadata=\{[^}]*\}|\.\d+", "", text)

    traced = plan.jit(case.donate_argnums).trace(*args).jaxpr.jaxpr
    assert [e.primitive.name for e in traced.eqns] == ["jit"]
    written = compiled_text()
    apply = autoshard.rewrite.apply
    monkeypatch.setattr(apply, "rewritten_function", apply.rewrite)
    assert written == compiled_text()
    want = jax.device_get(plan.jit(())(*case.args))
    monkeypatch.undo()
    got = jax.device_get(plan.jit(())(*case.args))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
