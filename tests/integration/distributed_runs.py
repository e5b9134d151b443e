"""Runs of tests/integration/distributed_driver.py in subprocesses, shared by the test modules.

Each run gets its own device count (set before JAX starts in the child), so the pytest
process's 8 simulated devices never leak into it. The uninterrupted two-process reference
run is made once per pytest process and reused.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "tests", "integration", "distributed_driver.py")
RUN_TIMEOUT_S = 420
STEPS = 10
CHECKPOINT_EVERY = 5
STEP_LINE = re.compile(r"^\[p(\d+)\] step (\d+) loss (\S+)$|^step (\d+) loss (\S+)$")


@dataclasses.dataclass
class Run:
    returncode: int
    output: str
    result: dict | None
    directory: str

    def losses(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.result or {}).get("losses", {}).items()}

    def printed_steps(self, process_id: int = 0) -> list[int]:
        """Step indices a process printed, in order (from its prefixed output)."""
        steps = []
        for line in self.output.splitlines():
            m = STEP_LINE.match(line)
            if m and m.group(1) is not None and int(m.group(1)) == process_id:
                steps.append(int(m.group(2)))
            elif m and m.group(4) is not None:
                steps.append(int(m.group(4)))
        return steps


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_driver(directory: str, args: list[str], *, num_processes: int = 1,
               devices_per_process: int = 8, timeout_s: float = RUN_TIMEOUT_S) -> Run:
    """Run the driver alone or under the launcher; its JSON result lands in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    out = os.path.join(directory, "result.json")
    driver = [sys.executable, DRIVER, *args, "--out", out]
    env = child_env()
    if num_processes == 1:
        env["AUTOSHARD_DEVICES_PER_PROCESS"] = str(devices_per_process)
        command = driver
    else:
        command = [sys.executable, "-m", "autoshard.runtime.launch", "-n", str(num_processes),
                   "--devices-per-process", str(devices_per_process),
                   "--timeout", str(timeout_s - 20), "--", *driver]
    proc = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    result = None
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    return Run(proc.returncode, proc.stdout, result, directory)


@functools.cache
def scratch_root() -> str:
    root = tempfile.mkdtemp(prefix="autoshard-distributed-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def reference_run() -> Run:
    """Two processes x 4 devices on a 2x4 mesh, 10 steps, checkpoints at 5 and 10,
    the state after 5 steps dumped to ``state5.npz``."""
    directory = os.path.join(scratch_root(), "reference")
    run = run_driver(directory, [
        "--mesh", "2x4", "--steps", str(STEPS), "--checkpoint-dir",
        os.path.join(directory, "ckpt"), "--checkpoint-every", str(CHECKPOINT_EVERY),
        "--dump-state-at", "5", "--dump-path", os.path.join(directory, "state5.npz")],
        num_processes=2, devices_per_process=4)
    assert run.returncode == 0, run.output[-4000:]
    return run


def load_npz(path: str) -> dict:
    import numpy as np
    with np.load(path) as data:
        return {k: data[k] for k in data.files}
