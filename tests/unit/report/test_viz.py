"""Views of a plan: tables, cost breakdown, memory, diffs, what-if meshes, figures, errors."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.frontend import specs
from autoshard.planning import api
from autoshard.report import judge, viz
from autoshard.runtime import cli
from autoshard.solver.request import Request, SharedCost, evaluation
from autoshard.testing import programs


@pytest.fixture(scope="module")
def mlp():
    return programs.mlp_train_step()


@pytest.fixture(scope="module")
def plan(mlp, mesh_2d):
    return autoshard.plan(mlp.fn, *mlp.args, mesh=mesh_2d)


@pytest.fixture(scope="module")
def abstract():
    return programs.inference_mlp(batch=16, d=1024, abstract=True)


@pytest.fixture(scope="module")
def abstract_plan(abstract, mesh_2d):
    return autoshard.plan(abstract.fn, *abstract.args, mesh=mesh_2d)


def assert_labelled(fig):
    assert fig.axes, "figure has no axes"
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), ax
    fig.canvas.draw()   # renders headless


# -- table ------------------------------------------------------------------------------------

def test_table_has_a_row_per_argument(plan):
    view = viz.table(plan)
    rows = view.rows()
    assert [r["path"] for r in rows] == [a.path for a in plan.arguments]
    for r, a in zip(rows, plan.arguments):   # against JAX's own shard shapes
        sharding = NamedSharding(plan.mesh, specs.to_partition_spec(a.spec))
        shard = sharding.shard_shape(tuple(a.shape))
        assert r["bytes_per_device"] == np.prod(shard, dtype=int) * np.dtype(a.dtype).itemsize
        blocks = {tuple((s.start, s.stop) for s in index)
                  for index in sharding.devices_indices_map(tuple(a.shape)).values()}
        assert r["num_shards"] == len(blocks)
    text = str(view)
    assert "params['layers'][0]['w']" in text and "bytes/device" in text
    html = plan._repr_html_()
    assert html.startswith("<table>") and "params[&#x27;layers&#x27;][0][&#x27;w&#x27;]" in html
    assert ("replicated" in text) or ("sharded" in text)


def test_index_patterns():
    assert viz.index_pattern("s['blocks'][3]['w']") == ("s['blocks'][*]['w']", (3,))
    assert viz.index_set_str([5, 0, 1, 2]) == "0..2,5"
    assert viz.pattern_path("s['b'][*]['w']", [(0,), (1,), (2,)]) == "s['b'][0..2]['w']"


def test_summary_collapses_layers_and_folds_optimizer_state():
    program = programs.transformer_train_step(layers=3)
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh)
    view = viz.summary(plan)
    rows = view.rows()
    assert sum(r["leaves"] + r["followers"] for r in rows) == len(plan.arguments)
    assert len(rows) < len(plan.arguments) / 3
    assert any("['layers'][0..2]" in r["path"] for r in rows), [r["path"] for r in rows]
    sizes = [r["bytes_per_device"] for r in rows]
    assert sizes == sorted(sizes, reverse=True)
    folded = [r for r in rows if r["followers"]]            # Adam's m and v with their param
    assert folded and all(r["followers"] == 2 * r["leaves"] for r in folded)
    assert "plan.summary(full=True)" in str(view)
    assert len(viz.summary(plan, full=True).rows()) == len(plan.arguments)


def test_views_refuse_what_is_not_a_plan():
    with pytest.raises(autoshard.PlanError, match="needs an autoshard.Plan"):
        viz.table({"not": "a plan"})


# -- breakdown ----------------------------------------------------------------------------------

def test_breakdown_adds_up_to_the_plan_cost(plan):
    items = plan.breakdown
    assert items
    compute = sum(i.compute_s for i in items)
    comm = sum(i.comm_s + i.reshard_s for i in items)
    reshard = sum(i.reshard_s for i in items)
    np.testing.assert_allclose(compute, plan.cost.compute_s, rtol=1e-9)
    np.testing.assert_allclose(comm, plan.cost.comm_s, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(reshard, plan.cost.reshard_s, rtol=1e-9, atol=1e-15)
    for item in items:   # split by the collectives that reshard
        np.testing.assert_allclose(sum(item.reshard_s_by_kind.values()), item.reshard_s,
                                   rtol=1e-9, atol=1e-15)
    rows = viz.breakdown(plan).rows()
    np.testing.assert_allclose(sum(r["total_s"] for r in rows), plan.cost.total_s, rtol=1e-9)


def test_breakdown_names_layers_after_parameters(plan):
    labels = {r["label"] for r in viz.breakdown(plan).rows()}
    assert "params['layers'][0]" in labels
    assert all(not label.startswith("opt_state") for label in labels)
    primitives = {r["label"] for r in viz.breakdown(plan, by="primitive").rows()}
    assert "dot_general" in primitives
    assert len(viz.breakdown(plan, top=2).rows()) <= 2


def test_layer_of_paths():
    from autoshard.cost.breakdown import argument_layers, layer_of
    assert layer_of("params['layers'][0]['wq']") == "params['layers'][0]"
    assert layer_of("params['layers']['wq']") == "params['layers']"
    assert layer_of("state['blocks'][1]['attn']['query']['kernel'].value") == "state['blocks'][1]"
    assert argument_layers(["params['layers'][0]['w']", "opt_state['m']['layers'][0]['w']",
                            "batch['x']"]) == ["params['layers'][0]"] * 2 + ["batch['x']"]
    zoo = ["state['params']['blocks'][0]['mlp']['kernel'].value",
           "state['params']['embed']['embedding'].value",
           "state['opt_state'][0].mu['blocks'][0]['mlp']['kernel'].value",
           "state['opt_state'][0].nu['embed']['embedding'].value",
           "state['opt_state'][0].count", "state['step']"]
    assert argument_layers(zoo) == [
        "state['params']['blocks'][0]", "state['params']['embed']",
        "state['params']['blocks'][0]", "state['params']['embed']",
        "state['opt_state'][0]", "state['step']"]
    # a bias of a later layer is no mirror of a top-level parameter of the same name
    assert argument_layers(["params['b']", "params['layers'][1]['b']"]) == [
        "params['b']", "params['layers'][1]"]


def test_breakdown_survives_json_and_old_json_says_so(plan, mesh_2d):
    loaded = autoshard.Plan.from_json(plan.to_json(), mesh=mesh_2d)
    assert loaded.breakdown == plan.breakdown
    assert loaded.memory_parts == plan.memory_parts
    old = json.loads(plan.to_json())
    del old["breakdown"], old["memory_parts"]
    older = autoshard.Plan.from_json(json.dumps(old), mesh=mesh_2d)
    assert older.breakdown == ()
    with pytest.raises(autoshard.PlanError, match="no cost breakdown"):
        viz.breakdown(older)
    viz.memory(older).rows()       # falls back to "outputs + temporaries"


def test_breakdown_figure_is_labelled(plan):
    assert_labelled(viz.breakdown(plan).plot())
    with pytest.raises(autoshard.AutoshardError, match="'layer' or 'primitive'"):
        viz.breakdown(plan, by="colour")


# -- memory -------------------------------------------------------------------------------------

def test_memory_parts_against_the_compiled_program(plan, mlp):
    """Arguments and outputs as XLA allocates them; temporaries (the peak less those)
    never fewer than XLA's: the planner does not undercount what the budget judges."""
    compiled = plan.report(*mlp.args).compiled
    view = viz.memory(plan)
    parts = view.predicted()
    assert set(parts) >= {"parameters", "data", "outputs", "temporaries"}
    assert parts["parameters"] + parts["data"] == compiled.argument_bytes
    # XLA's output bytes also hold the result tuple's table (a pointer per output): so do
    # the predicted ones
    assert compiled.output_bytes == parts["outputs"]
    assert parts["temporaries"] >= compiled.temp_bytes
    assert_labelled(view.plot())


