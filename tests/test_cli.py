"""The ``autoshard`` command, run in subprocesses (each sets its own simulated devices)."""

import os
import subprocess
import sys

import pytest

from autoshard import cli


def autoshard(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


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
