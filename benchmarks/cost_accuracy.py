"""Cost-model accuracy on plans the solver did not choose.

For each program and mesh: every expert layout (data parallel, FSDP, Megatron, FSDP x TP,
expert parallel, ZeRO-1) and ``--random`` random partial pins, each planned with its pins
(the solver fills in the rest), compiled, and read with ``autoshard.report.hlo_report`` under the
same Hardware (an H100 node; on 8x2 the first axis crosses nodes, as in plan_quality.py).
Prints predicted vs compiled step time per plan, then per program and mesh the median and
worst |predicted / compiled - 1| and the Spearman rank correlation, and for the worst
offenders every term predicted against compiled: compute, each collective kind (the
resharding between operations counted in the kinds it compiles to), memory.

Run: python benchmarks/cost_accuracy.py [--programs gpt,moe,plain_lm,plain_moe,plain_cnn]
                                        [--meshes 8,2x4,8x2] [--random 20] [--worst 3]
     python benchmarks/cost_accuracy.py --programs clip   # plain_clip, haiku_clip,
         # linen_clip, equinox_clip: steps clipped to a global norm (the last three from
         # autoshard.testing.corpus at its "small" size; pip install -e ".[corpus]")
"""

import argparse
import dataclasses
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

import autoshard  # noqa: E402
from autoshard.frontend import specs  # noqa: E402
from autoshard.report.hlo_report import hlo_report  # noqa: E402
from autoshard.testing import plain  # noqa: E402
from autoshard.units import axis_sizes  # noqa: E402
from autoshard.zoo import experts, models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_quality import add_target_argument, hardware_for, mesh_for  # noqa: E402


class CorpusProgram:
    """A step from ``autoshard.testing.corpus`` (at its "small" size) as ``measure`` reads
    a train case: its step over held arguments, its expert layouts as pins, the paths of
    its arguments' leaves."""

    donate_argnums = ()

    def __init__(self, name: str):
        from autoshard.testing import corpus
        corpus.use_size("small")
        self.case = corpus.build(name)
        self.train_step = self.case.held_fn
        self.experts = {e: (lambda mesh, e=e: self.case.expert_in_shardings(mesh, e))
                        for e in self.case.expert_names()}

    def abstract_args(self) -> tuple:
        return self.case.abstract_args()

    def leaf_paths(self) -> list[str]:
        """Each argument leaf's path as ``autoshard.plan`` names the held step's (``*held``)."""
        return [p for i, arg in enumerate(self.case.abstract_args())
                for p in experts.leaf_paths(arg, f"args[{i}]")]


PROGRAMS = {
    "gpt": lambda: models.train_case("gpt", "small"),
    "moe": lambda: models.train_case("moe", "small"),
    "plain_lm": lambda: plain.lm("small"),
    "plain_moe": lambda: plain.moe("small"),
    "plain_cnn": lambda: plain.cnn("small"),
    # steps whose optimizer clips the gradients to one global norm before any update
    "plain_clip": lambda: plain.lm_clipped("small"),
    "haiku_clip": lambda: CorpusProgram("haiku_clip"),
    "linen_clip": lambda: CorpusProgram("linen_clip"),
    "equinox_clip": lambda: CorpusProgram("equinox_clip"),
}
GROUPS = {"clip": ("plain_clip", "haiku_clip", "linen_clip", "equinox_clip")}


@dataclasses.dataclass
class Measured:
    program: str
    mesh: str
    layout: str
    predicted_s: float
    compiled_s: float
    terms: dict          # term -> (predicted seconds or bytes, compiled)

    @property
    def error(self) -> float:
        return self.predicted_s / self.compiled_s - 1


def random_pins(case, mesh, seed: int, fraction: float = 0.5) -> dict:
    """Random valid specs for a random part of the arguments (path form). A train step
    returns its state first, and the donated state is written back there: each pinned
    leaf of a donated state has its output (``out[0]...``) pinned alike, as XLA aliases
    only buffers sharded alike."""
    rng = np.random.default_rng(seed)
    sizes = axis_sizes(mesh)
    if isinstance(case, CorpusProgram):   # nothing donated
        paths = [(p, None) for p in case.leaf_paths()]
    else:
        paths = ([("state" + p, "out[0]" + p if 0 in case.donate_argnums else None)
                  for p in experts.leaf_paths(case.state)]
                 + [(p, None) for p in experts.leaf_paths(case.make_batch(0), "batch")])
    pins = {}
    for (path, written_to), leaf in zip(paths, jax.tree.leaves(case.abstract_args())):
        if rng.random() < fraction:
            options = list(specs.enumerate_specs(leaf.shape, sizes))
            pins[path] = specs.to_partition_spec(options[rng.integers(len(options))])
            if written_to is not None:
                pins[written_to] = pins[path]
    return pins


def layouts(case, mesh, num_random: int) -> dict:
    abstract = case.abstract_args()
    out = {name: fn(mesh) for name, fn in case.experts.items()}
    out["zero1"] = experts.zero1(*abstract)(mesh)
    out.update({f"random{seed}": random_pins(case, mesh, seed) for seed in range(num_random)})
    return out