def test_memory_with_compiled_report(plan, mlp):
    report = plan.report(*mlp.args)
    view = viz.memory(plan, report)
    rows = {r["part"]: r for r in view.rows()}
    assert rows["arguments"]["compiled"] == report.compiled.argument_bytes
    assert rows["temporaries"]["compiled"] == report.compiled.temp_bytes
    assert_labelled(view.plot())
    other = autoshard.plan(mlp.fn, *mlp.args, mesh=plan.mesh,
                           pins={"batch['x']": P("data")})
    with pytest.raises(autoshard.PlanError, match="another plan"):
        viz.memory(other, report)
    with pytest.raises(autoshard.PlanError, match="report must be"):
        viz.memory(plan, "a report")


def test_optimizer_state_is_told_apart():
    paths = ["params['w']", "opt_state['m']['w']", "opt_state['count']", "batch['x']"]
    kinds = [viz.argument_category(p, paths) for p in paths]
    assert kinds == ["parameters", "optimizer state", "optimizer state", "data"]


# -- diff ---------------------------------------------------------------------------------------

def test_diff_of_a_plan_with_itself_is_empty(plan):
    d = viz.diff(plan, plan)
    assert len(d) == 0 and d.rows() == []
    assert len(viz.diff(plan, plan, show_all=True).rows()) == len(plan.arguments)


