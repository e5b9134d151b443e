"""The model zoo: registry, expert plans, and auto-sharded numerics of every model.

Each auto-sharded train step must match the single-device ``jax.jit`` step (loss and the
whole updated state) within ``case.rtol`` and ``case.atol``: each case states and derives
its tolerance (f32: rtol 1e-5 and ~0.1 lr for Adam's first step; bf16: wider).
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
import autoshard.report.hlo_report
from autoshard.runtime import train
from autoshard.zoo import experts, models

CORE = [("mlp", "tiny"), ("gpt", "tiny"), ("gpt_scan", "tiny"), ("moe", "tiny"),
        ("resnet", "tiny"), ("vit", "tiny")]
VARIANTS = [("gpt", "tiny_bf16"), ("moe", "tiny_top1")]


@functools.cache
def case_of(name, size):
    return models.train_case(name, size)


@functools.cache
def reference(name, size):
    case = case_of(name, size)
    return jax.device_get(jax.jit(case.train_step)(*case.args))


@functools.cache
def plan_of(name, size, mesh):
    case = case_of(name, size)
    return autoshard.plan(case.train_step, *case.args, mesh=mesh)


@functools.cache
def planned_step(name, size, mesh):
    return plan_of(name, size, mesh).jit()


def assert_matches(case, got, want):
    def check(path, a, b):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=case.rtol,
            atol=case.atol, err_msg=f"{case.name} at {jax.tree_util.keystr(path)}")
    jax.tree_util.tree_map_with_path(check, jax.device_get(got), want)


def test_registry():
    assert models.names() == ["gpt", "gpt_scan", "mlp", "moe", "resnet", "vit"]
    for name in models.names():
        assert {"tiny", "small", "large"} <= set(models.get(name).sizes)
    with pytest.raises(autoshard.InputError, match="known models: gpt, gpt_scan"):
        models.get("bert")
    with pytest.raises(autoshard.InputError, match="sizes: tiny"):
        models.train_case("gpt", "huge")


def test_state_paths_and_batches():
    case = case_of("gpt", "tiny")
    paths = experts.leaf_paths(case.state, "state")
    assert "state['params']['blocks'][0]['attn']['query']['kernel']" in paths
    assert "state['opt_state'][0].mu['blocks'][0]['mlp']['fc1']['kernel']" in paths
    assert "state['step']" in paths
    one, again, other = case.make_batch(3), case.make_batch(3), case.make_batch(4)
    np.testing.assert_array_equal(one["inputs"], again["inputs"])
    assert not np.array_equal(one["inputs"], other["inputs"])
    assert "batch_stats" in case_of("resnet", "tiny").state


def test_abstract_case_allocates_nothing():
    case = models.train_case("moe", "large", abstract=True)
    leaves = jax.tree.leaves(case.args)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert case.state["params"]["blocks"][0]["mlp"]["wi"]["kernel"].shape == (16, 1024, 4096)


@pytest.mark.slow
@pytest.mark.parametrize("name,size", CORE + VARIANTS)
def test_auto_plan_matches_one_device(name, size, mesh):
    if (name, size) in VARIANTS and len(mesh.axis_names) == 1:
        pytest.skip("variants run on the 2-D mesh only")
    case = case_of(name, size)
    got = planned_step(name, size, mesh)(*case.args)
    assert_matches(case, got, reference(name, size))


def assert_moments_match(case, got_state, want_state, fraction=0.1):
    """Adam's moments against one device, each leaf within ``fraction`` of its own largest
    value (``nu`` as its square root, which scales like the gradient). Adam's update
    ``m / sqrt(v)`` hides a gradient's scale (a gradient halved on one layer moves no
    parameter), and ``nu`` (~1e-3 g^2) sits below any atol fit for the parameters; the
    moments are where the scale shows: halved, ``mu`` and ``sqrt(nu)`` are off by 50% of
    their largest value. bf16 rounding of partial sums moves them by at most ~2.4% on
    gpt/tiny_bf16 on 2x4."""
    got = jax.tree_util.tree_flatten_with_path(jax.device_get(got_state["opt_state"]))[0]
    want = jax.tree.leaves(want_state["opt_state"])
    for (path, a), b in zip(got, want):
        where = "opt_state" + jax.tree_util.keystr(path)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if ".nu" in where:
            a, b = np.sqrt(a), np.sqrt(b)
        scale = float(np.max(np.abs(b), initial=0.0))
        np.testing.assert_allclose(a, b, rtol=0, atol=fraction * scale,
                                   err_msg=f"{case.name} at {where}")


def test_bf16_moments_match_one_device_at_their_scale(mesh_2d):
    case = case_of("gpt", "tiny_bf16")
    got_state, _ = planned_step("gpt", "tiny_bf16", mesh_2d)(*case.args)
    want_state, _ = reference("gpt", "tiny_bf16")
    assert_moments_match(case, got_state, want_state)


@pytest.mark.slow
@pytest.mark.parametrize("name,size", CORE)
def test_loss_falls_over_20_steps(name, size, mesh_1d):
    case = case_of(name, size)
    losses = train.run(case, planned_step(name, size, mesh_1d), case.state, steps=20,
                       log=None, shardings=plan_of(name, size, mesh_1d).in_shardings)
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.9 * losses[0], losses


def test_expert_rules_fit_any_mesh(mesh_1d, mesh_2d):
    assert experts.fit_spec(P(experts.BATCH, None), (6, 16), mesh_2d) == P("data")
    assert experts.fit_spec(P(None, experts.MODEL), (6, 16), mesh_2d) == P(None, "model")
    assert experts.fit_spec(P(None, experts.MODEL), (6, 16), mesh_1d) == P(None, "data")
    assert experts.fit_spec(P(experts.DATA), (8,), mesh_1d) == P()
    assert experts.largest_dim_spec((64, 256), mesh_2d) == P(None, ("data", "model"))
    assert experts.largest_dim_spec((3, 12), mesh_2d) == P(None, "model")


def test_expert_plans_shard_as_named(mesh_2d):
    case = case_of("moe", "tiny")
    query = lambda tree: tree[0]["params"]["blocks"][0]["attn"]["query"]["kernel"].spec
    wi = lambda tree: tree[0]["params"]["blocks"][0]["mlp"]["wi"]["kernel"].spec
    assert query(case.experts["data_parallel"](mesh_2d)) == P()
    assert case.experts["data_parallel"](mesh_2d)[1]["inputs"].spec == P(("data", "model"))
    assert query(case.experts["megatron"](mesh_2d)) == P(None, "model")
    assert case.experts["megatron"](mesh_2d)[1]["inputs"].spec == P("data")
    assert query(case.experts["fsdp_tp"](mesh_2d)) == P("data", "model")
    assert wi(case.experts["expert_parallel"](mesh_2d)) == P("model")
    fsdp = case.experts["fsdp"](mesh_2d)[0]["opt_state"][0].mu["embed"]["embedding"].spec
    assert fsdp == P(("data", "model"))


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["megatron", "expert_parallel"])
def test_expert_step_matches_one_device(plan_name, mesh_2d):
    case = case_of("moe", "tiny")
    got = experts.jit_expert(case, mesh_2d, plan_name, donate=False)(*case.args)
    assert_matches(case, got, reference("moe", "tiny"))
    compiled = experts.compile_expert(case, mesh_2d, plan_name)
    report = autoshard.report.hlo_report.hlo_report(compiled, autoshard.H100, mesh_2d)
    assert report.memory_bytes > 0


def sharding_constraints(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return str(jaxpr).count("sharding_constraint")


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["fsdp", "megatron", "fsdp_tp", "zero2"])
def test_expert_constraints_keep_numerics(plan_name, mesh_2d):
    """Experts that constrain activations (MaxText-style logical rules) or gradients
    (ZeRO-2) trace those constraints only inside their own context, and the constrained
    step still computes the single-device step."""
    case = case_of("gpt", "tiny")
    expert = experts.as_expert(
        experts.zero2(*case.args) if plan_name == "zero2" else case.experts[plan_name])
    assert sharding_constraints(case.train_step, *case.args) == 0
    assert sharding_constraints(expert.wrap(case.train_step, mesh_2d), *case.args) > 0
    ins = expert(mesh_2d)
    step = jax.jit(expert.wrap(case.train_step, mesh_2d), in_shardings=ins,
                   out_shardings=(ins[0], NamedSharding(mesh_2d, P())))
    assert_matches(case, step(*case.args), reference("gpt", "tiny"))


@pytest.mark.slow
def test_zero2_constrains_every_gradient_as_the_optimizer_state(mesh_2d):
    from autoshard.testing import plain
    case = plain.lm("tiny")
    expert = experts.zero2(*case.args)
    constrained = expert.wrap(case.train_step, mesh_2d)
    jaxpr = jax.make_jaxpr(constrained)(*case.args)
    specs = {e.params["sharding"].spec for e in jaxpr.jaxpr.eqns
             if e.primitive.name == "sharding_constraint"}
    state_in, batch_in = expert(mesh_2d)
    assert {s.spec for s in jax.tree.leaves(state_in["opt_state"]["mu"])} <= specs
    step = jax.jit(constrained, in_shardings=(state_in, batch_in),
                   out_shardings=(state_in, NamedSharding(mesh_2d, P())))
    assert_matches(case, step(*case.args), jax.device_get(jax.jit(case.train_step)(*case.args)))


def test_annotation_pins(mesh_2d, mesh_1d):
    case = case_of("gpt", "tiny")
    pins = case.annotation_pins(mesh_2d)
    assert pins["state['params']['blocks'][0]['attn']['query']['kernel']"] == P(None, "model")
    assert pins["state['params']['embed']['embedding']"] == P("model")
    assert case.annotation_pins(mesh_1d)["state['params']['head']['kernel']"] == P(None, "data")


@pytest.mark.slow
def test_expert_layout_as_pins_keeps_numerics_with_donation(mesh_2d):
    """FSDP x TP splits the scan's stacked state on the layer dim, which the scan's
    outputs never come in: the donated outputs are resharded into the pinned specs."""
    case = case_of("gpt_scan", "tiny")
    shardings = case.experts["fsdp_tp"](mesh_2d)
    leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    flat = jax.tree_util.tree_flatten_with_path(case.args)[0]
    pins = {("state", "batch")[k[0].idx] + jax.tree_util.keystr(k[1:]): s.spec
            for (k, _), s in zip(flat, leaves)}
    assert any(spec and spec[0] for spec in pins.values())   # a layer dim split
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh_2d, pins=pins,
                          donate_argnums=case.donate_argnums, cache=False)
    want = reference("gpt_scan", "tiny")
    args = jax.tree.map(lambda x: x.copy(), case.args)   # donated: the cached case keeps its own
    assert_matches(case, plan.jit()(*args), want)


@pytest.mark.slow
def test_priced_budget_plan_matches_one_device(mesh_1d, monkeypatch):
    """Under a budget the unconstrained plan exceeds, with branch and bound off: the plan
    found by pricing memory fits as predicted and computes what one device computes."""
    monkeypatch.setattr(autoshard.solver.solve, "EXACT_MAX_VARIABLES", 0)
    case = case_of("gpt", "tiny")
    free = plan_of("gpt", "tiny", mesh_1d)
    budget = 0.6 * free.cost.memory_bytes
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh_1d, memory_budget=budget,
                          cache=False)
    assert plan.stats.status in ("priced", "optimal")
    compiled = plan.jit().lower(*case.args).compile()     # judged as XLA counts it
    report = autoshard.report.hlo_report.hlo_report(compiled, plan.hardware, mesh_1d)
    assert report.memory_bytes <= budget
    assert plan.stats.lower_bound_s <= plan.cost.total_s * (1 + 1e-6)
    assert_matches(case, plan.jit()(*case.args), reference("gpt", "tiny"))


@pytest.mark.slow
@pytest.mark.parametrize("name", models.names())
def test_large_sizes_plan_within_80gb(name, mesh_2d):
    case = models.train_case(name, "large", abstract=True)
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh_2d, memory_budget=80e9,
                          donate_argnums=case.donate_argnums)
    assert plan.cost.memory_bytes <= 80e9
    assert plan.stats.status == "optimal"
