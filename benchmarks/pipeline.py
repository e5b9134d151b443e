"""Pipeline, gradient accumulation and rematerialization, chosen by the planner.

Part 1 (``--part gpt``): a GPT train step (scanned layers, Adam, bf16) on 16 simulated
devices as two nodes, mesh 2x8 whose first axis crosses nodes (4e10 B/s against 3.6e11
inside a node). The auto plan with a pipeline allowed (``pipeline="auto"``,
``microbatches="auto"``) is compiled beside every expert plan (data parallel, FSDP,
Megatron, FSDP x TP) and each compiled program is priced by ``autoshard.report.hlo_report`` with
the same hardware, beside the pipelines over 'data' with the GPipe schedule (each
microbatch whole inside the stages, and split over 'model' there, each forced) and with
the circular one forced (V = 2, 4 repeats; M chosen). It prints the compute-only bound, the
bubble, the stage transfers and where the rest goes, and each plan's compute inside and
outside loops, predicted against compiled.

Part 2 (``--part 70b``): a LLaMA-3-70B-shaped step (80 layers, d_model 8192, FFN 28672,
Adam, bf16, batch 64 x 2048 tokens) planned from abstract arguments on 8x8 within 80 GB
per device with ``microbatches="auto"`` and ``remat="auto"``: memory parts, K, the remat
choice, predicted step time and planning time, with each setting's seconds by stage
(``--unrolled``: the layers a Python list of blocks, as Hugging Face's models write
them; ``--pipeline data``: the search over pipelines on that axis instead). (The zoo's
GPT has a GELU MLP: two FFN matrices a layer where LLaMA's SwiGLU has three, so the shape
holds ~56e9 parameters.)

Part 3 (``--part unrolled``): part 1's GPT written both ways, its blocks a ``lax.scan``
over stacked weights and a Python loop over a list of blocks (which the planner rolls into
a scan before pipelining it), each planned with the pipeline over 'data' forced and with
``pipeline="auto"``, compiled and priced: the unrolled model's step against the scanned
one's, planned and compiled (``--microbatches`` fixes M; default ``"auto"``).

Part 5 (``--part traces``): part 2's step traced under each setting its search plans
(K = 1 with each remat policy, K = 2, 4, 8 over 'model' with nothing saved), two ways side
by side in one process: the marked loss traced alone and put into the step kept from the
first setting (``rewrite.traces.Traces.program``, what the search does), and the whole
step traced again (what it did before), the loss's own jaxprs kept in both. It prints
the seconds of each and whether the two programs are one (their fingerprints).

Part 4 (``--part 8b``): a LLaMA-3-8B-shaped step (32 layers, d_model 4096, FFN 14336,
Adam, bf16, batch 512 x 2048 tokens) planned from abstract arguments on 512 devices, mesh
8x8x8 (data, fsdp, model), options left at their defaults: planning time by stage, the
number of reshards priced, the plan's step and memory.

    python benchmarks/pipeline.py                 # parts 1 and 2, each in its own process
    python benchmarks/pipeline.py --part gpt --layers 8 --d-model 2048
    python benchmarks/pipeline.py --part unrolled
    python benchmarks/pipeline.py --part 70b --unrolled
    python benchmarks/pipeline.py --part 8b
    python benchmarks/pipeline.py --part traces --unrolled
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEVICES = {"gpt": 16, "70b": 64, "unrolled": 16, "8b": 512, "traces": 64}


def hardware(autoshard):
    return autoshard.Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                              link_bandwidth={"data": 4e10, "model": 3.6e11},
                              link_latency=1e-5)


def gpt_config(args, scan_layers: bool = True):
    """Part 1's GPT at the sizes ``args`` asks for, its blocks scanned or a list."""
    from autoshard.zoo.models import gpt
    return gpt.GPTConfig(vocab=32000, seq=args.seq, d_model=args.d_model, heads=16,
                         layers=args.layers, d_ff=4 * args.d_model, batch=args.batch,
                         dtype="bfloat16", lr=3e-4, scan_layers=scan_layers)


