"""Coarsening, reuse of repeated layers, and the plan cache.

Layers: the reduced request is exact (random requests, every class-consistent choice);
dropping dominated strategies never changes the optimum (brute force); on an unrolled
transformer, reuse finds the layers, prices within 1 % of solving every group alone, and
the reused plan computes what one device computes; plans are deterministic and cached.
"""

import dataclasses
import io
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.planning import cache as plan_cache
from autoshard.planning import progress
from autoshard.solver import coarsen
from autoshard.solver.request import (
    CopyTerm,
    GroupTerm,
    LiveRows,
    PairTerm,
    Request,
    SharedEdgeCost,
    evaluate,
)
from autoshard.solver.solve import solve
from autoshard.testing import programs
from autoshard.testing.requests import brute_force
from autoshard.zoo import models

# Slow devices and cheap links: even tiny layers gain from being split, so every layer
# has a real choice to make.
SLOW = autoshard.Hardware(flops=1e9, hbm_bandwidth=1e9, memory=1e9, link_bandwidth=1e10,
                          link_latency=1e-7)


def random_request(rng, groups=6, strategies=3, edges=8, budget=None) -> Request:
    sizes = [strategies] * groups
    edge_list = []
    for _ in range(edges):
        u, v = sorted(rng.choice(groups, 2, replace=False))
        edge_list.append((int(u), int(v), rng.random((sizes[u], sizes[v]))))
    terms = [GroupTerm(g, rng.random(sizes[g]) * 10) for g in range(groups)]
    rows = LiveRows(terms=range(1, groups), starts=range(1, groups),
                    ends=[min(g + 2, groups) for g in range(1, groups)], points=range(groups))
    return Request(node_costs=[rng.random(s) for s in sizes], edges=edge_list,
                   memory_terms=terms, fixed_terms=[0], memory_rows=rows,
                   memory_budget=budget)


CLASS_OF = np.array([0, 1, 0, 1, 2, 2])   # groups 0 and 2 choose alike, and so on


def assert_quotient_exact(request: Request, class_of: np.ndarray = CLASS_OF) -> None:
    """The reduced request prices (and weighs) every class-consistent choice as the full
    one does."""
    reduced = coarsen.quotient(request, class_of)
    for choice in itertools.product(range(3), repeat=int(class_of.max()) + 1):
        full = np.asarray(choice)[class_of]
        np.testing.assert_allclose(evaluate(reduced, choice), evaluate(request, full))


def test_live_rows_sum_what_they_hold():
    rows = LiveRows(terms=[0, 1, 2], starts=[0, 1, 3], ends=[2, 4, 3], points=[1, 2, 3, 4],
                    explicit=[(0, 2)])
    values = np.array([1.0, 10.0, 100.0])
    assert [rows[r] for r in range(len(rows))] == [(0, 1), (0, 1), (1, 2), (1,), (0, 2)]
    np.testing.assert_allclose(rows.sums(values), [11, 11, 110, 10, 101])


@pytest.mark.parametrize("seed", range(5))
def test_quotient_prices_every_class_consistent_choice_exactly(seed):
    rng = np.random.default_rng(seed)
    assert_quotient_exact(random_request(rng))


@pytest.mark.parametrize("seed", range(5))
def test_dropping_dominated_strategies_keeps_the_optimum(seed):
    rng = np.random.default_rng(seed)
    request = random_request(rng, groups=5, strategies=4, edges=4)
    # make some strategies dominated: a copy of another, only dearer
    costs = [c.copy() for c in request.node_costs]
    costs[0][3] = costs[0][1] + 1.0
    edges = [(u, v, m.copy()) for u, v, m in request.edges]
    for u, v, m in edges:
        if u == 0:
            m[3, :] = m[1, :]
        if v == 0:
            m[:, 3] = m[:, 1]
    terms = [GroupTerm(g, b.copy()) for g, b in request.memory_terms]
    terms[0].num_bytes[3] = terms[0].num_bytes[1]
    request = Request(node_costs=costs, edges=edges, memory_terms=terms,
                      fixed_terms=request.fixed_terms, memory_rows=request.memory_rows,
                      memory_budget=12.0)
    pruned = coarsen.drop_dominated(request)
    assert 3 not in pruned.allowed[0]
    assert brute_force(pruned) == pytest.approx(brute_force(request))


