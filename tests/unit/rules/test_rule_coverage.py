"""Every primitive JAX defines in jax.lax, jax.random and jax.nn (and the call, checkpoint
and callback modules) has a sharding rule, is planned by trace, or is kept replicated on
purpose with a reason; docs/coverage.md is the current page of that table."""

import pathlib

import pytest

from autoshard.rules import RULES, coverage, replicate_all
from autoshard.rules.replicated import REPLICATED

PAGE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "coverage.md"


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

    from autoshard.frontend.trace import trace

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


def test_version_table_matches_the_installed_jax():
    """The primitives only some supported releases define are those the installed JAX
    defines or lacks as the table says; the page lists every supported release's."""
    from autoshard.frontend import jax_compat
    installed = coverage.jax_primitives()
    release = jax_compat.installed_release()
    for name, (module, releases) in jax_compat.PRIMITIVES_BY_VERSION.items():
        assert (name in installed) == (release in releases), name
        if name in installed:
            assert installed[name] == module, name
    listed = {e.primitive for e in coverage.coverage()}
    assert set(installed) | set(jax_compat.PRIMITIVES_BY_VERSION) == listed


def test_coverage_page_is_current(entries):
    expected = coverage.markdown(entries)
    assert PAGE.read_text() == expected, (
        "docs/coverage.md is stale: python -m autoshard.rules.coverage > docs/coverage.md")


def ordinary_programs():
    """Functions of jax.nn, jax.numpy, jax.random and optax as models call them."""
    import jax
    import jax.numpy as jnp
    import optax

    def nn(x):
        acts = (jax.nn.gelu, lambda x: jax.nn.gelu(x, approximate=False), jax.nn.silu,
                jax.nn.softplus, jax.nn.softmax, jax.nn.log_softmax, jax.nn.relu6, jax.nn.elu,
                jax.nn.selu, jax.nn.celu, jax.nn.glu, jax.nn.sigmoid, jax.nn.log_sigmoid,
                jax.nn.logsumexp, jax.nn.standardize, jax.nn.mish)
        q = x.reshape(1, 8, 2, 8)
        return ([f(x) for f in acts] + [jax.nn.one_hot(jnp.argmax(x, -1), 16),
                jax.nn.dot_product_attention(q, q, q, is_causal=True)])

    def numpy(x):
        return [jnp.median(x, axis=0), jnp.percentile(x, 50, axis=1), jnp.roll(x, 2, 1),
                jnp.flip(x), jnp.tril(x), jnp.searchsorted(jnp.sort(x[0]), x[1]),
                jnp.var(x), jnp.nanmean(x), jnp.clip(x, 0, 1), jnp.round(x), jnp.isnan(x),
                jnp.nan_to_num(x), jnp.linalg.norm(x, axis=-1), jnp.interp(x, x[0], x[1]),
                jnp.histogram(x, bins=4)[0], jnp.count_nonzero(x), jnp.repeat(x, 2, 0),
                jnp.take_along_axis(x, jnp.argsort(x, 1), 1), jnp.logaddexp(x, x),
                jnp.remainder(x, 3), jnp.unique(jnp.arange(8), size=8),
                jnp.partition(x, 3, axis=1), jnp.convolve(x[0], x[1]), jnp.fft.ifft(x),
                jax.scipy.special.erfinv(jnp.tanh(x)), jax.scipy.special.gammaln(x),
                jax.scipy.stats.norm.ppf(jax.nn.sigmoid(x))]

    def random(key):
        shape = (8, 16)
        return [jax.random.normal(key, shape), jax.random.truncated_normal(key, -2, 2, shape),
                jax.random.categorical(key, jnp.zeros(shape)), jax.random.permutation(key, 16),
                jax.random.randint(key, shape, 0, 10), jax.random.gumbel(key, shape),
                jax.random.split(key, 4), jax.random.fold_in(key, 1),
                jax.random.bernoulli(key, 0.5, shape),
                jax.random.uniform(key, shape, dtype=jnp.bfloat16),
                jax.random.beta(key, 2.0, 3.0), jax.random.exponential(key, shape)]

    def optimizers(params, grads):
        out = []
        for tx in (optax.adamw(1e-3), optax.lion(1e-3), optax.adafactor(1e-3),
                   optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                   optax.sgd(1e-2, momentum=0.9), optax.lamb(1e-3), optax.rmsprop(1e-3)):
            updates, _ = tx.update(grads, tx.init(params), params)
            out.append(optax.apply_updates(params, updates))
        return out
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    return {"nn": (nn, (x,)), "numpy": (numpy, (x,)), "random": (random, (key,)),
            "optax": (optimizers, (x, x))}


@pytest.mark.parametrize("name", ["nn", "numpy", "random", "optax"])
def test_ordinary_programs_need_no_fallback(name):
    """Every primitive these emit has a rule; none is kept whole but ``platform_index``
    (the scalar that picks a platform's branch)."""
    from autoshard.frontend.trace import trace
    fn, args = ordinary_programs()[name]
    graph = trace(fn, *args)
    primitives = {n.primitive for n in graph.nodes if n.kind == "eqn"}
    assert primitives, name
    assert not {p for p in primitives if p not in RULES}
    assert {p for p in primitives if p in REPLICATED} <= {"platform_index"}
