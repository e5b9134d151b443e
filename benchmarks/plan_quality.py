"""Plan quality: the auto plan against the expert plans, all judged by their compiled HLO.

For each case and mesh, compiles the auto plan and every expert plan with the same
Hardware (an H100 node; on the 8x2 mesh the first axis crosses nodes and gets the
inter-node bandwidth), prices each compiled program with ``autoshard.report.hlo_report`` and prints
one table: step time, compute, communication, memory per device, feasible under the
budget, and auto / best feasible expert (INFEASIBLE when auto's compiled memory breaks the
budget; an expert XLA fails to compile is a FAILED row), then their geometric mean. A
second table puts the planner's prediction beside the compiled figures of the auto plan.
Experts are written as practitioners write them: Megatron, FSDP and FSDP x TP also
constrain the activations the models name (MaxText-style logical rules, see
``experts.constrain``), and the train steps carry ZeRO-1 and ZeRO-2 (gradients constrained
to the optimizer state's layout) beside their experts; plain_lm, plain_moe and plain_cnn are
train steps written in plain JAX (autoshard.testing.plain).

Run: python benchmarks/plan_quality.py [--cases gpt,moe,resnet,inference,gpt_budget,
                                                plain_lm,plain_moe,plain_cnn]
                                       [--meshes 8,2x4,8x2] [--json out.json]
     python benchmarks/plan_quality.py --cases mlp,vit,gpt_scan      # the rest of the zoo
     python benchmarks/plan_quality.py --cases corpus --meshes 8,2x4 [--corpus-size medium]
         # models from the libraries people use (autoshard.testing.corpus; pip install -e
         ".[corpus]"), or a comma list of gpt2, llama, bert, equinox_lm, haiku_lm, keras_lm,
         linen_cnn; "medium" builds them at d_model 512, batch 64 x 128 tokens
     python benchmarks/plan_quality.py --cases plain_clip,haiku_clip,linen_clip,equinox_clip \
         --corpus-size small   # steps clipped to a global norm before their optimizer
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16").strip()
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import autoshard  # noqa: E402
from autoshard.errors import MemoryBudgetError  # noqa: E402
from autoshard.report.hlo_report import hlo_report  # noqa: E402
from autoshard.target import hardware  # noqa: E402
from autoshard.testing import plain, programs  # noqa: E402
from autoshard.zoo import experts, models  # noqa: E402

NVLINK = 3.6e11        # bytes/s per device inside a node
INTER_NODE = 4e10      # bytes/s per device between nodes
MESHES = {"8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "model")),
          "8x2": ((8, 2), ("data", "model"))}


def hardware_for(mesh_name: str, target: str = "cpu") -> autoshard.Hardware:
    """An H100 node; on 8x2 (two nodes of 8) the first axis crosses the node boundary. A
    GPU target's mesh is priced as ``autoshard.plan`` prices it (the kind's profile, the
    axes between hosts at the inter-node bandwidth): for H100s the same figures."""
    if target != "cpu":
        return hardware.default_hardware(mesh_for(mesh_name, target))
    names = MESHES[mesh_name][1]
    inter = {names[0]: INTER_NODE} if mesh_name == "8x2" else {}
    return autoshard.Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                              link_bandwidth={n: inter.get(n, NVLINK) for n in names},
                              link_latency=1e-5)


def mesh_for(mesh_name: str, target: str = "cpu"):
    """The mesh of simulated CPU devices (``target`` "cpu", compiled by XLA:CPU), or of
    deviceless GPUs of that kind on hosts of 8 (compiled by XLA:GPU)."""
    shape, names = MESHES[mesh_name]
    if target != "cpu":
        return autoshard.target_mesh(target, shape, names)
    n = 1
    for s in shape:
        n *= s
    return autoshard.make_mesh(shape, names, devices=jax.devices()[:n])


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="cpu",
                        help="cpu (simulated devices, XLA:CPU) or a GPU kind compiled for "
                             "without one, e.g. h100 (XLA:GPU; pip install -e \".[cuda]\")")


@dataclasses.dataclass
class Case:
    """A program, its abstract args, and expert in_shardings by name (fn of mesh)."""

    name: str
    fn: object
    args: tuple
    experts: dict
    out_shardings: object = None       # fn(mesh, in_shardings) -> out_shardings
    donate_argnums: tuple = ()
    budget_fraction_of_dp: float | None = None   # budget = this x data parallel's memory


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def zoo_case(model: str, size: str = "small", **kw) -> Case:
    case = models.train_case(model, size, abstract=True)
    return train_case_entry(case, f"{model}/{size}", **kw)


def train_case_entry(case, name: str | None = None, **kw) -> Case:
    """A ``TrainCase`` with its experts, ZeRO-1 and ZeRO-2 (state out as it came in)."""
    args = _abstract(case.args)
    return Case(name or case.name, case.train_step, args,
                {**case.experts, "zero1": experts.zero1(*args), "zero2": experts.zero2(*args)},
                lambda mesh, ins: (ins[0], NamedSharding(mesh, P())),
                tuple(case.donate_argnums), **kw)


def plain_case(name: str, size: str = "small") -> Case:
    """A plain-JAX train step (no flax, Adam by tree maps) from autoshard.testing.plain."""
    return train_case_entry(plain.train_case(name, size))


def inference_case() -> Case:
    """Big weights, small batch: y = gelu(x @ W1) @ W2, W 8192x8192, batch 16."""
    program = programs.inference_mlp(abstract=True)
    params, x = program.args

    def tensor_parallel(mesh):
        model = experts.role_axes(mesh, experts.MODEL)
        return ({"w1": NamedSharding(mesh, P(None, model)),
                 "w2": NamedSharding(mesh, P(model, None))}, NamedSharding(mesh, P()))

    def data_parallel(mesh):
        return (jax.tree.map(lambda _: NamedSharding(mesh, P()), params),
                NamedSharding(mesh, experts.fit_spec(P(experts.BATCH), x.shape, mesh)))

    return Case("inference_mlp", program.fn, program.args,
                {"tensor_parallel": tensor_parallel, "data_parallel": data_parallel},
                lambda mesh, ins: NamedSharding(mesh, P()))


def corpus_case(name: str) -> Case:
    """A model from autoshard.testing.corpus, its step as the library's users write it."""
    from autoshard.testing import corpus
    case = corpus.build(name)
    return Case(f"{name}", case.held_fn, case.abstract_args(),
                {e: (lambda mesh, e=e: case.expert_in_shardings(mesh, e))
                 for e in case.expert_names()},
                case.expert_out_shardings)


