"""The example programs of autoshard.testing run, learn, trace and stay abstract."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.testing import programs
from autoshard.testing.programs import Program

TRAIN_STEPS = [
    "mlp_train_step",
    "transformer_train_step",
    "nnx_transformer_train_step",
    "moe_layer_train_step",
    "conv_train_step",
    "scan_transformer_train_step",
]


@functools.cache
def _all_programs() -> dict:
    """``all_programs()`` by name, built once per test session."""
    return {p.name: p for p in programs.all_programs()}


def _program(name: str) -> Program:
    return _all_programs()[name]


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_all_programs_are_the_six_train_steps():
    assert list(_all_programs()) == TRAIN_STEPS
    for p in _all_programs().values():
        assert not p.is_abstract
        assert 0 < p.atol <= 1e-4
        assert all(0 <= i < len(p.args) for i in p.donate_argnums)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAIN_STEPS)
def test_train_step_runs_and_learns(name):
    p = _program(name)
    step = jax.jit(p.fn)  # no donation: p.args are shared with other tests
    args, losses = p.args, []
    for _ in range(3):
        *state, loss = step(*args)
        losses.append(float(loss))
        args = (*state, p.args[-1])  # same batch every step
    assert all(math.isfinite(l) for l in losses), losses
    # Two updates on the same batch reduce the loss, each one a little.
    assert losses[2] < losses[1] < losses[0], losses
    # The outputs have the structure of the state they replace.
    assert jax.tree.structure(tuple(state)) == jax.tree.structure(p.args[:-1])


@pytest.mark.parametrize("name", TRAIN_STEPS)
def test_traces_from_abstract_args(name):
    p = _program(name)
    abstract = p.abstract_args()
    assert jax.tree.structure(abstract) == jax.tree.structure(p.args)
    for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(p.args)):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype) == (x.shape, x.dtype)
    out = jax.make_jaxpr(p.fn)(*abstract).out_avals
    # (new state..., loss): the state keeps its shapes, the loss is an f32 scalar.
    state_leaves = jax.tree.leaves(abstract[:-1])
    assert [(a.shape, a.dtype) for a in out[:-1]] == [(a.shape, a.dtype) for a in state_leaves]
    assert (out[-1].shape, out[-1].dtype) == ((), jnp.float32)


@pytest.mark.parametrize("name", TRAIN_STEPS)
def test_dims_divisible_by_8_and_floats_are_f32(name):
    for path, x in jax.tree_util.tree_leaves_with_path(_program(name).args):
        key = jax.tree_util.keystr(path)
        if jnp.issubdtype(x.dtype, jnp.floating):
            assert x.dtype == jnp.float32, key
        # Exempt: the scalar Adam step count and 3x3 conv windows.
        dims = x.shape[2:] if "convs" in key else x.shape
        assert all(d % 8 == 0 for d in dims), (key, x.shape)


@pytest.mark.parametrize("name", ["mlp_train_step", "moe_layer_train_step"])
def test_batch_sharded_run_matches_within_tolerance(name):
    """A data-parallel run reorders the sums; the declared atol absorbs that."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (see tests/conftest.py)")
    p = _program(name)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    *state, batch = p.args
    sharded = (*state, jax.device_put(batch, batch_sharding))
    expected, got = jax.jit(p.fn)(*p.args), jax.jit(p.fn)(*sharded)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=programs.RTOL, atol=p.atol),
                 got, expected)


def test_params_have_the_documented_layout():
    mlp = _program("mlp_train_step").args[0]
    assert [l["w"].shape for l in mlp["layers"]] == [(64, 128), (128, 128), (128, 128), (128, 16)]
    lm, opt, batch = _program("transformer_train_step").args
    assert lm["layers"][0]["wq"].shape == (64, 64)
    assert set(opt) == {"m", "v", "count"} and opt["count"].dtype == jnp.int32
    assert batch["inputs"].shape == batch["targets"].shape == (8, 16)
    scanned = _program("scan_transformer_train_step").args[0]
    assert scanned["layers"]["wq"].shape == (8, 64, 64)
    state = _program("nnx_transformer_train_step").args[0]
    assert state["blocks"][0]["attn"]["query"]["kernel"].shape == (64, 8, 8)


def test_deterministic():
    a, b = programs.mlp_train_step(), programs.mlp_train_step()
    jax.tree.map(np.testing.assert_array_equal, a.args, b.args)


def test_inference_mlp_runs_small():
    p = programs.inference_mlp(batch=8, d=64)
    params, x = p.args
    y = jax.jit(p.fn)(*p.args)
    assert y.shape == (8, 64) and bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_allclose(y, jax.nn.gelu(x @ params["w1"]) @ params["w2"],
                               rtol=programs.RTOL, atol=p.atol)


def test_inference_mlp_abstract_default_allocates_nothing():
    before = _live_bytes()
    p = programs.inference_mlp(abstract=True)
    assert p.is_abstract
    params, x = p.abstract_args()
    assert x.shape == (16, 8192) and params["w1"].shape == params["w2"].shape == (8192, 8192)
    out = jax.make_jaxpr(p.fn)(*p.abstract_args()).out_avals
    assert out[0].shape == (16, 8192)
    assert _live_bytes() - before < 1 << 20


def test_lm_1b_is_abstract_and_about_a_billion_params():
    before = _live_bytes()
    p = programs.lm_1b_train_step_abstract()
    assert p.is_abstract
    params, opt_state, _ = p.abstract_args()
    assert 0.9e9 <= programs.param_count(params) <= 1.3e9
    assert programs.param_count(opt_state["m"]) == programs.param_count(params)
    jaxpr = jax.make_jaxpr(p.fn)(*p.abstract_args())
    assert jaxpr.out_avals[-1].shape == ()
    # Tracing built no concrete arrays of any size (params alone are 4.6 GB).
    assert _live_bytes() - before < 1 << 20
