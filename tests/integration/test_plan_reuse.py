"""A plan is used only on the arguments it was made for; donation ties and what the user
passed: a pin on a donated output plans, and arguments not donated are left intact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard


def mean_loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def sgd_step(w, batch):
    loss, grad = jax.value_and_grad(mean_loss)(w, batch)
    return w - 0.1 * grad, loss


def make_batch(rows: int, seed: int = 0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (rows, 16)), "y": jax.random.normal(ky, (rows, 32))}


W = jax.random.normal(jax.random.key(1), (16, 32)) * 0.1


def test_plan_jit_refuses_a_batch_of_another_size(mesh_2d):
    plan = autoshard.plan(mean_loss, W, make_batch(8), mesh=mesh_2d, cache=False)
    jitted = plan.jit()
    np.testing.assert_allclose(jitted(W, make_batch(8)), mean_loss(W, make_batch(8)), rtol=1e-5)
    with pytest.raises(autoshard.PlanError, match=r"batch\['x'\].*float32\[8, 16\].*"
                                                  r"float32\[4, 16\]"):
        jitted(W, make_batch(4))
    with pytest.raises(autoshard.PlanError, match=r"argument w: .*bfloat16"):
        jitted(W.astype(jnp.bfloat16), make_batch(8))


def test_bind_refuses_arguments_of_another_shape(mesh_2d):
    text = autoshard.plan(mean_loss, W, make_batch(8), mesh=mesh_2d, cache=False).to_json()
    loaded = autoshard.Plan.from_json(text, mesh=mesh_2d)
    with pytest.raises(autoshard.PlanError, match=r"batch\['y'\]"):
        loaded.bind(mean_loss, W, {"x": make_batch(8)["x"], "y": make_batch(4)["y"]})


def test_auto_shard_plans_again_for_another_batch_size(mesh_2d):
    step = autoshard.auto_shard(mean_loss, mesh=mesh_2d, cache=False)
    for rows in (8, 4):
        batch = make_batch(rows, seed=rows)
        np.testing.assert_allclose(step(W, batch), mean_loss(W, batch), rtol=1e-5)
    assert len(step._plans) == 2


def snapshot(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


@pytest.mark.parametrize("donate", [(), (0,)])
def test_arguments_not_donated_are_left_intact(mesh_2d, donate):
    plan = autoshard.plan(sgd_step, W, make_batch(8), mesh=mesh_2d, donate_argnums=donate,
                          cache=False)
    w, batch = jax.device_put((W, make_batch(8)), plan.in_shardings)
    before = snapshot((w, batch))
    new_w, _ = plan.jit()(w, batch)
    jax.block_until_ready(new_w)
    kept = [batch] if donate else [w, batch]
    for tree, want in zip(kept, before[len(donate):]):
        for leaf, old in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
            assert not leaf.is_deleted()
            np.testing.assert_array_equal(np.asarray(leaf), old)
    assert w.is_deleted() == bool(donate)   # donation did take effect where asked


@pytest.mark.parametrize("spec", [P("data"), P(None, "data")])
def test_output_pin_with_donation_plans_and_matches_one_device(mesh_1d, spec):
    """A donated argument too small to be split on its own takes its output's pin."""
    def step(a, b):
        return jnp.tanh(a) + b.sum(), b * 2.0

    a = jax.random.normal(jax.random.key(2), (8, 16))
    b = jax.random.normal(jax.random.key(3), (8, 16))
    plan = autoshard.plan(step, a, b, mesh=mesh_1d, pins={"out[0]": spec}, donate_argnums=(0,),
                          cache=False)
    want_spec = autoshard.frontend.specs.from_partition_spec(spec, 2)
    assert plan.out_specs[0] == plan.in_specs[0] == want_spec
    want = jax.jit(step)(a, b)
    got = plan.jit()(*jax.device_put((a, b), plan.in_shardings))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_differing_pins_on_a_donated_pair_name_both(mesh_2d):
    def step(w, x):
        return w * 2.0, x @ w

    w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    with pytest.raises(autoshard.PinError, match=r"'w'.*'out\[0\]'.*donated"):
        autoshard.plan(step, w, x, mesh=mesh_2d, donate_argnums=(0,), cache=False,
                       pins={"w": P(None, "model"), "out[0]": P("data", None)})
    plan = autoshard.plan(step, w, x, mesh=mesh_2d, cache=False,   # undonated: both hold
                          pins={"w": P(None, "model"), "out[0]": P("data", None)})
    assert plan.in_specs[0] != plan.out_specs[0]


def test_donation_under_a_budget_is_named_not_blamed_on_pins(mesh_1d, monkeypatch):
    """Where plans ignoring the donation ties fit the budget but the solver finds none
    keeping them (no pins at all), the error names the budget and the donated arguments."""
    from autoshard.solver import search
    from autoshard.solver.solve import InfeasibleBudget

    def no_plan_keeps_the_ties(request, **_):
        raise InfeasibleBudget(0.5 * request.memory_budget)
    monkeypatch.setattr(search, "solve", no_plan_keeps_the_ties)
    with pytest.raises(autoshard.MemoryBudgetError, match=r"donated: 'w'.*leave those "
                                                          r"arguments undonated") as info:
        autoshard.plan(sgd_step, W, make_batch(8), mesh=mesh_1d, donate_argnums=(0,),
                       memory_budget=1e5, cache=False)
    assert "pin" not in str(info.value)
    assert info.value.budget_bytes == 1e5
