"""Gradient accumulation planned by autoshard: ``autoshard.value_and_grad`` and
``autoshard.plan(..., microbatches=...)``.

A residual MLP whose activations outweigh its weights (batch 16384 rows, d_model 128,
FFN 512, 3 layers): splitting the batch into K microbatches shrinks what the backward
pass keeps, while the gradient reduction stays one per step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.frontend import specs
from autoshard.report.hlo_report import hlo_report

D_MODEL, FFN, ROWS, LAYERS = 128, 512, 16384, 3
HW = autoshard.Hardware(flops=1e12, hbm_bandwidth=1e11, memory=80e9,
                        link_bandwidth={"data": 4e10, "model": 3.6e11}, link_latency=1e-6)


def loss_fn(params, batch):
    h = batch["x"]
    for layer in params["layers"]:
        h = jnp.tanh(h @ layer["up"]) @ layer["down"] + h
    return jnp.mean((h - batch["y"]) ** 2)


def train_step(params, batch):
    loss, grads = autoshard.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def make_args(rows=ROWS):
    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 2)
    params = {"layers": [
        {"up": jax.random.normal(keys[2 * i], (D_MODEL, FFN)) / D_MODEL ** 0.5,
         "down": jax.random.normal(keys[2 * i + 1], (FFN, D_MODEL)) / FFN ** 0.5}
        for i in range(LAYERS)]}
    batch = {"x": jax.random.normal(keys[-2], (rows, D_MODEL)),
             "y": jax.random.normal(keys[-1], (rows, D_MODEL))}
    return params, batch


@pytest.fixture(scope="module")
def args():
    return make_args()


@pytest.fixture(scope="module")
def expected(args):
    return jax.jit(train_step)(*args)


def plan_for(args, mesh, **options):
    return autoshard.plan(train_step, *args, mesh=mesh, hardware=HW, cache=False,
                          progress=False, **options)


def assert_matches(got, expected):
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


def compiled_report(plan_, args):
    return hlo_report(plan_.jit().lower(*args).compile(), plan_.hardware, plan_.mesh)


def assert_fits_once_compiled(plan_, args, budget):
    """A budget is a promise about the compiled program: the plan fits it as predicted,
    and as XLA's memory analysis counts it (arguments + outputs + temporaries - aliased)."""
    compiled = compiled_report(plan_, args).memory_bytes
    assert plan_.cost.memory_bytes <= budget
    assert compiled <= budget, (f"compiled {compiled} B over the budget of {budget:.0f} B "
                                f"(predicted {plan_.cost.memory_bytes:.0f} B)")


# -- autoshard.value_and_grad outside plan -------------------------------------------------

def aux_loss(w, b, x):
    y = jnp.tanh(x @ w + b)
    return jnp.mean(y ** 2), {"max": jnp.max(y)}


def test_value_and_grad_is_jax_value_and_grad_eagerly_and_under_jit():
    keys = jax.random.split(jax.random.key(1), 3)
    w, b = jax.random.normal(keys[0], (8, 4)), jax.random.normal(keys[1], (4,))
    x = jax.random.normal(keys[2], (16, 8))
    for argnums, has_aux in ((0, False), ((0, 1), True)):
        fn = aux_loss if has_aux else (lambda w, b, x: aux_loss(w, b, x)[0])
        theirs = jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)
        mine = autoshard.value_and_grad(fn, argnums=argnums, has_aux=has_aux)
        for got, want in ((mine(w, b, x), theirs(w, b, x)),
                          (jax.jit(mine)(w, b, x), jax.jit(theirs)(w, b, x))):
            assert jax.tree.structure(got) == jax.tree.structure(want)
            for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_default_plan_is_the_plan_of_jax_value_and_grad(args, mesh_2d):
    def plain_step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    ours = plan_for(args, mesh_2d)
    theirs = autoshard.plan(plain_step, *args, mesh=mesh_2d, hardware=HW, cache=False,
                            progress=False)
    assert ours.fingerprint == theirs.fingerprint
    assert ours.in_specs == theirs.in_specs and ours.out_specs == theirs.out_specs
    assert ours.microbatching is None