def gpt_part(args) -> None:
    import autoshard
    from autoshard.report.hlo_report import hlo_report
    from autoshard.zoo import experts
    from autoshard.zoo.models import gpt

    cfg = gpt_config(args)
    case = gpt.train_case(config=cfg, abstract=True)
    mesh = autoshard.make_mesh((2, 8), ("data", "model"))
    hw = hardware(autoshard)
    print(f"GPT {cfg.layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, seq {cfg.seq}, "
          f"batch {cfg.batch}, bf16, Adam; {cfg.param_count() / 1e9:.2f}e9 params; "
          f"mesh 2x8 (data 4e10 B/s across nodes, model 3.6e11 B/s)")

    def timed(make):
        started = time.perf_counter()
        out = make()
        return out, time.perf_counter() - started

    def planned(**options):
        return autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hw,
                              donate_argnums=case.donate_argnums, progress=False, **options)

    def compiled(plan):
        return hlo_report(plan.jit().lower(*case.args).compile(), hw, mesh)

    rows = [(name, hlo_report(experts.compile_expert(case, mesh, name), hw, mesh))
            for name in case.experts]
    # by hand: data parallel inside each stage, so each microbatch splits over 'model'
    hand_m = max(1, cfg.batch // mesh.shape["model"])
    rows.append((f"gpipe (hand, M={hand_m})", hlo_report(
        experts.jit_gpipe(case, mesh, microbatches=hand_m).lower(*case.args).compile(), hw,
        mesh)))
    staged, staged_s = timed(lambda: planned(pipeline="data", microbatches="auto"))
    # the GPipe pipeline over 'data' with each microbatch whole inside the stages, and
    # with it split over 'model' there (data parallel inside a stage, gradients reduced
    # once after the loop), each forced by narrowing the search to that split
    plans = {"pipeline (whole)": forced_split(planned, ()),
             "pipeline (slices)": forced_split(planned, ("model",))}
    for v in (2, 4):
        if (cfg.layers // mesh.shape["data"]) % v == 0:
            plans[f"circular V={v}"] = planned(pipeline="data", microbatches="auto", repeats=v)
    auto, plan_s = timed(lambda: planned(pipeline="auto", microbatches="auto"))
    plans["auto"] = auto
    reports = {name: compiled(plan) for name, plan in plans.items()}
    print(f"\n{'plan':18}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}{'memory GB':>11}"
          f"{'fits':>6}{'predicted ms':>14}{'pred GB':>9}")
    for name, report in rows + list(reports.items()):
        plan = plans.get(name)
        predicted = (f"{plan.cost.total_s * 1e3:>14.2f}{plan.cost.memory_bytes / 1e9:>9.2f}"
                     if plan else "")
        print(f"{name:18}{report.total_s * 1e3:>10.2f}{report.compute_s * 1e3:>12.2f}"
              f"{report.comm_s * 1e3:>10.2f}{report.memory_bytes / 1e9:>11.2f}"
              f"{'yes' if report.memory_bytes <= hw.memory else 'no':>6}{predicted}")
    print("\ncompute inside loops (the layer loop, the stage loop) and outside them, "
          "predicted / compiled ms; of the compiled compute, the passes that only round "
          "bf16 computed in f32:")
    for name, plan in plans.items():
        (inside, outside), report = compute_split(plan), reports[name]
        loops = compiled_loop_seconds(report)
        print(f"  {name:18} inside {inside * 1e3:7.2f} / {loops * 1e3:7.2f}   outside "
              f"{outside * 1e3:7.2f} / {(report.compute_s - loops) * 1e3:7.2f}   rounding "
              f"{report.rounding_s * 1e3:6.2f}")
    experts_only = rows[:-1]
    feasible = [r for _, r in experts_only if r.memory_bytes <= hw.memory] or [
        r for _, r in experts_only]
    best = min(r.total_s for r in feasible)
    print(f"\nauto / best non-pipelined expert: {reports['auto'].total_s / best:.3f} "
          f"(target <= 0.75); planned in {plan_s:.1f} s (the data-axis pipeline alone in "
          f"{staged_s:.1f} s, microbatches {describe_split(staged)})")
    print(f"auto plan: {auto.pipeline.describe() if auto.pipeline else 'no pipeline'}"
          + (f"; {auto.microbatching}" if auto.microbatching else ""))
    print("pipelines the auto plan weighed (predicted step):")
    for tried in auto.stats.settings:
        if "schedule" in tried:
            step = f"{tried['step_s'] * 1e3:.2f} ms" if tried["step_s"] is not None else ""
            split = ",".join(tried["replica_axes"]) or "whole"
            print(f"  {tried['pipeline']:6} {tried['schedule']:9} "
                  f"M={tried['pipeline_microbatches']:<3}V={tried['repeats']:<2} "
                  f"slices {split:6} {step:>10}  {tried['outcome']}")
    for name, plan in plans.items():
        if plan.pipeline:
            print(f"\n{name}: {plan.pipeline.describe()}")
            where_time_goes(reports[name], plan.pipeline, hw)
    if not auto.pipeline:
        best_case(reports["auto"], permute_seconds(reports["pipeline (whole)"]), best,
                  stages=mesh.shape["data"], batch=cfg.batch)


def describe_split(plan) -> str:
    """How a pipelined plan's microbatches split inside its stages."""
    axes = plan.pipeline.replica_axes if plan.pipeline else ()
    return f"split over {','.join(axes)}" if axes else "whole"


def forced_split(planned, replica_axes: tuple):
    """The pipeline over 'data' whose microbatches split over ``replica_axes`` inside the
    stages (``()``: whole), the search narrowed to that split."""
    from autoshard.planning import settings
    weighed = settings.replica_splits
    settings.replica_splits = lambda axis, sizes: [replica_axes]
    try:
        return planned(pipeline="data", microbatches="auto")
    finally:
        settings.replica_splits = weighed


def compute_split(plan) -> tuple[float, float]:
    """The plan's predicted compute seconds inside loops (equations run more than once a
    step) and outside them."""
    inside = sum(item.compute_s for item in plan.breakdown if item.weight > 1)
    return inside, sum(item.compute_s for item in plan.breakdown) - inside


def compiled_loop_seconds(report) -> float:
    """Compute of the compiled ops that run more than once a step (inside loops)."""
    return sum(s for runs, s in report.compute_s_by_runs if runs > 1)


def best_case(report, transfers_s: float, expert_s: float, stages: int, batch: int) -> None:
    """What a pipeline over 'data' could reach from the plan without one: the same work per
    device (L / S layers on the whole batch instead of L layers on half of it) with no
    collective over 'data' left but the stage transfers, plus the bubble, (S - 1) / M of
    the layer loop's compute."""
    saved = sum(c.total_seconds for c in report.collectives if "data" in c.axes)
    loops = compiled_loop_seconds(report)
    print(f"\nwhy no pipeline: the plan without one spends {saved * 1e3:.2f} ms on "
          f"collectives over 'data' (what a pipeline over it saves) and {loops * 1e3:.2f} ms "
          f"of compute in its layer loop (the bubble's base); stage transfers "
          f"{transfers_s * 1e3:.2f} ms. Best case of a pipeline with this work per device:")
    for m in (m for m in (stages, 2 * stages, 4 * stages, 8 * stages) if batch % m == 0):
        bubble = (stages - 1) / m * loops
        step = report.total_s - saved + transfers_s + bubble
        print(f"  M={m:<3} bubble {bubble * 1e3:6.2f} ms  step >= {step * 1e3:6.2f} ms = "
              f"{step / expert_s:.3f} x the best expert")


def loop_compute_seconds(report, pipelining) -> float:
    """Compute of the ops the pipeline's loops run once per step (M V + S - 1 times, or a
    multiple inside nested loops)."""
    return sum(s for runs, s in report.compute_s_by_runs
               if runs >= pipelining.iterations and runs % pipelining.iterations == 0)


def bubble_seconds(report, pipelining) -> float:
    return pipelining.bubble_fraction * loop_compute_seconds(report, pipelining)


def permute_seconds(report) -> float:
    return sum(c.total_seconds for c in report.collectives if c.kind == "collective-permute")


def where_time_goes(report, pipelining, hw) -> None:
    """The compiled pipelined step, split: FLOPs at peak, the bubble, the stage transfers,
    the other collectives, and the compute beyond the FLOPs (memory-bound ops)."""
    bound = report.flops / hw.flops
    bubble, permutes = bubble_seconds(report, pipelining), permute_seconds(report)
    loop = loop_compute_seconds(report, pipelining)
    print(f"  compute-only bound (this program's FLOPs at peak): {bound * 1e3:.2f} ms")
    print(f"  stage loop compute {loop * 1e3:.2f} ms, of which bubble ((S-1)/(MV+S-1) = "
          f"{pipelining.bubble_fraction:.1%}): {bubble * 1e3:.2f} ms")
    print(f"  stage transfers (collective-permute): {permutes * 1e3:.2f} ms")
    print(f"  rest: other collectives {(report.comm_s - permutes) * 1e3:.2f} ms; compute "
          f"outside the stage loop {(report.compute_s - loop) * 1e3:.2f} ms; compute beyond "
          f"the bound and the bubble (memory-bound ops) "
          f"{(report.compute_s - bound - bubble) * 1e3:.2f} ms")


def llama_70b(args):
    """Part 2's step: its config, its abstract train case, and its 8x8 mesh."""
    import autoshard
    from autoshard.zoo.models import gpt

    cfg = gpt.GPTConfig(vocab=128256, seq=2048, d_model=8192, heads=64, layers=80,
                        d_ff=28672, batch=64, dtype="bfloat16", lr=3e-4,
                        scan_layers=not args.unrolled)
    return cfg, gpt.train_case(config=cfg, abstract=True), autoshard.make_mesh(
        (8, 8), ("data", "model"))


def llama_part(args) -> None:
    import autoshard

    cfg, case, mesh = llama_70b(args)
    hw = hardware(autoshard)
    print(f"LLaMA-3-70B shape: {cfg.layers} {'unrolled' if args.unrolled else 'scanned'} "
          f"layers, d_model {cfg.d_model}, FFN {cfg.d_ff}, "
          f"batch {cfg.batch} x {cfg.seq}, bf16, Adam; {cfg.param_count() / 1e9:.1f}e9 "
          f"params (GELU MLP); mesh 8x8, budget 80 GB per device")
    started, cpu_started = time.perf_counter(), time.process_time()
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hw,
                          donate_argnums=case.donate_argnums, microbatches="auto",
                          remat="auto", pipeline=args.pipeline, progress=False)
    plan_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    m = plan.microbatching
    print(f"microbatches K = {m.microbatches if m else 1}, remat = "
          f"{(m.remat if m else None) or 'none'}")
    print("memory parts per device: " + ", ".join(
        f"{k} {v / 1e9:.2f} GB" for k, v in plan.memory_parts.items()))
    print(f"predicted peak {plan.cost.memory_bytes / 1e9:.2f} GB, step "
          f"{plan.cost.total_s:.3f} s (compute {plan.cost.compute_s:.3f} s, comm "
          f"{plan.cost.comm_s:.3f} s); planning took {plan_s:.1f} s")
    print(f"the chosen setting's program: {plan.stats.nodes} nodes, "
          f"{plan.stats.groups} groups, {plan.stats.solved_groups} solved")
    print("settings tried (planning seconds each: trace / cost / coarsen / solve):")
    for tried in plan.stats.settings:
        print(f"  {tried['setting']:32}{tried['plan_s']:>7.1f} s  ({stage_split(tried)})  "
              f"{tried['outcome']}"
              + (f", step {tried['step_s']:.3f} s" if tried["step_s"] is not None else ""))
    totals = {stage: sum((t["stage_s"] or {}).get(stage) or 0.0
                         for t in plan.stats.settings)
              for stage in ("trace", "cost", "coarsen", "solve")}
    print(f"planning {plan_s:.1f} s wall, {cpu_s:.1f} s CPU: " +
          ", ".join(f"{stage} {s:.1f} s" for stage, s in totals.items()))


def traces_part(args) -> None:
    """Part 2's step traced under each setting: the kept step against the whole step."""
    import gc

    from autoshard.frontend.trace import trace_program
    from autoshard.planning.fingerprint import program_fingerprint
    from autoshard.planning.settings import describe
    from autoshard.rewrite.accumulate import Microbatching, TraceRecord, microbatching
    from autoshard.rewrite.traces import Traces

    cfg, case, mesh = llama_70b(args)
    settings = [None] + [Microbatching(1, remat=r) for r in ("dots_saveable", "nothing_saveable")]
    settings += [Microbatching(k, ("model",), 8, remat="nothing_saveable") for k in (2, 4, 8)]
    # each keeps the loss's jaxprs across settings; only the first keeps the step
    kept, whole = Traces(), Traces(marking=False)
    print(f"LLaMA-3-70B shape, {cfg.layers} {'unrolled' if args.unrolled else 'scanned'} "
          "layers: seconds to trace each setting's program")
    print(f"  {'setting':40}{'kept step':>10}{'whole step':>12}  same program")
    totals = [0.0, 0.0]
    gc.disable()   # as planning traces (apply.collection_paused)
    trace_program(case.train_step, *case.args)   # JAX's own first-use costs, paid by neither
    for setting in settings:
        started = time.perf_counter()
        with microbatching(setting, TraceRecord(), mesh, kept):
            a = kept.program(case.train_step, case.args)
        middle = time.perf_counter()
        with microbatching(setting, TraceRecord(), mesh, whole):
            b = whole.program(case.train_step, case.args)
        ended = time.perf_counter()
        same = (program_fingerprint(a.closed_jaxpr, a.leaves)
                == program_fingerprint(b.closed_jaxpr, b.leaves))
        totals[0] += middle - started
        totals[1] += ended - middle
        print(f"  {describe(setting):40}{middle - started:>9.2f}s{ended - middle:>11.2f}s"
              f"  {same}")
    print(f"  {'all':40}{totals[0]:>9.2f}s{totals[1]:>11.2f}s")


def llama_8b_part(args) -> None:
    import autoshard
    from autoshard.cost import partitioner
    from autoshard.zoo.models import gpt

    cfg = gpt.GPTConfig(vocab=128256, seq=2048, d_model=4096, heads=32, layers=32,
                        d_ff=14336, batch=512, dtype="bfloat16", lr=3e-4,
                        scan_layers=not args.unrolled)
    case = gpt.train_case(config=cfg, abstract=True)
    mesh = autoshard.make_mesh((8, 8, 8), ("data", "fsdp", "model"))
    print(f"LLaMA-3-8B shape: {cfg.layers} {'unrolled' if args.unrolled else 'scanned'} "
          f"layers, d_model {cfg.d_model}, FFN "
          f"{cfg.d_ff}, batch {cfg.batch} x {cfg.seq}, bf16, Adam; mesh 8x8x8 (512 devices)")
    started = time.perf_counter()
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hardware(autoshard),
                          donate_argnums=case.donate_argnums, progress=False)
    plan_s = time.perf_counter() - started
    stages = plan.stats.stage_seconds()
    print(f"planning took {plan_s:.1f} s (target 5 s): " + ", ".join(
        f"{stage} {stages.get(stage) or 0.0:.1f} s" for stage in ("trace", "cost", "coarsen",
                                                                     "solve")))
    print(f"reshards followed: {partitioner._steps_on.cache_info().misses}; "
          f"{plan.stats.nodes} nodes, {plan.stats.groups} groups, "
          f"{plan.stats.solved_groups} solved")
    print(f"predicted peak {plan.cost.memory_bytes / 1e9:.2f} GB, step {plan.cost.total_s:.3f} s "
          f"(compute {plan.cost.compute_s:.3f} s, comm {plan.cost.comm_s:.3f} s)")


