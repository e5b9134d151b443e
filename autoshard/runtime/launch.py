"""Start N processes of one command on this machine as one ``jax.distributed`` run.

    python -m autoshard.runtime.launch -n 2 --devices-per-process 4 -- python train.py --steps 20

Each process gets ``AUTOSHARD_COORDINATOR_ADDRESS`` (a free local port),
``AUTOSHARD_NUM_PROCESSES``, ``AUTOSHARD_PROCESS_ID`` and
``AUTOSHARD_DEVICES_PER_PROCESS``, which :func:`autoshard.runtime.distributed.initialize` reads,
and ``JAX_PLATFORMS=cpu`` with gloo collectives unless ``--platform`` says otherwise.
Output lines are prefixed ``[p0]``, ``[p1]``, ...; when one process fails the others
are terminated and the launcher exits with the failing process's code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# The variables autoshard.runtime.distributed.initialize() reads (this module imports no jax).
ENV_COORDINATOR_ADDRESS = "AUTOSHARD_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "AUTOSHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTOSHARD_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "AUTOSHARD_DEVICES_PER_PROCESS"

ZOO_DEFAULT_MESH = "2x4"      # autoshard zoo's --mesh default
TERMINATE_GRACE_S = 5.0
POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def process_env(process_id: int, num_processes: int, coordinator_address: str, *,
                devices_per_process: int | None, platform: str | None,
                base: dict | None = None) -> dict:
    """The environment of process ``process_id``.

    Example::

        env = process_env(1, 2, "localhost:12345", devices_per_process=4, platform="cpu")
        env["AUTOSHARD_PROCESS_ID"]   # '1'
    """
    env = dict(os.environ if base is None else base)
    env[ENV_COORDINATOR_ADDRESS] = coordinator_address
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_process is not None:
        env[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
    if platform:
        env["JAX_PLATFORMS"] = platform
    if platform == "cpu":
        env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    return env


def zoo_mesh(command: Sequence[str]) -> str | None:
    """The ``--mesh`` of an ``autoshard zoo`` command (its default when not given); None
    when ``command`` is not a zoo run."""
    tokens = list(command)
    for i, token in enumerate(tokens[1:], start=1):
        before = os.path.basename(tokens[i - 1])
        if token == "zoo" and before in ("autoshard", "autoshard.runtime.cli"):
            rest = tokens[i + 1:]
            for j, arg in enumerate(rest):
                if arg == "--mesh" and j + 1 < len(rest):
                    return rest[j + 1]
                if arg.startswith("--mesh="):
                    return arg.split("=", 1)[1]
            return ZOO_DEFAULT_MESH
    return None


def default_devices_per_process(command: Sequence[str],
                                num_processes: int) -> tuple[int | None, str]:
    """CPU devices per process when ``--devices-per-process`` is not given, and a line to
    say about it: a zoo run's mesh size / ``num_processes``; otherwise None (JAX's one CPU
    device each) and what to pass for more, which the launcher says if the run fails.

    Example::

        default_devices_per_process(["autoshard", "zoo", "gpt", "--mesh", "2x4"], 2)   # (4, ...)
    """
    mesh = zoo_mesh(command)
    if mesh is None:
        return None, ("[launch] each process has 1 CPU device; pass --devices-per-process K "
                      "for K simulated devices each")
    try:
        count = math.prod(int(n) for n in mesh.lower().split("x"))
    except ValueError:
        return None, ""            # zoo itself reports the unreadable mesh
    if count % num_processes:
        return None, (f"[launch] mesh {mesh} ({count} devices) does not split evenly over "
                      f"{num_processes} processes; pass --devices-per-process K")
    per_process = count // num_processes
    return per_process, (f"[launch] {per_process} CPU devices per process for mesh {mesh} "
                         f"over {num_processes} processes")


@dataclasses.dataclass
class Child:
    process_id: int
    popen: subprocess.Popen
    reader: threading.Thread


def _stream(prefix: str, pipe, out, lock: threading.Lock) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    pipe.close()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start(command: Sequence[str], process_id: int, env: dict, out, lock) -> Child:
    popen = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    reader = threading.Thread(target=_stream, args=(f"[p{process_id}] ", popen.stdout, out, lock),
                              daemon=True)
    reader.start()
    return Child(process_id, popen, reader)


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(children: Sequence[Child], grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM every running child's process group, then SIGKILL after ``grace_s``."""
    running = [c for c in children if c.popen.poll() is None]
    for c in running:
        _signal_group(c, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in running:
        try:
            c.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(c, signal.SIGKILL)
            c.popen.wait()


def check_command(command: Sequence[str], num_processes: int,
                  devices_per_process: int | None, timeout_s: float | None) -> None:
    """``LaunchError`` for what would fail to start: no command, one not found or not
    executable, or process and device counts that are not positive."""
    import numbers
    import shutil

    from autoshard.errors import LaunchError
    from autoshard.frontend import validate
    for name, value in (("num_processes", num_processes),
                        ("devices_per_process", devices_per_process)):
        if value is None and name == "devices_per_process":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise LaunchError(f"{name} must be a positive int, got {value!r}")
    if timeout_s is not None:
        validate.number("timeout", timeout_s, positive=True, error=LaunchError)
    if isinstance(command, str) or not command or not all(isinstance(c, str) for c in command):
        raise LaunchError(f"the command to launch must be a non-empty list of strs, got "
                          f"{command!r}")
    if shutil.which(command[0]) is None:
        raise LaunchError(f"cannot start {command[0]!r}: no such executable (not found on "
                          "PATH, or not executable)")


def launch(command: Sequence[str], num_processes: int, *, devices_per_process: int | None = None,
           platform: str | None = "cpu", host: str = "localhost", port: int | None = None,
           timeout_s: float | None = None, out=None) -> int:
    """Run ``command`` as ``num_processes`` processes of one run; returns the exit code.

    0 when every process exits 0; otherwise the first failure's code (or 124 on
    ``timeout_s``), after terminating the processes still running. On CPU without
    ``devices_per_process``, a zoo run gets its mesh size / ``num_processes`` devices each
    (:func:`default_devices_per_process`).

    Example::

        code = launch(["python", "train.py"], 2, devices_per_process=4)
    """
    check_command(command, num_processes, devices_per_process, timeout_s)
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    hint = ""
    if devices_per_process is None and platform == "cpu":
        devices_per_process, note = default_devices_per_process(command, num_processes)
        if devices_per_process is not None:
            out.write(note + "\n")
            out.flush()
        else:
            hint = note        # said if the run fails (a mesh wanting more devices, say)
    coordinator = f"{host}:{port or free_port()}"
    children = [_start(command, pid, process_env(pid, num_processes, coordinator,
                                                 devices_per_process=devices_per_process,
                                                 platform=platform), out, lock)
                for pid in range(num_processes)]
    code = _wait(children, timeout_s, out, lock)
    for c in children:
        c.reader.join(timeout=2.0)
    if code != 0 and hint:
        out.write(hint + "\n")
        out.flush()
    return code


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _wait(children: Sequence[Child], timeout_s: float | None, out, lock) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while True:
            codes = [c.popen.poll() for c in children]
            failed = [(c, rc) for c, rc in zip(children, codes) if rc not in (None, 0)]
            if failed:
                child, rc = failed[0]
                with lock:
                    out.write(f"[launch] process {child.process_id} exited with code {rc}; "
                              "terminating the others\n")
                    out.flush()
                terminate(children)
                return rc if rc > 0 else 128 - rc
            if all(rc == 0 for rc in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                with lock:
                    out.write(f"[launch] timed out after {timeout_s:g} s; terminating\n")
                    out.flush()
                terminate(children)
                return 124
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        terminate(children)
        return 130


if __name__ == "__main__":   # python -m autoshard.runtime.launch: ``autoshard launch``
    from autoshard.runtime.cli import main
    sys.exit(main(["launch", *sys.argv[1:]]))
