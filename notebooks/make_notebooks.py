"""Write the notebooks of this folder from the cells below, without outputs.

    python notebooks/make_notebooks.py          # rewrites notebooks/*.ipynb

Edit the cells here rather than the .ipynb files, so the stored notebooks stay free of
outputs and their diffs stay readable.
"""

from __future__ import annotations

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).resolve().parent

SETUP = '''\
import os

# 8 simulated CPU devices; this must run before JAX starts its backend.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
%matplotlib inline

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import autoshard
from autoshard.report import judge, viz

print(jax.devices())'''


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


QUICKSTART = [
    md('''
# autoshard quickstart

Decorate a train step with `@autoshard.auto_shard`, call it as usual, and look at the plan
it made. Everything runs on 8 simulated CPU devices.
'''),
    code(SETUP),
    md('''
## A train step

A two-layer MLP classifier trained with SGD, written in plain JAX. Nothing in it mentions
devices or shardings.
'''),
    code('''
def init(key, d_in=256, d_hidden=512, classes=16):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d_in, d_hidden)) / d_in ** 0.5,
        "b1": jnp.zeros(d_hidden),
        "w2": jax.random.normal(k2, (d_hidden, classes)) / d_hidden ** 0.5,
        "b2": jnp.zeros(classes),
    }


def loss_fn(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    labels = jax.nn.one_hot(batch["y"], logits.shape[-1])
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def sgd_step(params, batch, lr=0.1):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


params = init(jax.random.key(0))
kx, ky = jax.random.split(jax.random.key(1))
batch = {"x": jax.random.normal(kx, (128, 256)), "y": jax.random.randint(ky, (128,), 0, 16)}
'''),
    md('''
## Shard it automatically

`auto_shard` plans on the first call (trace, price every strategy, solve) and caches the
plan per argument shapes. The mesh has Auto axes: `autoshard.make_mesh` builds them.
Donating the parameters lets XLA write the new ones into the old buffers, and keeps each
updated parameter in the spec it came in, ready for the next step.
'''),
    code('''
mesh = autoshard.make_mesh((2, 4), ("data", "model"))
train_step = autoshard.auto_shard(sgd_step, mesh=mesh, donate_argnums=(0,))

p = jax.tree.map(jnp.copy, params)      # the step donates (consumes) its parameters
for step in range(5):
    p, loss = train_step(p, batch)
    print(f"step {step}: loss {float(loss):.4f}")
'''),
    md('''
The same numbers as one device computes:
'''),
    code('''
expected, expected_loss = jax.jit(sgd_step)(params, batch)
got, got_loss = train_step(jax.tree.map(jnp.copy, params), batch)
print("max difference:", max(float(jnp.max(jnp.abs(a - b)))
                             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))))
print("w1 is laid out as", got["w1"].sharding.spec)
'''),
    md('''
## The plan

A plan renders as a table, largest first: each argument's spec and its bytes per device,
with the predicted step time and peak memory per device underneath. The same leaf of every
layer shares one row (`blocks[0..11]['attn']['query']['kernel']`), and optimizer state that
takes its parameter's spec is counted in the parameter's row (`+2 opt`);
`plan.summary(full=True)` and `viz.table(plan)` list every argument.
'''),
    code('''
plan = train_step.plan_for(params, batch)
plan
'''),
    code('''
print(viz.explain(plan, "params['w1']"))
'''),
    md('''
One tensor across the mesh: which device holds which block.
'''),
    code('''
viz.sharding(plan, "params['w1']")
'''),
    code('''
viz.sharding(plan, "batch['x']").show()
'''),
    md('''
## Predicted against compiled

`plan.report(*args)` compiles the plan and prices XLA's partitioned program with the same
hardware model: per-device compute, the collectives it really emits, and XLA's memory
analysis.
'''),
    code('''
print(plan.report(params, batch))
'''),
    code('''
viz.memory(plan, plan.report(params, batch)).plot()
'''),
]