def test_diff_against_a_pinned_plan(plan, mlp):
    path = "params['layers'][0]['w']"
    want = P(None, "model") if plan.argument(path).spec != ((), ("model",)) else P("data", None)
    pinned = autoshard.plan(mlp.fn, *mlp.args, mesh=plan.mesh, pins={path: want})
    d = plan.diff(pinned, names=("auto", "pinned"))
    expected = [a.path for a, b in zip(plan.arguments, pinned.arguments) if a.spec != b.spec]
    assert d.changed == expected and path in d.changed
    row = next(r for r in d.rows() if r["path"] == path)
    assert row["spec_b"] == specs.from_partition_spec(want, 2)
    assert "pinned" in str(d)


def test_diff_against_expert_in_shardings(plan, mlp):
    mesh = plan.mesh
    params, _ = mlp.args
    replicated = NamedSharding(mesh, P())
    expert = (jax.tree.map(lambda _: replicated, params),
              {"x": NamedSharding(mesh, P(("data", "model"))), "y": P(("data", "model"))})
    d = viz.diff(plan, expert, names=("auto", "data parallel"))
    want = {"batch['x']": (("data", "model"), ()), "batch['y']": (("data", "model"),)}
    expected = [a.path for a in plan.arguments
                if a.spec != want.get(a.path, specs.replicated(len(a.shape)))]
    assert d.changed == expected
    prefix = (replicated, {"x": P("data"), "y": P("data")})   # one sharding for all params
    assert set(viz.diff(plan, prefix).changed) >= {
        a.path for a in plan.arguments if a.path.startswith("params") and specs.spec_axes(a.spec)}


def test_diff_of_mismatched_plans_names_the_culprit(plan, mesh_2d):
    other = programs.mlp_train_step(depth=2)
    other_plan = autoshard.plan(other.fn, *other.args, mesh=mesh_2d)
    with pytest.raises(autoshard.PlanError, match=r"params\['layers'\]\[3\]"):
        viz.diff(plan, other_plan)
    wider = programs.mlp_train_step(d_hidden=64)
    wider_plan = autoshard.plan(wider.fn, *wider.args, mesh=mesh_2d)
    with pytest.raises(autoshard.PlanError, match=r"shape"):
        viz.diff(plan, wider_plan)
    with pytest.raises(autoshard.PlanError, match="do not match"):
        viz.diff(plan, (P(), P(), P()))
    with pytest.raises(autoshard.PlanError, match="at least one"):
        viz.diff((P(),), (P(),))


# -- what if ------------------------------------------------------------------------------------

def test_what_if_plans_each_mesh_shape(mlp):
    view = judge.what_if(mlp.fn, *mlp.args, mesh_shapes=[(2, 4), (8, 1)])
    assert list(view.plans) == ["2×4", "8×1"]
    for name, row in zip(view.plans, view.rows()):
        p = view.plans[name]
        assert tuple(p.mesh.devices.shape) == tuple(int(n) for n in name.split("×"))
        assert row["total_s"] == p.cost.total_s and row["memory_bytes"] == p.cost.memory_bytes
        np.testing.assert_allclose(row["compute_s"] + row["comm_s"] + row["reshard_s"],
                                   p.cost.total_s)
    assert view.best == min(view.rows(), key=lambda r: r["total_s"])["mesh"]
    assert view[(8, 1)] is view.plans["8×1"]
    with pytest.raises(autoshard.PlanError, match="no plan for mesh shape 4×2"):
        view[(4, 2)]
    assert_labelled(view.plot())
    assert "2×4" in str(view) and "<table>" in view._repr_html_()
    with pytest.raises(autoshard.AutoshardError, match="has 3 axes"):
        judge.what_if(mlp.fn, *mlp.args, mesh_shapes=[(2, 2, 2)])


def test_compare_expert_and_auto_by_compiled_programs(plan, mlp):
    mesh = plan.mesh
    dp = (jax.tree.map(lambda _: NamedSharding(mesh, P()), mlp.args[0]),
          jax.tree.map(lambda _: NamedSharding(mesh, P(("data", "model"))), mlp.args[1]))
    view = judge.compare(mlp.fn, *mlp.args, candidates={"auto": plan, "data parallel": dp})
    rows = {r["plan"]: r for r in view.rows()}
    assert rows["auto"]["predicted_total_s"] == plan.cost.total_s
    assert rows["data parallel"]["predicted_total_s"] is None
    assert rows["data parallel"]["memory_bytes"] > 0 and view.best in rows
    assert_labelled(view.plot())


# -- one tensor, explain --------------------------------------------------------------------------

