"""Multi-process runs: launcher, start-up, plan agreement, numerics across processes, resume.

The multi-process tests run tests/integration/distributed_driver.py in subprocesses (2 processes x 4
simulated CPU devices with gloo collectives) and compare with one process of 8 devices.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import distributed_runs as runs
import numpy as np
import pytest

from autoshard.runtime import distributed, launch

RTOL = 1e-5


# -- launcher -------------------------------------------------------------------------------


def python_command(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# Forking from this process (JAX running) warns; the child execs at once.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


def test_launch_prefixes_output_and_passes_process_env():
    out = io.StringIO()
    code = launch.launch(python_command(
        "import os; print('id', os.environ['AUTOSHARD_PROCESS_ID'], "
        "os.environ['AUTOSHARD_NUM_PROCESSES'], os.environ['AUTOSHARD_DEVICES_PER_PROCESS'], "
        "os.environ['AUTOSHARD_COORDINATOR_ADDRESS'].startswith('localhost:'))"),
        2, devices_per_process=4, out=out, timeout_s=60)
    assert code == 0
    lines = sorted(out.getvalue().splitlines())
    assert lines == ["[p0] id 0 2 4 True", "[p1] id 1 2 4 True"]


def test_launch_stops_the_others_when_one_fails():
    out = io.StringIO()
    started = time.monotonic()
    code = launch.launch(python_command(
        "import os, sys, time\n"
        "if os.environ['AUTOSHARD_PROCESS_ID'] == '1':\n"
        "    print('failing', flush=True); sys.exit(7)\n"
        "time.sleep(120)"), 2, out=out, timeout_s=100)
    assert code == 7
    assert time.monotonic() - started < 30
    assert "[p1] failing" in out.getvalue()
    assert "process 1 exited with code 7" in out.getvalue()


def test_launch_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard.runtime.launch", "-n", "2", "--", sys.executable, "-c",
         "import os; print(os.environ['AUTOSHARD_PROCESS_ID'])"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
        env=runs.child_env(), cwd=runs.ROOT)
    assert proc.returncode == 0, proc.stdout
    assert sorted(proc.stdout.splitlines()) == ["[p0] 0", "[p1] 1"]


def test_process_env_sets_cpu_collectives():
    env = launch.process_env(1, 2, "localhost:1234", devices_per_process=4, platform="cpu",
                             base={})
    assert env["AUTOSHARD_PROCESS_ID"] == "1"
    assert env["AUTOSHARD_DEVICES_PER_PROCESS"] == "4"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"


# -- single-process behaviour ---------------------------------------------------------------


def test_initialize_alone_is_a_single_process_run(monkeypatch):
    for name in (distributed.ENV_COORDINATOR_ADDRESS, distributed.ENV_NUM_PROCESSES,
                 distributed.ENV_PROCESS_ID, distributed.ENV_DEVICES_PER_PROCESS):
        monkeypatch.delenv(name, raising=False)
    if distributed.detected_cluster() is not None:
        pytest.skip("running inside a detected cluster environment")
    info = distributed.initialize()
    assert (info.process_id, info.num_processes, info.is_primary) == (0, 1, True)
    assert distributed.exchange("x", "value") == ["value"]


def description(batch_rows=8, spec=(("data",), ()), mesh_shape=(2, 4), fingerprint="f0",
                hash_="h0"):
    return {"hash": hash_, "fingerprint": fingerprint,
            "mesh": {"axis_names": ["data", "model"], "shape": list(mesh_shape)},
            "arguments": [["state['w']", [16, 16], "float32", [[], ["model"]]],
                          ["batch['inputs']", [batch_rows, 16], "int32",
                           [list(a) for a in spec]]],
            "outputs": [[]]}


def test_describe_difference_names_the_argument_shape():
    mine, theirs = description(batch_rows=4, hash_="a"), description(hash_="b")
    assert distributed.describe_difference(mine, theirs, me=1, them=0) == (
        "process 1 traced a different program: batch['inputs'] shape (4, 16) vs (8, 16) "
        "on process 0")


def test_describe_difference_names_mesh_fingerprint_and_spec():
    base = description(hash_="b")
    assert "built a different mesh: {'data': 4, 'model': 2} vs {'data': 2, 'model': 4}" in \
        distributed.describe_difference(description(mesh_shape=(4, 2), hash_="a"), base,
                                        me=1, them=0)
    assert "the function itself differs" in distributed.describe_difference(
        description(fingerprint="f1", hash_="a"), base, me=1, them=0)
    assert "batch['inputs'] spec" in distributed.describe_difference(
        description(spec=((), ()), hash_="a"), base, me=1, them=0)
    assert distributed.describe_difference(base, description(hash_="b"), me=1, them=0) is None


def test_plan_hash_survives_json_round_trip(mesh_2d):
    import autoshard
    from autoshard.testing.programs import mlp_train_step
    program = mlp_train_step()
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh_2d)
    again = autoshard.Plan.from_json(plan.to_json(), mesh=mesh_2d)
    assert distributed.plan_hash(plan) == distributed.plan_hash(again)
    assert distributed.check_same_plan(plan) == distributed.plan_hash(plan)


def test_put_batch_and_to_host_round_trip(mesh_2d):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    batch = {"inputs": np.arange(128, dtype=np.int32).reshape(8, 16)}
    sharding = NamedSharding(mesh_2d, P("data", "model"))
    placed = distributed.put_batch(batch, {"inputs": sharding})
    assert placed["inputs"].sharding == sharding
    np.testing.assert_array_equal(distributed.to_host(placed)["inputs"], batch["inputs"])
    assert distributed.process_slice(sharding, (8, 16)) == (slice(0, 8), slice(0, 16))


# -- two processes --------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_match_one_process_step_for_step():
    reference = runs.reference_run()
    assert reference.result["num_processes"] == 2 and reference.result["device_count"] == 8
    single = runs.run_driver(os.path.join(runs.scratch_root(), "single"),
                             ["--mesh", "2x4", "--steps", str(runs.STEPS)],
                             num_processes=1, devices_per_process=8)
    assert single.returncode == 0, single.output[-4000:]
    two, one = reference.losses(), single.losses()
    assert sorted(two) == sorted(one) == list(range(runs.STEPS))
    np.testing.assert_allclose([two[s] for s in range(runs.STEPS)],
                               [one[s] for s in range(runs.STEPS)], rtol=RTOL)
    # Both processes printed every step, and the same loss.
    assert reference.printed_steps(0) == reference.printed_steps(1) == list(range(runs.STEPS))


@pytest.mark.slow
def test_resume_after_a_process_dies_reproduces_the_run():
    reference = runs.reference_run()
    directory = os.path.join(runs.scratch_root(), "crash")
    common = ["--mesh", "2x4", "--steps", str(runs.STEPS), "--checkpoint-dir",
              os.path.join(directory, "ckpt"), "--checkpoint-every", str(runs.CHECKPOINT_EVERY)]
    crashed = runs.run_driver(directory, common + ["--exit-after-step", "6"],
                              num_processes=2, devices_per_process=4)
    assert crashed.returncode == 3, crashed.output[-4000:]
    assert "[p1] exiting after step 6" in crashed.output
    assert "process 1 exited with code 3" in crashed.output
    assert crashed.printed_steps(1) == list(range(7))

    resumed = runs.run_driver(os.path.join(directory, "resumed"), common + ["--resume"],
                              num_processes=2, devices_per_process=4)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.result["resumed_from"] == 5
    assert resumed.result["consumed"] == [5, 6, 7, 8, 9]
    # The final state consumed every batch exactly once: 0-4 before checkpoint 5, then 5-9.
    lineage = crashed.printed_steps(1)[:resumed.result["resumed_from"]] + resumed.result["consumed"]
    assert lineage == list(range(runs.STEPS))
    want = reference.losses()
    assert resumed.losses() == {s: want[s] for s in range(5, runs.STEPS)}   # bit for bit


@pytest.mark.slow
def test_mismatched_programs_stop_with_a_clear_error():
    started = time.monotonic()
    run = runs.run_driver(os.path.join(runs.scratch_root(), "mismatch"),
                          ["--mesh", "2x4", "--steps", "2", "--batch-for-process", "1=4",
                           "--plan-timeout", "120"],
                          num_processes=2, devices_per_process=4, timeout_s=300)
    assert run.returncode != 0
    assert ("process 1 traced a different program: batch['inputs'] shape (4, 16) vs (8, 16) "
            "on process 0") in run.output
    assert "PlanMismatchError" in run.output
    assert "step 0 loss" not in run.output
    assert time.monotonic() - started < 280