def unrolled_part(args) -> None:
    """The GPT of part 1 planned from its scanned and from its unrolled form."""
    import autoshard
    from autoshard.report.hlo_report import hlo_report
    from autoshard.zoo.models import gpt

    mesh = autoshard.make_mesh((2, 8), ("data", "model"))
    hw = hardware(autoshard)
    microbatches = "auto" if args.microbatches == "auto" else int(args.microbatches)
    print(f"GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq}, batch "
          f"{args.batch}, bf16, Adam; mesh 2x8; microbatches {microbatches}")
    print(f"{'model':10}{'options':28}{'predicted ms':>14}{'compiled ms':>13}"
          f"{'memory GB':>11}{'plan s':>8}  pipeline")
    steps = {}
    for options in ({"pipeline": "data", "microbatches": microbatches},
                    {"pipeline": "auto", "microbatches": microbatches}):
        for scanned in (True, False):
            case = gpt.train_case(config=gpt_config(args, scanned), abstract=True)
            started = time.perf_counter()
            plan = autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hw,
                                  donate_argnums=case.donate_argnums, progress=False,
                                  **options)
            plan_s = time.perf_counter() - started
            report = hlo_report(plan.jit().lower(*case.args).compile(), hw, mesh)
            model = "scanned" if scanned else "unrolled"
            steps[model, options["pipeline"]] = report.total_s
            label = ", ".join(f"{k}={v}" for k, v in options.items())
            print(f"{model:10}{label:28}{plan.cost.total_s * 1e3:>14.2f}"
                  f"{report.total_s * 1e3:>13.2f}{report.memory_bytes / 1e9:>11.2f}"
                  f"{plan_s:>8.1f}  {plan.pipeline.describe() if plan.pipeline else 'none'}")
    for pipeline in ("data", "auto"):
        ratio = steps["unrolled", pipeline] / steps["scanned", pipeline]
        print(f"pipeline={pipeline}: unrolled / scanned compiled step = {ratio:.3f} "
              f"(target <= 1.05)")


