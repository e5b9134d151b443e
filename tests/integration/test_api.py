"""Public API: JSON round trip, views, and clear errors on bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.testing import programs


@pytest.fixture(scope="module")
def mlp():
    return programs.mlp_train_step()


def test_json_round_trips_exactly(mlp, mesh_2d):
    plan = autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d)
    text = plan.to_json()
    loaded = autoshard.Plan.from_json(text, mesh=mesh_2d)
    assert loaded.to_json() == text
    got = loaded.bind(mlp.fn, *mlp.args).jit()(*mlp.args)
    want = plan.jit()(*mlp.args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_json_for_another_program_is_refused(mlp, mesh_2d):
    plan = autoshard.Plan.from_json(autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d).to_json(),
                                    mesh=mesh_2d)
    other = programs.mlp_train_step(batch=128)
    with pytest.raises(autoshard.PlanError, match="fingerprint"):
        plan.bind(other.fn, *other.args)


def test_summary_and_explain(mlp, mesh_2d, capsys):
    plan = autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d)
    plan.summary()
    out = capsys.readouterr().out
    assert "params['layers'][0]['w']" in out and "bytes/device" in out
    text = plan.explain("params['layers'][0]['w']")
    assert "would cost" in text
    with pytest.raises(autoshard.PlanError, match="did you mean"):
        plan.explain("params['layers'][0]['ww']")


def test_pins_are_honored(mlp, mesh_2d):
    plan = autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d,
                          pins={"params['layers'][0]['w']": P(None, "model")})
    assert plan.argument("params['layers'][0]['w']").spec == ((), ("model",))
    got = plan.jit()(*mlp.args)
    want = jax.jit(mlp.fn)(*mlp.args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=mlp.atol)


def test_pin_errors_name_the_culprit(mlp, mesh_2d):
    with pytest.raises(autoshard.PinError, match="no axis 'tensor'"):
        autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d,
                       pins={"params['layers'][0]['w']": P("tensor")})
    with pytest.raises(autoshard.PinError, match="params\\['layer'\\]"):
        autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d, pins={"params['layer']": P()})
    with pytest.raises(autoshard.PinError, match="does not divide"):
        autoshard.plan(lambda v: v * 2, jnp.ones(12), mesh=mesh_2d,
                       pins={"v": P(("data", "model"))})


def test_output_pin_in_another_axis_order_is_refused(mesh_2d):
    with pytest.raises(autoshard.PinError, match="out"):
        autoshard.plan(lambda v: v * 2, jnp.ones((16, 8)), mesh=mesh_2d,
                       pins={"out": P(("model", "data"))})


def test_non_array_leaf_is_named(mesh_2d):
    with pytest.raises(autoshard.InputError, match=r"config\['name'\]"):
        autoshard.plan(lambda x, config: x * 2, jnp.ones(8), {"name": "adam"}, mesh=mesh_2d)


def test_explicit_mesh_is_converted(mlp):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.warns(UserWarning, match="Auto"):
        plan = autoshard.plan(mlp.fn, *mlp.args, mesh=mesh)
    assert all(t == AxisType.Auto for t in plan.mesh.axis_types)
    plan.jit()(*mlp.args)


def test_impossible_budget_says_smallest(mlp, mesh_2d):
    with pytest.raises(autoshard.MemoryBudgetError, match="no plan fits the memory budget") as e:
        autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d, memory_budget=1000)
    assert e.value.smallest_bytes > 1000


def test_indivisible_dims_stay_whole(mesh_2d):
    def fn(w, x):
        return jnp.tanh(x @ w)
    w = jax.random.normal(jax.random.key(0), (63, 35))
    x = jax.random.normal(jax.random.key(1), (9, 63))
    plan = autoshard.plan(fn, w, x, mesh=mesh_2d)
    for a in plan.arguments:
        for size, axes in zip(a.shape, a.spec):
            assert size % int(np.prod([dict(mesh_2d.shape)[n] for n in axes] or [1])) == 0
    np.testing.assert_allclose(plan.jit()(w, x), jax.jit(fn)(w, x), rtol=1e-5, atol=1e-6)


def test_cost_fields(mlp, mesh_2d):
    cost = autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d).cost
    assert cost.total_s == pytest.approx(cost.compute_s + cost.comm_s)
    assert cost.memory_bytes > 0
