"""``PlanOptions``: plan()'s keywords checked and resolved once, where they are built."""

import dataclasses
import inspect

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

import autoshard
from autoshard.errors import InputError, OptionError
from autoshard.planning.fingerprint import plan_key
from autoshard.planning.options import PlanOptions
from autoshard.target.hardware import default_hardware


def test_defaults_are_resolved(mesh_2d):
    options = PlanOptions.build(mesh=mesh_2d, donate_argnums=1)
    assert options.hardware == default_hardware(mesh_2d)
    assert options.memory_budget == options.hardware.memory
    assert options.donate_argnums == (1,)
    assert not options.searches_settings
    assert PlanOptions.build(mesh=mesh_2d, memory_budget=5e9).memory_budget == 5e9
    assert PlanOptions.build(mesh=mesh_2d, remat="auto").searches_settings


def test_an_explicit_mesh_becomes_auto_with_a_warning_naming_plans_caller():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.warns(UserWarning, match="AxisType.Auto") as record:
        options = PlanOptions.build(mesh=mesh)
    assert all(t == AxisType.Auto for t in options.mesh.axis_types)
    with pytest.warns(UserWarning, match="AxisType.Auto") as record:
        autoshard.plan(lambda x: x * 2, jax.ShapeDtypeStruct((8, 8), "float32"), mesh=mesh,
                       cache=False, progress=False)
    assert record[0].filename == __file__


def test_options_are_frozen(mesh_2d):
    options = PlanOptions.build(mesh=mesh_2d)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.memory_budget = 1.0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"repeats": 2}, InputError, "pass pipeline="),
    ({"pipeline": "nope"}, InputError, "mesh axis 'nope'"),
    ({"microbatches": 0}, InputError, "microbatches must be"),
    ({"pipeline": "data", "repeats": 2.5}, InputError, "repeats must be"),
    ({"remat": "some"}, InputError, "remat must be"),
    ({"time_limit_s": -1}, OptionError, "time_limit_s"),
    ({"donate_argnums": (3,)}, OptionError, "donate_argnums"),
])
def test_bad_options_are_refused_where_built(mesh_2d, kwargs, error, match):
    with pytest.raises(error, match=match):
        PlanOptions.build(mesh=mesh_2d, num_args=2, **kwargs)


def test_the_cache_key_reads_the_options_that_decide_a_plan(mesh_2d):
    base = PlanOptions.build(mesh=mesh_2d, pins={"x": PartitionSpec("data")})

    def key(**changes):
        return plan_key("f00d", ["x"], dataclasses.replace(base, **changes))
    assert key() == key(cache=False, progress=True, seconds_to_beat=1.0, microbatches=2)
    for change in ({"memory_budget": 1e9}, {"time_limit_s": 1.0}, {"reuse": False},
                   {"donate_argnums": (0,)}, {"pins": {"x": PartitionSpec("model")}},
                   {"hardware": dataclasses.replace(base.hardware, flops=1e12)}):
        assert key(**change) != key(), change


def test_an_unknown_keyword_is_named_with_the_one_it_resembles(mesh_2d):
    with pytest.raises(autoshard.OptionError,
                       match=r"'memory_budgt'.*did you mean 'memory_budget'"):
        autoshard.plan(lambda x: x, np.ones(8), mesh=mesh_2d, memory_budgt=1e9)
    with pytest.raises(autoshard.OptionError, match="'mesh_shape'"):
        autoshard.auto_shard(mesh=mesh_2d, mesh_shape=(2, 4))
    with pytest.raises(autoshard.MeshError, match="needs mesh="):
        autoshard.plan(lambda x: x, np.ones(8))


def test_plan_and_auto_shard_show_the_keywords_declared_once():
    fields = [f.name for f in dataclasses.fields(PlanOptions) if not f.kw_only]
    for fn, leading in ((autoshard.plan, ["fn", "args"]), (autoshard.auto_shard, ["fn"])):
        parameters = inspect.signature(fn).parameters
        assert list(parameters) == leading + fields
        assert parameters["time_limit_s"].default == PlanOptions.time_limit_s
        assert parameters["mesh"].default is inspect.Parameter.empty
