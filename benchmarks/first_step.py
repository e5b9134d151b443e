"""The first step: how long until a GPT train step is ready to run on a 2x4 mesh.

For 12, 24 and 48 layers of the zoo's GPT (d_model 2048, 16 heads, d_ff 8192, vocab
32000, seq 1024, batch 16, bf16 compute over f32 Adam state), from abstract arguments:

  auto        autoshard.plan (empty cache) + compiling plan.jit(), whose program carries
              with_sharding_constraint only where the plan needs one
  shardings   compiling jax.jit(train_step) with the plan's specs as in/out shardings only
  expert      compiling each expert plan (data parallel, FSDP, Megatron, FSDP x TP); the
              best is the one whose compiled step autoshard.hlo_report prices fastest

and the ratio (plan + compile) / (best expert's compile), the target being <= 1.10 at 24
and 48 layers. Beside it, the compiled step time of the auto plan with the constraints
pruned and with a constraint on every result (--compare-all), priced by autoshard.hlo_report:
pruning must not change it. Planning and compiling share the machine with nothing else
in this process; each figure is the fastest of --repeat runs.

Run: python benchmarks/first_step.py [--layers 12,24,48] [--repeat 1] [--compare-all]
"""

import argparse
import dataclasses
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

import autoshard  # noqa: E402
from autoshard import experts  # noqa: E402
from autoshard.hlo_report import hlo_report  # noqa: E402
from autoshard.models import gpt  # noqa: E402

HARDWARE = autoshard.H100


def gpt_case(layers: int):
    cfg = dataclasses.replace(gpt.SIZES["large"], layers=layers)
    return gpt.train_case(f"{layers} layers", abstract=True, config=cfg)


def seconds(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def fastest(fn, repeat: int):
    runs = [seconds(fn) for _ in range(repeat)]
    return min(runs, key=lambda run: run[1])


def plan_case(case, mesh):
    return autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=HARDWARE,
                          donate_argnums=case.donate_argnums, cache=False, progress=False)


def shardings_only(case, plan):
    return jax.jit(case.train_step, in_shardings=plan.in_shardings,
                   out_shardings=plan.out_shardings, donate_argnums=case.donate_argnums)


def every_result_constrained(plan, case):
    """The same plan with a constraint on every result (apply without pruning)."""
    from autoshard.apply import constraining_every_result
    with constraining_every_result():
        return plan_case(case, plan.mesh)


def constraints(plan) -> int:
    return sum(sum(s is not None for s in d.out_specs) + sum(s is not None for s in d.in_specs)
               for d in plan.decisions.values())


def run(layers: int, mesh, repeat: int, compare_all: bool) -> dict:
    case = gpt_case(layers)
    args = case.args
    plan, plan_s = fastest(lambda: plan_case(case, mesh), repeat)
    auto, auto_s = fastest(lambda: plan.jit(case.donate_argnums).lower(*args).compile(), repeat)
    _, shard_s = fastest(lambda: shardings_only(case, plan).lower(*args).compile(), repeat)
    row = dict(layers=layers, plan_s=plan_s, compile_s=auto_s, shardings_s=shard_s,
               constraints=constraints(plan), step_s=hlo_report(auto, HARDWARE, mesh).total_s)
    best = None
    for name in case.experts:
        compiled, compile_s = fastest(lambda: experts.compile_expert(case, mesh, name, args),
                                      repeat)
        step_s = hlo_report(compiled, HARDWARE, mesh).total_s
        row[f"{name}_compile_s"], row[f"{name}_step_s"] = compile_s, step_s
        if best is None or step_s < row[f"{best}_step_s"]:
            best = name
    row["best"] = best
    row["ratio"] = (plan_s + auto_s) / row[f"{best}_compile_s"]
    if compare_all:
        full = every_result_constrained(plan, case)
        compiled, full_s = seconds(lambda: full.jit(case.donate_argnums).lower(*args).compile())
        row.update(all_constraints=constraints(full), all_compile_s=full_s,
                   all_step_s=hlo_report(compiled, HARDWARE, mesh).total_s)
    return row


def print_row(r: dict, compare_all: bool) -> None:
    best = r["best"]
    line = (f"{r['layers']:>6}{r['plan_s']:>8.1f}{r['compile_s']:>9.1f}{r['shardings_s']:>11.1f}"
            f"{best:>15}{r[f'{best}_compile_s']:>9.1f}{r['ratio']:>8.2f}"
            f"{r['step_s'] * 1e3:>11.2f}{r[f'{best}_step_s'] * 1e3:>11.2f}{r['constraints']:>7}")
    if compare_all:
        line += (f"{r['all_constraints']:>7}{r['all_compile_s']:>9.1f}"
                 f"{r['all_step_s'] * 1e3:>11.2f}")
    print(line, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="12,24,48")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--compare-all", action="store_true",
                        help="also compile the plan with a constraint on every result")
    args = parser.parse_args()
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    print(f"GPT train step (zoo 'large' widths), mesh 2x4 on {jax.devices()[0].platform}, "
          f"priced on H100s; seconds, fastest of {args.repeat}")
    header = (f"{'layers':>6}{'plan':>8}{'compile':>9}{'shardings':>11}{'best expert':>15}"
              f"{'compile':>9}{'ratio':>8}{'auto ms':>11}{'expert ms':>11}{'wsc':>7}")
    if args.compare_all:
        header += f"{'wsc*':>7}{'compile*':>9}{'auto* ms':>11}"
    print(header)
    for layers in (int(x) for x in args.layers.split(",")):
        print_row(run(layers, mesh, args.repeat, args.compare_all), args.compare_all)
    print("ratio: (plan + compile) / best expert's compile; ms: compiled step time "
          "(autoshard.hlo_report); wsc: with_sharding_constraints in the auto program"
          + ("; *: a constraint on every result" if args.compare_all else ""))


if __name__ == "__main__":
    main()
