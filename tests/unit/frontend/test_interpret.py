"""trace and apply walk a program alike: every decision a plan holds names a node of the
traced graph, and apply looks up exactly the keys of the graph's equations and seams. A
key they spell differently would drop that decision's constraints without a word."""

import random

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.frontend import interpret
from autoshard.frontend.trace import trace
from autoshard.rewrite.apply import Rewriter
from autoshard.testing import fuzz
from autoshard.zoo import models


class RecordingRewriter(Rewriter):
    """apply's interpreter, noting every key it looks a decision up by."""

    def __init__(self, decisions, mesh):
        super().__init__(decisions, mesh)
        self.looked_up = set()

    def decision(self, key):
        self.looked_up.add(key)
        return super().decision(key)


def check_keys(fn, args, mesh):
    graph = trace(fn, *args)
    plan = autoshard.plan(fn, *args, mesh=mesh, cache=False, progress=False)
    node_keys = {n.key for n in graph.nodes}
    assert len(node_keys) == len(graph.nodes), "two nodes share a key"
    assert set(plan.decisions) <= node_keys
    rewriter = RecordingRewriter(plan.decisions, mesh)
    closed = graph.closed_jaxpr
    leaves = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in
              (graph.values[graph.nodes[i].outputs[0]] for i in graph.arg_nodes)]
    jax.make_jaxpr(lambda *a: rewriter.run(closed.jaxpr, closed.consts, a, ()))(*leaves)
    decided = {n.key for n in graph.nodes if n.kind in ("eqn", "boundary")}
    assert rewriter.looked_up == decided
    return graph


def control_flow_program():
    """A scan inside a cond branch, a while loop with a constant, a fori loop, custom_vjp
    and remat."""
    @jax.custom_vjp
    def clip(x):
        return jnp.clip(x, -1, 1)
    clip.defvjp(lambda x: (clip(x), None), lambda _, g: (g,))

    @jax.checkpoint
    def block(x, w):
        return jnp.tanh(x @ w)

    def scanned(x, ws):
        return jax.lax.scan(lambda c, w: (block(c, w), c.sum()), x, ws)

    def fn(x, ws, n):
        h, sums = jax.lax.cond(n.sum() > 0, scanned, lambda x, ws: (x * 2.0, ws[:, 0, 0]),
                               x, ws)
        h = jax.lax.fori_loop(0, 3, lambda i, c: clip(c) * 0.5, h)
        i, h = jax.lax.while_loop(lambda s: s[0] < n.sum() % 4,
                                  lambda s: (s[0] + 1, jnp.cos(s[1]) * x),   # x: a constant
                                  (jnp.int32(0), h))
        return h, sums, i

    args = (jax.ShapeDtypeStruct((16, 32), jnp.float32),
            jax.ShapeDtypeStruct((4, 32, 32), jnp.float32),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    return fn, args


def test_control_flow_keys(mesh):
    graph = check_keys(*control_flow_program(), mesh)
    primitives = {n.primitive for n in graph.nodes}
    assert {"loop_const", "loop_carry", "loop_xs", "loop_ys", "branch_in",
            "branch_out"} <= primitives
    keys = [n.key for n in graph.nodes]
    assert any("custom_vjp_call" in k for k in keys) and any("remat2" in k for k in keys)


def test_seam_keys_spell_the_scheme():
    # The scheme itself, read by both interpreters: eqn 3 of a scan body at eqn 5.
    scan = interpret.eqn_key((), 5)
    assert interpret.eqn_key(interpret.body_key(scan), 3) == (5, "body", 3)
    assert interpret.carry_key(scan, 1) == (5, "carry", 1)
    assert interpret.branch_key(scan, 2) == (5, "branch2")
    assert interpret.inlined_key(scan, "jit") == (5, "jit")


def fuzz_programs(seeds):
    for seed in seeds:
        case = fuzz.generate(fuzz.RandomDraw(seed))
        fn = fuzz.compile_source(case.source)
        args = [jax.ShapeDtypeStruct(a.shape, jnp.dtype(a.dtype)) for a in case.args]
        shape, names = fuzz.MESHES[case.mesh]
        yield seed, fn, args, autoshard.make_mesh(shape, names)


@pytest.mark.parametrize("seed", range(4))
def test_generated_program_keys(seed):
    (_, fn, args, mesh), = fuzz_programs([seed])
    check_keys(fn, args, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("seed", random.Random(21).sample(range(10_000), 24))
def test_more_generated_program_keys(seed):
    (_, fn, args, mesh), = fuzz_programs([seed])
    check_keys(fn, args, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_scan", "moe", "resnet"])
def test_zoo_keys(name, mesh_2d):
    case = models.train_case(name, "tiny")
    check_keys(case.train_step, case.abstract_args(), mesh_2d)


def test_interpreters_cover_the_same_control_flow():
    from autoshard.frontend import trace as trace_module
    from autoshard.rewrite import apply
    assert set(apply.CONTROL_FLOW_RULES) == set(trace_module.CONTROL_FLOW_RULES) \
        == set(interpret.CONTROL_FLOW)
    assert set(interpret.REMAT) <= set(interpret.INLINED)