def test_sharding_view_covers_every_device(plan, capsys):
    arg = max(plan.arguments, key=lambda a: len(specs.spec_axes(a.spec)))
    view = viz.sharding(plan, arg.path)
    rows = view.rows()
    assert sorted(r["device"] for r in rows) == sorted(d.id for d in plan.mesh.devices.flat)
    shards = specs.num_shards(arg.spec, dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape)))
    for r in rows:
        size = np.prod([(s.stop if s.stop is not None else n) - (s.start or 0)
                        for s, n in zip(r["block"], arg.shape)])
        assert size * shards == np.prod(arg.shape)
    cells = [c for row in view.grid() for c in row]
    assert sorted(int(d) for c in cells for d in c.split(",")) == list(range(8))
    assert "devices" in view._repr_html_()
    view.show(use_color=False)
    assert "CPU" in capsys.readouterr().out


def test_explain_reads_as_sentences(plan):
    arg = plan.arguments[0]
    text = viz.explain(plan, arg.path)
    assert text.startswith(arg.path) and text.count(".") >= 2
    assert ("is split" in text) or ("is replicated" in text)
    with pytest.raises(autoshard.PlanError, match="did you mean"):
        viz.explain(plan, "params['layers'][0]['ww']")
    with pytest.raises(autoshard.PlanError, match="did you mean"):
        viz.sharding(plan, "params['layer'][0]['w']")


def test_runner_ups_pay_the_latencies_the_solver_pays():
    # group 0 (an argument) has strategies a and b (1 s each); group 1 reads it. One
    # combined collective's latency (5 s) is paid once if group 0 takes b or group 1 takes
    # its strategy 1.
    request = Request(node_costs=[np.array([1.0, 1.0]), np.array([0.0, 0.0])], edges=[],
                      shared_costs=[SharedCost(5.0, [(0, 1), (1, 1)])])
    # nobody pays it yet: b costs the 5 s latency more
    assert list(api.local_costs(request, [0, 0])[0]) == [1.0, 6.0]
    # group 1 pays it already: b costs the same
    assert list(api.local_costs(request, [0, 1])[0]) == [1.0, 1.0]
    for choice in ([0, 0], [0, 1], [1, 0], [1, 1]):
        costs = api.local_costs(request, choice)
        for g in (0, 1):
            moved = list(choice)
            for s in (0, 1):
                moved[g] = s
                assert (evaluation(request, moved).seconds
                        - evaluation(request, choice).seconds
                        == pytest.approx(costs[g][s] - costs[g][choice[g]]))


# -- abstract arguments ---------------------------------------------------------------------------

def test_views_of_an_abstract_plan(abstract, abstract_plan):
    p = abstract_plan
    assert [r["path"] for r in viz.table(p).rows()] == ["params['w1']", "params['w2']", "x"]
    assert_labelled(viz.breakdown(p).plot())
    report = p.report(*abstract.args)             # compiles from ShapeDtypeStructs
    assert_labelled(viz.memory(p, report).plot())
    assert "params['w1']" in viz.explain(p, "params['w1']")
    assert len(viz.sharding(p, "params['w1']").rows()) == 8
    sharded = [a for a in p.arguments if specs.spec_axes(a.spec)]
    assert len(viz.diff(p, jax.tree.map(lambda _: P(), abstract.args))) == len(sharded)


def test_command_line_saves_figures(tmp_path, capsys):
    assert cli.main(["view", "mlp_train_step", "--mesh", "2x4", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "breakdown.png").stat().st_size > 0
    assert (tmp_path / "memory.png").stat().st_size > 0
    assert "params['layers'][0]['w']" in capsys.readouterr().out


def test_scoreboard_ratios_against_the_fastest_other_plan():
    from autoshard.report.hlo_report import Report

    def report(total_s, memory_bytes):
        return Report(flops=0, bytes_accessed=0, compute_s=total_s / 2, comm_s=total_s / 2,
                      total_s=total_s, collectives=(), memory_bytes=memory_bytes)
    views = {
        "a": viz.CompareView({"auto": report(2e-6, 100), "dp": report(4e-6, 300),
                              "fsdp": report(8e-6, 50)}, {"auto": 1e-6}),
        "b": viz.CompareView({"auto": report(9e-6, 10), "dp": report(3e-6, 20)}, {}),
    }
    board = viz.scoreboard(views)
    ratios = {(r["program"], r["plan"]): (r["time_ratio"], r["memory_ratio"])
              for r in board.rows()}
    # a: fastest other is dp (4 us), smallest other is fsdp (50 B)
    assert ratios[("a", "auto")] == pytest.approx((0.5, 2.0))
    assert ratios[("a", "fsdp")] == pytest.approx((2.0, 1.0))
    # b: the only other is dp (3 us, 20 B)
    assert ratios[("b", "auto")] == pytest.approx((3.0, 0.5))
    summary = {s["program"]: s for s in board.summary()}
    assert summary["a"]["best_other"] == "dp" and summary["b"]["time_ratio"] == pytest.approx(3.0)
    assert views["a"].best == "auto"
    assert_labelled(board.plot())
    assert "÷ fastest other" in str(board)
