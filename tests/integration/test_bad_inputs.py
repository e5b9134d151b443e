"""A catalogue of bad inputs across the public surface.

Each case is a call that must fail with an ``AutoshardError`` subclass whose message names
the culprit (the keyword, argument path, field, axis or file). Programs are tiny and
arguments abstract: nearly every case fails before anything compiles.
"""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.errors import (
    AutoshardError,
    HardwareError,
    InputError,
    LaunchError,
    MeshError,
    OptionError,
    PathError,
    PinError,
    PlanError,
    TraceError,
)
from autoshard.report import judge, viz
from autoshard.runtime import cli
from autoshard.runtime.checkpoint import Checkpointer, CheckpointError, latest_step
from autoshard.runtime.launch import launch

W = jax.ShapeDtypeStruct((16, 32), jnp.float32)
BATCH = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32),
         "y": jax.ShapeDtypeStruct((8, 32), jnp.float32)}


def loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def raises_value_error(w, batch):
    raise ValueError("the user's own complaint")


def mismatched_dims(w, batch):
    return batch["y"] @ w          # [8, 32] @ [16, 32]


def closed_over_batch(w, batch):
    """A step whose marked loss closes over the batch (``run_clm_flax.py`` writes
    ``compute_loss(params)``): microbatches have no batch to split."""
    value, grad = autoshard.value_and_grad(lambda v: loss(v, batch))(w)
    return w - 0.1 * grad, value


def concretizes(w, batch):
    return jnp.ones(3) * float(w[0, 0])


@pytest.fixture(scope="module")
def mesh():
    return autoshard.make_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def plan(mesh):
    return autoshard.plan(loss, W, BATCH, mesh=mesh, cache=False, progress=False)


@pytest.fixture(scope="module")
def plan_json(plan):
    return plan.to_json()


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return path


def plan_with(ctx, **kwargs):
    return autoshard.plan(loss, W, BATCH, mesh=ctx.mesh, cache=False, progress=False, **kwargs)


def hardware(**fields):
    return autoshard.Hardware(**fields)


def edited_json(text, edit):
    d = json.loads(text)
    edit(d)
    return json.dumps(d)


def set_first_spec(d, spec):
    d["arguments"][0]["spec"] = spec


class Ctx:
    """What a case may use: the mesh, a plan, its JSON, a file and a temporary directory."""

    def __init__(self, mesh, plan, plan_json, a_file, tmp_path):
        self.mesh, self.plan, self.json = mesh, plan, plan_json
        self.file, self.tmp = a_file, tmp_path


