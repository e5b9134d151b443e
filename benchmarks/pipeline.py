"""Pipeline, gradient accumulation and rematerialization, chosen by the planner.

Part 1 (``--part gpt``): a GPT train step (scanned layers, Adam, bf16) on 16 simulated
devices as two nodes, mesh 2x8 whose first axis crosses nodes (4e10 B/s against 3.6e11
inside a node). The auto plan with a pipeline allowed (``pipeline="auto"``,
``microbatches="auto"``) is compiled beside every expert plan (data parallel, FSDP,
Megatron, FSDP x TP) and each compiled program is priced by ``autoshard.inspect`` with
the same hardware. It prints the compute-only bound, the bubble, the stage transfers and
where the rest goes.

Part 2 (``--part 70b``): a LLaMA-3-70B-shaped step (80 layers, d_model 8192, FFN 28672,
Adam, bf16, batch 64 x 2048 tokens) planned from abstract arguments on 8x8 within 80 GB
per device with ``microbatches="auto"`` and ``remat="auto"``: memory parts, K, the remat
choice, predicted step time and planning time. (The zoo's GPT has a GELU MLP: two FFN
matrices a layer where LLaMA's SwiGLU has three, so the shape holds ~56e9 parameters.)

    python benchmarks/pipeline.py                 # both parts, each in its own process
    python benchmarks/pipeline.py --part gpt --layers 8 --d-model 2048
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEVICES = {"gpt": 16, "70b": 64}


def hardware(autoshard):
    return autoshard.Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                              link_bandwidth={"data": 4e10, "model": 3.6e11},
                              link_latency=1e-5)


def gpt_part(args) -> None:
    import jax
    import autoshard
    from autoshard import experts
    from autoshard.inspect import inspect
    from autoshard.models import gpt

    cfg = gpt.GPTConfig(vocab=32000, seq=args.seq, d_model=args.d_model, heads=16,
                        layers=args.layers, d_ff=4 * args.d_model, batch=args.batch,
                        dtype="bfloat16", lr=3e-4, scan_layers=True)
    case = gpt.train_case(config=cfg, abstract=True)
    mesh = autoshard.make_mesh((2, 8), ("data", "model"))
    hw = hardware(autoshard)
    print(f"GPT {cfg.layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, seq {cfg.seq}, "
          f"batch {cfg.batch}, bf16, Adam; {cfg.param_count() / 1e9:.2f}e9 params; "
          f"mesh 2x8 (data 4e10 B/s across nodes, model 3.6e11 B/s)")
    rows = []
    for name in case.experts:
        started = time.perf_counter()
        report = inspect(experts.compile_expert(case, mesh, name), hw, mesh)
        rows.append((name, report, time.perf_counter() - started))
    started = time.perf_counter()
    gpipe = inspect(experts.jit_gpipe(case, mesh, microbatches=4).lower(*case.args).compile(),
                    hw, mesh)
    hand = [("gpipe (hand, M=4)", gpipe, time.perf_counter() - started)]
    started = time.perf_counter()
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hw,
                          donate_argnums=case.donate_argnums, pipeline="auto",
                          microbatches="auto", progress=False)
    plan_s = time.perf_counter() - started
    auto = inspect(plan.jit().lower(*case.args).compile(), hw, mesh)
    print(f"\n{'plan':16}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}{'memory GB':>11}"
          f"{'fits':>6}")
    for name, report, _ in rows + hand + [("auto", auto, plan_s)]:
        print(f"{name:16}{report.total_s * 1e3:>10.2f}{report.compute_s * 1e3:>12.2f}"
              f"{report.comm_s * 1e3:>10.2f}{report.memory_bytes / 1e9:>11.2f}"
              f"{'yes' if report.memory_bytes <= hw.memory else 'no':>6}")
    feasible = [r for _, r, _ in rows if r.memory_bytes <= hw.memory] or [r for _, r, _ in rows]
    best = min(r.total_s for r in feasible)
    print(f"\nauto / best non-pipelined expert: {auto.total_s / best:.3f} (target <= 0.75); "
          f"planned in {plan_s:.1f} s")
    print(f"auto plan: {plan.pipeline.describe() if plan.pipeline else 'no pipeline'}"
          + (f"; {plan.microbatching}" if plan.microbatching else ""))
    bound = auto.flops / hw.flops
    permutes = sum(c.total_seconds for c in auto.collectives if c.kind == "collective-permute")
    bubble = plan.pipeline.bubble_fraction * auto.compute_s if plan.pipeline else 0.0
    print(f"compute-only bound (this program's FLOPs at peak): {bound * 1e3:.2f} ms")
    print(f"bubble ((S-1)/(M+S-1) of compute): {bubble * 1e3:.2f} ms")
    print(f"stage transfers (collective-permute): {permutes * 1e3:.2f} ms")
    print(f"rest: other collectives {(auto.comm_s - permutes) * 1e3:.2f} ms, compute beyond "
          f"the bound and the bubble (memory-bound ops) "
          f"{(auto.compute_s - bound - bubble) * 1e3:.2f} ms")


def llama_part(args) -> None:
    import autoshard
    from autoshard.models import gpt

    cfg = gpt.GPTConfig(vocab=128256, seq=2048, d_model=8192, heads=64, layers=80,
                        d_ff=28672, batch=64, dtype="bfloat16", lr=3e-4, scan_layers=True)
    case = gpt.train_case(config=cfg, abstract=True)
    mesh = autoshard.make_mesh((8, 8), ("data", "model"))
    hw = hardware(autoshard)
    print(f"LLaMA-3-70B shape: {cfg.layers} layers, d_model {cfg.d_model}, FFN {cfg.d_ff}, "
          f"batch {cfg.batch} x {cfg.seq}, bf16, Adam; {cfg.param_count() / 1e9:.1f}e9 "
          f"params (GELU MLP); mesh 8x8, budget 80 GB per device")
    started = time.perf_counter()
    plan = autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hw,
                          donate_argnums=case.donate_argnums, microbatches="auto",
                          remat="auto", progress=False)
    plan_s = time.perf_counter() - started
    m = plan.microbatching
    print(f"microbatches K = {m.microbatches if m else 1}, remat = "
          f"{(m.remat if m else None) or 'none'}")
    print("memory parts per device: " + ", ".join(
        f"{k} {v / 1e9:.2f} GB" for k, v in plan.memory_parts.items()))
    print(f"predicted peak {plan.cost.memory_bytes / 1e9:.2f} GB, step "
          f"{plan.cost.total_s:.3f} s (compute {plan.cost.compute_s:.3f} s, comm "
          f"{plan.cost.comm_s:.3f} s); planning took {plan_s:.1f} s")
    print(f"the chosen setting's program: {plan.solver['nodes']} nodes, "
          f"{plan.solver['groups']} groups, {plan.solver['solved_groups']} solved")
    print("settings tried (planning seconds each):")
    for tried in plan.solver.get("settings", []):
        print(f"  {tried['setting']:32}{tried['plan_s']:>7.1f} s  {tried['outcome']}"
              + (f", step {tried['step_s']:.3f} s" if tried["step_s"] is not None else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("gpt", "70b", "all"), default="all")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
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
    (gpt_part if args.part == "gpt" else llama_part)(args)


if __name__ == "__main__":
    main()