EXPLORING = [
    md('''
# Exploring plans

Where a plan's time goes, how much memory it needs, how it differs from the plans people
write by hand, what other mesh shapes would do, and how to steer it with a memory budget or
pins, then save it and load it back.
'''),
    code(SETUP),
    code('''
from autoshard.testing import programs

# A 2-layer LM (10M parameters) with a hand-written Adam: fn(params, opt_state, batch).
lm = dict(batch=32, seq=128, d_model=512, d_ff=2048, vocab=4096, heads=8)
program = programs.transformer_train_step(**lm)
args = program.args

# H100-like devices whose "data" links (across nodes) are 9x slower than "model" links.
hw = autoshard.Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                        link_bandwidth={"data": 4e10, "model": 3.6e11}, link_latency=1e-5)
mesh = autoshard.make_mesh((2, 4), ("data", "model"))
plan = autoshard.plan(program.fn, *args, mesh=mesh, hardware=hw, donate_argnums=(0, 1))
plan
'''),
    md('''
## Where the time goes

The predicted step time per layer: compute, each kind of collective, and the resharding
between operations. Layers are named after the parameters their equations read; Adam's
moments count with their parameter's layer.
'''),
    code('''
viz.breakdown(plan)
'''),
    code('''
viz.breakdown(plan).plot()
'''),
    code('''
viz.breakdown(plan, by="primitive", top=8)
'''),
    md('''
## Memory per device

Parameters, optimizer state and data as the plan places them, plus outputs and the
temporaries live at the peak; beside them, XLA's memory analysis of the compiled plan.
'''),
    code('''
report = plan.report(*args)
view = viz.memory(plan, report)
view
'''),
    code('''
view.plot()
'''),
    md('''
## Against plans written by hand

Two expert plans as `in_shardings` pytrees: data parallel (replicate the model, split the
batch over every device) and FSDP (also split every weight and Adam moment along a dim 8
devices divide). `viz.diff` lists the arguments whose specs differ; `judge.compare` compiles
each plan and prices the program XLA built.
'''),
    code('''
everyone = ("data", "model")


def data_parallel(params, opt_state, batch):
    whole = NamedSharding(mesh, P())
    return (jax.tree.map(lambda _: whole, params), jax.tree.map(lambda _: whole, opt_state),
            jax.tree.map(lambda _: NamedSharding(mesh, P(everyone)), batch))


def fsdp_spec(x):
    for dim, size in enumerate(x.shape):
        if size % 8 == 0:
            return NamedSharding(mesh, P(*[None] * dim, everyone))
    return NamedSharding(mesh, P())


def fsdp(params, opt_state, batch):
    return (jax.tree.map(fsdp_spec, params), jax.tree.map(fsdp_spec, opt_state),
            jax.tree.map(lambda _: NamedSharding(mesh, P(everyone)), batch))


dp_shardings, fsdp_shardings = data_parallel(*args), fsdp(*args)
viz.diff(plan, fsdp_shardings, names=("auto", "fsdp"))
'''),
    code('''
comparison = judge.compare(program.fn, *args, candidates={
    "auto": plan, "data parallel": dp_shardings, "fsdp": fsdp_shardings})
print("fastest compiled plan:", comparison.best)
comparison
'''),
    code('''
comparison.plot()
'''),
    md('''
## What if the mesh had another shape?

The same 8 devices as 1×8, 2×4, 4×2 and 8×1 meshes of (`data`, `model`): one plan each.
The `data` axis has the slow links, so the shape matters.
'''),
    code('''
shapes = judge.what_if(program.fn, *args, mesh_shapes=[(1, 8), (2, 4), (4, 2), (8, 1)],
                     hardware=hw, donate_argnums=(0, 1))
print("fastest shape that fits:", shapes.best)
shapes
'''),
    code('''
shapes.plot()
'''),
    code('''
viz.diff(shapes[(2, 4)], shapes[(8, 1)], names=("2×4", "8×1"))
'''),
    md('''
## A tighter memory budget

On a wider MLP, ask for plans within 80%, 50% and 30% of the unconstrained plan's peak
memory. The planner gives up speed for memory by splitting weights; when nothing fits it
says how small it could get.
'''),
    code('''
mlp = programs.mlp_train_step(batch=64, d_in=256, d_hidden=1024, depth=3)
free = autoshard.plan(mlp.fn, *mlp.args, mesh=mesh, donate_argnums=(0,))
budgeted = {"no budget": free}
for fraction in (0.8, 0.5, 0.3):
    budget = fraction * free.cost.memory_bytes
    try:
        budgeted[f"{fraction:.0%}"] = autoshard.plan(mlp.fn, *mlp.args, mesh=mesh,
                                                     donate_argnums=(0,), memory_budget=budget)
    except autoshard.MemoryBudgetError as e:
        print(f"{fraction:.0%}: {e}")
for name, p in budgeted.items():
    print(f"{name:>10}: {viz.format_seconds(p.cost.total_s)}/step, "
          f"{viz.format_bytes(p.cost.memory_bytes)}/device")
'''),
    code('''
tight = budgeted[list(budgeted)[-1]]
viz.diff(free, tight, names=("no budget", "tightest"))
'''),
    code('''
viz.memory(tight).plot()
'''),
    md('''
## Pins: a partial plan of your own

Pin the embedding to a vocab-parallel split and the batch to the `data` axis; the planner
re-solves everything else around them.
'''),
    code('''
pins = {"params['embed']": P("model", None), "batch": P("data")}
pinned = autoshard.plan(program.fn, *args, mesh=mesh, hardware=hw, donate_argnums=(0, 1),
                        pins=pins)
print(viz.explain(pinned, "params['embed']"))
viz.diff(plan, pinned, names=("auto", "pinned"))
'''),
    md('''
## Save and load

A plan round-trips through JSON. Loaded, it needs its program back (`bind`) to run; the
views work straight away.
'''),
    code('''
import pathlib
import tempfile

path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
path.write_text(plan.to_json())
loaded = autoshard.Plan.from_json(path.read_text(), mesh=mesh)
print(len(viz.diff(plan, loaded)), "arguments differ after the round trip")
viz.breakdown(loaded, top=3)
'''),
    code('''
loaded = loaded.bind(program.fn, *args)
fresh = programs.transformer_train_step(**lm)   # new buffers: the step donates its inputs
_, _, loss = loaded.jit()(*fresh.args)
print("loss from the loaded plan:", float(loss))
'''),
    md('''
## Plans of abstract arguments

Nothing of the arguments' size is allocated when they are `jax.ShapeDtypeStruct`s: here two
256 MiB weights, planned and compiled without any of their memory.
'''),
    code('''
big = programs.inference_mlp(abstract=True)
big_plan = autoshard.plan(big.fn, *big.args, mesh=mesh)
print(viz.explain(big_plan, "params['w1']"))
viz.memory(big_plan, big_plan.report(*big.args))
'''),
]