# -- accumulation --------------------------------------------------------------------------

def test_microbatched_plan_matches_single_device(args, expected, mesh_2d):
    plan_ = plan_for(args, mesh_2d, microbatches=4)
    assert plan_.microbatching.microbatches == 4
    assert_matches(plan_.jit()(*args), expected)


def test_auto_microbatches_fit_a_budget_one_batch_does_not(args, expected, mesh_1d):
    whole = plan_for(args, mesh_1d)
    budget = 0.6 * whole.cost.memory_bytes
    with pytest.raises(autoshard.MemoryBudgetError):
        plan_for(args, mesh_1d, memory_budget=budget)
    plan_ = plan_for(args, mesh_1d, memory_budget=budget, microbatches="auto")
    assert plan_.microbatching.microbatches > 1
    assert_fits_once_compiled(plan_, args, budget)
    assert_matches(plan_.jit()(*args), expected)
    assert f"{plan_.microbatching.microbatches} microbatches" in plan_.summary_text()


def test_gradients_reduced_once_whatever_k(args, mesh_1d):
    """The gradient reduction runs after the loop: the bytes each collective kind moves
    per step are the same for K = 2, 4, 8, no more than one batch's all-reduce, and
    inside the loop only the loss's scalars move."""
    whole = compiled_report(plan_for(args, mesh_1d), args)
    # the unsplit step reduces gradients: all-reduced, or reduce-scattered where the plan
    # splits them (on CPU a combined all-reduce whose results are only sliced)
    gradient_bytes = whole.collective_bytes("all-reduce") + whole.collective_bytes(
        "reduce-scatter")
    assert gradient_bytes > 4 * D_MODEL * FFN
    per_kind = []
    for k in (2, 4, 8):
        report = compiled_report(plan_for(args, mesh_1d, microbatches=k), args)
        assert all(c.num_bytes <= 16 for c in report.collectives if c.count > 1), \
            [c for c in report.collectives if c.count > 1]
        per_kind.append({kind: report.collective_bytes(kind) for kind in
                         ("all-reduce", "reduce-scatter", "all-to-all", "all-gather")})
        reduced = sum(per_kind[-1][kind] for kind in ("all-reduce", "reduce-scatter",
                                                     "all-to-all"))
        assert reduced <= gradient_bytes
    assert per_kind[0] == per_kind[1] == per_kind[2]


def test_memory_falls_as_microbatches_grow(args, mesh_1d):
    plans = [plan_for(args, mesh_1d, microbatches=k) for k in (1, 2, 4, 8)]
    predicted = [p.cost.memory_bytes for p in plans]
    compiled = [compiled_report(p, args).memory_bytes for p in plans]
    assert predicted[0] > predicted[1] > predicted[2] >= predicted[3]
    assert compiled[0] > compiled[1] > compiled[2] > compiled[3]


def test_json_round_trip_keeps_microbatches(args, expected, mesh_2d):
    plan_ = plan_for(args, mesh_2d, microbatches=2)
    loaded = autoshard.Plan.from_json(plan_.to_json(), mesh_2d).bind(train_step, *args)
    assert loaded.microbatching == plan_.microbatching
    assert loaded.decisions == plan_.decisions
    assert_matches(loaded.jit()(*args), expected)


def test_microbatches_need_a_marked_loss_and_a_count(args, mesh_1d):
    def plain_step(params, batch):
        return jax.value_and_grad(loss_fn)(params, batch)
    with pytest.raises(autoshard.InputError, match="autoshard.value_and_grad"):
        autoshard.plan(plain_step, *args, mesh=mesh_1d, microbatches=2, progress=False)
    for bad in (0, -2, 2.5, "many", True):
        with pytest.raises(autoshard.InputError, match="microbatches"):
            plan_for(args, mesh_1d, microbatches=bad)
    with pytest.raises(autoshard.InputError, match="does not split"):
        plan_for(make_args(rows=24), mesh_1d, microbatches=5)