@pytest.mark.parametrize("seed", range(3))
def test_coarsening_keeps_memory_that_depends_on_two_groups(seed):
    # edge memory terms (a resharded copy: bytes per pair of strategies) on pairs that
    # fall in two classes and in one class; rows hold them beside the group terms
    rng = np.random.default_rng(seed)
    base = random_request(rng, groups=6, strategies=3, edges=6)
    pairs = [(0, 1), (2, 0), (4, 5)]            # classes (0, 1), (0, 0), (2, 2)
    copies = [PairTerm(u, v, rng.random((3, 3)) * 10) for u, v in pairs]
    rows = LiveRows(terms=[1, 2, 3, 6, 7, 8], starts=[0, 0, 1, 0, 1, 1],
                    ends=[1, 2, 2, 1, 2, 2], points=[1, 2])
    request = Request(node_costs=base.node_costs, edges=base.edges,
                      memory_terms=[*base.memory_terms, *copies], fixed_terms=[0],
                      memory_rows=rows, memory_budget=25.0)
    assert_quotient_exact(request)
    best = brute_force(request)
    assert np.isfinite(best) and brute_force(coarsen.drop_dominated(request)) == pytest.approx(best)
    assert solve(request).objective == pytest.approx(best)


@pytest.fixture(scope="module")
def four_layers():
    return programs.transformer_train_step(layers=4)


def test_reuse_solves_repeated_layers_once(four_layers, mesh_2d):
    args = four_layers.abstract_args()
    reused = autoshard.plan(four_layers.fn, *args, mesh=mesh_2d, hardware=SLOW, cache=False)
    alone = autoshard.plan(four_layers.fn, *args, mesh=mesh_2d, hardware=SLOW, reuse=False,
                           cache=False)
    assert reused.stats.solved_groups < 0.6 * reused.stats.groups
    assert alone.stats.solved_groups == alone.stats.groups
    assert any(a.spec != ((),) * len(a.shape) for a in reused.arguments)   # not trivial
    assert reused.cost.total_s <= alone.cost.total_s * 1.01
    # copies chose alike: every layer's weight has the spec layer 1's has
    for leaf in ("wq", "w1", "w2"):
        layer_specs = {reused.argument(f"params['layers'][{i}]['{leaf}']").spec
                       for i in range(1, 3)}
        assert len(layer_specs) == 1


def stacked_layers_step(layers, x):
    """Plain JAX as a list of layers is often written: the list stacked inside the loss
    for a scan, each layer's weight updated from its slice of the gradient."""
    def loss(layers):
        def body(h, w):
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(body, x, jnp.stack(layers))
        return jnp.sum(h ** 2)
    grads = jax.grad(loss)(layers)
    return [w - 0.1 * g * (1 + jnp.abs(g)) for w, g in zip(layers, grads)]


def test_layers_stacked_in_the_step_are_solved_once(mesh_2d):
    # the stack's operands and the unstacked gradient's parts are alike: each layer's
    # update is a copy of the others', however many layers the list has
    solved = {}
    for count in (4, 8, 16):
        layers = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * count
        x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        plan = autoshard.plan(stacked_layers_step, layers, x, mesh=mesh_2d, hardware=SLOW,
                              cache=False)
        assert plan.stats.solved_groups < plan.stats.groups
        solved[count] = plan.stats.solved_groups
    assert solved[4] == solved[8] == solved[16]
    keys = jax.random.split(jax.random.key(0), 9)
    layers = [jax.random.normal(k, (64, 64)) / 8 for k in keys[:8]]
    x = jax.random.normal(keys[8], (32, 64))
    plan = autoshard.plan(stacked_layers_step, layers, x, mesh=mesh_2d, hardware=SLOW,
                          cache=False)
    for e, g in zip(jax.jit(stacked_layers_step)(layers, x), plan.jit()(layers, x)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_reused_plan_matches_single_device(four_layers, mesh_2d):
    expected = jax.jit(four_layers.fn)(*four_layers.args)
    plan = autoshard.plan(four_layers.fn, *four_layers.args, mesh=mesh_2d, hardware=SLOW,
                          cache=False)
    got = plan.jit()(*four_layers.args)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5,
                                   atol=four_layers.atol)


def plan_fields(plan):
    d = plan.to_dict()
    d.pop("stats")
    return d


def test_identical_inputs_give_identical_plans(four_layers, mesh_2d):
    args = four_layers.abstract_args()
    first = autoshard.plan(four_layers.fn, *args, mesh=mesh_2d, hardware=SLOW, cache=False)
    second = autoshard.plan(four_layers.fn, *args, mesh=mesh_2d, hardware=SLOW, cache=False)
    assert plan_fields(first) == plan_fields(second)