f32 = jnp.float32
CASES = [
    # -- autoshard.plan: the function and its arguments ------------------------------------
    ("plan fn int", lambda c: autoshard.plan(3, W, mesh=c.mesh), InputError, "fn"),
    ("plan fn str", lambda c: autoshard.plan("loss", W, mesh=c.mesh), InputError, "callable"),
    ("plan fn None", lambda c: autoshard.plan(None, W, mesh=c.mesh), InputError, "fn"),
    ("plan str array", lambda c: autoshard.plan(loss, W, {"x": np.array(["a", "b"]), "y": 0},
                                                mesh=c.mesh), InputError, "batch['x']"),
    ("plan object array", lambda c: autoshard.plan(loss, np.array([object()]), BATCH,
                                                   mesh=c.mesh), InputError, "w"),
    ("plan bytes array", lambda c: autoshard.plan(loss, W, {"x": np.array([b"ab"]), "y": 0},
                                                  mesh=c.mesh), InputError, "batch['x']"),
    ("plan datetime array", lambda c: autoshard.plan(
        loss, np.array(["2020-01-01"], "datetime64[D]"), BATCH, mesh=c.mesh), InputError, "w"),
    ("plan str leaf", lambda c: autoshard.plan(loss, "weights", BATCH, mesh=c.mesh),
     InputError, "w"),
    ("plan object leaf", lambda c: autoshard.plan(loss, W, {"x": object(), "y": 0},
                                                  mesh=c.mesh), InputError, "batch['x']"),
    ("plan returns str", lambda c: autoshard.plan(lambda w: "done", W, mesh=c.mesh),
     InputError, "out"),
    ("plan returns object", lambda c: autoshard.plan(lambda w: object(), W, mesh=c.mesh),
     InputError, "out"),
    ("plan returns dict with str", lambda c: autoshard.plan(
        lambda w: {"loss": w.sum(), "name": "mlp"}, W, mesh=c.mesh), InputError, "out['name']"),
    ("plan fn raises", lambda c: autoshard.plan(raises_value_error, W, BATCH, mesh=c.mesh),
     TraceError, "test_bad_inputs.py"),
    ("plan fn mismatched dims", lambda c: autoshard.plan(mismatched_dims, W, BATCH, mesh=c.mesh),
     TraceError, "mismatched_dims"),
    ("plan fn concretizes", lambda c: autoshard.plan(concretizes, W, BATCH, mesh=c.mesh),
     TraceError, "concretizes"),
    ("plan too many args", lambda c: autoshard.plan(loss, W, BATCH, W, mesh=c.mesh),
     TraceError, "loss"),
    ("plan fn argument wrong shape", lambda c: autoshard.plan(
        loss, jax.ShapeDtypeStruct((17, 32), f32), BATCH, mesh=c.mesh), TraceError,
     "w: float32[17, 32]"),
    ("plan fn argument None", lambda c: autoshard.plan(loss, W, {"x": None, "y": BATCH["y"]},
                                                      mesh=c.mesh), TraceError,
     "batch['x']: None"),
    # -- autoshard.plan: keywords -----------------------------------------------------------
    ("plan mesh None", lambda c: autoshard.plan(loss, W, BATCH, mesh=None), MeshError, "mesh"),
    ("plan mesh str", lambda c: autoshard.plan(loss, W, BATCH, mesh="2x4"), MeshError, "mesh"),
    ("plan mesh tuple", lambda c: autoshard.plan(loss, W, BATCH, mesh=(2, 4)), MeshError, "mesh"),
    ("plan jax mesh duplicate names", lambda c: autoshard.plan(
        loss, W, BATCH, mesh=jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4),
                                               ("data", "data"))), MeshError, "'data' repeats"),
    ("plan hardware str", lambda c: plan_with(c, hardware="h100"), OptionError, "hardware"),
    ("plan hardware dict", lambda c: plan_with(c, hardware={"flops": 1e12}), OptionError,
     "hardware"),
    ("plan budget negative", lambda c: plan_with(c, memory_budget=-1), OptionError,
     "memory_budget"),
    ("plan budget zero", lambda c: plan_with(c, memory_budget=0), OptionError, "memory_budget"),
    ("plan budget nan", lambda c: plan_with(c, memory_budget=math.nan), OptionError,
     "memory_budget"),
    ("plan budget -inf", lambda c: plan_with(c, memory_budget=-math.inf), OptionError,
     "memory_budget"),
    ("plan budget str", lambda c: plan_with(c, memory_budget="1GB"), OptionError,
     "memory_budget"),
    ("plan budget bool", lambda c: plan_with(c, memory_budget=True), OptionError,
     "memory_budget"),
    ("plan pins list", lambda c: plan_with(c, pins=[("w", P())]), PinError, "pins[0][0]"),
    ("plan pins str", lambda c: plan_with(c, pins="w"), OptionError, "pins"),
    ("plan pins int key", lambda c: plan_with(c, pins={0: P()}), OptionError, "pins"),
    ("plan pin spec str", lambda c: plan_with(c, pins={"w": "data"}), PinError, "'w'"),
    ("plan pin unknown axis", lambda c: plan_with(c, pins={"w": P("tensor")}), PinError,
     "tensor"),
    ("plan pin unknown path", lambda c: plan_with(c, pins={"weights": P()}), PinError,
     "weights"),
    ("plan pin too many dims", lambda c: plan_with(c, pins={"w": P(None, None, None)}),
     PinError, "'w'"),
    ("plan pin undividable", lambda c: autoshard.plan(
        lambda v: v.sum(), jax.ShapeDtypeStruct((6,), f32), mesh=c.mesh, pins={"v": P("model")}),
     PinError, "does not divide"),
    ("plan donate str", lambda c: plan_with(c, donate_argnums="0"), OptionError,
     "donate_argnums"),
    ("plan donate out of range", lambda c: plan_with(c, donate_argnums=(5,)), OptionError,
     "donate_argnums"),
    ("plan donate negative", lambda c: plan_with(c, donate_argnums=(-1,)), OptionError,
     "donate_argnums"),
    ("plan donate repeated", lambda c: plan_with(c, donate_argnums=(0, 0)), OptionError,
     "donate_argnums"),
    ("plan donate float", lambda c: plan_with(c, donate_argnums=(0.0,)), OptionError,
     "donate_argnums"),
    ("plan donate None", lambda c: plan_with(c, donate_argnums=None), OptionError,
     "donate_argnums"),
    ("plan time limit negative", lambda c: plan_with(c, time_limit_s=-1), OptionError,
     "time_limit_s"),
    ("plan time limit zero", lambda c: plan_with(c, time_limit_s=0), OptionError,
     "time_limit_s"),
    ("plan time limit nan", lambda c: plan_with(c, time_limit_s=math.nan), OptionError,
     "time_limit_s"),
    ("plan time limit inf", lambda c: plan_with(c, time_limit_s=math.inf), OptionError,
     "time_limit_s"),
    ("plan time limit str", lambda c: plan_with(c, time_limit_s="60"), OptionError,
     "time_limit_s"),
    ("plan reuse str", lambda c: plan_with(c, reuse="yes"), OptionError, "reuse"),
    ("plan reuse None", lambda c: plan_with(c, reuse=None), OptionError, "reuse"),
    ("plan cache str", lambda c: autoshard.plan(loss, W, BATCH, mesh=c.mesh, cache="no"),
     OptionError, "cache"),
    ("plan progress str", lambda c: autoshard.plan(loss, W, BATCH, mesh=c.mesh, cache=False,
                                                   progress="quiet"), OptionError, "progress"),
    ("plan cache dir int", lambda c: plan_with(c, cache_directory=42), PathError,
     "cache_directory"),
    ("plan cache dir is a file", lambda c: plan_with(c, cache_directory=c.file), PathError,
     "a_file"),
    ("plan cache dir under a file", lambda c: plan_with(c, cache_directory=c.file / "plans"),
     PathError, "a_file"),
    ("plan cache dir empty", lambda c: plan_with(c, cache_directory=""), PathError,
     "cache_directory"),
    ("plan microbatches of a loss closing over its batch",
     lambda c: autoshard.plan(closed_over_batch, W, BATCH, mesh=c.mesh, cache=False,
                              progress=False, microbatches=2), InputError, "takes none"),
    # -- auto_shard -------------------------------------------------------------------------
    ("auto_shard fn int", lambda c: autoshard.auto_shard(5, mesh=c.mesh), InputError, "fn"),
    ("auto_shard decorates int", lambda c: autoshard.auto_shard(mesh=c.mesh)(5), InputError,
     "fn"),
    ("auto_shard mesh None", lambda c: autoshard.auto_shard(loss, mesh=None), MeshError, "mesh"),
    ("auto_shard budget nan", lambda c: autoshard.auto_shard(loss, mesh=c.mesh,
                                                             memory_budget=math.nan),
     OptionError, "memory_budget"),
    ("auto_shard time limit negative", lambda c: autoshard.auto_shard(
        loss, mesh=c.mesh, time_limit_s=-5), OptionError, "time_limit_s"),
    ("auto_shard donate str", lambda c: autoshard.auto_shard(loss, mesh=c.mesh,
                                                             donate_argnums="all"),
     OptionError, "donate_argnums"),
    ("auto_shard hardware str", lambda c: autoshard.auto_shard(loss, mesh=c.mesh,
                                                               hardware="a100"),
     OptionError, "hardware"),
    ("auto_shard pins list", lambda c: autoshard.auto_shard(loss, mesh=c.mesh, pins=["w"]),
     PinError, "pins[0]"),
    ("auto_shard cache dir is a file", lambda c: autoshard.auto_shard(
        loss, mesh=c.mesh, cache_directory=c.file), PathError, "a_file"),
    ("auto_shard call with str leaf", lambda c: autoshard.auto_shard(loss, mesh=c.mesh)(
        "weights", BATCH), InputError, "w"),
    # -- Hardware ---------------------------------------------------------------------------
    ("hardware flops zero", lambda c: hardware(flops=0), HardwareError, "flops"),
    ("hardware flops negative", lambda c: hardware(flops=-1e12), HardwareError, "flops"),
    ("hardware flops nan", lambda c: hardware(flops=math.nan), HardwareError, "flops"),
    ("hardware flops inf", lambda c: hardware(flops=math.inf), HardwareError, "flops"),
    ("hardware flops str", lambda c: hardware(flops="fast"), HardwareError, "flops"),
    ("hardware hbm zero", lambda c: hardware(hbm_bandwidth=0), HardwareError, "hbm_bandwidth"),
    ("hardware hbm nan", lambda c: hardware(hbm_bandwidth=math.nan), HardwareError,
     "hbm_bandwidth"),
    ("hardware memory negative", lambda c: hardware(memory=-80e9), HardwareError, "memory"),
    ("hardware memory zero", lambda c: hardware(memory=0), HardwareError, "memory"),
    ("hardware latency negative", lambda c: hardware(link_latency=-1e-5), HardwareError,
     "link_latency"),
    ("hardware latency nan", lambda c: hardware(link_latency=math.nan), HardwareError,
     "link_latency"),
    ("hardware link zero", lambda c: hardware(link_bandwidth=0), HardwareError,
     "link_bandwidth"),
    ("hardware link str", lambda c: hardware(link_bandwidth="nvlink"), HardwareError,
     "link_bandwidth"),
    ("hardware link axis nan", lambda c: hardware(link_bandwidth={"data": math.nan}),
     HardwareError, "link_bandwidth['data']"),
    ("hardware link axis negative", lambda c: hardware(link_bandwidth={"model": -4e10}),
     HardwareError, "link_bandwidth['model']"),
    ("hardware link axis int key", lambda c: hardware(link_bandwidth={0: 4e10}), HardwareError,
     "link_bandwidth"),
    ("hardware default link zero", lambda c: hardware(default_link_bandwidth=0), HardwareError,
     "default_link_bandwidth"),
    ("hardware from_dict unknown field", lambda c: autoshard.Hardware.from_dict({"flop": 1e12}),
     HardwareError, "flop"),
    ("hardware from_dict list", lambda c: autoshard.Hardware.from_dict([1e12]), HardwareError,
     "list"),
    # -- make_mesh --------------------------------------------------------------------------
    ("mesh duplicate names", lambda c: autoshard.make_mesh((2, 4), ("data", "data")), MeshError,
     "'data'"),
    ("mesh zero size", lambda c: autoshard.make_mesh((0, 8), ("data", "model")), MeshError, "0"),
    ("mesh negative size", lambda c: autoshard.make_mesh((-2, 4), ("data", "model")), MeshError,
     "-2"),
    ("mesh float size", lambda c: autoshard.make_mesh((2.5,), ("data",)), MeshError, "2.5"),
    ("mesh str size", lambda c: autoshard.make_mesh(("2",), ("data",)), MeshError, "'2'"),
    ("mesh int shape", lambda c: autoshard.make_mesh(8, ("data",)), MeshError, "axis_shapes"),
    ("mesh str names", lambda c: autoshard.make_mesh((8,), "data"), MeshError, "axis_names"),
    ("mesh int name", lambda c: autoshard.make_mesh((2, 4), ("data", 1)), MeshError, "1"),
    ("mesh empty name", lambda c: autoshard.make_mesh((8,), ("",)), MeshError, "''"),
    ("mesh lengths differ", lambda c: autoshard.make_mesh((2, 4), ("data",)), MeshError,
     "('data',)"),
    ("mesh too many devices", lambda c: autoshard.make_mesh((4, 4), ("data", "model")),
     MeshError, "16 devices"),
    # -- Plan.jit and bind ------------------------------------------------------------------
    ("jit batch of another size", lambda c: c.plan.jit()(
        W, {"x": jax.ShapeDtypeStruct((4, 16), f32), "y": BATCH["y"]}), PlanError, "batch['x']"),
    ("jit lower batch of another size", lambda c: c.plan.jit().lower(
        W, {"x": jax.ShapeDtypeStruct((4, 16), f32), "y": BATCH["y"]}), PlanError, "batch['x']"),
    ("jit other dtype", lambda c: c.plan.jit().lower(
        jax.ShapeDtypeStruct((16, 32), jnp.bfloat16), BATCH), PlanError, "bfloat16"),
    ("jit missing key", lambda c: c.plan.jit().lower(W, {"x": BATCH["x"]}), PlanError,
     "args[1]['y']"),
    ("jit extra key", lambda c: c.plan.jit().lower(W, dict(BATCH, z=BATCH["x"])), PlanError,
     "args[1]['z']"),
    ("jit too few args", lambda c: c.plan.jit()(W), PlanError, "2 arguments"),
    ("jit donate out of range", lambda c: c.plan.jit(donate_argnums=(7,)), OptionError,
     "donate_argnums"),
    ("jit donate str", lambda c: c.plan.jit(donate_argnums="0"), OptionError, "donate_argnums"),
    ("bind fn not callable", lambda c: autoshard.Plan.from_json(c.json, c.mesh).bind(3, W, BATCH),
     InputError, "fn"),
    ("bind other program", lambda c: autoshard.Plan.from_json(c.json, c.mesh).bind(
        lambda w, b: jnp.sum(b["x"] @ w), W, BATCH), PlanError, "fingerprint"),
    ("bind other shapes", lambda c: autoshard.Plan.from_json(c.json, c.mesh).bind(
        loss, W, {"x": jax.ShapeDtypeStruct((4, 16), f32), "y": BATCH["y"]}), PlanError,
     "batch['x']"),
    ("bind fn raises", lambda c: autoshard.Plan.from_json(c.json, c.mesh).bind(
        raises_value_error, W, BATCH), TraceError, "raises_value_error"),
    ("in_shardings before bind", lambda c: autoshard.Plan.from_json(c.json, c.mesh).in_shardings,
     PlanError, "bind"),
    # -- explain ----------------------------------------------------------------------------
    ("explain unknown path", lambda c: c.plan.explain("weights"), PlanError, "weights"),
    ("explain int path", lambda c: c.plan.explain(0), PlanError, "int"),
    ("explain close path", lambda c: c.plan.explain("batch['xx']"), PlanError, "batch['x']"),
    # -- Plan.from_json ---------------------------------------------------------------------
    ("json truncated", lambda c: autoshard.Plan.from_json(c.json[:len(c.json) // 2], c.mesh),
     PlanError, "truncated"),
    ("json empty", lambda c: autoshard.Plan.from_json("", c.mesh), PlanError, "malformed"),
    ("json garbage", lambda c: autoshard.Plan.from_json("plan: yes", c.mesh), PlanError,
     "malformed"),
    ("json int", lambda c: autoshard.Plan.from_json(42, c.mesh), PlanError, "int"),
    ("json list", lambda c: autoshard.Plan.from_json("[]", c.mesh), PlanError, "list"),
    ("json missing arguments", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d.pop("arguments")), c.mesh), PlanError, "arguments"),
    ("json unknown axis", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: set_first_spec(d, [["tensor"], []])), c.mesh), PlanError,
     "tensor"),
    ("json spec not a list", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: set_first_spec(d, "data")), c.mesh), PlanError, "'data'"),
    ("json other mesh", lambda c: autoshard.Plan.from_json(
        c.json, autoshard.make_mesh((8,), ("data",))), PlanError, "mesh"),
    ("json other format", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d.update(format=99)), c.mesh), PlanError, "99"),
    ("json mesh str", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d.update(mesh="2x4")), c.mesh), PlanError, "mesh"),
    ("json arguments int", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d.update(arguments=3)), c.mesh), PlanError,
     "field 'arguments'"),
    ("json outputs int", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d.update(outputs=3)), c.mesh), PlanError,
     "field 'outputs'"),
    ("json argument path int", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d["arguments"][0].update(path=3)), c.mesh), PlanError,
     "field 'arguments[0]'"),
    ("json cost list", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d.update(cost=[1])), c.mesh), PlanError, "field 'cost'"),
    ("json hardware nan", lambda c: autoshard.Plan.from_json(
        edited_json(c.json, lambda d: d["hardware"].update(flops=-1)), c.mesh), HardwareError,
     "flops"),
    ("json mesh arg str", lambda c: autoshard.Plan.from_json(c.json, "2x4"), MeshError, "Mesh"),
    # -- viz --------------------------------------------------------------------------------
    ("viz table str", lambda c: viz.table("plan"), PlanError, "viz.table"),
    ("viz breakdown by", lambda c: viz.breakdown(c.plan, by="op"), AutoshardError, "'op'"),
    ("viz breakdown top zero", lambda c: viz.breakdown(c.plan, top=0), OptionError, "top"),
    ("viz breakdown top str", lambda c: viz.breakdown(c.plan, top="3"), OptionError, "top"),
    ("viz memory str", lambda c: viz.memory("plan"), PlanError, "viz.memory"),
    ("viz memory report int", lambda c: viz.memory(c.plan, report=3), PlanError, "report"),
    ("viz memory categorize int", lambda c: viz.memory(c.plan, categorize=5), InputError,
     "categorize"),
    ("viz diff names str", lambda c: viz.diff(c.plan, c.plan, names="ab"), OptionError,
     "names"),
    ("viz diff show_all str", lambda c: viz.diff(c.plan, c.plan, show_all="yes"), OptionError,
     "show_all"),
    ("viz sharding unknown path", lambda c: viz.sharding(c.plan, "nope"), PlanError, "nope"),
    ("viz sharding int path", lambda c: viz.sharding(c.plan, 1), PlanError, "int"),
    ("viz explain unknown path", lambda c: viz.explain(c.plan, "wq"), PlanError, "wq"),
    ("judge what_if fn int", lambda c: judge.what_if(3, W, BATCH), InputError, "what_if"),
    ("judge what_if axes differ", lambda c: judge.what_if(loss, W, BATCH, mesh_shapes=[(2, 2, 2)]),
     AutoshardError, "(2, 2, 2)"),
    ("judge compare candidates list", lambda c: judge.compare(loss, W, BATCH, candidates=[c.plan]),
     OptionError, "candidates"),
    ("judge compare candidates empty", lambda c: judge.compare(loss, W, BATCH, candidates={}),
     OptionError, "candidates"),
    ("judge compare mesh str", lambda c: judge.compare(loss, W, BATCH, candidates={"a": c.plan},
                                                   mesh="2x4"), MeshError, "mesh"),
    ("judge compare unknown axis", lambda c: judge.compare(
        loss, W, BATCH, candidates={"experts": (P("expert"), {"x": P(), "y": P()})},
        mesh=c.mesh), PlanError, "candidate 'experts' in_shardings[0] = P('expert',) names "
     "mesh axis 'expert'"),
    ("viz scoreboard int view", lambda c: viz.scoreboard({"gpt": 1}), OptionError, "gpt"),
    ("viz scoreboard list", lambda c: viz.scoreboard([]), OptionError, "comparisons"),
    # -- checkpoints ------------------------------------------------------------------------
    ("checkpoint dir int", lambda c: Checkpointer(42), PathError, "checkpoint directory"),
    ("checkpoint dir is a file", lambda c: Checkpointer(c.file), PathError, "a_file"),
    ("checkpoint dir under a file", lambda c: Checkpointer(c.file / "ckpt"), PathError, "a_file"),
    ("checkpoint max_to_keep zero", lambda c: Checkpointer(c.tmp / "ck", max_to_keep=0),
     OptionError, "max_to_keep"),
    ("checkpoint save negative step", lambda c: Checkpointer(c.tmp / "ck").save(
        -1, {"w": jnp.ones(2)}), CheckpointError, "step"),
    ("checkpoint save str step", lambda c: Checkpointer(c.tmp / "ck").save(
        "1", {"w": jnp.ones(2)}), CheckpointError, "step"),
    ("checkpoint save no arrays", lambda c: Checkpointer(c.tmp / "ck").save(1, "state"),
     CheckpointError, "str"),
    ("checkpoint restore missing step", lambda c: Checkpointer(c.tmp / "ck").restore(
        3, {"w": jnp.ones(2)}), CheckpointError, "step 3"),
    ("checkpoint restore empty", lambda c: Checkpointer(c.tmp / "ck").restore(
        None, {"w": jnp.ones(2)}), CheckpointError, "no complete checkpoint"),
    ("checkpoint latest_step int", lambda c: latest_step(42), PathError, "checkpoint directory"),
    # -- launch -----------------------------------------------------------------------------
    ("launch unknown command", lambda c: launch(["no-such-command-xyz"], 2), LaunchError,
     "no-such-command-xyz"),
    ("launch no command", lambda c: launch([], 2), LaunchError, "command"),
    ("launch str command", lambda c: launch("python train.py", 2), LaunchError, "command"),
    ("launch zero processes", lambda c: launch(["true"], 0), LaunchError, "num_processes"),
    ("launch zero devices", lambda c: launch(["true"], 2, devices_per_process=0), LaunchError,
     "devices_per_process"),
    ("launch negative timeout", lambda c: launch(["true"], 1, timeout_s=-1), LaunchError,
     "timeout"),
]