# -- pipeline ------------------------------------------------------------------------------

STACK_LAYERS, STACK_ROWS = 8, 64


def stack_loss(params, batch):
    """An embedding, a lax.scan over 8 stacked residual layers (with an auxiliary loss
    summed in the carry), and a head: the shape of a scanned transformer."""
    h = batch["x"] @ params["embed"]

    def layer(carry, w):
        h, aux = carry
        h = jnp.tanh(h @ w["up"]) @ w["down"] * batch["mask"][:, None] + h
        return (h, aux + jnp.mean(h ** 2)), None

    (h, aux), _ = jax.lax.scan(layer, (h, jnp.zeros((), jnp.float32)), params["layers"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2) + 0.01 * aux


def stack_step(params, batch):
    loss, grads = autoshard.value_and_grad(stack_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def make_stack_args(rows: int = STACK_ROWS):
    keys = jax.random.split(jax.random.key(2), 7)
    d, f = 32, 128
    params = {"embed": jax.random.normal(keys[0], (16, d)) / 4,
              "layers": {"up": jax.random.normal(keys[1], (STACK_LAYERS, d, f)) / d ** 0.5,
                         "down": jax.random.normal(keys[2], (STACK_LAYERS, f, d)) / f ** 0.5},
              "head": jax.random.normal(keys[3], (d, 8)) / d ** 0.5}
    batch = {"x": jax.random.normal(keys[4], (rows, 16)),
             "y": jax.random.normal(keys[5], (rows, 8)),
             "mask": jax.random.uniform(keys[6], (rows,))}
    return params, batch


@pytest.fixture(scope="module")
def stack_args():
    return make_stack_args()


def plan_stack(stack_args, mesh, **options):
    return autoshard.plan(stack_step, *stack_args, mesh=mesh, hardware=HW, cache=False,
                          progress=False, **options)


def test_gpipe_schedule_arithmetic():
    from autoshard.rewrite.pipeline import Pipelining
    p = Pipelining("data", stages=4, microbatches=8, layers=16)
    assert (p.layers_per_stage, p.iterations) == (4, 11)
    assert p.bubble_fraction == pytest.approx(3 / 11)
    for stage in range(4):   # each stage runs every microbatch once, in order, from step s
        work = [p.busy(stage, t) for t in range(p.iterations)]
        assert [m for m in work if m is not None] == list(range(8))
        assert work.index(0) == stage
    idle = sum(p.busy(s, t) is None for s in range(4) for t in range(p.iterations))
    assert idle / (4 * p.iterations) == pytest.approx(p.bubble_fraction)


@pytest.mark.slow
def test_forced_pipeline_matches_single_device(stack_args, mesh_2d):
    expected = jax.jit(stack_step)(*stack_args)
    plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4)
    staged = plan_.pipeline
    assert (staged.axis, staged.stages, staged.microbatches, staged.layers) == ("data", 2, 4, 8)
    assert staged.layers_per_stage == 4
    assert_matches(plan_.jit()(*stack_args), expected)
    for path in ("params['layers']['up']", "params['layers']['down']"):
        assert plan_.argument(path).spec[0] == ("data",)   # a stage's layers on its devices
    assert_only_the_shift_crosses_stages(plan_, stack_args)
    assert "pipeline over 'data': 2 stages x 4 layers, 4 microbatches" in plan_.summary_text()


@pytest.mark.slow
def test_auto_pipeline_is_the_fastest_candidate_and_matches(stack_args, mesh_2d):
    expected = jax.jit(stack_step)(*stack_args)
    plan_ = plan_stack(stack_args, mesh_2d, pipeline="auto")   # both schedules weighed
    assert any(t.get("schedule") == "circular" for t in plan_.stats.settings)
    assert_matches(plan_.jit()(*stack_args), expected)
    for other in (plan_stack(stack_args, mesh_2d),
                  plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4)):
        assert plan_.cost.total_s <= other.cost.total_s * (1 + 1e-9)


