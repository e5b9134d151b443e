"""The planner's per-device memory against XLA's memory analysis of the compiled plan.

Each program is planned on 8 simulated CPU devices, compiled, and its predicted peak
(arguments + outputs + temporaries - donated) compared with ``memory_analysis()``.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.report.hlo_report import buffer_bytes, hlo_report
from autoshard.testing import plain, programs
from autoshard.zoo import models

TOLERANCE = 0.10


def compiled_memory(plan, args, donate_argnums=()):
    compiled = plan.jit(donate_argnums=donate_argnums).lower(*args).compile()
    return hlo_report(compiled, plan.hardware, plan.mesh)


def test_gathered_weight_is_counted(mesh_1d):
    """FSDP-like: x is split by batch and w [256, 1024] by rows, so both dots gather w;
    the gathered copies (1 MiB each) are a quarter of the peak."""
    def fn(w, x):
        return jnp.tanh(x @ w) @ w.T

    w = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
    plan = autoshard.plan(fn, w, x, mesh=mesh_1d,
                          pins={"w": P("data", None), "x": P("data"), "out": P("data")})
    report = compiled_memory(plan, (w, x))
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert gathers and all(c.num_bytes == 256 * 1024 * 4 for c in gathers)
    assert plan.cost.memory_bytes == pytest.approx(report.memory_bytes, rel=TOLERANCE)


def test_data_parallel_step_holds_gradients_and_their_reduced_copies(mesh_1d):
    """Adam on a replicated MLP: XLA combines every gradient's all-reduce into one, which
    runs after the last gradient, holding all of them and all their results at once."""
    step, args = programs.mlp_adam_abstract(batch=256, d=512, depth=3)
    plan = autoshard.plan(step, *args, mesh=mesh_1d, donate_argnums=(0, 1),
                          pins={"params": P(), "opt_state": P(), "batch": P("data")})
    report = compiled_memory(plan, args, donate_argnums=(0, 1))
    assert report.count("all-reduce") == 1
    assert plan.cost.memory_bytes == pytest.approx(report.memory_bytes, rel=TOLERANCE)


@pytest.mark.slow
def test_zoo_gpt_under_a_budget_fits_and_is_predicted(mesh_1d):
    """A budget below the replicated plan's memory: the plan shards weights and optimizer
    state, reshards and reduces, and still fits once compiled."""
    case = models.train_case("gpt", "tiny", abstract=True)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.args)
    donate = tuple(case.donate_argnums)
    replicated = autoshard.plan(case.train_step, *args, mesh=mesh_1d, donate_argnums=donate)
    budget = 0.6 * compiled_memory(replicated, args, donate).memory_bytes
    plan = autoshard.plan(case.train_step, *args, mesh=mesh_1d, donate_argnums=donate,
                          memory_budget=budget)
    report = compiled_memory(plan, args, donate)
    assert report.memory_bytes <= budget
    assert plan.cost.memory_bytes == pytest.approx(report.memory_bytes, rel=TOLERANCE)


@pytest.mark.slow
def test_gathered_weights_are_held_to_their_last_reader_that_shares_them(mesh_1d):
    """FSDP on the plain-JAX MoE: each weight is gathered once for the forward and the
    backward pass, and the copy dies after the backward pass. The optimizer's update
    reads the weight as it is stored, not the copy; held to the update (the last reader
    that could have shared it), the copies put the predicted peak 32 % over XLA's."""
    case = plain.moe("small")
    args = case.abstract_args()
    plan = autoshard.plan(case.train_step, *args, mesh=mesh_1d, cache=False,
                          pins=case.experts["fsdp"](mesh_1d), donate_argnums=case.donate_argnums)
    report = compiled_memory(plan, args, case.donate_argnums)
    assert plan.cost.memory_bytes == pytest.approx(report.memory_bytes, rel=TOLERANCE)


