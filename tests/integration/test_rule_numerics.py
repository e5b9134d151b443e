"""Plans of programs built from the ordinary-model primitives (dropout, pooling, grouped
convolutions, sort/top_k, cumulative ops, fft) on the 2x4 mesh: they plan with no
replicated-fallback warning, run, and compute what the unsharded program computes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.report import hlo_report as hlo_lib
from autoshard.target.hardware import H100

RTOL, ATOL = 1e-5, 1e-6


def plan_without_fallback(fn, *args, mesh, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(fn, *args, mesh=mesh, hardware=H100, progress=False, **kwargs)
    fallbacks = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not fallbacks, fallbacks
    return plan


def as_numbers(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def assert_matches_one_device(plan, fn, *args):
    expected = jax.jit(fn)(*args)
    got = plan.jit()(*args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(as_numbers(g), as_numbers(e), rtol=RTOL, atol=ATOL)
    return got


def is_split(sharding) -> bool:
    return any(axes is not None for axes in sharding.spec)


def dropout_loss(w, x, key):
    h = jnp.tanh(x @ w)
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    return jnp.mean(jnp.where(keep, h / 0.9, 0.0) ** 2)


@pytest.mark.slow
def test_dropout_mask_is_made_per_shard(mesh_2d):
    """With the batch split (pinned, as a data-parallel input pipeline hands it over), the
    mask of jax.random.bernoulli is sharded like the activation it multiplies: no device
    makes the full-size random bits. JAX's threefry is partitionable (its default since
    0.5), so the values equal one device's bit for bit whatever the split."""
    assert jax.config.jax_threefry_partitionable

    def fn(w, x, key):
        return jax.value_and_grad(dropout_loss)(w, x, key)
    w = jax.random.normal(jax.random.key(0), (256, 512)) / 16
    x = jax.random.normal(jax.random.key(1), (256, 256))
    args = (w, x, jax.random.key(2))
    plan = plan_without_fallback(fn, *args, mesh=mesh_2d, pins={"x": P(("data", "model"))})
    assert_matches_one_device(plan, fn, *args)
    hlo = plan.jit().lower(*args).compile().as_text()
    assert "u32[32,512]" in hlo
    assert "u32[256,512]" not in hlo and "pred[256,512]" not in hlo

    def mask(key, ones):
        return jax.random.bernoulli(key, 0.5, ones.shape) * ones
    ones = jnp.ones((256, 512))
    mask_plan = plan_without_fallback(mask, args[2], ones, mesh=mesh_2d)
    assert is_split(mask_plan.out_shardings)
    np.testing.assert_array_equal(mask_plan.jit()(args[2], ones), jax.jit(mask)(args[2], ones))


@pytest.mark.slow
@pytest.mark.parametrize("library", ["linen", "nnx"])
def test_flax_dropout_train_step(library, mesh_2d):
    """A Flax MLP with dropout (linen Dropout with a dropout rng; nnx Dropout with its Rngs
    state) trained one SGD step: the plan matches one device."""
    import flax.linen as nn
    from flax import nnx
    x = jax.random.normal(jax.random.key(1), (64, 128))
    if library == "linen":
        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.Dropout(0.2, deterministic=False)(nn.relu(nn.Dense(256)(x)))
                return nn.Dense(8)(x)
        model = MLP()
        params = model.init({"params": jax.random.key(0)}, x)

        def step(params, x, key):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean(
                model.apply(p, x, rngs={"dropout": key}) ** 2))(params)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
        args = (params, x, jax.random.key(2))
    else:
        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.up, self.down = nnx.Linear(128, 256, rngs=rngs), nnx.Linear(256, 8, rngs=rngs)
                self.drop = nnx.Dropout(0.2, rngs=rngs)

            def __call__(self, x):
                return self.down(self.drop(nnx.relu(self.up(x))))
        graphdef, params, rng_state = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)

        def step(params, rng_state, x):
            model = nnx.merge(graphdef, params, rng_state)
            value, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            _, _, rng_state = nnx.split(model, nnx.Param, ...)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), rng_state, value
        args = (params, rng_state, x)
    plan = plan_without_fallback(step, *args, mesh=mesh_2d)
    assert_matches_one_device(plan, step, *args)


def pool(kind, x):
    if kind == "max":
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def conv(x, k, groups=1):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=groups,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_with_gradient(kind, mesh_2d):
    """conv -> pool -> loss, with the gradient (select_and_scatter_add for max pooling)."""
    def fn(k, x):
        return jax.value_and_grad(lambda k: jnp.mean(pool(kind, jnp.tanh(conv(x, k))) ** 2))(k)
    args = (jax.random.normal(jax.random.key(0), (3, 3, 8, 32)) / 4,
            jax.random.normal(jax.random.key(1), (16, 16, 16, 8)))
    plan = plan_without_fallback(fn, *args, mesh=mesh_2d)
    assert_matches_one_device(plan, fn, *args)