CORPUS = ("gpt2", "llama", "bert", "equinox_lm", "haiku_lm", "keras_lm", "linen_cnn")

CASES = {
    "gpt": lambda: zoo_case("gpt"),
    "moe": lambda: zoo_case("moe"),
    "resnet": lambda: zoo_case("resnet"),
    "inference": inference_case,
    "gpt_budget": lambda: dataclasses.replace(zoo_case("gpt"), name="gpt/small budget",
                                              budget_fraction_of_dp=0.6),
    # the rest of the zoo's small sizes
    "mlp": lambda: zoo_case("mlp"),
    "vit": lambda: zoo_case("vit"),
    "gpt_scan": lambda: zoo_case("gpt_scan"),
    # models from the libraries people use (tiny configs, dropout on)
    **{name: (lambda name=name: corpus_case(name)) for name in CORPUS},
    # train steps written in plain JAX, the way people write them without a framework
    "plain_lm": lambda: plain_case("plain_lm"),
    "plain_moe": lambda: plain_case("plain_moe"),
    "plain_cnn": lambda: plain_case("plain_cnn"),
    # steps whose optimizer clips the gradients to one global norm before any update
    "plain_clip": lambda: plain_case("plain_lm_clip"),
    **{name: (lambda name=name: corpus_case(name))
       for name in ("haiku_clip", "linen_clip", "equinox_clip")},
}
GROUPS = {"corpus": CORPUS}
DEFAULT_CASES = ("gpt", "moe", "resnet", "inference", "gpt_budget", "plain_lm", "plain_moe",
                 "plain_cnn")


@dataclasses.dataclass
class Row:
    case: str
    mesh: str
    plan: str
    step_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    budget: float
    predicted_s: float | None = None
    predicted_bytes: float | None = None
    note: str = ""

    @property
    def feasible(self) -> bool:
        return self.memory_bytes <= self.budget

    @property
    def failed(self) -> bool:
        return self.note.startswith("FAILED")


def compile_expert(case: Case, mesh, name: str):
    """The expert's step compiled: its in/out shardings, traced under its activation and
    gradient constraints."""
    expert = experts.as_expert(case.experts[name])
    ins = expert(mesh)
    outs = case.out_shardings(mesh, ins) if case.out_shardings else None
    jitted = jax.jit(expert.wrap(case.fn, mesh), in_shardings=ins, out_shardings=outs,
                     donate_argnums=case.donate_argnums)
    return jitted.lower(*case.args).compile()