@pytest.mark.parametrize("case", [
    pytest.param(lambda: plain.cnn("small"), id="plain_cnn"),
    pytest.param(lambda: models.train_case("gpt", "small"), id="gpt"),
])
@pytest.mark.slow
def test_a_gathered_weight_dies_once_copied_for_the_backward_pass(mesh_1d, case):
    """FSDP, against the bytes XLA holds together at its peak (``buffer_bytes``). XLA
    gathers every weight at the start and at once copies it into the layouts its readers
    want (a dot's backward layout, a convolution's reversed kernel); then the gathered
    copy dies. Held to its readers in the backward pass beside the copies made from it,
    the gathered weights put the prediction 34 % (CNN) and 15 % (GPT) over XLA's dumped
    peak. Against what XLA holds together, the CNN is predicted 4.4 % under (11.37 MB
    against 11.89 MB; 8.9 % under before its transposed activations were counted from
    their write, ``xla.layout_copies_made_when_written``), the GPT 0.2 % under, on both
    jaxes."""
    case = case()
    args = case.abstract_args()
    plan = autoshard.plan(case.train_step, *args, mesh=mesh_1d, cache=False,
                          pins=case.experts["fsdp"](mesh_1d), donate_argnums=case.donate_argnums)
    live, _ = buffer_bytes(plan.jit(donate_argnums=case.donate_argnums).lower(*args))
    assert plan.cost.memory_bytes == pytest.approx(live, rel=0.05)


@pytest.mark.slow
def test_bf16_gradients_are_held_at_the_wire_width_until_their_combined_all_reduce(mesh_1d):
    """The bf16 GPT, data parallel. XLA:CPU all-reduces bf16 in f32: each weight
    gradient is converted to f32 where it is computed, and held so until the combined
    all-reduce of all of them, beside its result. jax 0.12's XLA:CPU computes those
    gradients' dots at bf16, so the f32 copy is a buffer of its own: counted at bf16
    width, the step was predicted 9.2 % under what XLA holds together (63.98 MiB against
    70.46 MiB); on jax 0.10 the dots already write f32 (2.0 % under)."""
    case = models.train_case("gpt", "small_bf16")
    args = case.abstract_args()
    plan = autoshard.plan(case.train_step, *args, mesh=mesh_1d, cache=False,
                          pins=case.experts["data_parallel"](mesh_1d),
                          donate_argnums=case.donate_argnums)
    live, _ = buffer_bytes(plan.jit(donate_argnums=case.donate_argnums).lower(*args))
    assert plan.cost.memory_bytes == pytest.approx(live, rel=0.03)


@pytest.mark.slow
def test_zoo_gpt_small_under_a_tight_budget_compiles_within_it(mesh_1d):
    """gpt/small under 0.6 x data parallel's memory on an H100 node: the plan shards the
    weights and optimizer state, and compiles within the budget, its peak predicted
    within 10 %. The margin is thin: XLA's packing of the temporaries takes a few percent
    over their live peak, which the planner does not model (README). Budget 42.27 MiB,
    predicted 42.26, compiled 41.76. While gathered copies were held to the last reader
    that could share them (the optimizer's update), the planner counted a copy of the
    embedding table through the peak and chose a slower plan (predicted 0.392 ms against
    0.356 ms now) that compiled to 39.56 MiB."""
    case = models.train_case("gpt", "small", abstract=True)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.args)
    donate = tuple(case.donate_argnums)
    hw = autoshard.Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                            link_bandwidth={"data": 3.6e11}, link_latency=1e-5)
    data_parallel = autoshard.plan(case.train_step, *args, mesh=mesh_1d, hardware=hw,
                                   pins=case.experts["data_parallel"](mesh_1d),
                                   donate_argnums=donate)
    budget = 0.6 * compiled_memory(data_parallel, args, donate).memory_bytes
    plan = autoshard.plan(case.train_step, *args, mesh=mesh_1d, hardware=hw,
                          donate_argnums=donate, memory_budget=budget)
    report = compiled_memory(plan, args, donate)
    assert report.memory_bytes <= budget
    assert plan.cost.memory_bytes == pytest.approx(report.memory_bytes, rel=TOLERANCE)


def narrow_conv_step(x, k):
    """A bf16 grouped convolution and its kernel's gradient, as a CNN layer's step."""
    def loss(k):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=2,
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return jnp.sum(jnp.square(y.astype(jnp.float32)))
    return jax.grad(loss)(k)


def narrow_top_k(x):
    return jax.lax.top_k(jnp.tanh(x), 8)


def spectrum(x):
    return jnp.abs(jnp.fft.rfft(jnp.tanh(x))) * 2.0


def scaled_conv(x, k):
    """An NCHW stem convolution (RGB in) scaled on its way out."""
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NCHW", "OIHW", "NCHW")) * 0.5