def test_pipeline_json_round_trip(stack_args, mesh_2d):
    plan_ = plan_stack(stack_args, mesh_2d, pipeline="model", microbatches=8)
    loaded = autoshard.Plan.from_json(plan_.to_json(), mesh_2d).bind(stack_step, *stack_args)
    assert loaded.pipeline == plan_.pipeline
    assert loaded.pipeline.bubble_fraction == pytest.approx(3 / 11)
    assert_matches(loaded.jit()(*stack_args), jax.jit(stack_step)(*stack_args))


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=autoshard.MemoryBudgetError, reason=(
    "the memory model holds a program's outputs from the start, where XLA's buffer "
    "assignment puts temporaries of their size that die before an output is written in "
    "its buffer (here a gradient accumulator and a stage-major weight stack, in the "
    "backward loop): a pipeline of this undonated step is predicted 8.5 % (jax 0.12) to "
    "12.5 % (0.10) high, and K pipelined steps no lower than one (before, they were "
    "predicted low and broke the budget by 32 % once compiled)"))
def test_pipeline_accumulates_where_one_pipelined_step_does_not_fit(stack_args, mesh_2d):
    """Under a budget the pipelined step misses, K pipelined steps on B / K rows each
    accumulate the gradients: less memory, same step."""
    plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4)
    assert plan_.microbatching.microbatches == 1
    for _ in range(8):   # tighten the budget until no single pipelined step fits
        budget = 0.9 * plan_.cost.memory_bytes
        plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4,
                           memory_budget=budget)
        if plan_.microbatching.microbatches > 1:
            break
    assert plan_.microbatching.microbatches > 1 and plan_.pipeline.microbatches == 4
    assert_fits_once_compiled(plan_, stack_args, budget)
    assert "accumulation steps" in plan_.summary_text()
    assert_matches(plan_.jit()(*stack_args), jax.jit(stack_step)(*stack_args))


@pytest.mark.slow
def test_auto_shard_and_plan_train_step_take_pipeline_options(stack_args, mesh_2d):
    from autoshard.runtime import distributed
    expected = jax.jit(stack_step)(*stack_args)
    options = dict(mesh=mesh_2d, hardware=HW, cache=False, progress=False, pipeline="data",
                   microbatches=4)
    decorated = autoshard.auto_shard(stack_step, **options)
    assert decorated.plan_for(*stack_args).pipeline.stages == 2
    assert_matches(decorated(*stack_args), expected)
    plan_ = distributed.plan_train_step(stack_step, *stack_args, **options)
    assert (plan_.pipeline.axis, plan_.pipeline.microbatches) == ("data", 4)
    assert distributed.carried_specs_agree(plan_)   # the state comes out as it went in
    assert_matches(plan_.jit()(*stack_args), expected)


def test_pipeline_needs_a_layer_stack(args, mesh_2d):
    with pytest.raises(autoshard.InputError, match="no layer stack"):
        plan_for(args, mesh_2d, pipeline="data", microbatches=2)
    with pytest.raises(autoshard.InputError, match="mesh axis 'stage'"):
        plan_for(args, mesh_2d, pipeline="stage")


def test_a_pipeline_needs_the_batch_passed_to_the_loss(stack_args, mesh_2d):
    # the way run_clm_flax.py writes it: the loss closes over the batch
    def step(params, batch):
        loss, grads = autoshard.value_and_grad(lambda p: stack_loss(p, batch))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    with pytest.raises(autoshard.InputError, match="pass the batch to it as an argument"):
        autoshard.plan(step, *stack_args, mesh=mesh_2d, hardware=HW, cache=False,
                       progress=False, pipeline="data", microbatches=2)


# -- the circular schedule ------------------------------------------------------------------

