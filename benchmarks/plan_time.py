"""Planning time at LLM scale: a GPT train step (d_model 2048, Adam) with 12, 24, 48 and
96 layers, unrolled and scanned, planned on a 2x4 mesh for H100s.

Prints per case: equations, graph nodes, groups before and after coarsening, strategies
the solver sees, seconds per stage (trace, strategies + costs, coarsen, solve) and end
to end (XLA compilation excluded), and the time of a second call, which the plan cache
answers. Then the targets: 24 layers within 5 s, 48 layers within 1.5 x 12 layers.

With --quality, the 12-layer unrolled plan with reuse is judged against the plan
without it by their compiled programs (autoshard.inspect, as in plan_quality.py).

Run: python benchmarks/plan_time.py [--layers 12,24,48,96] [--variants unrolled,scanned]
                                    [--quality]
"""

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import autoshard  # noqa: E402
from autoshard import cache  # noqa: E402
from autoshard.inspect import inspect  # noqa: E402
from autoshard.testing import programs  # noqa: E402

D_MODEL = 2048


def gpt(layers: int, scanned: bool):
    return programs._lm_adam_program(
        f"gpt{layers}", batch=8, seq=1024, vocab=32000, d_model=D_MODEL, heads=16,
        layers=layers, d_ff=4 * D_MODEL, lr=1e-3, scan_layers=scanned, abstract=True)


def timed_plan(program, mesh, **kwargs):
    start = time.perf_counter()
    plan = autoshard.plan(program.fn, *program.args, mesh=mesh, time_limit_s=600, **kwargs)
    return plan, time.perf_counter() - start


def row(name, plan, total, again):
    s = plan.solver
    stages = s["trace_s"], s["cost_s"], s["coarsen_s"], s["solve_s"]
    return (f"{name:18}{s['nodes']:>8}{s['groups']:>8}{s['solved_groups']:>8}"
            + "".join(f"{x:>9.2f}" for x in stages) + f"{total:>9.2f}{again:>9.3f}"
            + f"{plan.cost.total_s * 1e3:>10.2f}  {s['status']}")


def quality(mesh):
    """The reused plan against the plan without reuse, both judged by compiled HLO."""
    program = gpt(12, scanned=False)
    hw = autoshard.H100
    print("\nreuse vs no reuse, 12 layers unrolled, judged by the compiled program:")
    print(f"{'plan':12}{'plan s':>9}{'predicted ms':>14}{'compiled ms':>13}{'memory GiB':>12}")
    figures = {}
    for name, reuse in (("reuse", True), ("no reuse", False)):
        plan, seconds = timed_plan(program, mesh, reuse=reuse, cache=False)
        report = inspect(plan.jit().lower(*program.args).compile(), hw, mesh)
        figures[name] = report.total_s
        print(f"{name:12}{seconds:>9.1f}{plan.cost.total_s * 1e3:>14.3f}"
              f"{report.total_s * 1e3:>13.3f}{report.memory_bytes / 2**30:>12.2f}", flush=True)
    print(f"reuse / no reuse (compiled step time): {figures['reuse'] / figures['no reuse']:.4f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="12,24,48,96")
    parser.add_argument("--variants", default="unrolled,scanned")
    parser.add_argument("--quality", action="store_true")
    args = parser.parse_args()
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    layer_counts = [int(x) for x in args.layers.split(",")]
    print(f"GPT d_model {D_MODEL}, Adam, mesh 2x4, H100 hardware; seconds")
    print(f"{'case':18}{'nodes':>8}{'groups':>8}{'solved':>8}{'trace':>9}{'cost':>9}"
          f"{'coarsen':>9}{'solve':>9}{'total':>9}{'cached':>9}{'pred ms':>10}")
    totals = {}
    for variant in args.variants.split(","):
        for layers in layer_counts:
            program = gpt(layers, scanned=variant == "scanned")
            cache.PLANS.clear()
            plan, total = timed_plan(program, mesh)
            _, again = timed_plan(program, mesh)
            totals[(variant, layers)] = total
            print(row(f"{variant} {layers}", plan, total, again), flush=True)
    for variant in args.variants.split(","):
        if (variant, 24) in totals:
            print(f"{variant}: 24 layers in {totals[(variant, 24)]:.2f} s (target 5 s)")
        if (variant, 12) in totals and (variant, 48) in totals:
            ratio = totals[(variant, 48)] / totals[(variant, 12)]
            print(f"{variant}: 48 / 12 layers = {ratio:.2f} (target 1.5)")
    if args.quality:
        quality(mesh)


if __name__ == "__main__":
    main()
