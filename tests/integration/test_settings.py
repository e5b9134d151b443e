"""The search over settings (``settings.py``) on a stub planner: each setting's program is
traced for real (the marked loss is rewritten into K microbatches), but planned by a table
of step seconds and bytes per setting, so the search's choices can be checked by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.errors import MemoryBudgetError
from autoshard.planning.options import PlanOptions
from autoshard.planning.plan import ArgumentInfo, Plan, PlanCost, PlanStats
from autoshard.planning.settings import plan_settings, replica_candidates
from autoshard.rewrite.accumulate import active_setting
from autoshard.solver.solve import CannotBeat

ROWS = 64


def loss_fn(w, batch):
    return jnp.mean((batch @ w) ** 2)


def train_step(w, batch):
    loss, grad = autoshard.value_and_grad(loss_fn)(w, batch)
    return w - 0.1 * grad, loss


ARGS = (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((ROWS, 4), jnp.float32))


@dataclasses.dataclass
class StubPlan:
    cost: PlanCost
    stats: PlanStats
    arguments: tuple
    microbatching: object = None
    with_stats = Plan.with_stats


class StubPlanner:
    """Plans one traced program from ``table``: (K, replica axes) -> (seconds, bytes),
    raising as the solve stage does over the budget or where the seconds to beat are not
    beaten. ``calls`` hears each setting and the options it was planned with."""

    def __init__(self, table):
        self.table = table
        self.calls = []

    def __call__(self, fn, args, options, trace):
        setting = active_setting()
        if setting is None or setting.remat is None:   # no layer stack to rematerialize
            trace()   # traced under the setting, as the search traces it
        key = (1, ()) if setting is None else (setting.microbatches, setting.replica_axes)
        if setting is not None and setting.remat is not None:
            key += (setting.remat,)
        self.calls.append((key, options))
        seconds, num_bytes = self.table[key]
        if options.seconds_to_beat is not None and seconds >= options.seconds_to_beat:
            raise CannotBeat(seconds)
        if num_bytes > options.memory_budget:
            raise MemoryBudgetError("over", options.memory_budget, num_bytes)
        batch = ArgumentInfo("batch", (ROWS, 4), "float32", (("data",), ()))
        return StubPlan(PlanCost(seconds, 0.0, num_bytes), PlanStats(), (batch,))


def options_for(mesh, **kwargs):
    return PlanOptions.build(mesh=mesh, memory_budget=100.0, cache=False, progress=False,
                             **kwargs)


def test_auto_microbatches_keep_the_fastest_fitting_k_and_stop_when_outpaced(mesh_1d):
    # K=1 holds 200 bytes, over the budget of 100; each K splits over data (faster) or
    # over no axis. K=2 fits at 3 s, K=4 at 2 s; K=8 would take 2.5 s: told to beat 2 s it
    # gives up, and K=16 is never tried. Split over no axis, K=2 cannot beat 3 s: that
    # split is not tried at more microbatches.
    table = {(1, ()): (1.0, 200.0)}
    for k, seconds in ((2, 3.0), (4, 2.0), (8, 2.5), (16, 1.0)):
        table[k, ("data",)] = (seconds, 90.0 / k)
        table[k, ()] = (seconds + 1.0, 90.0 / k)
    planner = StubPlanner(table)
    options = options_for(mesh_1d, microbatches="auto")
    found = plan_settings(planner, train_step, ARGS, options)
    assert found.microbatching.microbatches == 4
    assert found.microbatching.replica_axes == ("data",)
    assert found.cost.total_s == 2.0
    # each setting is told the best step seconds found before it
    tried = [(key, o.seconds_to_beat) for key, o in planner.calls]
    assert tried == [((1, ()), None), ((2, ("data",)), None), ((2, ()), 3.0),
                     ((4, ("data",)), 3.0), ((8, ("data",)), 2.0)]
    # and planned with the caller's options otherwise
    for _, received in planner.calls:
        assert dataclasses.replace(received, seconds_to_beat=None) == options
    outcomes = [(s["setting"], s["outcome"]) for s in found.stats.settings]
    assert outcomes == [
        ("K=1, no remat", "over budget: at least 200 bytes"),
        ("K=2 over data, remat none", "fits"),
        ("K=2, remat none", "cannot beat 3 s: at least 4 s"),
        ("K=4 over data, remat none", "fits"),
        ("K=8 over data, remat none", "cannot beat 2 s: at least 2.5 s")]


def test_a_setting_over_budget_is_tried_at_more_microbatches_an_outpaced_one_is_not(
        mesh_1d):
    # split over no axis, K=2 is over the budget: tried again at K=4, where it fits and
    # is kept; over data, K=4 cannot beat K=2's 3 s regardless of memory: not tried at 8
    table = {(1, ()): (2.0, 150.0), (2, ("data",)): (3.0, 40.0), (2, ()): (2.5, 150.0),
             (4, ("data",)): (3.5, 20.0), (4, ()): (2.8, 90.0),
             (8, ("data",)): (4.0, 10.0), (8, ()): (2.9, 40.0)}
    planner = StubPlanner(table)
    found = plan_settings(planner, train_step, ARGS, options_for(mesh_1d, microbatches="auto"))
    assert [key for key, _ in planner.calls] == [(1, ()), (2, ("data",)), (2, ()),
                                                 (4, ("data",)), (4, ()), (8, ())]
    assert found.microbatching.microbatches == 4 and found.cost.total_s == 2.8


def test_a_fixed_count_plans_that_count_only(mesh_1d):
    # K=1 is planned first (it tells the batch and the replica axes) but not kept
    table = {(1, ()): (1.0, 50.0), (2, ("data",)): (3.0, 40.0)}
    planner = StubPlanner(table)
    found = plan_settings(planner, train_step, ARGS, options_for(mesh_1d, microbatches=2))
    assert found.microbatching.microbatches == 2 and found.cost.total_s == 3.0
    assert [key for key, _ in planner.calls] == [(1, ()), (2, ("data",))]


def test_no_setting_fitting_raises_the_last_budget_failure(mesh_1d):
    table = {(k, axes): (1.0, 1000.0 / k) for k in (1, 2, 4, 8) for axes in (("data",), ())}
    planner = StubPlanner(table)
    with pytest.raises(MemoryBudgetError) as e:
        plan_settings(planner, train_step, ARGS, options_for(mesh_1d, microbatches=4))
    assert e.value.smallest_bytes == 250.0   # K=4's, the last tried


def test_policies_saving_more_than_one_over_budget_are_rejected_unplanned(mesh_1d):
    # K=1: no remat (200 bytes) and dots saved (150) are over the budget of 100, nothing
    # saved fits at 5 s. At K=2 over data, nothing saved (the least held) is over the
    # budget: saving dots or every residual holds more, and is not planned. At K=4,
    # nothing saved and dots saved fit, no remat is over the budget; at K=8 only no remat
    # beats K=4's dots saved (2.5 s), and is kept.
    table = {(1, ()): (1.0, 200.0), (1, (), "dots_saveable"): (2.0, 150.0),
             (1, (), "nothing_saveable"): (5.0, 90.0)}
    held = {2: (330.0, 220.0, 110.0), 4: (285.0, 95.0, 50.0), 8: (90.0, 50.0, 25.0)}
    for k, sizes in held.items():
        for policy, seconds, num_bytes in zip((None, "dots_saveable", "nothing_saveable"),
                                              (1.5, 2.5, 4.5), sizes):
            key = (k, ("data",)) + (() if policy is None else (policy,))
            table[key] = (seconds, num_bytes)
    planner = StubPlanner(table)
    found = plan_settings(planner, train_step, ARGS,
                          options_for(mesh_1d, microbatches="auto", remat="auto"))
    planned = [key for key, _ in planner.calls]
    assert planned[:3] == [(1, ()), (1, (), "dots_saveable"), (1, (), "nothing_saveable")]
    assert planned[3:] == [(2, ("data",), "nothing_saveable"),
                           (4, ("data",), "nothing_saveable"), (4, ("data",), "dots_saveable"),
                           (4, ("data",)), (8, ("data",), "nothing_saveable"),
                           (8, ("data",), "dots_saveable"), (8, ("data",))]
    assert found.microbatching.microbatches == 8
    assert found.microbatching.remat is None and found.cost.total_s == 1.5
    outcomes = {s["setting"]: s["outcome"] for s in found.stats.settings}
    for policy in ("dots_saveable", "none"):
        assert outcomes[f"K=2 over data, remat {policy}"] == (
            "over budget: holds more than remat nothing_saveable, at least 110 bytes")


def test_replica_candidates():
    sizes = {"data": 2, "model": 4, "one": 1}
    # the plan without microbatches splits the batch over data: that, and every axis
    batch = ArgumentInfo("b", (8, 4), "f32", (("data",), ()))
    base = StubPlan(PlanCost(1, 0, 0), PlanStats(), (batch,))
    assert replica_candidates(base, 8, sizes) == [("data",), ("data", "model")]
    # no such plan: every axis, each alone (largest first), none
    assert replica_candidates(None, 8, sizes) == [("data", "model"), ("model",), ("data",), ()]