def test_circular_schedule_arithmetic():
    """Each microbatch passes the stages V times, one stage a step, and re-enters stage 0
    only after its last pass left the last stage; the bubble is (S-1)/(MV+S-1)."""
    from autoshard.rewrite.pipeline import Pipelining
    for s, m, v in ((4, 8, 2), (2, 2, 4), (4, 4, 2), (3, 5, 3)):
        p = Pipelining("data", stages=s, microbatches=m, layers=s * v * 2,
                       schedule="circular", repeats=v)
        assert (p.layers_per_stage, p.layers_per_pass) == (2 * v, 2)
        assert p.iterations == m * v + s - 1
        assert p.bubble_fraction == pytest.approx((s - 1) / (m * v + s - 1))
        when = {}   # (stage, microbatch, repeat) -> step
        for stage in range(s):
            work = [p.work(stage, t) for t in range(p.iterations)]
            assert [w for w in work if w is not None] == [(k % m, k // m)
                                                          for k in range(m * v)]
            when.update({(stage,) + w: t for t, w in enumerate(work) if w is not None})
        for (stage, mb, r), t in when.items():   # its input was made the step before
            if stage > 0:
                assert when[(stage - 1, mb, r)] == t - 1
            elif r > 0:
                assert when[(s - 1, mb, r - 1)] < t
        idle = sum(p.work(i, t) is None for i in range(s) for t in range(p.iterations))
        assert idle / (s * p.iterations) == pytest.approx(p.bubble_fraction)
    gpipe = Pipelining("data", stages=4, microbatches=8, layers=16)
    assert gpipe.bubble_fraction > Pipelining("data", 4, 8, 16, "circular", 2).bubble_fraction
    for bad in ({"schedule": "circular", "repeats": 1}, {"schedule": "gpipe", "repeats": 2},
                {"schedule": "circular", "repeats": 2, "microbatches": 2},
                {"schedule": "interleaved", "repeats": 2}):
        with pytest.raises(autoshard.InputError):
            Pipelining("data", **{"stages": 4, "microbatches": 8, **bad})


def assert_only_the_shift_crosses_stages(plan_, args):
    """Inside the loop only the stage buffer crosses the stage axis, by a
    collective-permute once per iteration (forward and backward)."""
    staged = plan_.pipeline
    report = compiled_report(plan_, args)
    in_loop = [c for c in report.collectives if staged.axis in c.axes and c.count > 1]
    assert in_loop and all(c.kind == "collective-permute" and c.count == staged.iterations
                           for c in in_loop), in_loop


@pytest.mark.slow
def test_microbatch_slices_inside_stages_reduce_gradients_once(stack_args, mesh_2d,
                                                                monkeypatch):
    # each microbatch split over 'model' inside the stages over 'data' (data parallel
    # inside a stage): the stage's layers are broadcast to one copy a slice before the
    # loop, so that each slice's gradient accumulates on its own devices and no collective
    # over 'model' runs inside the loop; the step matches one device, and round-trips
    from autoshard.planning import settings
    expected = jax.jit(stack_step)(*stack_args)
    monkeypatch.setattr(settings, "replica_splits", lambda axis, sizes: [("model",)])
    plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4)
    staged = plan_.pipeline
    assert (staged.replica_axes, staged.replicas, staged.microbatches) == (("model",), 4, 4)
    assert_matches(plan_.jit()(*stack_args), expected)
    assert_only_the_shift_crosses_stages(plan_, stack_args)
    report = compiled_report(plan_, stack_args)
    assert not [c for c in report.collectives if "model" in c.axes and c.count > 1]
    assert "4 microbatches (each in 4 slices over model)" in plan_.summary_text()
    loaded = autoshard.Plan.from_json(plan_.to_json(), mesh_2d).bind(stack_step, *stack_args)
    assert loaded.pipeline == staged
    assert_matches(loaded.jit()(*stack_args), expected)


