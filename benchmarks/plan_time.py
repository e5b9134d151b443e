"""Planning time: trace, cost and solve seconds per case (2x4 mesh, H100 hardware).

Run: python benchmarks/plan_time.py [--skip-gpt]
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autoshard  # noqa: E402
from autoshard.testing import programs  # noqa: E402


def gpt_case(layers=12, d_model=2048):
    return programs.lm_1b_train_step_abstract(layers=layers, d_model=d_model)


def cases(skip_gpt: bool):
    out = [(p.name, p.fn, p.abstract_args()) for p in programs.all_programs()]
    inference = programs.inference_mlp(abstract=True)
    out.append(("inference_mlp 8192", inference.fn, inference.args))
    lm = programs.lm_1b_train_step_abstract()
    out.append(("lm_1b_train_step", lm.fn, lm.args))
    if not skip_gpt:
        gpt = gpt_case()
        out.append(("gpt 12 layers d2048 (Adam)", gpt.fn, gpt.args))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-gpt", action="store_true")
    args = parser.parse_args()
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    print(f"{'case':32}{'eqns':>8}{'groups':>8}{'trace s':>10}{'cost s':>10}{'solve s':>10}"
          f"{'total s':>10}  status")
    for name, fn, fn_args in cases(args.skip_gpt):
        start = time.perf_counter()
        plan = autoshard.plan(fn, *fn_args, mesh=mesh, time_limit_s=300)
        total = time.perf_counter() - start
        s = plan.solver
        print(f"{name:32}{s['nodes']:>8}{s['groups']:>8}{s['trace_s']:>10.2f}{s['cost_s']:>10.2f}"
              f"{s['solve_s']:>10.2f}{total:>10.2f}  {s['status']}", flush=True)


if __name__ == "__main__":
    main()