def terms_of(plan, report) -> dict:
    """Predicted and compiled seconds per term: compute, and per collective kind the
    collectives the chosen strategies make plus those resharding their operands (they
    compile to the same ops); the latencies combined collectives share (predicted only:
    compiled, they are in each collective); and bytes of memory."""
    predicted: dict = {"compute": plan.cost.compute_s}
    for item in plan.breakdown:
        for kinds in (item.comm_s_by_kind, item.reshard_s_by_kind):
            for kind, seconds in kinds.items():
                predicted[kind] = predicted.get(kind, 0.0) + seconds
    listed = sum(v for k, v in predicted.items() if k != "compute")
    predicted["shared latency"] = plan.cost.comm_s - listed
    compiled: dict = {"compute": report.compute_s}
    for c in report.collectives:
        compiled[c.kind] = compiled.get(c.kind, 0.0) + c.seconds * c.count
    out = {k: (predicted.get(k, 0.0), compiled.get(k, 0.0))
           for k in dict.fromkeys([*predicted, *compiled])}
    out["communication"] = (plan.cost.comm_s, report.comm_s)
    out["resharding (in the kinds above)"] = (plan.cost.reshard_s, None)
    out["memory bytes"] = (plan.cost.memory_bytes, report.memory_bytes)
    return out


SUMMED = ("communication", "resharding (in the kinds above)", "memory bytes")


def furthest_term(m: Measured) -> str:
    """The time term (compute, or a collective kind) furthest off, in seconds."""
    gaps = {k: abs(p - c) for k, (p, c) in m.terms.items()
            if k not in SUMMED and k != "shared latency"}
    name = max(gaps, key=gaps.get)
    p, c = m.terms[name]
    return f"{name} {p * 1e3:.4f} vs {c * 1e3:.4f} ms"


def term_lines(m: Measured) -> list[str]:
    """Every term of one plan, predicted against compiled."""
    lines = []
    for name, (p, c) in m.terms.items():
        if name == "memory bytes":
            lines.append(f"      {name:32} {p / 2**20:9.2f} {c / 2**20:9.2f} MiB")
        elif c is None:
            lines.append(f"      {name:32} {p * 1e3:9.4f} {'':>9} ms")
        else:
            lines.append(f"      {name:32} {p * 1e3:9.4f} {c * 1e3:9.4f} ms  "
                         f"{(p - c) * 1e3:+.4f}")
    return lines


def measure(program: str, case, mesh_name: str, num_random: int, target: str = "cpu"
            ) -> list[Measured]:
    mesh, hw = mesh_for(mesh_name, target), hardware_for(mesh_name, target)
    args = case.abstract_args()
    out = []
    for layout, pins in layouts(case, mesh, num_random).items():
        try:
            plan = autoshard.plan(case.train_step, *args, mesh=mesh, hardware=hw, pins=pins,
                                  donate_argnums=case.donate_argnums, progress=False)
            report = hlo_report(plan.jit().lower(*args).compile(), hw, mesh)
        except Exception as e:   # a layout the planner or XLA refuses is reported
            print(f"  {program} {mesh_name} {layout}: {type(e).__name__}: {e}"[:160],
                  file=sys.stderr)
            continue
        m = Measured(program, mesh_name, layout, plan.cost.total_s, report.total_s,
                     terms_of(plan, report))
        print(f"{program:10} {mesh_name:4} {layout:16} {m.predicted_s * 1e3:9.4f} "
              f"{m.compiled_s * 1e3:9.4f} {m.error * 100:+7.1f}%", flush=True)
        out.append(m)
    return out


def by_program_and_mesh(rows) -> dict:
    """Measured rows grouped by (program, mesh), in the order first seen."""
    groups: dict = {}
    for m in rows:
        groups.setdefault((m.program, m.mesh), []).append(m)
    return groups


def summarize(rows: list[Measured], worst: int) -> None:
    print(f"\n{'program':10} {'mesh':4} {'plans':>5} {'median':>8} {'worst':>8} {'spearman':>9}")
    groups = by_program_and_mesh(rows)
    for (program, mesh), group in groups.items():
        errors = np.abs([m.error for m in group])
        rho = stats.spearmanr([m.predicted_s for m in group],
                              [m.compiled_s for m in group]).statistic if len(group) > 2 else 1.0
        print(f"{program:10} {mesh:4} {len(group):5} {np.median(errors) * 100:7.1f}% "
              f"{errors.max() * 100:7.1f}% {rho:9.3f}")
    print("\nworst offenders: the term furthest off, then every term (predicted, compiled)")
    for (program, mesh), group in groups.items():
        for m in sorted(group, key=lambda m: -abs(m.error))[:worst]:
            print(f"{program:10} {mesh:4} {m.layout:16} {m.error * 100:+7.1f}%  "
                  f"{furthest_term(m)}")
            print("\n".join(term_lines(m)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="gpt,moe,plain_lm,plain_moe,plain_cnn",
                        help=f"comma-separated, from {', '.join(PROGRAMS)}, or clip")
    parser.add_argument("--meshes", default="8,2x4,8x2")
    parser.add_argument("--random", type=int, default=20, help="random pinned plans")
    parser.add_argument("--worst", type=int, default=3, help="offenders named per group")
    add_target_argument(parser)
    args = parser.parse_args(argv)
    print(f"{'program':10} {'mesh':4} {'layout':16} {'pred ms':>9} {'comp ms':>9} {'err':>8}")
    rows = []
    for program in [p for group in args.programs.split(",") for p in GROUPS.get(group, (group,))]:
        case = PROGRAMS[program]()
        for mesh_name in args.meshes.split(","):
            started = time.perf_counter()
            rows += measure(program, case, mesh_name, args.random, args.target)
            print(f"  {program} on {mesh_name}: {time.perf_counter() - started:.1f}s",
                  file=sys.stderr, flush=True)
    summarize(rows, args.worst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