@pytest.mark.slow
def test_cache_in_memory_and_on_disk(four_layers, mesh_2d, mesh_1d, tmp_path):
    args = four_layers.abstract_args()
    plan_cache.PLANS.clear()
    kwargs = dict(mesh=mesh_2d, hardware=SLOW, cache_directory=tmp_path)
    fresh = autoshard.plan(four_layers.fn, *args, **kwargs)
    assert fresh.stats.cache is None and len(list(tmp_path.glob("*.json"))) == 1
    # JAX's make_jaxpr is timed apart, within the trace stage
    assert 0 < fresh.stats.jaxpr_s <= fresh.stats.trace_s <= fresh.stats.plan_s
    again = autoshard.plan(four_layers.fn, *args, **kwargs)
    assert again.stats.cache == "memory" and plan_fields(again) == plan_fields(fresh)
    assert 0 < again.stats.jaxpr_s <= again.stats.plan_s   # this call's trace
    plan_cache.PLANS.clear()   # as another process would start
    loaded = autoshard.plan(four_layers.fn, *args, **kwargs)
    assert loaded.stats.cache == "disk" and plan_fields(loaded) == plan_fields(fresh)
    out = loaded.jit()(*four_layers.args)   # the cached plan carries its program
    want = jax.eval_shape(four_layers.fn, *args)
    assert [x.shape for x in jax.tree.leaves(out)] == [x.shape for x in jax.tree.leaves(want)]
    # anything the plan depends on changes the key
    other = [autoshard.plan(four_layers.fn, *args, mesh=mesh_1d, hardware=SLOW,
                            cache_directory=tmp_path),
             autoshard.plan(four_layers.fn, *args, mesh=mesh_2d, cache_directory=tmp_path),
             autoshard.plan(four_layers.fn, *args, memory_budget=5e7, **kwargs)]
    assert all(p.stats.cache is None for p in other)
    assert len(list(tmp_path.glob("*.json"))) == 4


def test_progress_shows_stages_only_when_asked(monkeypatch):
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    shown = progress.PlanProgress(enabled=True)
    shown.console = autoshard_console(buffer := io.StringIO())
    with shown as show:
        show.stage("solving 12 groups")
        time.sleep(0.3)
    assert "autoshard" in buffer.getvalue()
    silent = progress.PlanProgress(enabled=False)
    silent.console = autoshard_console(quiet := io.StringIO())
    with silent as show:
        show.stage("solving 12 groups")
    assert quiet.getvalue() == ""


def autoshard_console(buffer):
    from rich.console import Console
    return Console(file=buffer, force_terminal=True, width=80)


def test_reuse_lets_neighbouring_layers_alternate(mesh_1d):
    """A plain MLP's best plan is Megatron's: column- then row-parallel layers. The layers
    are copies that feed one another, so reuse must not force them to choose alike."""
    case = models.train_case("mlp", "small", abstract=True)
    hw = autoshard.Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                            link_bandwidth=3.6e11, link_latency=1e-5)
    plans = [autoshard.plan(case.train_step, *case.args, mesh=mesh_1d, hardware=hw,
                            donate_argnums=case.donate_argnums, reuse=reuse, cache=False)
             for reuse in (True, False)]
    reused, alone = plans
    assert reused.stats.solved_groups < alone.stats.solved_groups
    assert reused.cost.total_s <= alone.cost.total_s * 1.01
    kernels = [reused.argument(f"state['params']['hidden'][{i}]['kernel']").spec
               for i in range(2, 6)]
    assert kernels[0] != kernels[1] and kernels[0] == kernels[2] and kernels[1] == kernels[3]


@pytest.mark.parametrize("seed", range(3))
def test_coarsening_keeps_copies_paid_once(seed):
    # a copy several readers share, on pairs falling in two classes and in one class,
    # and the memory it holds
    rng = np.random.default_rng(seed)
    base = random_request(rng, groups=6, strategies=3, edges=6)
    shared = [SharedEdgeCost(1.5, [(0, 1, rng.random((3, 3)) < 0.5),
                                   (0, 3, rng.random((3, 3)) < 0.5)]),
              SharedEdgeCost(0.7, [(4, 5, rng.random((3, 3)) < 0.5)])]
    # the first copy holds 4 B while made, counted at every point (a fixed term)
    request = dataclasses.replace(base, shared_edge_costs=shared,
                                  memory_terms=[*base.memory_terms, CopyTerm(0, 4.0)],
                                  fixed_terms=[0, 6])
    assert_quotient_exact(request)
    best = brute_force(request)
    assert brute_force(coarsen.drop_dominated(request)) == pytest.approx(best)
    assert solve(request).objective == pytest.approx(best)