ZOO = [
    md('''
# The model zoo: automatic against expert plans

Every model of `autoshard.zoo.models` at its `tiny` size, planned automatically and compared
with the expert plans that come with it (data parallel, FSDP, Megatron tensor parallel,
FSDP×TP, expert parallel for the MoE). Each plan is judged by its compiled program: XLA's
partitioned HLO priced with one hardware model, and XLA's memory analysis.
'''),
    code(SETUP),
    code('''
import time

from autoshard.zoo import experts, models

mesh = autoshard.make_mesh((2, 4), ("data", "model"))
hw = autoshard.H100
print(models.names())
'''),
    code('''
comparisons, plans = {}, {}
for name in models.names():
    started = time.perf_counter()
    case = models.train_case(name, "tiny")
    plans[name] = autoshard.plan(case.train_step, *case.args, mesh=mesh, hardware=hw,
                                 donate_argnums=case.donate_argnums)
    candidates = {"auto": plans[name]}
    for expert in case.experts:
        candidates[expert] = experts.inspect_expert(case, mesh, expert, hw)
    comparisons[name] = judge.compare(case.train_step, *case.args, candidates=candidates,
                                    hardware=hw)
    print(f"{name:>10}: {len(case.experts)} expert plans, "
          f"{time.perf_counter() - started:.1f} s")
'''),
    md('''
## Each model's plans
'''),
    code('''
for view in comparisons.values():
    display(view)
'''),
    md('''
## All models at once

Compiled step time of every plan divided by the fastest expert plan's for the same model
(1.0 is the fastest expert; lower is better; the axis is logarithmic).
'''),
    code('''
board = viz.scoreboard(comparisons)
for row in board.summary():
    print(f"{row['program']:>10}: auto {viz.format_seconds(row['candidate_s'])}, best expert "
          f"{row['best_other']} {viz.format_seconds(row['best_other_s'])} "
          f"({row['time_ratio']:.2f}x)")
board.plot()
'''),
    code('''
board
'''),
    md('''
## Where the automatic plan of one model spends its time
'''),
    code('''
name = models.names()[0]
viz.breakdown(plans[name]).plot()
'''),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_exploring_plans.ipynb": EXPLORING,
    "03_model_zoo.ipynb": ZOO,
}


def build(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def main() -> None:
    for filename, cells in NOTEBOOKS.items():
        nb = build(cells)
        nbformat.validate(nb)
        nbformat.write(nb, HERE / filename)
        print(f"wrote {filename}: {len(cells)} cells")


if __name__ == "__main__":
    main()
