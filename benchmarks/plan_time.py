"""Planning time at LLM scale: a GPT train step (d_model 2048, Adam) with 12, 24, 48 and
96 layers, unrolled and scanned, planned on a 2x4 mesh for H100s.

Prints per case: graph nodes, groups before and after coarsening, seconds per stage
(JAX's own make_jaxpr of the program, our graph, strategies + costs, coarsen, solve) and
end to end (XLA compilation excluded), the planner's own seconds (end to end less JAX's
make_jaxpr), and the time of a second call, which the plan cache answers. Each case is
planned --repeat times from an empty cache after a warm-up plan, the layer counts in turn
in each round, and its median run is shown, so that one-time costs, a busy machine's
outliers and its drift do not decide the figures. Then the targets: 24 layers within 5 s,
48 layers within 1.5 x 12 layers, end to end and for the planner's own share (also per
round, each round's pair planned side by side), and the floor that JAX's tracing alone
sets on the 48 / 12 ratio (the 12-layer time plus the growth of make_jaxpr from 12 to 48
layers).

With --quality, the 12-layer unrolled plan with reuse is judged against the plan
without it by their compiled programs (autoshard.report.hlo_report, as in plan_quality.py).

Run: python benchmarks/plan_time.py [--layers 12,24,48,96] [--variants unrolled,scanned]
                                    [--repeat 3] [--quality]
"""

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import autoshard  # noqa: E402
from autoshard.planning import cache  # noqa: E402
from autoshard.report.hlo_report import hlo_report  # noqa: E402
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
    s = plan.stats.to_dict()
    stages = (s["jaxpr_s"], s["trace_s"] - s["jaxpr_s"], s["cost_s"], s["coarsen_s"],
              s["solve_s"])
    return (f"{name:14}{s['nodes']:>7}{s['groups']:>7}{s['solved_groups']:>7}"
            + "".join(f"{x:>8.2f}" for x in stages)
            + f"{total:>8.2f}{total - s['jaxpr_s']:>8.2f}{again:>8.2f}"
            + f"{plan.cost.total_s * 1e3:>9.2f}  {s['status']}")


def interleaved_plans(programs: dict, mesh, repeat: int) -> dict:
    """Per layer count, ``repeat`` plans from an empty cache, the counts taken in turn in
    each round, so that a machine slowing down or speeding up weighs on every count."""
    runs = {layers: [] for layers in programs}
    for _ in range(repeat):
        for layers, program in programs.items():
            cache.PLANS.clear()
            runs[layers].append(timed_plan(program, mesh))
    return runs


def median_run(runs, program, mesh):
    """The median of ``runs`` (plan, seconds), and a cached call after it."""
    plan, total = sorted(runs, key=lambda run: run[1])[(len(runs) - 1) // 2]
    _, again = timed_plan(program, mesh)
    return plan, total, again


def quality(mesh):
    """The reused plan against the plan without reuse, both judged by compiled HLO."""
    program = gpt(12, scanned=False)
    hw = autoshard.H100
    print("\nreuse vs no reuse, 12 layers unrolled, judged by the compiled program:")
    print(f"{'plan':12}{'plan s':>9}{'predicted ms':>14}{'compiled ms':>13}{'memory GiB':>12}")
    figures = {}
    for name, reuse in (("reuse", True), ("no reuse", False)):
        plan, seconds = timed_plan(program, mesh, reuse=reuse, cache=False)
        report = hlo_report(plan.jit().lower(*program.args).compile(), hw, mesh)
        figures[name] = report.total_s
        print(f"{name:12}{seconds:>9.1f}{plan.cost.total_s * 1e3:>14.3f}"
              f"{report.total_s * 1e3:>13.3f}{report.memory_bytes / 2**30:>12.2f}", flush=True)
    print(f"reuse / no reuse (compiled step time): {figures['reuse'] / figures['no reuse']:.4f}")


def ratio_lines(label, times, with_24_layers: bool):
    """The 48 / 12 ratio of ``times`` (seconds by layer count), and the 24-layer time."""
    lines = []
    if 24 in times and with_24_layers:
        lines.append(f"{label}: 24 layers in {times[24]:.2f} s (target 5 s)")
    if 12 in times and 48 in times:
        lines.append(f"{label}: 48 / 12 layers = {times[48] / times[12]:.2f} (target 1.5)")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="12,24,48,96")
    parser.add_argument("--variants", default="unrolled,scanned")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quality", action="store_true")
    args = parser.parse_args()
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    layer_counts = [int(x) for x in args.layers.split(",")]
    timed_plan(gpt(2, scanned=False), mesh)   # warm-up: JAX's caches, imports, the solver
    print(f"GPT d_model {D_MODEL}, Adam, mesh 2x4, H100 hardware; seconds, median of "
          f"{args.repeat}; jaxpr = JAX's make_jaxpr, own = total - jaxpr")
    print(f"{'case':14}{'nodes':>7}{'groups':>7}{'solved':>7}{'jaxpr':>8}{'graph':>8}"
          f"{'cost':>8}{'coarsen':>8}{'solve':>8}{'total':>8}{'own':>8}{'cached':>8}"
          f"{'pred ms':>9}")
    totals, jaxprs, rounds = {}, {}, {}
    for variant in args.variants.split(","):
        programs = {n: gpt(n, scanned=variant == "scanned") for n in layer_counts}
        runs = interleaved_plans(programs, mesh, args.repeat)
        rounds[variant] = runs
        for layers, program in programs.items():
            plan, total, again = median_run(runs[layers], program, mesh)
            totals[(variant, layers)] = total
            jaxprs[(variant, layers)] = plan.stats.jaxpr_s
            print(row(f"{variant} {layers}", plan, total, again), flush=True)
    for variant in args.variants.split(","):
        total = {n: t for (v, n), t in totals.items() if v == variant}
        jaxpr = {n: t for (v, n), t in jaxprs.items() if v == variant}
        own = {n: total[n] - jaxpr[n] for n in total}
        for line in (ratio_lines(f"{variant} end to end", total, True)
                     + ratio_lines(f"{variant} planner's own", own, False)):
            print(line)
        if 12 in total and 48 in total:
            own_of = [[plan_s - p.stats.jaxpr_s for p, plan_s in rounds[variant][n]]
                      for n in (12, 48)]
            print(f"{variant} planner's own, 48 / 12 layers in each round: " + ", ".join(
                f"{b / a:.2f}" for a, b in zip(*own_of)))
            floor = (total[12] + jaxpr[48] - jaxpr[12]) / total[12]
            print(f"{variant}: JAX's make_jaxpr alone takes {jaxpr[12]:.2f} s at 12 layers and "
                  f"{jaxpr[48]:.2f} s at 48, so 48 / 12 end to end is at least {floor:.2f} "
                  f"even if the planner's own work did not grow")
    if args.quality:
        quality(mesh)


if __name__ == "__main__":
    main()
