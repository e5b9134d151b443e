"""Plan choice on canonical cases: the specs chosen, and what XLA compiled from them."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.frontend import specs
from autoshard.report.hlo_report import hlo_report
from autoshard.testing import programs


def spec_of(plan, path):
    return specs.to_partition_spec(plan.argument(path).spec)


def test_large_batch_small_weights_is_data_parallel(mesh_1d):
    # big enough that 8x less compute beats one combined gradient all-reduce (~50 us)
    program = programs.mlp_train_step(batch=4096, d_in=1024, d_hidden=1024, d_out=256)
    plan = autoshard.plan(program.fn, *program.abstract_args(), mesh=mesh_1d)
    for a in plan.arguments:
        if a.path.startswith("params"):
            assert not specs.spec_axes(a.spec), a.path
    assert spec_of(plan, "batch['x']") == P("data")
    assert spec_of(plan, "batch['y']") == P("data")


def test_small_batch_big_weights_is_megatron(mesh_1d):
    """x[16, 8192] @ W1 -> gelu -> @ W2: column then row, one all-reduce, no weight gather."""
    mesh = autoshard.make_mesh((8,), ("model",))
    program = programs.inference_mlp(abstract=True)
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh, pins={"out": P()})
    assert spec_of(plan, "params['w1']") == P(None, "model")
    assert spec_of(plan, "params['w2']") == P("model")
    report = hlo_report(plan.jit().lower(*program.args).compile(), plan.hardware, mesh)
    weight_bytes = 8192 * 8192 * 4
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert all(c.num_bytes < weight_bytes / 8 for c in gathers), gathers
    assert report.count("all-reduce") == 1


def test_tight_memory_shards_parameters_and_optimizer_state(mesh_1d):
    """Adam on a wide MLP with a tiny batch: params + 2 moments dominate memory."""
    fn, args = programs.mlp_adam_abstract(batch=8, d=1024, depth=4)
    dp = autoshard.plan(fn, *args, mesh=mesh_1d, donate_argnums=(0, 1),
                        pins={"params": P(), "opt_state": P()})
    dp_memory = hlo_report(dp.jit().lower(*args).compile(), dp.hardware, mesh_1d).memory_bytes
    budget = dp_memory * 0.5
    plan = autoshard.plan(fn, *args, mesh=mesh_1d, donate_argnums=(0, 1),
                          memory_budget=budget)
    weights = [a for a in plan.arguments if a.path.endswith("['w']")]
    assert weights and all(specs.spec_axes(a.spec) for a in weights)
    compiled = hlo_report(plan.jit().lower(*args).compile(), plan.hardware, mesh_1d)
    assert compiled.memory_bytes <= budget, (compiled.memory_bytes, budget)


@pytest.mark.slow
def test_scan_over_layers_shards_stacked_weights(mesh_2d):
    program = programs.scan_transformer_train_step()
    args = program.abstract_args()
    unconstrained = autoshard.plan(program.fn, *args, mesh=mesh_2d,
                                   pins={"params": P(), "opt_state": P()})
    budget = unconstrained.memory_parts["arguments"] * 0.6  # below replicated weights and moments
    plan = autoshard.plan(program.fn, *args, mesh=mesh_2d, memory_budget=budget)
    stacked = [a for a in plan.arguments if a.path.startswith("params['layers']")
               and len(a.shape) == 3]
    assert stacked
    sharded = [a for a in stacked if specs.spec_axes(a.spec)]
    assert sharded and all(not a.spec[0] for a in stacked)  # the scanned dim stays whole


def scan_mlp_program(batch, d, layers):
    """Residual MLP blocks applied by lax.scan over stacked weights, plain SGD."""
    import jax.numpy as jnp
    params = {"w1": jax.ShapeDtypeStruct((layers, d, 2 * d), jnp.float32),
              "w2": jax.ShapeDtypeStruct((layers, 2 * d, d), jnp.float32)}
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)

    def step(params, x):
        def loss(params):
            def block(h, w):
                return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None
            return (jax.lax.scan(block, x, params)[0] ** 2).mean()
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value
    return step, (params, x)


def test_scan_over_layers_with_large_batch_is_data_parallel_inside_the_loop(mesh_1d):
    """Each iteration of the backward scan all-reduces its layer's two weight gradients
    as one combined collective, and the activations a replicated body would copy in and
    out of their stacks every iteration are 8x smaller split: data parallel wins."""
    fn, args = scan_mlp_program(batch=2048, d=256, layers=4)
    plan = autoshard.plan(fn, *args, mesh=mesh_1d, donate_argnums=(0,))
    assert spec_of(plan, "x") == P("data")
    assert spec_of(plan, "params['w1']") == P() and spec_of(plan, "params['w2']") == P()
    report = hlo_report(plan.jit(donate_argnums=(0,)).lower(*args).compile(), plan.hardware,
                     mesh_1d)
    single = hlo_report(jax.jit(fn).lower(*args).compile(), plan.hardware)
    assert report.flops * 8 == single.flops   # the loop bodies run on 1/8 of the batch
    # one all-reduce per backward iteration (4) and one for the loss
    assert report.count("all-reduce") == 5
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=0.1)

@pytest.mark.slow
def test_one_billion_parameters_plan_from_shapes_only(mesh_2d):
    program = programs.lm_1b_train_step_abstract()
    before = sum(x.nbytes for x in jax.live_arrays())
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh_2d, time_limit_s=120)
    after = sum(x.nbytes for x in jax.live_arrays())
    assert after - before < 64 * 2**20
    assert plan.cost.memory_bytes < plan.hardware.memory


def two_readers_of_x(axis):
    """x, split on its batch, feeding two column-parallel dots that both read it whole:
    (fn, abstract args, pins)."""
    def fn(x, w1, w2):
        return jnp.tanh(x @ w1), jnp.tanh(x @ w2)
    args = (jax.ShapeDtypeStruct((64, 256), jnp.float32),
            jax.ShapeDtypeStruct((256, 8192), jnp.float32),
            jax.ShapeDtypeStruct((256, 8192), jnp.float32))
    return fn, args, {"x": P(axis), "w1": P(None, axis), "w2": P(None, axis)}


def test_a_copy_two_readers_want_is_priced_once(mesh_1d):
    """x, split on its batch, feeds two column-parallel dots that both read it whole: XLA
    gathers x once, and the plan prices one gather, not one per reader."""
    fn, args, pins = two_readers_of_x(mesh_1d.axis_names[0])
    plan = autoshard.plan(fn, *args, mesh=mesh_1d, cache=False, pins=pins)
    report = hlo_report(plan.jit().lower(*args).compile(), plan.hardware, mesh_1d)
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert len(gathers) == 1 and gathers[0].num_bytes == 64 * 256 * 4
    assert plan.cost.reshard_s == pytest.approx(gathers[0].seconds, rel=0.01)


def test_sibling_reductions_pay_one_latency(mesh_1d):
    """Three row-parallel dots summed before a contraction that reads the sum (the input
    gradients of q, k and v): their all-reduces depend on none of each other, so XLA
    combines them, and the plan prices one latency for the three, not three."""
    def fn(a, b, c, w1, w2, w3, v):
        return jnp.tanh(a @ w1 + b @ w2 + c @ w3) @ v
    x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    w = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    args = (x, x, x, w, w, w, jax.ShapeDtypeStruct((256, 256), jnp.float32))
    axis = mesh_1d.axis_names[0]
    row = {"a": P(None, axis), "b": P(None, axis), "c": P(None, axis),
           "w1": P(axis), "w2": P(axis), "w3": P(axis), "v": P(), "out": P()}
    plan = autoshard.plan(fn, *args, mesh=mesh_1d, cache=False, pins=row)
    report = hlo_report(plan.jit().lower(*args).compile(), plan.hardware, mesh_1d)
    assert report.count("all-reduce") < 3
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=0.05)


def test_a_reduction_after_a_trailing_one_pays_its_own_latency(mesh_1d):
    """Nothing contracts after these reductions, so both run late, but a sum over features
    split after the all-reduce reads its result: XLA cannot combine the two. Priced as
    one latency, slicing the summed rows to sum them in parts looked cheaper; priced as
    two, the plan sums the rows whole, one all-reduce, as predicted."""
    def fn(a, b, w1, w2):
        y = a @ w1 + b @ w2
        return y, y.sum(axis=1)
    x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    w = jax.ShapeDtypeStruct((1024, 4096), jnp.float32)
    axis = mesh_1d.axis_names[0]
    pins = {"a": P(None, axis), "b": P(None, axis), "w1": P(axis), "w2": P(axis),
            "out[1]": P()}
    plan = autoshard.plan(fn, x, x, w, w, mesh=mesh_1d, cache=False, pins=pins)
    report = hlo_report(plan.jit().lower(x, x, w, w).compile(), plan.hardware, mesh_1d)
    assert report.count("all-reduce") == 1
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=0.05)


def gradients_and_their_norm(norm_first: bool):
    """Three weight gradients (each contracted over the batch, so all-reduced) returned
    split as the optimizer state is, and the global norm over them, as
    ``clip_by_global_norm`` reads it: (fn, abstract args, pins)."""
    def fn(xs, ys):
        grads = [x.T @ y for x, y in zip(xs, ys)]
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
        return (norm, grads) if norm_first else (grads, norm)
    x = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
    pins = {f"{name}[{k}]": P("data") for name in ("xs", "ys") for k in range(3)}
    pins.update({f"out[{1 if norm_first else 0}][{k}]": P("data") for k in range(3)})
    return fn, ([x] * 3, [x] * 3), pins


# HBM slow enough that each gradient's sum of squares is taken on its shard, and a latency
# that tells one combined all-reduce from four
SLOW_HBM = autoshard.Hardware(flops=4.9e14, hbm_bandwidth=1e10, memory=80e9,
                              link_bandwidth={"data": 3.6e11}, link_latency=1e-5)


@pytest.mark.parametrize("norm_first,ops", [(True, 4), (False, 2)])
def test_a_global_norm_over_split_gradients_is_priced_as_the_combiner_splits_it(
        mesh_1d, norm_first, ops):
    """Each gradient's sum of squares, taken on its shard, is all-reduced after the
    gradient's own all-reduce. XLA's combiner walks the program in post order and starts
    another combined op at each all-reduce that depends on one in the op it is filling.
    Read for the norm first, the program reaches each gradient just before its sum of
    squares: four ops (the first gradient; each sum of squares with the next gradient; the
    last sum). Read for the gradients first, it reaches all three gradients, then the three
    sums: two ops. The plan prices the ops the program compiles to."""
    fn, args, pins = gradients_and_their_norm(norm_first)
    plan = autoshard.plan(fn, *args, mesh=mesh_1d, hardware=SLOW_HBM, cache=False,
                          pins=pins)
    report = hlo_report(plan.jit().lower(*args).compile(), plan.hardware, mesh_1d)
    reductions = {c.name for c in report.collectives
                  if c.kind in ("all-reduce", "reduce-scatter")}
    assert len(reductions) == ops
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=0.05)


def test_a_sum_over_dims_split_on_two_axes_is_two_all_reduces(mesh_2d):
    """XLA reduces a sum over dims split on different mesh axes with one all-reduce per
    dim, each over its own axis (a batch norm's statistics over batch and height); the
    plan prices both."""
    first, second = mesh_2d.axis_names
    x = jax.ShapeDtypeStruct((64, 32, 32, 256), jnp.float32)   # too big to gather
    plan = autoshard.plan(lambda x: x.sum(axis=(0, 1, 2)), x, mesh=mesh_2d, cache=False,
                          pins={"x": P(None, second, first), "out": P()})
    report = hlo_report(plan.jit().lower(x).compile(), plan.hardware, mesh_2d)
    assert sorted(c.axes for c in report.collectives) == [(first,), (second,)]
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=0.05)


def test_past_the_cap_a_shared_copy_is_held_once_and_paid_per_read(mesh_1d, monkeypatch):
    """A value with more shared copies than the solver takes on (``MAX_SHARED_COPIES``)
    still holds one copy per wanted spec; only its seconds are paid per read. Built
    without sharing held copies, each read holds a copy of its own from the read before
    it on, where the shared copy is held up to each read that shares it
    (``shared.held_until``): the same bytes at every point."""
    from autoshard import cost
    from autoshard.cost import strategies
    from autoshard.frontend import trace
    from autoshard.planning import api
    from autoshard.solver import request as requests
    from autoshard.solver import solve

    fn, args, pins = two_readers_of_x(mesh_1d.axis_names[0])
    graph = trace.trace(fn, *args)
    sizes = api.axis_sizes(mesh_1d)
    space = strategies.build_strategies(graph, sizes, autoshard.H100,
                                        api.resolve_pins(pins, graph, sizes))

    def priced(share=True):
        cg = cost.build_cost_graph(space, share_held_copies=share)
        request = cg.request(None, 60)
        result = solve.solve(request)
        return cg, result, requests.row_bytes(request, result.choice)
    _, shared, shared_bytes = priced()
    monkeypatch.setattr(cost.shared, "MAX_SHARED_COPIES", 0)   # where shared_copies reads it
    _, capped, capped_bytes = priced()
    assert list(capped.choice) == list(shared.choice)
    assert list(capped_bytes) == list(shared_bytes)
    assert capped.objective > shared.objective + 0.5 * autoshard.H100.link_latency
    cg, unshared, unshared_bytes = priced(share=False)
    assert cg.held_per_read and list(unshared.choice) == list(shared.choice)
    assert list(unshared_bytes) == list(shared_bytes)


def test_cpu_gradient_reduce_scatters_join_the_combined_all_reduce(mesh_1d):
    """FSDP on CPU: XLA:CPU has no reduce-scatter, so the partitioner all-reduces each
    weight gradient and keeps a slice, and the combiner merges those all-reduces with the
    loss's into one. Priced as one latency for all, reduce-scattering the gradients beats
    all-reducing them whole (compiled communication: 46.4 against 49.6 us), and the plan prices the
    program it compiles to."""
    def step(params, x):
        def loss(p):
            h = jnp.tanh(x @ p["w1"]) @ p["w2"]
            return jnp.mean(jnp.tanh(h @ p["w3"]) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value
    f32 = jnp.float32
    args = ({"w1": jax.ShapeDtypeStruct((256, 512), f32),
             "w2": jax.ShapeDtypeStruct((512, 256), f32),
             "w3": jax.ShapeDtypeStruct((256, 256), f32)}, jax.ShapeDtypeStruct((512, 256), f32))
    axis = mesh_1d.axis_names[0]
    pins = ({"w1": P(axis), "w2": P(axis), "w3": P(axis)}, P(axis))
    plan = autoshard.plan(step, *args, mesh=mesh_1d, cache=False, pins=pins,
                          donate_argnums=(0,))
    report = hlo_report(plan.jit(donate_argnums=(0,)).lower(*args).compile(), plan.hardware,
                        mesh_1d)
    reductions = [c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter")]
    assert {c.name for c in reductions} == {reductions[0].name}   # one combined op
    scattered = [c for c in reductions if c.kind == "reduce-scatter"]
    assert scattered and scattered[0].num_bytes == 4 * (256 * 512 * 2 + 256 * 256)
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=0.01)


def test_scattering_onto_a_split_batch_dim_is_priced_as_xla_partitions_it(mesh_2d):
    """An expert's second dot, batched over experts split over data and contracted over
    model, with its result wanted over (data, model) on the expert dim: XLA's partitioner
    does not reduce-scatter onto that batch dim. It all-reduces over model, all-gathers
    the whole result over data and keeps its slice. Priced so, the plan all-reduces and
    slices where the result lies, and its communication is the compiled program's. Priced
    as a reduce-scatter, it scattered, and compiled to an all-gather it did not price."""
    def experts(h, w):
        return jnp.tanh(jnp.einsum("ebhd,ehdf->ebf", h, w))
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((16, 128, 8, 32), f32),
            jax.ShapeDtypeStruct((16, 8, 32, 256), f32))
    pins = {"h": P("data", None, None, "model"), "w": P("data", None, "model"),
            "out": P(("data", "model"))}
    plan = autoshard.plan(experts, *args, mesh=mesh_2d, cache=False, pins=pins)
    report = hlo_report(plan.jit().lower(*args).compile(), plan.hardware, mesh_2d)
    assert [c.kind for c in report.collectives] == ["all-reduce"]
    assert plan.cost.comm_s == pytest.approx(report.comm_s, rel=0.01)
