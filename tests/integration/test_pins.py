"""Pins as a pytree, like jax.jit's in_shardings, beside the path form."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.errors import PinError
from autoshard.frontend import specs


def step(params, batch):
    def loss(params):
        h = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean(jnp.square(h @ params["w2"] - batch["y"]))
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


ARGS = ({"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
         "w2": jax.ShapeDtypeStruct((256, 32), jnp.float32)},
        {"x": jax.ShapeDtypeStruct((64, 64), jnp.float32),
         "y": jax.ShapeDtypeStruct((64, 32), jnp.float32)})


def planned(mesh, pins):
    return autoshard.plan(step, *ARGS, mesh=mesh, pins=pins, cache=False, progress=False)


def spec(plan, path):
    return specs.to_partition_spec(plan.argument(path).spec)


def test_tuple_of_spec_trees_pins_each_leaf(mesh_2d):
    pins = ({"w1": P(None, "model"), "w2": P("model", None)}, {"x": P("data"), "y": None})
    plan = planned(mesh_2d, pins)
    assert spec(plan, "params['w1']") == P(None, "model")
    assert spec(plan, "params['w2']") == P("model")
    assert spec(plan, "batch['x']") == P("data")
    path_form = planned(mesh_2d, {"params['w1']": P(None, "model"),
                                  "params['w2']": P("model", None), "batch['x']": P("data")})
    assert plan.in_specs == path_form.in_specs


def test_a_path_pins_the_tree_under_it(mesh_2d):
    """A path's pin may be a tree of specs, as the result's structure holds them: a
    tuple of specs pinned on ``out`` was read as one spec whose entries were specs
    ("mesh has no axis ('data', 'model')")."""
    rows = P(("data", "model"))
    tree = planned(mesh_2d, {"out": {"w1": rows, "w2": None}, "batch": {"x": P("data")}})
    paths = planned(mesh_2d, {"out['w1']": rows, "batch['x']": P("data")})
    assert tree.out_specs == paths.out_specs and tree.in_specs == paths.in_specs
    assert tree.out_specs[0] == specs.from_partition_spec(rows, 2)

    def pair(x):
        return jnp.tanh(x), jnp.sin(x)
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    plan = autoshard.plan(pair, x, mesh=mesh_2d, pins={"out": [rows, NamedSharding(mesh_2d,
                                                                                     rows)]},
                          cache=False, progress=False)
    assert plan.out_specs == (specs.from_partition_spec(rows, 2),) * 2


def test_prefix_tree_and_named_shardings(mesh_2d):
    plan = planned(mesh_2d, (NamedSharding(mesh_2d, P()), NamedSharding(mesh_2d, P("data"))))
    for path in ("params['w1']", "params['w2']"):
        assert spec(plan, path) == P()
    for path in ("batch['x']", "batch['y']"):
        assert spec(plan, path) == P("data")


def test_one_spec_for_every_argument(mesh_1d):
    plan = planned(mesh_1d, P())
    assert all(not specs.spec_axes(a.spec) for a in plan.arguments)


def test_none_leaves_an_argument_free(mesh_2d):
    free = planned(mesh_2d, None)
    plan = planned(mesh_2d, (None, None))
    assert plan.in_specs == free.in_specs


def test_tree_that_does_not_match_is_a_pin_error(mesh_2d):
    with pytest.raises(PinError, match="do not match"):
        planned(mesh_2d, ({"w1": P()}, None))
    with pytest.raises(PinError, match="PartitionSpec, NamedSharding or None"):
        planned(mesh_2d, ({"w1": "model", "w2": None}, None))


def adam_step(params, opt_state, x):
    """One Adam step on a linear layer with a bias of 64 (kept whole unless pinned):
    the bias's two moments are computed from one gradient, in one group."""
    def loss(params):
        return jnp.mean(jnp.square(x @ params["w"] + params["b"]))
    grads = jax.grad(loss)(params)
    mu, nu = opt_state
    mu = jax.tree.map(lambda m, g: 0.1 * g + 0.9 * m, mu, grads)   # as optax writes them
    nu = jax.tree.map(lambda v, g: 0.01 * g * g + 0.99 * v, nu, grads)
    params = jax.tree.map(lambda p, m, v: p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), params, mu, nu)
    return params, (mu, nu)


def test_small_donated_argument_pinned_alone_is_left_unaliased(mesh_2d):
    """A donated argument too small to be split unless pinned, pinned split: its output is
    computed in one group with the other moment's, which keeps its whole argument's spec,
    so no plan writes it back split. The pin holds and the pair is left unaliased (as XLA
    does with a donated buffer sharded unlike its output), with a warning, not a budget
    error blaming the donation; the plan counts that output's own buffer, as compiled."""
    params = {"w": jax.ShapeDtypeStruct((256, 64), jnp.float32),
              "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
    args = (params, (params, params), jax.ShapeDtypeStruct((128, 256), jnp.float32))
    path = "opt_state[0]['b']"
    with pytest.warns(UserWarning, match="will not alias"):
        plan = autoshard.plan(adam_step, *args, mesh=mesh_2d, pins={path: P("model")},
                              donate_argnums=(0, 1), cache=False, progress=False)
    assert spec(plan, path) == P("model")
    with pytest.warns(UserWarning, match="donated buffers were not usable"):   # jax's
        compiled = plan.jit().lower(*args).compile()
    memory = compiled.memory_analysis()
    assert plan.memory_parts["outputs"] == memory.output_size_in_bytes - memory.alias_size_in_bytes
    assert plan.memory_parts["outputs"] >= 64 * 4
    # the other pairs stay tied, and plans without that pin keep every donation
    free = autoshard.plan(adam_step, *args, mesh=mesh_2d, donate_argnums=(0, 1),
                          cache=False, progress=False)
    free_memory = free.jit().lower(*args).compile().memory_analysis()
    assert free.memory_parts["outputs"] == (free_memory.output_size_in_bytes
                                            - free_memory.alias_size_in_bytes)
    assert plan.memory_parts["outputs"] == free.memory_parts["outputs"] + 64 * 4
