"""The ``autoshard`` command, run in subprocesses (each sets its own simulated devices)."""

import os
import re
import subprocess
import sys

import pytest

from autoshard.runtime import cli


def autoshard(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "autoshard.runtime.cli", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_list():
    result = autoshard("zoo", "--list")
    assert result.returncode == 0, result.stderr
    assert "gpt " in result.stdout and "moe " in result.stdout and "tiny" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["zoo", "bert"], "unknown model 'bert'"),
    (["zoo", "gpt", "--size", "huge"], "has no size 'huge'"),
    (["zoo", "gpt", "--mesh", "2x"], "cannot read mesh"),
    (["zoo", "gpt", "--mesh", "2x4", "--axes", "a,b,c"], "names 3 axes"),
    (["zoo", "gpt", "--steps", "abc"], "--steps"),
    (["zoo", "gpt", "--memory-budget", "1KB", "--steps", "0"], "no plan fits the memory budget"),
    (["zoo", "gpt", "--hardware", "tpu9"], "unknown hardware"),
])
@pytest.mark.slow
def test_bad_input_is_one_line(args, message):
    result = autoshard(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_parsers():
    assert cli.parse_bytes("40GB") == 40e9
    assert cli.parse_bytes("512MiB") == 512 * 2 ** 20
    assert cli.parse_mesh("2x4", None) == ((2, 4), ("data", "model"))
    assert cli.parse_mesh("8", None) == ((8,), ("data",))
    assert cli.parse_mesh("2x2x2", "a,b,c") == ((2, 2, 2), ("a", "b", "c"))


@pytest.mark.slow
def test_tiny_run(tmp_path):
    plan_file = tmp_path / "plan.json"
    result = autoshard("zoo", "mlp", "--size", "tiny", "--mesh", "2x4", "--steps", "3",
                       "--save-plan", str(plan_file))
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for text in ("[2/6] planning", "autoshard plan on mesh", "predicted", "data_parallel",
                 "megatron", "step     2  loss", "PASS"):
        assert text in out, out
    assert plan_file.read_text().startswith("{")


@pytest.mark.slow
def test_respect_annotations_pins_megatron_layout():
    result = autoshard("zoo", "gpt", "--mesh", "8", "--steps", "1", "--respect-annotations")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "with the model's annotations pinned" in result.stdout
    assert "PASS" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-dir", "ckpt"], "saves nothing without --checkpoint-every"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
])
def test_bad_checkpoint_flags_are_one_line(args, message):
    result = autoshard("zoo", "mlp", "--steps", "1", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def losses_by_step(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"^\s*step\s+(\d+)\s+loss\s+(\S+)$", out, re.MULTILINE)}