def test_pipelines_weigh_microbatches_whole_and_split_inside_stages(stack_args, mesh_2d):
    plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4)
    splits = {tuple(t["replica_axes"]) for t in plan_.stats.settings}
    assert splits == {(), ("model",)}


@pytest.mark.slow
def test_forced_circular_pipeline_matches_single_device(stack_args, mesh_2d):
    expected = jax.jit(stack_step)(*stack_args)
    plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4, repeats=2)
    staged = plan_.pipeline
    assert (staged.schedule, staged.repeats, staged.stages, staged.layers) == \
        ("circular", 2, 2, 8)
    assert (staged.layers_per_pass, staged.iterations) == (2, 4 * 2 + 2 - 1)
    assert_matches(plan_.jit()(*stack_args), expected)
    assert_only_the_shift_crosses_stages(plan_, stack_args)
    assert ("2 stages x 4 layers x 2 repeats of 2 layers, 4 microbatches, circular schedule, "
            "9 steps, bubble 11.1%") in " ".join(plan_.summary_text().split())
    loaded = autoshard.Plan.from_json(plan_.to_json(), mesh_2d).bind(stack_step, *stack_args)
    assert loaded.pipeline == staged
    assert_matches(loaded.jit()(*stack_args), expected)


@pytest.mark.slow
def test_auto_repeats_weigh_gpipe_and_circular(stack_args, mesh_2d):
    """Where compute outweighs the stage transfers, the smaller bubble wins: the planner
    takes the circular schedule, no slower than GPipe or any forced V, and it matches."""
    slow = autoshard.Hardware(flops=1e8, hbm_bandwidth=1e11, memory=80e9,
                              link_bandwidth={"data": 4e10, "model": 3.6e11},
                              link_latency=1e-6)

    def planned(repeats):
        return autoshard.plan(stack_step, *stack_args, mesh=mesh_2d, hardware=slow,
                              cache=False, progress=False, pipeline="data", microbatches=4,
                              repeats=repeats)
    chosen = planned("auto")
    assert chosen.pipeline.schedule == "circular"
    for forced in (1, 2, 4):
        assert chosen.cost.total_s <= planned(forced).cost.total_s * (1 + 1e-9)
    assert_matches(chosen.jit()(*stack_args), jax.jit(stack_step)(*stack_args))


CIRCULAR_SETTINGS = ((2, 2), (4, 4), (8, 2))   # (microbatches, repeats)


@pytest.mark.slow
def test_circular_settings_match(stack_args, mesh_2d):
    """Across microbatches and repeats: the step matches one device, and the loop runs
    M V + S - 1 times with only the shift crossing the stage axis."""
    expected = jax.jit(stack_step)(*stack_args)
    for m, v in CIRCULAR_SETTINGS:
        plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=m, repeats=v)
        assert plan_.pipeline.iterations == m * v + 1
        assert_matches(plan_.jit()(*stack_args), expected)
        assert_only_the_shift_crosses_stages(plan_, stack_args)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "the memory model holds a program's outputs from the start, where XLA's buffer "
    "assignment puts temporaries of their size that die before an output is written in "
    "its buffer: circular pipelines of this undonated step are predicted 7.0-9.5 % high "
    "on jax 0.12 (without the outputs -0.3 to +2.5 %), 8.5-14.1 % on 0.10 (+0.7 to +6.3 %)"))
def test_circular_settings_price_their_memory(stack_args, mesh_2d):
    """The predicted memory (the store of microbatches, each step's residuals) is XLA's
    within 5 %."""
    for m, v in CIRCULAR_SETTINGS:
        plan_ = plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=m, repeats=v)
        compiled = compiled_report(plan_, stack_args).memory_bytes
        assert plan_.cost.memory_bytes == pytest.approx(compiled, rel=0.05)


