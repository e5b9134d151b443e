"""Sharded checkpoints: restore onto other meshes and device counts, atomic saves."""

from __future__ import annotations

import os
import shutil

import distributed_runs as runs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.runtime.checkpoint import Checkpointer, CheckpointError, abstract_state, latest_step

RTOL = 1e-5


def small_state(mesh):
    state = {"params": {"w": jnp.arange(64.0).reshape(8, 8), "layers": {0: jnp.ones(4)}},
             "step": jnp.asarray(7, jnp.int32)}
    shardings = {"params": {"w": NamedSharding(mesh, P("data", "model")),
                            "layers": {0: NamedSharding(mesh, P("model"))}},
                 "step": NamedSharding(mesh, P())}
    return jax.device_put(state, shardings)


def test_save_on_2x4_restore_on_4_devices(tmp_path, mesh_2d):
    state = small_state(mesh_2d)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(3, state, data_position=3, record={"note": "x"})
        ckpt.wait_until_finished()
        assert not ckpt.save(3, state)            # a step is written once
        assert ckpt.all_steps() == [3]
        mesh4 = autoshard.make_mesh((4,), ("x",), devices=jax.devices()[:4])
        target = abstract_state(state, {"params": {"w": NamedSharding(mesh4, P(None, "x")),
                                                   "layers": {0: NamedSharding(mesh4, P())}},
                                        "step": NamedSharding(mesh4, P())})
        restored, record = ckpt.restore(None, target)
    assert record["step"] == 3 and record["data_position"] == 3 and record["note"] == "x"
    assert restored["params"]["w"].sharding.mesh.devices.size == 4
    assert restored["params"]["w"].sharding.spec == P(None, "x")
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert latest_step(tmp_path) == 3


def test_restore_into_another_state_names_the_difference(tmp_path, mesh_2d):
    state = small_state(mesh_2d)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        wrong_shape = abstract_state(state)
        wrong_shape["params"]["w"] = jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                                          sharding=state["params"]["w"].sharding)
        with pytest.raises(CheckpointError, match=r"params/w has shape \(8, 8\)"):
            ckpt.restore(1, wrong_shape)
        with pytest.raises(CheckpointError, match="unexpected"):
            ckpt.restore(1, {"params": abstract_state(state)["params"]})
        with pytest.raises(CheckpointError, match="no complete checkpoint of step 2"):
            ckpt.restore(2, abstract_state(state))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_text,devices", [("8", 8), ("2x2", 4)])
def test_checkpoint_from_2x4_restores_on_other_device_counts(tmp_path, mesh_text, devices):
    """Saved by 2 processes on a 2x4 mesh; restored by 1 process on 8 or 4 devices."""
    reference = runs.reference_run()
    ckpt_dir = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(reference.directory, "ckpt"), ckpt_dir)
    dump = str(tmp_path / "restored5.npz")
    run = runs.run_driver(str(tmp_path), [
        "--mesh", mesh_text, "--steps", str(runs.STEPS), "--checkpoint-dir", ckpt_dir,
        "--restore-step", "5", "--dump-state-at", "5", "--dump-path", dump],
        num_processes=1, devices_per_process=devices)
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["device_count"] == devices
    assert run.result["resumed_from"] == 5 and run.result["consumed"] == [5, 6, 7, 8, 9]
    saved = runs.load_npz(os.path.join(reference.directory, "state5.npz"))
    restored = runs.load_npz(dump)
    assert sorted(saved) == sorted(restored)
    for key in saved:
        np.testing.assert_array_equal(restored[key], saved[key], err_msg=key)
    want = reference.losses()
    got = run.losses()
    np.testing.assert_allclose([got[s] for s in range(5, runs.STEPS)],
                               [want[s] for s in range(5, runs.STEPS)], rtol=RTOL)


@pytest.mark.slow
def test_crash_during_save_leaves_the_previous_checkpoint_latest(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    dump = str(tmp_path / "state5.npz")
    run = runs.run_driver(str(tmp_path), [
        "--mesh", "2x2", "--steps", str(runs.STEPS), "--checkpoint-dir", ckpt_dir,
        "--checkpoint-every", "5", "--crash-in-save-of-step", "10",
        "--dump-state-at", "5", "--dump-path", dump], num_processes=1, devices_per_process=4)
    assert run.returncode == 17, run.output[-4000:]
    assert "crashing while saving checkpoint 10" in run.output
    entries = sorted(os.listdir(ckpt_dir))
    partial = [e for e in entries if e.startswith("10.")]
    assert "5" in entries and "10" not in entries and partial, entries
    # The partial save holds the state's files, written but never renamed into place.
    assert os.listdir(os.path.join(ckpt_dir, partial[0]))
    assert latest_step(ckpt_dir) == 5

    from autoshard.zoo import models
    state = models.train_case("gpt", "tiny").state
    mesh = autoshard.make_mesh((8,), ("data",))
    with Checkpointer(ckpt_dir) as ckpt:       # opening it clears the partial save
        assert ckpt.all_steps() == [5]
        restored, record = ckpt.restore(None, abstract_state(state, NamedSharding(mesh, P())))
    assert record["data_position"] == 5
    assert not [e for e in os.listdir(ckpt_dir) if e.startswith("10")]
    saved = runs.load_npz(dump)
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
    assert sorted(flat) == sorted(saved)
    for key in saved:
        np.testing.assert_array_equal(flat[key], saved[key], err_msg=key)


def test_train_run_checkpoints_and_resumes(tmp_path):
    from autoshard.runtime import train
    from autoshard.zoo import models
    case = models.train_case("mlp", "tiny")
    step_fn = jax.jit(case.train_step)
    full = train.run(case, step_fn, case.state, steps=6, log=None)
    consumed = []
    first = train.run(case, step_fn, case.state, steps=4, log=consumed.append,
                      checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert first == full[:4] and latest_step(tmp_path) == 4
    lines = []
    rest = train.run(case, step_fn, case.state, steps=6, log=lines.append,
                     checkpoint_dir=str(tmp_path), checkpoint_every=2, resume=True)
    assert lines[0] == "resumed from checkpoint 4 (next step 4)"
    assert [int(line.split()[1]) for line in lines[1:]] == [4, 5]
    assert rest == full[4:]                   # bit for bit
    assert latest_step(tmp_path) == 6