@pytest.mark.parametrize("fn, shapes, pins, dtype", [
    (narrow_conv_step, ((16, 8, 32, 32), (16, 4, 3, 3)), {"x": P("data")}, jnp.bfloat16),
    (narrow_top_k, ((64, 1024),), None, jnp.bfloat16),
    (spectrum, ((64, 1024),), {"x": P("data")}, jnp.float32),
    (scaled_conv, ((16, 3, 32, 32), (16, 3, 3, 3)), {"x": P("data")}, jnp.float32),
], ids=["conv_grad", "top_k", "fft", "nchw_out"])
def test_held_as_xla_cpu_holds_them(fn, shapes, pins, dtype, mesh_1d):
    """XLA:CPU convolves bf16 in f32 (an f32 copy of each operand, an f32 result), moves
    bf16 through its collectives in f32, and runs a bf16 top_k as a sort of its keys
    packed with their indices (the elementwise work before it computed in the packing).
    XLA's partitioner gathers a grouped conv, batch split or not. A plan copies an FFT's
    operand and result on XLA:CPU (to keep the layout its thunk runs). It writes an NCHW
    conv's result as NHWC and transposes it out: the scaling reads it through the
    transpose and cannot write in place of it. The model held all of them at the dtype's
    width, split, or not at all: tight budgets broke by up to 2x."""
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    plan = autoshard.plan(fn, *args, mesh=mesh_1d, pins=pins, cache=False, progress=False)
    assert plan.cost.memory_bytes == pytest.approx(compiled_memory(plan, args).memory_bytes,
                                                   rel=TOLERANCE)


def mlp_stack_loss(params, x):
    def layer(h, w):
        return jnp.tanh(h @ w["a"]) @ w["b"] + h, None
    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(h ** 2)


def mlp_stack_step(params, x):
    loss, grads = autoshard.value_and_grad(mlp_stack_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def accumulated_mlp_stack(mesh, microbatches: int, pins=None) -> tuple[float, int]:
    """(predicted, bytes XLA holds together at its peak) of ``mlp_stack_step`` (4 layers,
    256 <-> 1024, batch 1024) accumulated over ``microbatches`` with nothing saved, its
    replica slices over the whole mesh."""
    params = {"a": jax.ShapeDtypeStruct((4, 256, 1024), jnp.float32),
              "b": jax.ShapeDtypeStruct((4, 1024, 256), jnp.float32)}
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    plan = autoshard.plan(mlp_stack_step, params, x, mesh=mesh, microbatches=microbatches,
                          remat="nothing_saveable", donate_argnums=(0,), pins=pins,
                          cache=False, progress=False)
    assert plan.microbatching.replicas == mesh.devices.size
    live, _ = buffer_bytes(plan.jit().lower(params, x))
    return plan.cost.memory_bytes, live


@pytest.mark.parametrize("microbatches", [2, 4])
def test_accumulated_weights_per_replica_are_the_weights_themselves(microbatches, mesh_2d):
    """Accumulated over replica slices, the loss runs on a copy of the weights per slice,
    split over the replica axes: each device's copy is its weights. Scanning the layers
    moves the copies' replica dim behind the layer dim, a transpose that moves only a
    dim of one element on each device: a bitcast, no buffer. jax 0.10's XLA copies it
    into each layer scan's loop state while that scan runs; jax 0.12's does not. The
    model held one such buffer per weight for the forward scan and one for the backward,
    throughout the step: 70 % over on jax 0.12, 29 % on 0.10."""
    predicted, live = accumulated_mlp_stack(mesh_2d, microbatches)
    assert predicted == pytest.approx(live, rel=TOLERANCE)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_accumulated_weights_gathered_once_are_held_through_the_loop(microbatches, mesh_2d):
    """Weights split over the whole mesh are gathered once before the accumulation loop
    and broadcast to a copy per replica slice, a bitcast of the gathered weights: the
    gathered buffer is held while the loop reads the copies. The model freed it at the
    broadcast: 18 % under on jax 0.10, where XLA also holds it. jax 0.12's XLA holds it
    too: its dumped peak (22.2 MB) leaves out what the loop holds; held together, 29.4 MB
    against 30.3 MB predicted (2 microbatches)."""
    split = P(None, ("data", "model"))
    predicted, live = accumulated_mlp_stack(mesh_2d, microbatches,
                                            {"params['a']": split, "params['b']": split})
    assert predicted == pytest.approx(live, rel=TOLERANCE)