def test_repeats_need_a_pipeline_and_a_count(stack_args, mesh_2d):
    with pytest.raises(autoshard.InputError, match="pipeline="):
        plan_stack(stack_args, mesh_2d, repeats=2)
    for bad in (0, -1, 1.5, "many", True):
        with pytest.raises(autoshard.InputError, match="repeats"):
            plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4, repeats=bad)
    with pytest.raises(autoshard.InputError, match="as many microbatches as stages"):
        plan_stack(stack_args, mesh_2d, pipeline="model", microbatches=2, repeats=2)
    with pytest.raises(autoshard.InputError, match="no layer stack"):   # 8 layers, 2 x 3
        plan_stack(stack_args, mesh_2d, pipeline="data", microbatches=4, repeats=3)


def test_schedule_view_shows_the_interleaving():
    from autoshard.report import viz
    from autoshard.rewrite.pipeline import Pipelining
    view = viz.schedule(Pipelining("data", stages=2, microbatches=2, layers=8,
                                   schedule="circular", repeats=2))
    assert [view.cells(r) for r in view.rows()] == [["0", "0r0", "1r0", "0r1", "1r1", "."],
                                                    ["1", ".", "0r0", "1r0", "0r1", "1r1"]]
    assert "bubble (S-1)/(M*V+S-1) = 20.0%" in view.caption
    assert "x 2 layers x 2 repeats" in view.title
    fig = view.plot()
    assert len(fig.axes[0].collections) == 8   # one box per (stage, microbatch, repeat)


@pytest.mark.slow
def test_zoo_gpt_scan_pipelined_matches_single_device(mesh_2d):
    from autoshard.zoo import models
    case = models.train_case("gpt_scan", "tiny")
    expected = jax.jit(case.train_step)(*case.args)
    plan_ = autoshard.plan(case.train_step, *case.args, mesh=mesh_2d, cache=False,
                           progress=False, pipeline="data", microbatches=4)
    assert plan_.pipeline.layers == 2 and plan_.pipeline.stages == 2
    got = plan_.jit()(*case.args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=case.rtol, atol=case.atol)


def test_schedule_view_shows_the_bubble():
    from autoshard.report import viz
    from autoshard.rewrite.pipeline import Pipelining
    view = viz.schedule(Pipelining("data", stages=2, microbatches=3, layers=4))
    assert [view.cells(r) for r in view.rows()] == [["0", "0", "1", "2", "."],
                                                    ["1", ".", "0", "1", "2"]]
    assert "bubble (S-1)/(M+S-1) = 25.0%" in view.caption and "│ 1     │ .  │ 0" in view.text()
    fig = view.plot()
    assert len(fig.axes[0].collections) == 6   # one box per (stage, microbatch)
    with pytest.raises(autoshard.PlanError, match="pipelined plan"):
        viz.schedule(None)


# -- rematerialization ---------------------------------------------------------------------

@pytest.mark.slow
def test_remat_trades_recompute_for_memory_and_matches(mesh_1d):
    """Under one layout (the arguments split as the plan without remat splits them),
    saving only dot outputs, then nothing, keeps less for the backward pass (predicted
    and compiled) and recomputes more (compiled FLOPs). Left free, a policy may pick
    another layout: nothing saved, this one is data parallel, faster and bigger.

    The batch is one whose residuals weigh in the peak: 128 rows a device. At 8 rows a
    device the peak falls where they are dead, and the two policies' peaks differ by 1 KB
    in 360, well under the model's error on kilobyte programs (XLA's heap packing)."""
    stack_args = make_stack_args(rows=1024)
    expected = jax.jit(stack_step)(*stack_args)
    base = plan_stack(stack_args, mesh_1d)
    pins = {a.path: specs.to_partition_spec(a.spec) for a in base.arguments}
    plans = [base] + [plan_stack(stack_args, mesh_1d, remat=r, pins=pins)
                      for r in ("dots_saveable", "nothing_saveable")]
    reports = [compiled_report(p, stack_args) for p in plans]
    free = plan_stack(stack_args, mesh_1d, remat="nothing_saveable")
    for p in plans + [free]:
        assert_matches(p.jit()(*stack_args), expected)
    assert plans[0].microbatching is None
    assert [p.microbatching.remat for p in plans[1:]] == ["dots_saveable", "nothing_saveable"]
    predicted = [p.cost.memory_bytes for p in plans]
    compiled = [r.memory_bytes for r in reports]
    assert predicted[0] > predicted[1] > predicted[2]
    assert compiled[0] > compiled[1] > compiled[2]
    assert reports[2].flops > reports[0].flops
    assert "jax.checkpoint(policy=nothing_saveable)" in plans[2].summary_text()


