"""Models built from dropout, pooling and depthwise convolutions, planned and judged by
their compiled programs.

For each model and mesh: the replicated-fallback warnings planning raised (none expected),
the largest difference between the plan's step and one device's, and the step time per
device of the auto plan, of data parallel and (depthwise model) of the channel-split
layout, each compiled and priced by ``autoshard.report.hlo_report`` with the H100 numbers.

Models: ``dropout_mlp`` (flax linen, two Dense + Dropout layers, optax adamw),
``pool_cnn`` (flax linen: conv, max pool, depthwise conv, 1x1 conv, average pool, dropout,
dense; optax adamw), ``depthwise`` (two images of 512 channels through two depthwise
layers; SGD).

Run: python benchmarks/rule_models.py [--models dropout_mlp,pool_cnn,depthwise]
                                      [--meshes 2x4,8]
"""

import argparse
import os
import warnings

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import autoshard  # noqa: E402
from autoshard.report.hlo_report import hlo_report  # noqa: E402
from autoshard.target.hardware import H100  # noqa: E402

MESHES = {"8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "model"))}


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.Dropout(0.1, deterministic=False)(nn.gelu(nn.Dense(1024)(x)))
        return nn.Dense(10)(x)


class PoolCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(64, (3, 3), feature_group_count=64)(x))
        x = nn.relu(nn.Conv(64, (1, 1))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.Dropout(0.1, deterministic=False)(x)
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def linen_case(model, x, num_classes=10):
    """(adamw train step, args, data-parallel in_shardings maker)."""
    labels = jnp.arange(x.shape[0]) % num_classes
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)["params"]
    tx = optax.adamw(1e-3)

    def step(params, opt_state, x, labels, key):
        def loss(p):
            logits = model.apply({"params": p}, x, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    args = (params, tx.init(params), x, labels, jax.random.key(2))

    def data_parallel(mesh):
        whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names))
        every = lambda tree: jax.tree.map(lambda _: whole, tree)  # noqa: E731
        return (every(args[0]), every(args[1]), rows, rows, whole)
    return step, args, {"data parallel": data_parallel}


def depthwise_conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=x.shape[-1],
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def depthwise_case():
    def step(kernels, x):
        def loss(kernels):
            h = x
            for k in kernels:
                h = jax.nn.relu(depthwise_conv(h, k))
            return jnp.mean(h ** 2)
        value, grads = jax.value_and_grad(loss)(kernels)
        return [k - 0.1 * g for k, g in zip(kernels, grads)], value
    kernels = [jax.random.normal(jax.random.key(i), (3, 3, 1, 512)) * 0.3 for i in range(2)]
    args = (kernels, jax.random.normal(jax.random.key(9), (2, 32, 32, 512)))

    def layout(kernel_spec, x_spec):
        def shardings(mesh):
            kernel = NamedSharding(mesh, kernel_spec(mesh))
            return ([kernel] * len(kernels), NamedSharding(mesh, x_spec(mesh)))
        return shardings
    def batch(mesh):   # two images: a leading axis of 2 splits them, a larger one cannot
        first = mesh.axis_names[0]
        return (first,) if mesh.shape[first] == 2 else ()

    def channels(mesh):
        return tuple(a for a in mesh.axis_names if a not in batch(mesh)) or None
    return step, args, {
        "data parallel": layout(lambda m: P(), lambda m: P(batch(m) or None)),
        "channel split": layout(lambda m: P(None, None, None, channels(m)),
                                lambda m: P(batch(m) or None, None, None, channels(m))),
    }


CASES = {
    "dropout_mlp": lambda: linen_case(DropoutMLP(), jax.random.normal(jax.random.key(3),
                                                                       (64, 512))),
    "pool_cnn": lambda: linen_case(PoolCNN(), jax.random.normal(jax.random.key(3),
                                                                 (32, 16, 16, 8))),
    "depthwise": depthwise_case,
}


def numbers(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf, np.float64)


def judge(name, mesh_name):
    step, args, layouts = CASES[name]()
    mesh = autoshard.make_mesh(*MESHES[mesh_name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(step, *args, mesh=mesh, hardware=H100, progress=False)
    fallbacks = sorted({str(w.message).split("'")[1] for w in caught
                        if "no sharding rule" in str(w.message)})
    expected, got = jax.jit(step)(*args), plan.jit()(*args)
    error = max(float(np.max(np.abs(numbers(e) - numbers(g))))
                for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)))
    auto = hlo_report(plan.jit().lower(*args).compile(), H100, mesh).total_s
    others = {label: hlo_report(jax.jit(step, in_shardings=make(mesh)).lower(*args).compile(),
                             H100, mesh).total_s for label, make in layouts.items()}
    columns = "  ".join(f"{label} {s * 1e6:7.1f} us" for label, s in others.items())
    print(f"{name:12s} {mesh_name:4s} fallbacks {fallbacks or 'none'}  max |plan - one device| "
          f"{error:.1e}  auto {auto * 1e6:7.1f} us  {columns}  auto / data parallel "
          f"{auto / others['data parallel']:.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--meshes", default="2x4,8")
    options = parser.parse_args()
    for name in options.models.split(","):
        for mesh_name in options.meshes.split(","):
            judge(name, mesh_name)


if __name__ == "__main__":
    main()