@pytest.mark.parametrize("name,call,error,culprit", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_its_culprit(name, call, error, culprit, mesh, plan, plan_json, a_file,
                                     tmp_path):
    ctx = Ctx(mesh, plan, plan_json, a_file, tmp_path)
    with pytest.raises(error) as info:
        call(ctx)
    assert isinstance(info.value, AutoshardError)
    assert culprit in str(info.value), f"{culprit!r} not in: {info.value}"


def test_trace_error_shows_the_users_frame_and_chains_the_cause(mesh):
    with pytest.raises(TraceError) as info:
        autoshard.plan(raises_value_error, W, BATCH, mesh=mesh)
    frame = info.value.frame
    assert pathlib.Path(frame.filename).name == "test_bad_inputs.py"
    assert frame.name == "raises_value_error"
    assert f"test_bad_inputs.py:{frame.lineno}" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert "the user's own complaint" in str(info.value)


# -- the command line: one line on stderr, a non-zero exit, never a traceback -------------------

CLI_CASES = [
    ("zoo unknown model", ["zoo", "transformer"], "transformer"),
    ("zoo unknown size", ["zoo", "mlp", "--size", "huge"], "huge"),
    ("zoo zero mesh", ["zoo", "mlp", "--mesh", "0x4"], "0x4"),
    ("zoo unreadable mesh", ["zoo", "mlp", "--mesh", "2xfour"], "2xfour"),
    ("zoo duplicate axes", ["zoo", "mlp", "--mesh", "2x4", "--axes", "data,data"], "--axes"),
    ("zoo axes count", ["zoo", "mlp", "--mesh", "2x4", "--axes", "data"], "--axes"),
    ("zoo negative budget", ["zoo", "mlp", "--memory-budget", "-5GB"], "-5GB"),
    ("zoo unreadable budget", ["zoo", "mlp", "--memory-budget", "lots"], "lots"),
    ("zoo unknown hardware", ["zoo", "mlp", "--hardware", "tpu9"], "tpu9"),
    ("zoo bad hardware file", ["zoo", "mlp", "--hardware", "{hw_file}"], "flops"),
    ("zoo save-plan under a file", ["zoo", "mlp", "--save-plan", "{file}/plan.json"], "a_file"),
    ("zoo save-plan is a directory", ["zoo", "mlp", "--save-plan", "{tmp}"], "--save-plan"),
    ("zoo checkpoint dir is a file", ["zoo", "mlp", "--checkpoint-dir", "{file}",
                                      "--checkpoint-every", "5"], "a_file"),
    ("zoo checkpoint dir under a file", ["zoo", "mlp", "--checkpoint-dir", "{file}/ckpt",
                                         "--checkpoint-every", "5"], "a_file"),
    ("zoo repeats without a pipeline", ["zoo", "mlp", "--repeats", "2"], "--pipeline"),
    ("zoo zero repeats", ["zoo", "gpt_scan", "--pipeline", "data", "--repeats", "0"],
     "--repeats"),
    ("zoo resume from missing dir", ["zoo", "mlp", "--checkpoint-dir", "{tmp}/none",
                                     "--resume"], "does not exist"),
    ("launch unknown command", ["launch", "-n", "2", "--", "no-such-command-xyz"],
     "no-such-command-xyz"),
    ("launch no command", ["launch", "-n", "2"], "command"),
    ("launch zero processes", ["launch", "-n", "0", "--", "true"], "num-processes"),
]


@pytest.mark.parametrize("name,argv,culprit", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line(name, argv, culprit, a_file, tmp_path, capsys):
    hw_file = tmp_path / "hw.json"
    hw_file.write_text(json.dumps({"flops": 0}))
    argv = [a.format(file=a_file, tmp=tmp_path, hw_file=hw_file) for a in argv]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert culprit in err, err