@pytest.mark.slow
def test_auto_remat_and_microbatches_fit_a_tight_budget(stack_args, mesh_1d):
    expected = jax.jit(stack_step)(*stack_args)
    budget = 0.8 * plan_stack(stack_args, mesh_1d, remat="dots_saveable").cost.memory_bytes
    plan_ = plan_stack(stack_args, mesh_1d, memory_budget=budget, microbatches="auto",
                       remat="auto")
    assert_fits_once_compiled(plan_, stack_args, budget)
    for fixed in ({"remat": "nothing_saveable"}, {"microbatches": 2}):   # each fits alone
        other = plan_stack(stack_args, mesh_1d, memory_budget=budget, **fixed)
        assert_fits_once_compiled(other, stack_args, budget)
        assert plan_.cost.total_s <= other.cost.total_s * (1 + 1e-9)
    assert_matches(plan_.jit()(*stack_args), expected)
    with pytest.raises(autoshard.InputError, match="remat"):
        plan_stack(stack_args, mesh_1d, remat="everything")


@pytest.mark.slow
def test_policies_rejected_unplanned_are_over_the_budget_when_planned(mesh_1d):
    """From K = 2 on, a remat policy saving more than one found over the budget is
    rejected unplanned; each such setting, planned, is indeed over the budget."""
    from autoshard.planning.api import plan_program
    from autoshard.planning.options import PlanOptions
    from autoshard.planning.settings import Search
    from autoshard.rewrite.accumulate import Microbatching

    stack_args = make_stack_args(rows=1024)
    budget = 0.9 * plan_stack(stack_args, mesh_1d, remat="nothing_saveable").cost.memory_bytes
    found = plan_stack(stack_args, mesh_1d, memory_budget=budget, microbatches="auto",
                       remat="auto")
    implied = [s for s in found.stats.settings if "holds more than" in s["outcome"]]
    assert implied, "no setting rejected unplanned: the test checks nothing"
    options = PlanOptions.build(num_args=2, mesh=mesh_1d, hardware=HW, cache=False,
                                progress=False, memory_budget=budget)
    search = Search(plan_program, stack_step, stack_args, options)
    for tried in implied[:4]:
        axes = tuple(tried["replica_axes"])
        setting = Microbatching(tried["microbatches"], axes, mesh_1d.shape[axes[0]],
                                remat=tried["remat"])
        with pytest.raises(autoshard.MemoryBudgetError):
            search.plan(setting)


@pytest.mark.slow
def test_hand_written_gpipe_expert_matches_single_device(mesh_2d):
    from autoshard.zoo import experts, models
    case = models.train_case("gpt_scan", "tiny")
    expected = jax.jit(case.train_step)(*case.args)
    step = experts.jit_gpipe(case, mesh_2d, microbatches=4, donate=False)
    got = step(*case.args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=case.rtol, atol=case.atol)
    hlo = step.lower(*case.args).compile().as_text()
    assert "collective-permute" in hlo


@pytest.mark.parametrize("flag", ["--microbatches", "--repeats"])
def test_cli_count_options(flag):
    from autoshard.runtime.cli import CliError, parse_count
    assert parse_count(flag, "auto") == "auto" and parse_count(flag, "4") == 4
    for bad in ("0", "-1", "two", "2.5"):
        with pytest.raises(CliError, match=flag):
            parse_count(flag, bad)