@pytest.mark.slow
def test_checkpoint_and_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = ("zoo", "mlp", "--size", "tiny", "--mesh", "8", "--checkpoint-dir", ckpt)
    first = autoshard(*common, "--steps", "4", "--checkpoint-every", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(losses_by_step(first.stdout)) == [0, 1, 2, 3], first.stdout
    assert sorted(os.listdir(ckpt)) == ["2", "4"]

    again = autoshard(*common, "--steps", "6", "--checkpoint-every", "2")   # no --resume
    assert again.returncode == 2 and "add --resume" in again.stderr, again.stderr

    resumed = autoshard(*common, "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from checkpoint 4 (next step 4)" in resumed.stdout, resumed.stdout
    assert sorted(losses_by_step(resumed.stdout)) == [4, 5], resumed.stdout
    assert "PASS" in resumed.stdout

    # the resumed steps are the uninterrupted run's steps: same state, same batches
    whole = autoshard("zoo", "mlp", "--size", "tiny", "--mesh", "8", "--steps", "6")
    assert whole.returncode == 0, whole.stderr[-2000:]
    want = losses_by_step(whole.stdout)
    assert losses_by_step(first.stdout) == {k: want[k] for k in range(4)}
    assert losses_by_step(resumed.stdout) == {k: want[k] for k in (4, 5)}, (resumed.stdout,
                                                                            whole.stdout)


def test_launch_needs_a_command():
    result = autoshard("launch", "-n", "2")
    assert result.returncode == 2
    assert "give the command to run after --" in result.stderr.strip().splitlines()[0]


@pytest.mark.slow
def test_launch_zoo_two_processes():
    zoo = [sys.executable, "-m", "autoshard.runtime.cli", "zoo", "gpt", "--size", "tiny",
           "--mesh", "2x4", "--steps", "3"]
    result = autoshard("launch", "-n", "2", "--", *zoo)        # devices: the mesh's 8 / 2
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    out = result.stdout
    assert "[launch] 4 CPU devices per process for mesh 2x4 over 2 processes" in out
    for pid in (0, 1):
        assert f"[p{pid}] process {pid}/2: 4 local of 8 devices" in out, out[-3000:]
        prefix = f"[p{pid}]"
        steps = losses_by_step("\n".join(line[len(prefix):] for line in out.splitlines()
                                         if line.startswith(prefix)))
        assert sorted(steps) == [0, 1, 2], out[-3000:]
    assert "[p0] plan " in out and "[p1] plan " not in out     # tables on process 0 only
    assert "[p0]       skipped: a multi-process run" in out


def lines_before_training(out: str) -> list[str]:
    return out[:out.index("[5/6] training")].splitlines()


@pytest.mark.slow
def test_main_job_shows_a_split_plan_in_a_short_table():
    result = autoshard("zoo", "gpt", "--size", "tiny", "--mesh", "2x4", "--steps", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    head = lines_before_training(result.stdout)
    assert len(head) <= 60, "\n".join(head)
    rows = [line for line in head if line.startswith("│")]
    assert any("['blocks'][0..1]['mlp']['fc1']['kernel']" in r for r in rows), "\n".join(rows)
    assert any("model" in r.split("│")[4] for r in rows), "\n".join(rows)   # spec column
    assert " +4 opt " in "\n".join(rows)       # Adam's mu and nu folded into their parameter
    assert "PASS" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mesh,splits", [("3x3", False), ("1x1", False), ("16", True)])
def test_any_mesh_shape_plans_and_runs(tmp_path, mesh, splits):
    plan_file = tmp_path / "plan.json"
    result = autoshard("zoo", "gpt", "--size", "tiny", "--mesh", mesh, "--steps", "1",
                       "--save-plan", str(plan_file))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "PASS" in result.stdout
    import json
    args = json.loads(plan_file.read_text())["arguments"]
    sharded = [a for a in args if any(a["spec"])]
    assert bool(sharded) == splits, sharded[:3]     # no axis of 3x3 divides a dim: replicated


@pytest.mark.slow
def test_full_flag_lists_every_array():
    result = autoshard("zoo", "mlp", "--size", "tiny", "--mesh", "2x4", "--steps", "0",
                       "--full")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in lines_before_training(result.stdout) if line.startswith("│")]
    assert any("['hidden'][0]" in r for r in rows) and not any(".." in r for r in rows)


def test_launch_sizes_devices_from_the_zoo_mesh():
    from autoshard.runtime import launch
    zoo = ["autoshard", "zoo", "gpt", "--size", "tiny"]
    assert launch.default_devices_per_process(zoo + ["--mesh", "2x4"], 2)[0] == 4
    assert launch.default_devices_per_process(zoo + ["--mesh=16"], 4)[0] == 4
    assert launch.default_devices_per_process(zoo, 2)[0] == 4             # zoo's default 2x4
    python_m = [sys.executable, "-m", "autoshard.runtime.cli", "zoo", "mlp", "--mesh", "3x3"]
    assert launch.default_devices_per_process(python_m, 3)[0] == 3
    count, note = launch.default_devices_per_process(python_m, 2)
    assert count is None and "--devices-per-process" in note and "\n" not in note
    count, note = launch.default_devices_per_process(["python", "train.py"], 2)
    assert count is None and "pass --devices-per-process K" in note


def test_missing_extra_is_one_line():
    code = ("import sys; sys.modules['flax'] = None; from autoshard.runtime.cli import main; "
            "sys.exit(main(['zoo', 'gpt', '--steps', '0']))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "autoshard[zoo]"' in lines[0], result.stderr


def test_debug_shows_the_traceback_of_an_unexpected_error(monkeypatch, capsys):
    from autoshard.runtime import cli

    def broken():
        raise RuntimeError("deep inside")
    monkeypatch.setattr(cli, "list_models", broken)
    monkeypatch.delenv(cli.DEBUG_VARIABLE, raising=False)
    assert cli.main(["zoo", "--list"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: deep inside" in err and "--debug" in err and "Traceback" not in err
    assert cli.main(["--debug", "zoo", "--list"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err
    monkeypatch.setenv(cli.DEBUG_VARIABLE, "1")
    assert cli.main(["zoo", "--list"]) == 1
    assert "Traceback" in capsys.readouterr().err
