"""The first step: how long until a GPT train step is ready to run on a 2x4 mesh.

For 12, 24 and 48 layers of the zoo's GPT (d_model 2048, 16 heads, d_ff 8192, vocab
32000, seq 1024, batch 16, bf16 compute over f32 Adam state), from abstract arguments:

  auto        autoshard.plan (empty cache) + tracing, lowering and compiling plan.jit(),
              whose program carries with_sharding_constraint only where the plan needs one
  shardings   compiling jax.jit(train_step) with the plan's specs as in/out shardings only
  expert      tracing, lowering and compiling each expert plan (data parallel, FSDP,
              Megatron, FSDP x TP); the best is the one whose compiled step
              autoshard.report.hlo_report prices fastest

and the ratio (plan + lower + compile) / (best expert's lower + compile), the target
being <= 1.10 at 24 and 48 layers. XLA compiles one program slower the later it comes in
a process, so once the best expert is known, it and the auto program are compiled again,
alternately (--repeat times), each keeping its fastest: the auto program, compiled first,
is not favoured. JAX's caches and the planner's kept reshard prices
are cleared before each, so every program pays its own trace of the train step (the
plan's make_jaxpr for auto, jax.jit's trace for an expert) and every plan its own
prices. The floor is the ratio with planning free: the auto program's lower + compile
over the best expert's, which only a plan XLA compiles faster can lower. On a
shared machine wall seconds stretch with the load; the CPU seconds of this process
(the ``cpu`` columns) stretch far less, and ``--split`` prints them for every part beside
the planner's stages (JAX's make_jaxpr; graph, strategies and costs; coarsening; solving).
Beside it, the compiled step time of the auto plan with the constraints pruned and with
a constraint on every result (--compare-all), priced by autoshard.report.hlo_report: pruning must
not change it. Each figure is the fastest of --repeat runs.

``--pin-experts fsdp,data_parallel`` also plans with every argument pinned to an expert's
spec and prints, beside the free plan, the cost model's price of each, its compile time
and its compiled step: a layout priced within noise of another may compile much faster.

Run: python benchmarks/first_step.py [--layers 12,24,48] [--repeat 1] [--split]
         [--pin-experts fsdp] [--compare-all]
"""

import argparse
import dataclasses
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

import autoshard  # noqa: E402
from autoshard.cost import forget_prices  # noqa: E402
from autoshard.report.hlo_report import hlo_report  # noqa: E402
from autoshard.zoo import experts  # noqa: E402
from autoshard.zoo.models import gpt  # noqa: E402

HARDWARE = autoshard.H100


def gpt_case(layers: int):
    cfg = dataclasses.replace(gpt.SIZES["large"], layers=layers)
    return gpt.train_case(f"{layers} layers", abstract=True, config=cfg)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one part: wall clock and this process's CPU time."""

    wall: float
    cpu: float

    def __add__(self, other: "Timing") -> "Timing":
        return Timing(self.wall + other.wall, self.cpu + other.cpu)


def timed(fn):
    """``(fn(), Timing)``, JAX's caches and the planner's reshard prices cleared first so
    that nothing traced, lowered, compiled or priced before (the train step's trace for
    another plan, another size's reshards) is reused."""
    jax.clear_caches()
    forget_prices()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, Timing(time.perf_counter() - wall, time.process_time() - cpu)


def fastest(fn, repeat: int):
    runs = [timed(fn) for _ in range(repeat)]
    return min(runs, key=lambda run: run[1].wall)


def plan_case(case, mesh, pins=None):
    return autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=HARDWARE,
                          donate_argnums=case.donate_argnums, cache=False, progress=False,
                          pins=pins)


def shardings_only(case, plan):
    return jax.jit(case.train_step, in_shardings=plan.in_shardings,
                   out_shardings=plan.out_shardings, donate_argnums=case.donate_argnums)


def every_result_constrained(plan, case):
    """The same plan with a constraint on every result (apply without pruning)."""
    from autoshard.rewrite.apply import constraining_every_result
    with constraining_every_result():
        return plan_case(case, plan.mesh)


def constraints(plan) -> int:
    return sum(sum(s is not None for s in d.out_specs) + sum(s is not None for s in d.in_specs)
               for d in plan.decisions.values())


def lower_and_compile(jitted, args, repeat: int):
    """(compiled, Timing of trace + lower, Timing of XLA's compile), each the fastest of
    ``repeat``; every compile of its own lowering (a lowering keeps what it compiled)."""
    runs = []
    for _ in range(repeat):
        lowered, lower_t = timed(lambda: jitted.trace(*args).lower())
        compiled, compile_t = timed(lowered.compile)
        runs.append((compiled, lower_t, compile_t))
    return (runs[0][0], min((r[1] for r in runs), key=lambda t: t.wall),
            min((r[2] for r in runs), key=lambda t: t.wall))