def run_case(case: Case, mesh_name: str, target: str = "cpu") -> list[Row]:
    mesh, hw = mesh_for(mesh_name, target), hardware_for(mesh_name, target)
    rows, reports = [], {}
    for name in case.experts:
        try:
            reports[name] = hlo_report(compile_expert(case, mesh, name), hw, mesh)
        except Exception as e:  # an expert plan XLA cannot compile is a failure row
            reports[name] = f"FAILED {type(e).__name__}: {e}"[:120]
            print(f"  {case.name} {mesh_name} {name}: {reports[name]}", file=sys.stderr)
    budget = hw.memory
    if case.budget_fraction_of_dp is not None:
        budget = case.budget_fraction_of_dp * reports["data_parallel"].memory_bytes
    nan = float("nan")
    for name, r in reports.items():
        if isinstance(r, str):
            rows.append(Row(case.name, mesh_name, name, nan, nan, nan, float("inf"), budget,
                            note=r))
            continue
        rows.append(Row(case.name, mesh_name, name, r.total_s, r.compute_s, r.comm_s,
                        r.memory_bytes, budget))
    started = time.perf_counter()
    try:
        plan = autoshard.plan(case.fn, *case.args, mesh=mesh, hardware=hw,
                              memory_budget=budget, donate_argnums=case.donate_argnums)
    except MemoryBudgetError as e:
        rows.append(Row(case.name, mesh_name, "auto", float("nan"), float("nan"), float("nan"),
                        float("inf"), budget, note=str(e)[:80]))
        return rows
    planned = time.perf_counter() - started
    r = hlo_report(plan.jit().lower(*case.args).compile(), hw, mesh)
    rows.append(Row(case.name, mesh_name, "auto", r.total_s, r.compute_s, r.comm_s,
                    r.memory_bytes, budget, plan.cost.total_s, plan.cost.memory_bytes,
                    note=f"planned in {planned:.1f}s"))
    return rows


def ratio(rows: list[Row], auto: Row) -> float:
    """auto / the best feasible expert; infinite when auto breaks the budget."""
    if not auto.feasible:
        return float("inf")
    feasible = [r.step_s for r in rows if r.plan != "auto" and r.feasible]
    return auto.step_s / min(feasible) if feasible else float("nan")


def ratio_text(value: float) -> str:
    return "INFEASIBLE" if value == float("inf") else f"{value:9.3f}"


def print_tables(rows: list[Row]) -> None:
    print(f"\n{'case':18} {'mesh':5} {'plan':16} {'step ms':>9} {'compute':>9} {'comm':>9} "
          f"{'mem MiB':>9} {'budget':>9} {'fits':>5} {'auto/best':>9}")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.case, r.mesh), []).append(r)
    for (case, mesh), group in groups.items():
        auto = next(r for r in group if r.plan == "auto")
        for r in group:
            if r.failed:
                print(f"{case:18} {mesh:5} {r.plan:16} {r.note}")
                continue
            mark = ratio_text(ratio(group, auto)) if r is auto else ""
            print(f"{case:18} {mesh:5} {r.plan:16} {r.step_s * 1e3:9.4f} "
                  f"{r.compute_s * 1e3:9.4f} {r.comm_s * 1e3:9.4f} "
                  f"{r.memory_bytes / 2**20:9.1f} {r.budget / 2**20:9.0f} "
                  f"{'yes' if r.feasible else 'NO':>5} {mark}")
    ratios = [ratio(g, next(r for r in g if r.plan == "auto")) for g in groups.values()]
    finite = [x for x in ratios if 0 < x < float("inf")]
    if finite:
        mean = math.exp(sum(math.log(x) for x in finite) / len(finite))
        print(f"\nauto / best feasible expert: geometric mean {mean:.3f} over {len(finite)} "
              f"cases, worst {max(finite):.3f}; auto infeasible on "
              f"{sum(x == float('inf') for x in ratios)}")
    print(f"\npredicted vs compiled (auto plan)\n{'case':18} {'mesh':5} {'pred ms':>9} "
          f"{'comp ms':>9} {'err':>7} {'pred MiB':>9} {'comp MiB':>9} {'err':>7}")
    for r in rows:
        if r.plan != "auto" or r.predicted_s is None:
            continue
        print(f"{r.case:18} {r.mesh:5} {r.predicted_s * 1e3:9.4f} {r.step_s * 1e3:9.4f} "
              f"{(r.predicted_s / r.step_s - 1) * 100:+6.1f}% "
              f"{r.predicted_bytes / 2**20:9.1f} {r.memory_bytes / 2**20:9.1f} "
              f"{(r.predicted_bytes / r.memory_bytes - 1) * 100:+6.1f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, from {', '.join(CASES)}, or corpus")
    parser.add_argument("--meshes", default=",".join(MESHES))
    add_target_argument(parser)
    parser.add_argument("--json", default=None, help="write every row to this file")
    parser.add_argument("--corpus-size", default="tiny", choices=("tiny", "small", "medium"),
                        help="size of the corpus models (autoshard.testing.corpus.SIZES)")
    args = parser.parse_args(argv)
    if args.corpus_size != "tiny":
        from autoshard.testing import corpus
        corpus.use_size(args.corpus_size)
    rows = []
    names = [n for group in args.cases.split(",") for n in GROUPS.get(group, (group,))]
    for case_name in names:
        case = CASES[case_name]()
        for mesh_name in args.meshes.split(","):
            started = time.perf_counter()
            rows += run_case(case, mesh_name, args.target)
            print(f"  {case.name} on {mesh_name}: {time.perf_counter() - started:.1f}s",
                  file=sys.stderr, flush=True)
    print_tables(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(dataclasses.asdict(r), feasible=r.feasible) for r in rows], f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
