"""The ``autoshard`` command.

    autoshard zoo --list
    autoshard zoo gpt --size tiny --mesh 2x4 --steps 20
    autoshard zoo moe --size small --mesh 2x4 --hardware h100 --memory-budget 40GB \\
        --save-plan plan.json

``zoo`` plans a zoo model's train step, prints the plan, its predicted and compiled cost,
a comparison with the model's expert plans, trains a few steps on synthetic data and
checks the first step against a single-device run. Without an accelerator it simulates
as many CPU devices as the mesh has (set before JAX's backend starts).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="autoshard: automatic sharding for JAX programs.")


class CliError(Exception):
    """Bad command-line input: reported as one line on stderr."""


@app.callback()
def main_callback():
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
    except ValueError:
        raise CliError(f"cannot read memory size {text!r} (use e.g. 40GB, 512MiB, 1e9)") from None


def parse_mesh(text: str, axes: str | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"2x4"`` -> ``((2, 4), ("data", "model"))``; ``axes`` names them (comma-separated)."""
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise CliError(f"cannot read mesh {text!r} (use e.g. 8 or 2x4)") from None
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
    return shape, names


def load_hardware(text: str | None):
    """A profile name (``h100``) or a JSON file of ``autoshard.Hardware`` fields."""
    import autoshard
    if text is None or text.lower() == "h100":
        return autoshard.H100
    path = Path(text)
    if not path.is_file():
        raise CliError(f"unknown hardware {text!r}: use h100 or a JSON file of Hardware "
                       "fields (flops, hbm_bandwidth, memory, link_bandwidth, link_latency)")
    try:
        return autoshard.Hardware.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CliError(f"hardware file {text}: {e}") from None