def plan_stages(plan) -> dict:
    """The planner's wall seconds by stage, from ``plan.stats``."""
    s = plan.stats.to_dict()
    stages = dict(jaxpr=s["jaxpr_s"], graph_cost=s["trace_s"] - s["jaxpr_s"] + s["cost_s"],
                  coarsen=s["coarsen_s"], solve=s["solve_s"])
    stages["other"] = s["plan_s"] - sum(stages.values())
    return stages


def pinned_to(case, mesh, name: str) -> dict:
    """The plan with every argument pinned to an expert's spec: its objective (the cost
    model's price), the time to plan and compile it, and its compiled step time."""
    plan, plan_t = timed(lambda: plan_case(case, mesh, pins=case.experts[name](mesh)))
    compiled, lower_t, compile_t = lower_and_compile(plan.jit(case.donate_argnums),
                                                     case.args, 1)
    return dict(objective_s=plan.stats.objective_s, plan=plan_t, lower=lower_t,
                compile=compile_t, step_s=hlo_report(compiled, HARDWARE, mesh).total_s,
                constraints=constraints(plan))


def run(layers: int, mesh, repeat: int, compare_all: bool, pin_experts=()) -> dict:
    case = gpt_case(layers)
    args = case.args
    plan, plan_t = fastest(lambda: plan_case(case, mesh), repeat)
    auto, lower_t, compile_t = lower_and_compile(plan.jit(case.donate_argnums), args, repeat)
    _, shard_t = fastest(lambda: shardings_only(case, plan).lower(*args).compile(), repeat)
    row = dict(layers=layers, plan=plan_t, lower=lower_t, compile=compile_t,
               shardings=shard_t, stages=plan_stages(plan), constraints=constraints(plan),
               step_s=hlo_report(auto, HARDWARE, mesh).total_s, experts={})
    for name in case.experts:
        compiled, e_lower, e_compile = lower_and_compile(
            experts.jit_expert(case, mesh, name), args, repeat)
        row["experts"][name] = dict(lower=e_lower, compile=e_compile,
                                    step_s=hlo_report(compiled, HARDWARE, mesh).total_s)
    best = min(row["experts"], key=lambda name: row["experts"][name]["step_s"])
    expert = row["experts"][best]
    # side by side: XLA compiles a program slower the later it comes in a process, so the
    # auto program (compiled first) and the best expert are compiled again, alternately,
    # each keeping its fastest
    for _ in range(repeat):
        for jitted, times in ((lambda: plan.jit(case.donate_argnums), row),
                              (lambda: experts.jit_expert(case, mesh, best), expert)):
            _, again_lower, again_compile = lower_and_compile(jitted(), args, 1)
            times["lower"] = min(times["lower"], again_lower, key=lambda t: t.wall)
            times["compile"] = min(times["compile"], again_compile, key=lambda t: t.wall)
    lower_t, compile_t = row["lower"], row["compile"]
    expert_t = expert["lower"] + expert["compile"]
    auto_t = lower_t + compile_t
    row.update(best=best, expert_t=expert_t, objective_s=plan.stats.objective_s,
               ratio=(plan_t.wall + auto_t.wall) / expert_t.wall,
               cpu_ratio=(plan_t.cpu + auto_t.cpu) / expert_t.cpu,
               floor=auto_t.wall / expert_t.wall, cpu_floor=auto_t.cpu / expert_t.cpu)
    row["pinned"] = {name: pinned_to(case, mesh, name) for name in pin_experts}
    if compare_all:
        full = every_result_constrained(plan, case)
        compiled, full_t = timed(lambda: full.jit(case.donate_argnums).lower(*args).compile())
        row.update(all_constraints=constraints(full), all_compile=full_t,
                   all_step_s=hlo_report(compiled, HARDWARE, mesh).total_s)
    return row


HEADER = (f"{'layers':>6}{'plan':>7}{'lower':>7}{'compile':>9}{'shardings':>11}"
          f"{'best expert':>15}{'lower':>7}{'compile':>9}{'ratio':>7}{'cpu':>6}{'floor':>7}"
          f"{'cpu':>6}{'auto ms':>9}{'expert ms':>11}{'wsc':>6}")


