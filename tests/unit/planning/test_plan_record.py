"""A plan is a frozen record: its statistics typed (PlanStats), a change a new plan, the
JSON round trip exact, and the planner's decisions in its log."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.planning.plan import PlanStats

W = np.ones((64, 32), np.float32)
X = np.ones((16, 64), np.float32)


def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def step(w, x):
    value, grad = autoshard.value_and_grad(loss)(w, x)
    return w - 0.1 * grad, value


@pytest.fixture(scope="module")
def planned(mesh_2d):
    return autoshard.plan(loss, W, X, mesh=mesh_2d, cache=False)


def test_a_plan_is_frozen(planned):
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.cost = None
    with pytest.raises(TypeError):
        planned.decisions[("x",)] = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.stats.status = "optimal"


def test_bind_gives_a_new_plan_with_the_program(planned, mesh_2d):
    loaded = autoshard.Plan.from_json(planned.to_json(), mesh_2d)
    with pytest.raises(autoshard.PlanError, match="bind"):
        loaded.jit()
    bound = loaded.bind(loss, W, X)
    assert bound is not loaded and loaded.program is None and bound.program is not None
    np.testing.assert_allclose(bound.jit()(W, X), jax.jit(loss)(W, X), rtol=1e-6)


def test_the_statistics_are_typed_and_round_trip(planned, mesh_2d):
    stats = planned.stats
    assert stats.status in ("optimal", "priced", "trivial")
    assert stats.nodes > 0 and 0 < stats.solved_groups <= stats.groups
    assert 0 < stats.jaxpr_s <= stats.plan_s and stats.cache is None
    assert set(stats.stage_seconds()) == {"trace", "cost", "coarsen", "solve"}
    loaded = autoshard.Plan.from_json(planned.to_json(), mesh_2d)
    assert loaded.stats == stats
    assert PlanStats.from_dict({**stats.to_dict(), "unknown": 1}) == stats


def test_a_plan_of_the_old_format_is_refused(planned, mesh_2d):
    old = planned.to_json().replace('"format": 2', '"format": 1')
    with pytest.raises(autoshard.PlanError, match="format 1"):
        autoshard.Plan.from_json(old, mesh_2d)


def test_the_settings_tried_are_recorded_and_logged(mesh_2d, caplog):
    with caplog.at_level(logging.DEBUG, logger="autoshard"):
        found = autoshard.plan(step, W, X, mesh=mesh_2d, microbatches="auto", cache=False)
    tried = [s["setting"] for s in found.stats.settings]
    assert tried and tried[0] == "K=1, no remat"
    logged = [r.getMessage() for r in caplog.records
              if r.name == "autoshard.planning.settings"]
    assert [m.split(":")[0] for m in logged] == [f"setting {t}" for t in tried]
    assert any(r.name == "autoshard.planning.api" and "solved" in r.getMessage()
               for r in caplog.records)


def test_a_cache_hit_is_logged(mesh_2d, caplog):
    with caplog.at_level(logging.DEBUG, logger="autoshard.planning.api"):
        first = autoshard.plan(loss, W, X * 2, mesh=mesh_2d)
        again = autoshard.plan(loss, W, X * 2, mesh=mesh_2d)
    cache = [m for m in caplog.messages if "cache" in m]
    assert again.stats.cache == "memory" and first.stats.cache in (None, "memory")
    assert cache[-1].endswith("cache hit")