def simulate_devices(count: int) -> None:
    """Ask for ``count`` CPU devices; must run before JAX's backend starts."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    import jax
    jax.config.update("jax_num_cpu_devices", count)


# --------------------------------------------------------------------------- views


def stage(index: int, total: int, text: str) -> float:
    typer.echo(f"[{index}/{total}] {text}")
    return time.perf_counter()


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def comparison_table(rows: list[tuple[str, object]]) -> str:
    """Compiled step time, comm and memory per device of each plan; ratio auto/plan."""
    auto = rows[0][1]
    lines = [f"{'plan':<16}{'step (us)':>12}{'comm (us)':>12}{'memory/device':>16}"
             f"{'collectives':>13}{'auto/plan':>11}"]
    for name, report in rows:
        ratio = auto.total_s / report.total_s if report.total_s else float("nan")
        lines.append(f"{name:<16}{report.total_s * 1e6:>12.2f}{report.comm_s * 1e6:>12.2f}"
                     f"{human_bytes(report.memory_bytes):>16}{report.count():>13}"
                     f"{ratio:>11.2f}")
    return "\n".join(lines)


def annotation_diff(plan, pins: dict) -> list[str]:
    """Per annotated path whose auto spec differs: ``path: annotated -> auto``."""
    from autoshard import specs
    lines = []
    for path, pspec in pins.items():
        auto = plan.argument(path)
        wanted = specs.from_partition_spec(pspec, len(auto.shape))
        if wanted != auto.spec:
            lines.append(f"  {path}: annotated {specs.spec_str(wanted)}, "
                         f"auto {specs.spec_str(auto.spec)}")
    return lines


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
    from autoshard import models
    for name in models.names():
        typer.echo(f"{name:<10} sizes: {', '.join(models.get(name).sizes)}")


def run_zoo(model: str, size: str, mesh_text: str, steps: int, hardware: str | None,
            memory_budget: str | None, save_plan: Path | None, axes: str | None,
            respect_annotations: bool, seed: int) -> None:
    shape, names = parse_mesh(mesh_text, axes)
    count = math.prod(shape)
    budget = parse_bytes(memory_budget) if memory_budget else None
    simulate_devices(count)
    import jax
    import autoshard
    import autoshard.inspect
    from autoshard import experts, models, train

    entry = models.get(model)            # unknown names fail before any work
    if size not in entry.sizes:
        raise CliError(f"model {model!r} has no size {size!r}; sizes: {', '.join(entry.sizes)}")
    if len(jax.devices()) != count:
        raise CliError(f"mesh {mesh_text} needs {count} devices; {jax.devices()[0].platform} "
                       f"has {len(jax.devices())}")
    hw = load_hardware(hardware)
    total = 6
    t = stage(1, total, f"building {model}/{size} (seed {seed})")
    case = entry.train_case(size, seed=seed)
    mesh = autoshard.make_mesh(shape, names)
    typer.echo(f"      {len(jax.tree.leaves(case.state))} state arrays, mesh "
               f"{dict(zip(names, shape))} on {jax.devices()[0].platform}, "
               f"{time.perf_counter() - t:.1f} s")

    pins = case.annotation_pins(mesh) if case.annotations else {}
    t = stage(2, total, "planning (trace, cost, solve)"
              + (" with the model's annotations pinned" if respect_annotations and pins else ""))
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hw,
                          memory_budget=budget, donate_argnums=case.donate_argnums,
                          pins=pins if respect_annotations else None)
    s = plan.solver
    typer.echo(f"      trace {s.get('trace_s', 0):.1f} s, cost {s.get('cost_s', 0):.1f} s, "
               f"solve {s.get('solve_s', 0):.1f} s ({s.get('status', '')})")
    typer.echo(plan.summary_text())
    if pins and not respect_annotations:
        diff = annotation_diff(plan, pins)
        typer.echo(f"annotated vs auto plan: {len(diff)} of {len(pins)} annotated params "
                   "differ" + (":" if diff else ""))
        for line in diff:
            typer.echo(line)
    if save_plan:
        save_plan.write_text(plan.to_json())
        typer.echo(f"plan saved to {save_plan}")

    t = stage(3, total, "compiling the plan: predicted vs compiled (per device)")
    abstract_args = case.abstract_args()
    report = plan.report(*abstract_args)
    typer.echo(str(report))

    t = stage(4, total, f"compiling expert plans: {', '.join(case.experts)}")
    rows = [("auto", report.compiled)]
    for name in case.experts:
        compiled = experts.compile_expert(case, mesh, name, abstract_args)
        rows.append((name, autoshard.inspect.inspect(compiled, hw, mesh)))
    typer.echo(comparison_table(rows))

    t = stage(5, total, f"training {steps} steps on synthetic data")
    reference = jax.device_get(jax.jit(case.train_step)(*case.args))
    first = jax.device_get(plan.jit(donate_argnums=())(*case.args))
    state = jax.tree.map(lambda x: x.copy(), case.state)
    losses = train.run(case, plan.jit(), state, steps=steps, shardings=plan.in_shardings,
                       log=lambda line: typer.echo("      " + line))
    if losses:
        typer.echo(f"      loss {losses[0]:.4f} -> {losses[-1]:.4f} in "
                   f"{time.perf_counter() - t:.1f} s")

    stage(6, total, f"numerics of step 0 vs one device (rtol {case.rtol:g}, "
                    f"atol {case.atol:g})")
    ok, worst, where = numerics_check(case, first, reference)
    typer.echo(f"      {'PASS' if ok else 'FAIL'}: worst error {worst:.3g} of tolerance"
               + (f" at {where}" if where else ""))
    if not ok:
        raise typer.Exit(1)


@app.command()
def zoo(
    model: Optional[str] = typer.Argument(None, help="zoo model, e.g. gpt (see --list)"),
    size: str = typer.Option("tiny", help="size name: tiny, small, large, ..."),
    mesh: str = typer.Option("2x4", help="mesh shape, e.g. 8 or 2x4"),
    steps: int = typer.Option(20, min=0, help="training steps to run"),
    list_models_: bool = typer.Option(False, "--list", help="list models and sizes"),
    hardware: Optional[str] = typer.Option(None, help="h100, or a JSON file of Hardware fields"),
    memory_budget: Optional[str] = typer.Option(None, help="bytes per device, e.g. 40GB"),
    save_plan: Optional[Path] = typer.Option(None, help="write the plan as JSON here"),
    axes: Optional[str] = typer.Option(None, help="mesh axis names, e.g. data,model"),
    respect_annotations: bool = typer.Option(
        False, help="pin the model's nnx.with_partitioning annotations"),
    seed: int = typer.Option(0, help="seed of the initial params and the data"),
):
    """Plan, compare, train and check a zoo model on a (simulated) device mesh."""
    if list_models_:
        list_models()
        return
    if model is None:
        raise CliError("name a model (see autoshard zoo --list)")
    run_zoo(model, size, mesh, steps, hardware, memory_budget, save_plan, axes,
            respect_annotations, seed)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: bad input ends with one line on stderr and exit status 2."""
    from autoshard.errors import AutoshardError
    try:
        result = app(args=argv, standalone_mode=False)
        return result if isinstance(result, int) else 0
    except (CliError, AutoshardError) as e:
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


if __name__ == "__main__":
    sys.exit(main())
