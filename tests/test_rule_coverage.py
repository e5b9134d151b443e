"""Every primitive JAX defines in jax.lax, jax.random and jax.nn (and the call, checkpoint
and callback modules) has a sharding rule, is planned by trace, or is kept replicated on
purpose with a reason; docs/coverage.md is the current page of that table."""

import pathlib

import pytest

from autoshard.rules import RULES, coverage, replicate_all
from autoshard.rules.replicated import REPLICATED

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "coverage.md"


@pytest.fixture(scope="module")
def entries():
    return coverage.coverage()


def test_walk_finds_the_primitives_of_lax_random_and_nn(entries):
    names = {e.primitive for e in entries}
    assert {"dot_general", "conv_general_dilated", "reduce_window_max", "random_bits",
            "threefry2x32", "random_wrap", "bitcast_convert_type", "fft", "sort",
            "cumsum", "scan", "cholesky", "psum"} <= names
    assert len(names) > 200


def test_every_primitive_has_a_rule_or_a_reason(entries):
    missing = [e.primitive for e in entries if e.status == "missing"]
    assert not missing, f"primitives without a rule or a stated reason: {missing}"
    unexplained = [e.primitive for e in entries
                   if e.status == "replicated" and e.primitive not in REPLICATED]
    assert not unexplained


def test_replicated_table_gives_reasons_and_replicates():
    for name, reason in REPLICATED.items():
        assert len(reason.split()) >= 4, name
        assert RULES[name] is replicate_all, name


def test_no_primitive_is_both_ruled_and_replicated():
    ruled = {name for name, rule in RULES.items() if rule is not replicate_all}
    assert not ruled & set(REPLICATED)
    assert not ruled & set(coverage.TRACED)


def test_traced_primitives_never_reach_the_rules():
    """What the table calls planned by trace leaves no equation of its own in the graph."""
    import jax
    import jax.numpy as jnp
    from autoshard.trace import trace

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)
    f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * t[0]))

    def program(x):
        x = jax.jit(jnp.tanh)(x)
        x = jax.checkpoint(f)(x)
        x = jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)
        x = jax.lax.fori_loop(0, 2, lambda i, c: c * 2.0, x)
        return jax.lax.scan(lambda c, r: (c + r, c), x[0], x)[0]
    graph = trace(program, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    primitives = {n.primitive for n in graph.nodes if n.kind == "eqn"}
    assert not primitives & set(coverage.TRACED), primitives
    assert {"scan", "while", "cond", "jit", "checkpoint", "custom_jvp_call"} <= set(
        coverage.TRACED)


def test_coverage_page_is_current(entries):
    expected = coverage.markdown(entries)
    assert PAGE.read_text() == expected, (
        "docs/coverage.md is stale: python -m autoshard.rules.coverage > docs/coverage.md")
