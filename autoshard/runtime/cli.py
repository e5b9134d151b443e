"""The ``autoshard`` command.

    autoshard zoo --list
    autoshard zoo gpt --size tiny --mesh 2x4 --steps 20
    autoshard zoo moe --size small --mesh 2x4 --hardware h100 --memory-budget 40GB \\
        --save-plan plan.json
    autoshard zoo mlp --mesh 8 --steps 20 --checkpoint-dir ckpt --checkpoint-every 5
    autoshard zoo mlp --mesh 8 --steps 40 --checkpoint-dir ckpt --resume
    autoshard launch -n 2 -- autoshard zoo gpt --mesh 2x4 --steps 10

``zoo`` plans a zoo model's train step, prints the plan, its predicted and compiled cost,
a comparison with the model's expert plans, trains a few steps on synthetic data and
checks the first step against a single-device run. Without an accelerator it simulates
as many CPU devices as the mesh has (set before JAX's backend starts). Started by
``autoshard launch`` (or with the ``AUTOSHARD_*`` variables of ``runtime.launch`` set)
it joins the multi-process run instead: every process plans the same step and feeds its
own shards, process 0 prints the tables and every process its losses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path

import typer

from autoshard.runtime.launch import ZOO_DEFAULT_MESH
from autoshard.units import format_bytes

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="autoshard: automatic sharding for JAX programs.")


class CliError(Exception):
    """Bad command-line input: reported as one line on stderr."""


DEBUG_VARIABLE = "AUTOSHARD_DEBUG"   # set to 1: as --debug


def debugging(argv: list[str] | None) -> bool:
    """Whether ``--debug`` (before the command) or ``AUTOSHARD_DEBUG=1`` asks for the
    planner's log and the traceback of an error that is not bad input."""
    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def log_to_stderr() -> None:
    """The ``autoshard`` loggers' records at DEBUG and above, on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("autoshard")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


@app.callback()
def main_callback(debug: bool = typer.Option(
        False, "--debug", help=f"log the planner's decisions and show the traceback of an "
                               f"unexpected error (or set {DEBUG_VARIABLE}=1)")):
    """autoshard: automatic sharding for JAX programs."""


# --------------------------------------------------------------------------- parsing

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> float:
    """``"40GB"`` -> 4e10, ``"512MiB"`` -> 536870912, ``"1e9"`` -> 1e9."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise CliError(f"cannot read memory size {text!r} (use e.g. 40GB, 512MiB, 1e9)")
    try:
        return float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError as e:
        raise CliError(f"cannot read memory size {text!r} (use e.g. 40GB, 512MiB, 1e9)") from e