def stage_split(tried: dict) -> str:
    """A setting's planning seconds per stage, as ``plan.stats.settings`` lists them."""
    stages = tried.get("stage_s")
    if stages is None:
        return "not planned"
    return " / ".join(f"{stages.get(stage) or 0.0:.1f}"
                      for stage in ("trace", "cost", "coarsen", "solve"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("gpt", "70b", "unrolled", "8b", "traces", "all"),
                        default="all")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", default="auto",
                        help="pipeline microbatches in part 3: a count, or auto")
    parser.add_argument("--unrolled", action="store_true",
                        help="parts 2, 4 and 5: the layers a Python list of blocks, not a scan")
    parser.add_argument("--pipeline", default=None,
                        help="part 2: plan with this pipeline option too (a mesh axis, or "
                             "auto), searching pipelines instead of K alone")
    args = parser.parse_args()
    if args.part == "all":   # each part needs its own device count before JAX starts
        for part in ("gpt", "70b"):
            subprocess.run([sys.executable, __file__, "--part", part, "--layers",
                            str(args.layers), "--d-model", str(args.d_model), "--seq",
                            str(args.seq), "--batch", str(args.batch)], check=True)
            print()
        return
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES[args.part]}")
    {"gpt": gpt_part, "70b": llama_part, "unrolled": unrolled_part,
     "8b": llama_8b_part, "traces": traces_part}[args.part](args)


if __name__ == "__main__":
    main()
