"""Every plan computes what the unsharded function computes (f32, rtol 1e-5).

atol per program is stated in autoshard.testing.programs: sharded reductions add in
another order, and Adam divides by sqrt(v), so values near zero differ by more than
rtol alone allows.
"""

import jax
import numpy as np
import pytest

import autoshard
from autoshard.testing import programs

RTOL = 1e-5
PROGRAMS = {p.name: p for p in programs.all_programs()}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_plan_matches_single_device(name, mesh):
    program = PROGRAMS[name]
    expected = jax.jit(program.fn)(*program.args)
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh)
    got = plan.jit()(*program.args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=RTOL, atol=program.atol)
    # the result lives where the plan says
    for sharding, leaf in zip(jax.tree.leaves(plan.out_shardings), jax.tree.leaves(got)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_auto_shard_decorator_caches_per_signature(mesh_2d):
    program = PROGRAMS["mlp_train_step"]
    step = autoshard.auto_shard(program.fn, mesh=mesh_2d)
    first = step(*program.args)
    step(*program.args)
    assert len(step._plans) == 1
    expected = jax.jit(program.fn)(*program.args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(first)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=RTOL, atol=program.atol)
    assert step.plan_for(*program.args) is next(iter(step._plans.values()))


def test_auto_shard_takes_its_own_outputs_back(mesh_1d):
    """Two steps, the second fed the first's outputs (sharded as the plan's outputs, which
    need not match its inputs without donation), equal two single-device steps."""
    program = PROGRAMS["mlp_train_step"]
    params, batch = program.args
    step = autoshard.auto_shard(program.fn, mesh=mesh_1d)
    new_params, _ = step(params, batch)
    _, loss = step(new_params, batch)
    reference = jax.jit(program.fn)
    expected_params, _ = reference(params, batch)
    _, expected_loss = reference(expected_params, batch)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=RTOL, atol=program.atol)


def test_donation_keeps_numerics(mesh_1d):
    program = PROGRAMS["mlp_train_step"]
    expected = jax.jit(program.fn)(*program.args)
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh_1d, donate_argnums=(0,))
    args = jax.tree.map(lambda x: x.copy(), program.args)
    got = plan.jit()(*args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=RTOL, atol=program.atol)


def test_control_flow_numerics(mesh_2d):
    """while, cond, fori (scan), remat and custom_vjp survive the rewrite."""
    import jax.numpy as jnp

    @jax.custom_vjp
    def scale(a):
        return a * 3.0
    scale.defvjp(lambda a: (a * 3.0, None), lambda _, ct: (ct * 3.0,))

    def fn(w, x):
        def loss(w):
            h = jax.lax.cond(x.sum() > 0, lambda a: a @ w, lambda a: a @ w.T, x)
            h = jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), h)
            h = jax.checkpoint(lambda a: jnp.sin(a) @ w)(h)
            return scale(h).mean()
        value, grad = jax.value_and_grad(loss)(w)
        grad = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] * 1.5, c[1] + 1),
                                  (grad, 0))[0]
        return value, grad

    w = jax.random.normal(jax.random.key(1), (64, 64)) / 8
    x = jax.random.normal(jax.random.key(2), (32, 64))
    expected = jax.jit(fn)(w, x)
    got = autoshard.plan(fn, w, x, mesh=mesh_2d).jit()(w, x)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=RTOL, atol=1e-6)


def test_pinned_output_megatron_numerics():
    """The column-then-row plan chosen for big-weight inference, at a size that runs."""
    from jax.sharding import PartitionSpec as P
    mesh = autoshard.make_mesh((8,), ("model",))
    program = programs.inference_mlp(batch=16, d=512)
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh, pins={"out": P()})
    expected = jax.jit(program.fn)(*program.args)
    np.testing.assert_allclose(np.asarray(plan.jit()(*program.args)), np.asarray(expected),
                               rtol=RTOL, atol=program.atol)


def test_vocab_parallel_loss_numerics(mesh_1d):
    """An LM head split on the vocabulary keeps its loss vocab-parallel: the gradient's
    scatter into the logits stays split (each device holds V/8 columns)."""
    from jax.sharding import PartitionSpec as P

    from autoshard.zoo.models import common

    def fn(w, x, y):
        return jax.grad(lambda w, x: common.cross_entropy(x @ w, y), argnums=(0, 1))(w, x)
    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(keys[0], (256, 8192)) * 0.1
    x = jax.random.normal(keys[1], (8, 32, 256))
    y = jax.random.randint(keys[2], (8, 32), 0, 8192)
    axis = mesh_1d.axis_names[0]
    plan = autoshard.plan(fn, w, x, y, mesh=mesh_1d, pins={"w": P(None, axis)}, cache=False)
    hlo = plan.jit().lower(w, x, y).compile().as_text()
    assert "f32[8,32,1024]{2,1,0} scatter(" in hlo
    for g, e in zip(plan.jit()(w, x, y), jax.jit(fn)(w, x, y)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=RTOL, atol=1e-6)