@pytest.mark.parametrize("groups,in_per_group", [(32, 1), (8, 4)], ids=["depthwise", "grouped"])
def test_grouped_conv_with_gradient(groups, in_per_group, mesh_2d):
    def fn(k, x):
        return jax.value_and_grad(lambda k: jnp.mean(jnp.tanh(conv(x, k, groups)) ** 2))(k)
    args = (jax.random.normal(jax.random.key(0), (3, 3, in_per_group, 64)) / 4,
            jax.random.normal(jax.random.key(1), (4, 16, 16, 32)))
    plan = plan_without_fallback(fn, *args, mesh=mesh_2d)
    assert_matches_one_device(plan, fn, *args)


@pytest.mark.slow
def test_depthwise_conv_splits_on_channels(mesh_2d):
    """Two images, 512 channels, depthwise layers: the batch cannot fill 8 devices, the
    channels can, with no collective but the loss's. The plan takes that split, and its
    compiled program is faster than data parallel's."""
    def step(kernels, x):
        def loss(kernels):
            h = x
            for k in kernels:
                h = jax.nn.relu(conv(h, k, x.shape[-1]))
            return jnp.mean(h ** 2)
        value, grads = jax.value_and_grad(loss)(kernels)
        return [k - 0.1 * g for k, g in zip(kernels, grads)], value
    kernels = [jax.random.normal(jax.random.key(i), (3, 3, 1, 512)) * 0.3 for i in range(2)]
    args = (kernels, jax.random.normal(jax.random.key(9), (2, 32, 32, 512)))
    plan = plan_without_fallback(step, *args, mesh=mesh_2d)
    assert_matches_one_device(plan, step, *args)
    assert plan.in_shardings[1].spec == P(None, None, None, ("data", "model"))
    auto = hlo_lib.hlo_report(plan.jit().lower(*args).compile(), H100, mesh_2d)
    replicated = jax.sharding.NamedSharding(mesh_2d, P())
    batch = jax.sharding.NamedSharding(mesh_2d, P("data"))
    data_parallel = jax.jit(step, in_shardings=([replicated] * 2, batch))
    dp = hlo_lib.hlo_report(data_parallel.lower(*args).compile(), H100, mesh_2d)
    assert auto.total_s < dp.total_s
    assert auto.count() == auto.count("all-reduce") == 1


def test_ragged_dot_with_gradient(mesh_2d):
    """An MoE-style grouped matmul (lax.ragged_dot) and its kernel gradient."""
    def fn(x, w, group_sizes):
        return jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(
            jax.lax.ragged_dot(x, w, group_sizes)) ** 2))(w)
    args = (jax.random.normal(jax.random.key(0), (64, 32)),
            jax.random.normal(jax.random.key(1), (4, 32, 128)) / 8,
            jnp.array([30, 10, 0, 24], jnp.int32))
    plan = plan_without_fallback(fn, *args, mesh=mesh_2d)
    assert_matches_one_device(plan, fn, *args)


def test_top_k_is_computed_whole_as_xla_cpu_computes_it(mesh_2d):
    """XLA:CPU's partitioner gathers a top_k's rows and computes it whole, whatever its
    specs; a plan that split the rows priced no all-gather, and no sort buffers of the
    whole array. With the rows pinned split on both ends, the plan prices the gather
    XLA compiles and the result equals one device's."""
    rows = P(("data", "model"))

    def fn(x):
        return jax.lax.top_k(jnp.tanh(x) * 2.0, 4)
    x = jax.random.normal(jax.random.key(0), (512, 64))
    plan = autoshard.plan(fn, x, mesh=mesh_2d, pins={"x": rows, "out": [rows, rows]},
                          cache=False, progress=False)
    compiled = hlo_lib.hlo_report(plan.jit().lower(x).compile(), plan.hardware, mesh_2d)
    assert compiled.count("all-gather") >= 1
    assert plan.cost.comm_s == pytest.approx(compiled.comm_s, rel=0.05)
    for e, g in zip(jax.tree.leaves(jax.jit(fn)(x)), jax.tree.leaves(plan.jit()(x))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["sort", "argsort", "cumsum", "cumprod", "cummax",
                                  "fft", "rfft"])
def test_split_on_the_other_dims(name, mesh_2d):
    """sort/top_k, cumulative ops and the fft on rows of a large array: each row is whole
    on one device, the rows split, and the result equals one device's."""
    ops = {
        "sort": lambda x: jnp.sort(x, axis=-1),
        "argsort": lambda x: jnp.argsort(x, axis=-1),
        "cumsum": lambda x: jnp.cumsum(x, axis=-1),
        "cumprod": lambda x: jnp.cumprod(1.0 + x / 64, axis=-1),
        "cummax": lambda x: jax.lax.cummax(x, axis=1),
        "fft": lambda x: jnp.abs(jnp.fft.fft(x)),
        "rfft": lambda x: jnp.abs(jnp.fft.rfft(x)),
    }
    op = ops[name]

    def fn(x):
        return op(jnp.tanh(x) * 2.0)
    x = jax.random.normal(jax.random.key(0), (512, 64))
    plan = plan_without_fallback(fn, x, mesh=mesh_2d)
    assert any(is_split(s) for s in jax.tree.leaves(plan.out_shardings))
    expected = jax.jit(fn)(x)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(plan.jit()(x))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-4)