def parse_mesh(text: str, axes: str | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"2x4"`` -> ``((2, 4), ("data", "model"))``; ``axes`` names them (comma-separated)."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError as e:
        raise CliError(f"cannot read mesh {text!r} (use e.g. 8 or 2x4)") from e
    if not shape or any(s < 1 for s in shape):
        raise CliError(f"mesh {text!r} must be positive sizes joined by 'x' (e.g. 2x4)")
    if axes:
        names = tuple(a.strip() for a in axes.split(","))
    elif len(shape) <= 2:
        names = ("data", "model")[-len(shape):] if len(shape) == 2 else ("data",)
    else:
        raise CliError(f"mesh {text!r} has {len(shape)} axes: name them with --axes")
    if len(names) != len(shape):
        raise CliError(f"--axes {axes!r} names {len(names)} axes; mesh {text!r} has "
                       f"{len(shape)}")
    if len(set(names)) != len(names) or not all(names):
        raise CliError(f"--axes {axes!r} must name each axis once (e.g. data,model)")
    return shape, names


CPU_SLOWDOWN = 1000
"""``zoo`` on CPU prices on H100s slowed 1000x, on which the tiny models weigh about as
models 1000x larger weigh on H100s (on the real ones a tiny model is all latency, and its
best plan replicates everything)."""


def cpu_hardware(mesh):
    """``zoo``'s default on CPU: H100s slowed ``CPU_SLOWDOWN`` times, the first axis of a
    multi-axis mesh between hosts (``hardware.INTER_NODE_BANDWIDTH``), the others NVLink."""
    from autoshard.target import hardware
    names = mesh.axis_names if mesh is not None else ()
    links = {name: (hardware.INTER_NODE_BANDWIDTH if i == 0 and len(names) > 1
                    else hardware.H100.bandwidth(name)) for i, name in enumerate(names)}
    hw = dataclasses.replace(hardware.H100, link_bandwidth=links) if links else hardware.H100
    return hw.slowed(CPU_SLOWDOWN)


def load_hardware(text: str | None, mesh=None):
    """A profile (``h100``, ``a100``, ... as in ``hardware.DEVICE_KINDS``), a profile slowed
    by a factor (``h100/1000``), or a JSON file of ``autoshard.Hardware`` fields. None: the
    mesh's device kind (``hardware.default_hardware``); on CPU, :func:`cpu_hardware`."""
    from autoshard.target import hardware
    if text is None:
        on_cpu = mesh is None or mesh.devices.flat[0].platform == "cpu"
        return cpu_hardware(mesh) if on_cpu else hardware.default_hardware(mesh)
    name, _, factor = text.lower().partition("/")
    if name in hardware.DEVICE_KINDS and " " not in name:
        hw = hardware.DEVICE_KINDS[name]
        try:
            return hw.slowed(float(factor)) if factor else hw
        except (ValueError, ZeroDivisionError) as e:
            raise CliError(f"cannot read hardware {text!r}: the factor after / must be a "
                           "positive number (e.g. h100/1000)") from e
    path = Path(text)
    if not path.is_file():
        profiles = ", ".join(k for k in hardware.DEVICE_KINDS if " " not in k)
        raise CliError(f"unknown hardware {text!r}: use a profile ({profiles}), a profile "
                       "slowed by a factor (h100/1000), or a JSON file of Hardware fields "
                       "(flops, hbm_bandwidth, memory, link_bandwidth, link_latency)")
    try:
        return hardware.Hardware.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CliError(f"hardware file {text}: {e}") from e


TABLE_WIDTH = 150


def hardware_phrase(text: str | None, mesh) -> str:
    """How ``zoo`` names the hardware it prices on."""
    if text is not None:
        return text
    if mesh.devices.flat[0].platform == "cpu":
        between = (f", {mesh.axis_names[0]!r} axis between hosts" if len(mesh.axis_names) > 1
                   else "")
        return (f"H100s slowed {CPU_SLOWDOWN}x{between}: a tiny model weighs on them as a big "
                "one does on H100s (--hardware h100: the real ones)")
    return f"{mesh.devices.flat[0].device_kind} (its profile in autoshard.target.hardware)"


def launched() -> bool:
    """Whether ``autoshard.runtime.launch`` (or a cluster launcher setting its variables)
    started us."""
    from autoshard.runtime.launch import ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES
    return bool(os.environ.get(ENV_COORDINATOR_ADDRESS) or os.environ.get(ENV_NUM_PROCESSES))


def check_checkpoint_flags(checkpoint_dir: Path | None, checkpoint_every: int,
                           resume: bool) -> None:
    """Bad combinations of ``--checkpoint-dir``, ``--checkpoint-every`` and ``--resume``."""
    if checkpoint_dir is None:
        if resume:
            raise CliError("--resume needs --checkpoint-dir (the directory to resume from)")
        if checkpoint_every:
            raise CliError("--checkpoint-every needs --checkpoint-dir (where to save)")
        return
    if not checkpoint_every and not resume:
        raise CliError(f"--checkpoint-dir {checkpoint_dir} saves nothing without "
                       "--checkpoint-every K (or --resume to continue from it)")
    if checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise CliError(f"--checkpoint-dir {checkpoint_dir} is not a directory")
    from autoshard.frontend import validate
    validate.directory_path("--checkpoint-dir", checkpoint_dir, create=True,
                            must_exist=resume and not checkpoint_every)


def checkpoint_start(checkpoint_dir: Path | None, resume: bool) -> int | None:
    """The latest complete checkpoint's step; refuses to write over one without --resume."""
    if checkpoint_dir is None or not checkpoint_dir.is_dir():
        return None
    from autoshard.runtime.checkpoint import latest_step
    latest = latest_step(checkpoint_dir)
    if latest is not None and not resume:
        raise CliError(f"--checkpoint-dir {checkpoint_dir} already holds checkpoints (latest "
                       f"step {latest}): add --resume to continue from it, or use an empty "
                       "directory")
    return latest


def request_cpu_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices (heeded if JAX's backend has not started yet)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def simulate_devices(count: int) -> None:
    """Ask for ``count`` CPU devices; must run before JAX's backend starts."""
    request_cpu_devices(count)
    import jax
    jax.config.update("jax_num_cpu_devices", count)


# --------------------------------------------------------------------------- views


@dataclasses.dataclass(frozen=True)
class Say:
    """Prints a run's lines on process 0 only (every process of a single-process run);
    ``quiet`` on the other processes of a multi-process run."""

    quiet: bool = False

    def __call__(self, text: str) -> None:
        if not self.quiet:
            typer.echo(text)

    def stage(self, index: int, total: int, text: str) -> float:
        self(f"[{index}/{total}] {text}")
        return time.perf_counter()


def comparison_table(rows: list[tuple[str, object]]) -> str:
    """Compiled step time, comm and memory per device of each plan; ratio auto/plan."""
    auto = rows[0][1]
    lines = [f"{'plan':<16}{'step (us)':>12}{'comm (us)':>12}{'memory/device':>16}"
             f"{'collectives':>13}{'auto/plan':>11}"]
    for name, report in rows:
        ratio = auto.total_s / report.total_s if report.total_s else float("nan")
        lines.append(f"{name:<16}{report.total_s * 1e6:>12.2f}{report.comm_s * 1e6:>12.2f}"
                     f"{format_bytes(report.memory_bytes):>16}{report.count():>13}"
                     f"{ratio:>11.2f}")
    return "\n".join(lines)


def collectives_line(report) -> str:
    """The compiled step's collectives per device by kind: how many run, bytes moved."""
    kinds = sorted({c.kind for c in report.collectives})
    parts = [f"{kind} x{report.count(kind)} ({format_bytes(report.collective_bytes(kind))})"
             for kind in kinds]
    return "      collectives per step: " + (", ".join(parts) if parts else "none")


def annotation_diff(plan, pins: dict, full: bool = False) -> list[tuple[int, str]]:
    """Where the auto spec differs from the annotated one: ``(count, line)`` per path, or
    (``full=False``) per layer pattern, ``blocks[0..11]['mlp']['fc1']['kernel']``."""
    from autoshard.frontend import specs
    from autoshard.report import viz
    groups: dict[tuple, list] = {}
    for path, pspec in pins.items():
        auto = plan.argument(path)
        wanted = specs.from_partition_spec(pspec, len(auto.shape))
        if wanted != auto.spec:
            pattern, indices = viz.index_pattern(path)
            key = (path if full else pattern, specs.spec_str(wanted), specs.spec_str(auto.spec))
            groups.setdefault(key, []).append(indices)
    return [(len(indices), f"  {viz.pattern_path(pattern, indices) if not full else pattern}: "
                           f"annotated {wanted}, auto {auto}")
            for (pattern, wanted, auto), indices in groups.items()]


def numerics_check(case, got, want) -> tuple[bool, float, str]:
    """Worst ``|got - want| / (atol + rtol |want|)`` over the outputs (pass when <= 1)."""
    import jax
    import numpy as np
    worst, where = 0.0, ""
    flat_got = jax.tree_util.tree_flatten_with_path(jax.device_get(got))[0]
    for (path, a), b in zip(flat_got, jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        ratio = float(np.max(np.abs(a - b) / (case.atol + case.rtol * np.abs(b)), initial=0))
        if ratio > worst:
            worst, where = ratio, jax.tree_util.keystr(path)
    return worst <= 1.0, worst, where


# --------------------------------------------------------------------------- zoo


def list_models() -> None:
    from autoshard.zoo import models
    for name in models.names():
        typer.echo(f"{name:<10} sizes: {', '.join(models.get(name).sizes)}")


def start_backend(count: int):
    """Join the launcher's multi-process run, or simulate ``count`` devices; returns ProcessInfo."""
    from autoshard.runtime.launch import ENV_DEVICES_PER_PROCESS, ENV_NUM_PROCESSES
    alone = os.environ.get(ENV_NUM_PROCESSES, "1") == "1"
    if launched():
        if alone and not os.environ.get(ENV_DEVICES_PER_PROCESS):
            simulate_devices(count)     # one process: it holds the whole mesh
        from autoshard.runtime import distributed
        return distributed.initialize()
    simulate_devices(count)
    from autoshard.runtime.distributed import ProcessInfo
    return ProcessInfo(0, 1, None)


def run_zoo(model: str, size: str, mesh_text: str, steps: int, hardware: str | None,
            memory_budget: str | None, save_plan: Path | None, axes: str | None,
            respect_annotations: bool, seed: int, checkpoint_dir: Path | None = None,
            checkpoint_every: int = 0, resume: bool = False,
            microbatches: str | None = None, pipeline: str | None = None,
            full: bool = False, repeats: str | None = None, target: str | None = None,
            compile_only: bool = False) -> None:
    shape, names = parse_mesh(mesh_text, axes)
    compile_only = compile_only or target is not None   # a GPU target runs nothing here
    count = math.prod(shape)
    budget = parse_bytes(memory_budget) if memory_budget else None
    if budget is not None and not budget > 0:
        raise CliError(f"--memory-budget {memory_budget!r} must be positive")
    check_checkpoint_flags(checkpoint_dir, checkpoint_every, resume)
    if repeats is not None and pipeline is None:
        raise CliError("--repeats sets a pipeline's schedule: pass --pipeline too")
    counts = {name: parse_count(f"--{name}", text) for name, text in
              (("microbatches", microbatches), ("repeats", repeats)) if text is not None}
    if save_plan is not None:
        from autoshard.frontend import validate
        validate.writable_file("--save-plan", save_plan)
    from autoshard.zoo import models
    entry = models.get(model)            # unknown names fail before any work
    if size not in entry.sizes:
        raise CliError(f"model {model!r} has no size {size!r}; sizes: {', '.join(entry.sizes)}")
    hw = load_hardware(hardware)         # read (and checked) before the backend starts
    if target is not None and launched():
        raise CliError("--target compiles for GPUs this machine need not have: run it "
                       "without autoshard launch")
    info = start_backend(1 if target is not None else count)
    import jax

    import autoshard
    import autoshard.report.hlo_report
    from autoshard.runtime import distributed, train
    from autoshard.zoo import experts, models

    multi = jax.process_count() > 1
    say = Say(quiet=not info.is_primary)
    if target is None and len(jax.devices()) != count:
        raise CliError(f"mesh {mesh_text} needs {count} devices; {jax.devices()[0].platform} "
                       f"has {len(jax.devices())}"
                       + (f" over {jax.process_count()} processes" if multi else ""))
    mesh = (autoshard.target_mesh(target, shape, names) if target is not None
            else autoshard.make_mesh(shape, names))
    if hardware is None:   # the default depends on the mesh's devices
        hw = load_hardware(None, mesh)
    latest = checkpoint_start(checkpoint_dir, resume)
    if multi:
        typer.echo(f"process {info.process_id}/{info.num_processes}: "
                   f"{jax.local_device_count()} local of {jax.device_count()} devices")
    total = 4 if compile_only else 6
    t = say.stage(1, total, f"building {model}/{size} (seed {seed})"
                  + (", abstract: shapes and dtypes only" if compile_only else ""))
    case = entry.train_case(size, seed=seed, abstract=compile_only)
    say(f"      {len(jax.tree.leaves(case.state))} state arrays, mesh "
        f"{dict(zip(names, shape))} on {mesh.devices.flat[0].device_kind}"
        + (f" ({jax.process_count()} processes)" if multi else "")
        + f", {time.perf_counter() - t:.1f} s")
    say(f"      priced on {hardware_phrase(hardware, mesh)}")

    pins = case.annotation_pins(mesh) if case.annotations else {}
    t = say.stage(2, total, "planning (trace, cost, solve)"
              + (" with the model's annotations pinned" if respect_annotations and pins else "")
              + (", agreed across processes" if multi else ""))
    plan_kwargs = dict(mesh=mesh, hardware=hw, memory_budget=budget,
                       donate_argnums=case.donate_argnums,
                       pins=pins if respect_annotations else None)
    plan_kwargs.update(counts)
    if pipeline is not None:
        plan_kwargs["pipeline"] = pipeline
    if multi:      # the state must come out as it went in; every process takes process 0's plan
        plan = distributed.plan_train_step(case.train_step, *case.args, **plan_kwargs)
    else:
        plan = autoshard.plan(case.train_step, *case.args, **plan_kwargs)
    s = plan.stats
    say(f"      trace {s.trace_s or 0:.1f} s, cost {s.cost_s or 0:.1f} s, "
        f"solve {s.solve_s or 0:.1f} s ({s.status or ''})")
    say(plan.summary_text(width=TABLE_WIDTH, full=full))
    if plan.pipeline is not None:
        from autoshard.report import viz
        say(viz.schedule(plan).text())
    if pins and not respect_annotations:
        diff = annotation_diff(plan, pins, full=full)
        differ = sum(count for count, _ in diff)
        say(f"annotated vs auto plan: {differ} of {len(pins)} annotated params "
            "differ" + (":" if diff else ""))
        for _, line in diff:
            say(line)
    if save_plan and info.is_primary:
        save_plan.write_text(plan.to_json())
        say(f"plan saved to {save_plan}")

    t = say.stage(3, total, "compiling the plan: predicted vs compiled (per device)")
    abstract_args = case.abstract_args()
    report = plan.report(*abstract_args)
    say(str(report))
    if compile_only:
        say(collectives_line(report.compiled))

    t = say.stage(4, total, f"compiling expert plans: {', '.join(case.experts)}")
    rows = [("auto", report.compiled)]
    for name in case.experts:
        compiled = experts.compile_expert(case, mesh, name, abstract_args)
        rows.append((name, autoshard.report.hlo_report.hlo_report(compiled, hw, mesh)))
    say(comparison_table(rows))
    if compile_only:
        say(f"      compiled by XLA:{mesh.devices.flat[0].platform.upper()} without running: "
            "step times are the compiled program priced on the hardware above, memory is "
            "XLA's buffer assignment")
        return

    t = say.stage(5, total, f"training {steps} steps on synthetic data"
              + (f", checkpoints every {checkpoint_every} in {checkpoint_dir}"
                 if checkpoint_every else ""))
    if resume and latest is None:
        say(f"      no checkpoint in {checkpoint_dir} yet: starting from step 0")
    log = lambda line: typer.echo("      " + line)      # noqa: E731  (every process)
    loop = dict(checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
                checkpoint_every=checkpoint_every, resume=resume, log=log)
    if multi:      # each process fills only the shards (and batch rows) its devices hold
        state_shardings, batch_shardings = plan.in_shardings
        jitted = plan.jit()

        def step_fn(state, batch):
            state, loss = jitted(state, distributed.put_batch(batch, batch_shardings))
            return state, distributed.to_host(loss)

        state = distributed.put(case.state, state_shardings)
        losses = train.run(case, step_fn, state, steps=steps, **loop)
    else:
        reference = jax.device_get(jax.jit(case.train_step)(*case.args))
        first = jax.device_get(plan.jit(donate_argnums=())(*case.args))
        state = jax.tree.map(lambda x: x.copy(), case.state)
        losses = train.run(case, plan.jit(), state, steps=steps,
                           shardings=plan.in_shardings, **loop)
    if losses:
        say(f"      loss {losses[0]:.4f} -> {losses[-1]:.4f} in "
            f"{time.perf_counter() - t:.1f} s")
    elif resume and latest is not None:
        say(f"      nothing to run: the checkpoint is at step {latest}, --steps {steps}")

    say.stage(6, total, f"numerics of step 0 vs one device (rtol {case.rtol:g}, "
                    f"atol {case.atol:g})")
    if multi:
        say("      skipped: a multi-process run has no single-device reference")
        return
    ok, worst, where = numerics_check(case, first, reference)
    say(f"      {'PASS' if ok else 'FAIL'}: worst error {worst:.3g} of tolerance"
        + (f" at {where}" if where else ""))
    if not ok:
        raise typer.Exit(1)


@app.command()
def zoo(
    model: str | None = typer.Argument(None, help="zoo model, e.g. gpt (see --list)"),
    size: str = typer.Option("tiny", help="size name: tiny, small, large, ..."),
    mesh: str = typer.Option(ZOO_DEFAULT_MESH, help="mesh shape, e.g. 8, 2x4 or 3x3 (on CPU, "
                                                     "as many simulated devices)"),
    steps: int = typer.Option(20, min=0, help="training steps to run (the last is step "
                                              "steps-1, also when resuming)"),
    list_models_: bool = typer.Option(False, "--list", help="list models and sizes"),
    hardware: str | None = typer.Option(
        None, help="a profile (h100, h200, a100, ...), one slowed by a factor (h100/1000), or "
                   "a JSON file of Hardware fields; default: the GPU's kind, on CPU h100/1000"),
    memory_budget: str | None = typer.Option(None, help="bytes per device, e.g. 40GB"),
    save_plan: Path | None = typer.Option(None, help="write the plan as JSON here"),
    axes: str | None = typer.Option(None, help="mesh axis names, e.g. data,model"),
    respect_annotations: bool = typer.Option(
        False, help="pin the model's nnx.with_partitioning annotations"),
    seed: int = typer.Option(0, help="seed of the initial params and the data"),
    full: bool = typer.Option(False, "--full", help="list every array in the plan table "
                                                   "(default: one row per layer pattern)"),
    checkpoint_dir: Path | None = typer.Option(
        None, help="save sharded checkpoints of the train state here"),
    checkpoint_every: int = typer.Option(
        0, min=0, help="save a checkpoint after every K steps (0: never)"),
    resume: bool = typer.Option(
        False, "--resume", help="continue from the latest complete checkpoint in "
                                "--checkpoint-dir"),
    microbatches: str | None = typer.Option(
        None, help="gradient accumulation: a count K or 'auto' (fastest K within the budget)"),
    pipeline: str | None = typer.Option(
        None, help="run the layer stack as a pipeline over this mesh axis, or 'auto' "
                   "(each axis, GPipe or circular, or none)"),
    repeats: str | None = typer.Option(
        None, help="the pipeline's schedule: 1 (GPipe), V >= 2 (circular, V passes through "
                   "the stages), or 'auto'"),
    target: str | None = typer.Option(
        None, help="plan and compile for GPUs of this kind (h100, h200, a100) that this "
                   "machine need not have, hosts of 8; implies --compile-only"),
    compile_only: bool = typer.Option(
        False, "--compile-only", help="plan and compile, on abstract arguments; no training"),
):
    """Plan, compare, train and check a zoo model on a (simulated) device mesh."""
    if list_models_:
        list_models()
        return
    if model is None:
        raise CliError("name a model (see autoshard zoo --list)")
    run_zoo(model, size, mesh, steps, hardware, memory_budget, save_plan, axes,
            respect_annotations, seed, checkpoint_dir, checkpoint_every, resume,
            microbatches, pipeline, full, repeats, target, compile_only)


def parse_count(flag: str, text: str) -> int | str:
    """A flag taking a positive count or ``auto``."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise CliError(f"{flag} takes a positive count or 'auto', not {text!r}")
    return int(text)


@app.command(context_settings={"allow_interspersed_args": False,
                               "ignore_unknown_options": True})
def launch(
    command: list[str] | None = typer.Argument(
        None, help="-- then the command every process runs"),
    num_processes: int = typer.Option(..., "-n", "--num-processes", min=1,
                                      help="processes to start"),
    devices_per_process: int | None = typer.Option(
        None, min=1, help="simulated CPU devices per process (default for a zoo run: its "
                          "mesh size / N)"),
    platform: str = typer.Option(
        "cpu", help="JAX_PLATFORMS for the processes ('cpu'; '' leaves it unset)"),
    port: int | None = typer.Option(None, help="coordinator port (default: a free one)"),
    timeout: float | None = typer.Option(None, help="seconds before terminating all"),
):
    """Run a command as N processes of one jax.distributed run on this machine.

    Same as python -m autoshard.runtime.launch: each output line is prefixed with its process's
    number; when one process fails the others are terminated and its exit code returned.
    """
    from autoshard.runtime import launch as launcher
    command = list(command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("give the command to run after --, e.g. autoshard launch -n 2 "
                       "-- autoshard zoo gpt --mesh 2x4")
    return launcher.launch(command, num_processes, devices_per_process=devices_per_process,
                           platform=platform or None, port=port, timeout_s=timeout)


def program_makers() -> dict:
    """The functions of ``autoshard.testing.programs`` that make a Program from defaults."""
    import inspect

    from autoshard.testing import programs
    makers = {name: getattr(programs, name) for name in programs.__all__}
    return {name: f for name, f in makers.items() if callable(f) and
            inspect.signature(f).return_annotation in ("Program", programs.Program)}


@app.command()
def view(
    program: str = typer.Argument("transformer_train_step",
                                  help="a function of autoshard.testing.programs"),
    mesh: str = typer.Option("2x4", help="mesh shape, e.g. 2x4 (data x model)"),
    axes: str | None = typer.Option(None, help="mesh axis names, e.g. data,model"),
    out: Path | None = typer.Option(None, help="folder to save PNG figures into"),
):
    """Plan a test program and print its table, cost breakdown and memory; with --out,
    save the figures. Same as python -m autoshard.report.viz."""
    shape, names = parse_mesh(mesh, axes)
    request_cpu_devices(max(8, math.prod(shape)))
    makers = program_makers()
    if program not in makers:
        raise CliError(f"no program {program!r}; try one of {', '.join(makers)}")
    made = makers[program]()
    import autoshard
    from autoshard.report import viz
    plan = autoshard.plan(made.fn, *made.args, mesh=autoshard.make_mesh(shape, names))
    views = {"table": viz.table(plan), "breakdown": viz.breakdown(plan),
             "memory": viz.memory(plan)}
    for shown in views.values():
        typer.echo(shown.text(TABLE_WIDTH))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("breakdown", "memory"):
            views[name].plot().savefig(out / f"{name}.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: bad input ends with one line on stderr and exit status 2."""
    from autoshard.errors import AutoshardError
    from autoshard.extras import MissingExtraError
    debug = debugging(argv)
    if debug:
        log_to_stderr()
    try:
        result = app(args=argv, standalone_mode=False)
        return result if isinstance(result, int) else 0
    except (CliError, AutoshardError, MissingExtraError) as e:
        typer.echo(f"autoshard: error: {e}", err=True)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        typer.echo("autoshard: aborted", err=True)
        return 1
    except typer.TyperException as e:     # usage errors: bad option values, unknown options
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        if message.strip():             # (empty after the help a bare command prints)
            typer.echo(f"autoshard: error: {' '.join(message.split())}", err=True)
        return 2
    except OSError as e:                  # a file or directory that cannot be read or written
        typer.echo(f"autoshard: error: {e}", err=True)
        return 2
    except Exception as e:                # anything else: one line, the traceback with --debug
        if debug:
            traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = "" if debug else f" (--debug or {DEBUG_VARIABLE}=1 shows the traceback)"
        typer.echo(f"autoshard: error: {type(e).__name__}: {first}{hint}", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
