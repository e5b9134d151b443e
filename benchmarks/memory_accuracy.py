"""Memory accuracy: the planner's peak against the bytes XLA holds together at its peak
and XLA's allocation.

``memory_analysis()`` counts what XLA allocates: arguments, outputs and one heap of
temporaries, minus donated buffers. The heap is larger than the bytes live at its peak,
because XLA's buffer assignment cannot pack the temporaries without gaps; the planner
counts the live bytes and does not model that packing. XLA's buffer-assignment dump gives
both figures for each compiled program: the peak is the most bytes its live buffers
occupy at one point of its schedule, an output counted only from when it is written; for
a train step whose state is donated, the outputs are the arguments.

For each program and mesh: the auto plan and every expert layout (pinned, the solver
filling in the rest), compiled with XLA's dump on (``hlo_report.buffer_bytes``). Prints
the predicted peak, XLA's peak held together and its allocation (MiB), the prediction's
error against that peak (the planner's own error) and the allocation's excess over it
(the packing), then the median and worst of each per program and mesh.

Run: python benchmarks/memory_accuracy.py [--programs gpt,moe,plain_lm,plain_moe,plain_cnn]
                                          [--meshes 8,2x4]
"""

import argparse
import os
import sys
from typing import NamedTuple

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16").strip()

import numpy as np  # noqa: E402

import autoshard  # noqa: E402
from autoshard.report.hlo_report import buffer_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cost_accuracy import PROGRAMS, by_program_and_mesh  # noqa: E402
from plan_quality import add_target_argument, hardware_for, mesh_for  # noqa: E402

MIB = 2 ** 20


class Measured(NamedTuple):
    program: str
    mesh: str
    layout: str
    predicted: float   # bytes
    live: int          # the most bytes XLA holds together
    allocated: int     # what memory_analysis() counts

    @property
    def error(self) -> float:
        """The prediction against the bytes XLA holds together at its peak."""
        return self.predicted / self.live - 1

    @property
    def packing(self) -> float:
        """The allocation's excess over the bytes XLA holds together at its peak."""
        return self.allocated / self.live - 1


def layouts(case, mesh) -> dict:
    return {"auto": None, **{name: fn(mesh) for name, fn in case.experts.items()}}


def measure(program: str, case, mesh_name: str, target: str = "cpu") -> list[Measured]:
    mesh, hw = mesh_for(mesh_name, target), hardware_for(mesh_name, target)
    args = case.abstract_args()
    rows = []
    for layout, pins in layouts(case, mesh).items():
        try:
            plan = autoshard.plan(case.train_step, *args, mesh=mesh, hardware=hw, pins=pins,
                                  donate_argnums=case.donate_argnums, progress=False)
            live, allocated = buffer_bytes(plan.jit().lower(*args))
        except Exception as e:   # a layout the planner or XLA refuses is reported
            print(f"  {program} {mesh_name} {layout}: {type(e).__name__}: {e}"[:160],
                  file=sys.stderr)
            continue
        m = Measured(program, mesh_name, layout, plan.cost.memory_bytes, live, allocated)
        print(f"{program:10} {mesh_name:4} {layout:16} {m.predicted / MIB:9.2f} "
              f"{live / MIB:9.2f} {allocated / MIB:9.2f} {m.error * 100:+7.1f}% "
              f"{m.packing * 100:+7.1f}%", flush=True)
        rows.append(m)
    return rows


def summarize(rows: list[Measured]) -> None:
    print(f"\n{'program':10} {'mesh':4} {'plans':>5} {'|pred/live-1| median':>21} "
          f"{'worst':>7} {'packing median':>15} {'worst':>7}")
    for (program, mesh), group in by_program_and_mesh(rows).items():
        errors = np.abs([m.error for m in group])
        packing = np.array([m.packing for m in group])
        print(f"{program:10} {mesh:4} {len(group):5} {np.median(errors) * 100:20.1f}% "
              f"{errors.max() * 100:6.1f}% {np.median(packing) * 100:14.1f}% "
              f"{packing.max() * 100:6.1f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--meshes", default="8,2x4")
    add_target_argument(parser)
    args = parser.parse_args(argv)
    print(f"{'program':10} {'mesh':4} {'layout':16} {'pred MiB':>9} {'live MiB':>9} "
          f"{'alloc MiB':>9} {'pred/live':>8} {'packing':>8}")
    rows = []
    for program in args.programs.split(","):
        case = PROGRAMS[program]()
        for mesh_name in args.meshes.split(","):
            rows += measure(program, case, mesh_name, args.target)
    summarize(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