def print_row(r: dict, compare_all: bool) -> None:
    expert = r["experts"][r["best"]]
    line = (f"{r['layers']:>6}{r['plan'].wall:>7.1f}{r['lower'].wall:>7.1f}"
            f"{r['compile'].wall:>9.1f}{r['shardings'].wall:>11.1f}{r['best']:>15}"
            f"{expert['lower'].wall:>7.1f}{expert['compile'].wall:>9.1f}{r['ratio']:>7.2f}"
            f"{r['cpu_ratio']:>6.2f}{r['floor']:>7.2f}{r['cpu_floor']:>6.2f}"
            f"{r['step_s'] * 1e3:>9.2f}{expert['step_s'] * 1e3:>11.2f}{r['constraints']:>6}")
    if compare_all:
        line += (f"{r['all_constraints']:>7}{r['all_compile'].wall:>9.1f}"
                 f"{r['all_step_s'] * 1e3:>11.2f}")
    print(line, flush=True)


def print_split(rows: list[dict]) -> None:
    """Where the time goes: the planner's stages (wall), then CPU seconds of each part."""
    print("\nsplit, seconds: planner stages (wall) | CPU seconds of plan, auto lower, auto "
          "compile, each expert's lower + compile")
    names = list(rows[0]["experts"])
    print(f"{'layers':>6}{'jaxpr':>7}{'graph+cost':>11}{'coarsen':>8}{'solve':>7}{'other':>7} |"
          f"{'plan':>7}{'lower':>7}{'compile':>9}" + "".join(f"{n[:13]:>14}" for n in names))
    for r in rows:
        s = r["stages"]
        experts_cpu = "".join(f"{e['lower'].cpu:>6.1f} +{e['compile'].cpu:>6.1f}"
                              for e in r["experts"].values())
        print(f"{r['layers']:>6}{s['jaxpr']:>7.1f}{s['graph_cost']:>11.1f}{s['coarsen']:>8.1f}"
              f"{s['solve']:>7.1f}{s['other']:>7.1f} |{r['plan'].cpu:>7.1f}{r['lower'].cpu:>7.1f}"
              f"{r['compile'].cpu:>9.1f}{experts_cpu}")


def print_pinned(rows: list[dict]) -> None:
    """The free plan beside the plans pinned to an expert's argument specs: what the cost
    model prices each at, and what each costs to compile and to run."""
    print("\npinned: the plan with every argument pinned to an expert's spec; objective: "
          "the cost model's price; seconds wall (cpu)")
    print(f"{'layers':>6}{'pins':>15}{'objective ms':>14}{'plan':>14}{'compile':>14}"
          f"{'step ms':>9}{'wsc':>6}")
    for r in rows:
        free = dict(objective_s=r["objective_s"], plan=r["plan"], compile=r["compile"],
                    step_s=r["step_s"], constraints=r["constraints"])
        for name, p in {"none": free, **r["pinned"]}.items():
            print(f"{r['layers']:>6}{name:>15}{p['objective_s'] * 1e3:>14.2f}"
                  f"{p['plan'].wall:>7.1f} ({p['plan'].cpu:>4.1f}){p['compile'].wall:>7.1f} "
                  f"({p['compile'].cpu:>4.1f}){p['step_s'] * 1e3:>9.2f}{p['constraints']:>6}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24,48")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--split", action="store_true",
                        help="also print the planner's stages and the CPU seconds of each part")
    parser.add_argument("--pin-experts", default="",
                        help="also plan with the arguments pinned to these experts' specs "
                             "(comma-separated, e.g. fsdp,data_parallel)")
    parser.add_argument("--compare-all", action="store_true",
                        help="also compile the plan with a constraint on every result")
    args = parser.parse_args()
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    print(f"GPT train step (zoo 'large' widths), mesh 2x4 on {jax.devices()[0].platform}, "
          f"priced on H100s; seconds, fastest of {args.repeat}")
    print(HEADER + (f"{'wsc*':>7}{'compile*':>9}{'auto* ms':>11}" if args.compare_all else ""))
    pin_experts = [name for name in args.pin_experts.split(",") if name]
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        rows.append(run(layers, mesh, args.repeat, args.compare_all, pin_experts))
        print_row(rows[-1], args.compare_all)
    print("lower: trace + lower; ratio: (plan + lower + compile) / best expert's (lower + "
          "compile), in wall and CPU seconds; floor: the ratio with planning free; ms: "
          "compiled step time (autoshard.report.hlo_report); wsc: with_sharding_constraints in the "
          "auto program" + ("; *: a constraint on every result" if args.compare_all else ""))
    if args.split:
        print_split(rows)
    if pin_experts:
        print_pinned(rows)


if __name__ == "__main__":
    main()
