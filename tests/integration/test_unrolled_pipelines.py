"""Pipelines and rematerialization of models written as a Python loop over a list of
layers (``autoshard.rewrite.unrolled``): the loss's repeated layers are found in its jaxpr
and rolled into a ``lax.scan`` over their weights stacked inside the program, which the
pipeline and remat rewrites take as they take a scanned stack.

The models are written the way their users write them: a plain-JAX transformer LM over a
list of layer dicts, and transformers' Flax GPT-2 built from a small config.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.frontend import jax_compat
from autoshard.rewrite import unrolled

D_MODEL, HEADS, FFN, VOCAB, SEQ, ROWS = 32, 4, 64, 64, 8, 16
HW = autoshard.Hardware(flops=1e12, hbm_bandwidth=1e11, memory=80e9,
                        link_bandwidth={"data": 4e10, "model": 3.6e11}, link_latency=1e-6)


def layer_norm(x, scale):
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x ** 2, axis=-1, keepdims=True) + 1e-5) * scale


def block(layer, x, mask):
    """A pre-norm causal transformer block."""
    rows, seq, d = x.shape
    qkv = layer_norm(x, layer["ln1"]) @ layer["qkv"]
    q, k, v = (t.reshape(rows, seq, HEADS, d // HEADS) for t in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // HEADS) ** 0.5
    att = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(rows, seq, d) @ layer["proj"]
    return x + jax.nn.gelu(layer_norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]


def lm_loss(params, batch):
    """Embeddings, a Python loop over ``params['layers']`` (a list of dicts), a head."""
    tokens = batch["tokens"]
    x = params["embed"][tokens] + params["pos"]
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    for layer in params["layers"]:
        x = block(layer, x, mask)
    logits = layer_norm(x, params["ln_f"]) @ params["head"]
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def lm_step(params, batch):
    loss, grads = autoshard.value_and_grad(lm_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def make_layer(key, ffn: int = FFN):
    k = jax.random.split(key, 4)
    d = D_MODEL
    return {"ln1": jnp.ones((d,)), "ln2": jnp.ones((d,)),
            "qkv": jax.random.normal(k[0], (d, 3 * d)) / d ** 0.5,
            "proj": jax.random.normal(k[1], (d, d)) / d ** 0.5,
            "up": jax.random.normal(k[2], (d, ffn)) / d ** 0.5,
            "down": jax.random.normal(k[3], (ffn, d)) / ffn ** 0.5}


def make_lm_args(layers: int, first_ffn: int = FFN):
    """An LM of ``layers`` layers, the first with an FFN of ``first_ffn``."""
    keys = jax.random.split(jax.random.key(0), layers + 4)
    params = {"embed": jax.random.normal(keys[0], (VOCAB, D_MODEL)) / 4,
              "pos": jax.random.normal(keys[1], (SEQ, D_MODEL)) / 4,
              "layers": [make_layer(keys[2 + i], first_ffn if i == 0 else FFN)
                         for i in range(layers)],
              "ln_f": jnp.ones((D_MODEL,)),
              "head": jax.random.normal(keys[-2], (D_MODEL, VOCAB)) / D_MODEL ** 0.5}
    tokens = jax.random.randint(keys[-1], (ROWS, SEQ), 0, VOCAB)
    return params, {"tokens": tokens}


def plan_lm(step, args, mesh, **options):
    return autoshard.plan(step, *args, mesh=mesh, hardware=HW, cache=False, progress=False,
                          **options)


def assert_matches(got, expected, rtol=1e-4, atol=1e-5):
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol)


def stacked_layers(plan_, args, leaf) -> list[list[int]]:
    """Per stack of layer weights in the planned program (an equation stacking ``leaf``'s
    per-layer arguments, seen through reshapes and casts), the layers it stacks, by their
    index in the user's list."""
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    layer_of = {i: int(path[2].idx) for i, (path, _) in enumerate(flat)
                if len(path) > 3 and getattr(path[1], "key", None) == "layers"
                and getattr(path[3], "key", None) == leaf}
    jaxpr, _ = jax_compat.split_closed(plan_.program.closed_jaxpr)
    argument = dict(zip(jaxpr.invars, range(len(jaxpr.invars))))
    origin = {}   # a variable -> the argument it is (a reshape or cast of)
    stacks = []
    for eqn in jaxpr.eqns:
        ins = [origin.get(v, argument.get(v)) if not isinstance(v, jax_compat.Literal) else None
               for v in eqn.invars]
        if len(ins) == 1 and ins[0] is not None and eqn.primitive.name in (
                "reshape", "broadcast_in_dim", "convert_element_type", "expand_dims"):
            origin[eqn.outvars[0]] = ins[0]
        elif len(ins) > 1 and all(i in layer_of for i in ins):
            stacks.append([layer_of[i] for i in ins])
    return stacks


def stage_constraints(plan_, shape) -> list:
    """The specs of the planned program's sharding constraints on values of ``shape``."""
    jaxpr, _ = jax_compat.split_closed(plan_.program.closed_jaxpr)
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "sharding_constraint" and \
                    eqn.outvars[0].aval.shape == shape:
                found.append(tuple(eqn.params["sharding"].spec))
            for value in eqn.params.values():
                if jax_compat.is_jaxpr(value):
                    walk(jax_compat.split_closed(value)[0])
    walk(jaxpr)
    return found


@pytest.fixture(scope="module")
def lm4():
    args = make_lm_args(4)
    return args, jax.jit(lm_step)(*args)


# -- finding the layers ---------------------------------------------------------------------

def flat_loss(loss, args):
    flat, tree = jax.tree.flatten(args)
    return (lambda *f: loss(*jax.tree.unflatten(tree, f))), flat


@pytest.mark.slow
def test_the_loop_is_found_and_rolled_into_one_scan_over_stacked_weights():
    fn, flat = flat_loss(lm_loss, make_lm_args(4))
    layout = unrolled.find(fn, flat)
    assert layout is not None and layout.count == 4
    rolled = unrolled.rolled(fn, layout)
    eqns = jax.make_jaxpr(rolled)(*flat).eqns
    scans = [e for e in eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 4
    assert len(eqns) < len(jax.make_jaxpr(fn)(*flat).eqns) / 2
    np.testing.assert_allclose(rolled(*flat), fn(*flat), rtol=1e-6)
    weights = tuple(range(len(flat) - 1))   # the tokens last
    grads = jax.grad(rolled, argnums=weights)(*flat)
    for g, w in zip(grads, jax.grad(fn, argnums=weights)(*flat)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_first_layer_unlike_the_rest_stays_outside():
    fn, flat = flat_loss(lm_loss, make_lm_args(5, first_ffn=2 * FFN))
    layout = unrolled.find(fn, flat)
    assert layout.count == 4
    np.testing.assert_allclose(unrolled.rolled(fn, layout)(*flat), fn(*flat), rtol=1e-6)


def test_no_repeated_layers_no_run():
    def distinct(params, x):   # two layers of different shapes, and a chain of tanh
        for w in params:
            x = jnp.tanh(jnp.tanh(x @ w))
        return jnp.mean(x)
    params = [jnp.ones((8, 16)), jnp.ones((16, 4))]
    fn, flat = flat_loss(distinct, (params, jnp.ones((4, 8))))
    assert unrolled.find(fn, flat) is None


# -- pipelines and remat of the plain-JAX LM ------------------------------------------------

@pytest.mark.slow
def test_gpipe_over_an_unrolled_lm_matches_single_device(lm4, mesh_2d):
    args, expected = lm4
    plan_ = plan_lm(lm_step, args, mesh_2d, pipeline="data", microbatches=4)
    staged = plan_.pipeline
    assert (staged.axis, staged.stages, staged.layers, staged.schedule) == \
        ("data", 2, 4, "gpipe")
    assert_matches(plan_.jit()(*args), expected)
    # the layers stacked in the list's order, two consecutive layers a stage
    assert stacked_layers(plan_, args, "up") == [[0, 1, 2, 3]]
    specs = stage_constraints(plan_, (2, 2, D_MODEL, FFN))
    assert specs and all(s[0] == "data" for s in specs)


@pytest.mark.slow
def test_circular_pipeline_over_an_unrolled_lm_matches_single_device(lm4, mesh_2d):
    args, expected = lm4
    plan_ = plan_lm(lm_step, args, mesh_2d, pipeline="data", microbatches=4, repeats=2)
    staged = plan_.pipeline
    assert (staged.schedule, staged.repeats, staged.stages, staged.layers_per_pass) == \
        ("circular", 2, 2, 1)
    assert_matches(plan_.jit()(*args), expected)
    # stage s holds layers s and 2 + s: repeat r's pass over the stages runs 2r, 2r + 1
    specs = stage_constraints(plan_, (2, 2, 1, D_MODEL, FFN))
    assert specs and all(s[0] == "data" for s in specs)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["nothing_saveable", "auto"])
def test_remat_of_an_unrolled_lm_matches_single_device(remat, mesh_2d):
    args = make_lm_args(2)
    plan_ = plan_lm(lm_step, args, mesh_2d, remat=remat)
    assert_matches(plan_.jit()(*args), jax.jit(lm_step)(*args))
    if remat != "auto":
        assert plan_.microbatching.remat == remat
        assert f"jax.checkpoint(policy={remat})" in plan_.summary_text()


def test_the_settings_search_runs_the_losss_python_once_per_shape(mesh_2d):
    """``remat="auto"`` weighs three settings. The one without remat differentiates the
    loss as written (one run of its Python). The first remat policy traces it once more;
    the second reads its jaxpr, its layers and their roll from what the first kept
    (``rewrite.traces``): two runs in all, where each setting used to run it."""
    runs = []

    def counted_loss(params, batch):
        runs.append(1)
        return lm_loss(params, batch)

    def step(params, batch):
        return autoshard.value_and_grad(counted_loss)(params, batch)
    plan_ = plan_lm(step, make_lm_args(2), mesh_2d, remat="auto")
    assert len(plan_.stats.settings) == 3
    assert len(runs) == 2


@pytest.mark.slow
def test_a_loss_closing_over_its_batch_is_traced_again_in_each_setting(mesh_2d):
    """A loss that closes over the batch (``run_clm_flax.py``'s ``compute_loss(params)``)
    holds the step's tracers: its jaxpr is not kept for the next setting, whose trace
    is another."""
    args = make_lm_args(2)

    def step(params, batch):
        def loss(p):
            return lm_loss(p, batch)
        value, grads = autoshard.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value
    plan_ = plan_lm(step, args, mesh_2d, remat="auto")
    assert len(plan_.stats.settings) == 3
    assert_matches(plan_.jit()(*args), jax.jit(step)(*args))


@pytest.mark.slow
def test_pipeline_with_a_first_layer_unlike_the_rest(mesh_2d):
    args = make_lm_args(5, first_ffn=2 * FFN)
    plan_ = plan_lm(lm_step, args, mesh_2d, pipeline="data", microbatches=4)
    assert plan_.pipeline.layers == 4
    assert_matches(plan_.jit()(*args), jax.jit(lm_step)(*args))
    assert stacked_layers(plan_, args, "up") == [[1, 2, 3, 4]]


def test_without_repeated_layers_the_error_stays(mesh_2d):
    def mlp_loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    def step(params, batch):
        return autoshard.value_and_grad(mlp_loss)(params, batch)
    params = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 8))}
    batch = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 8))}
    with pytest.raises(autoshard.InputError, match="no layer stack to pipeline"):
        plan_lm(step, (params, batch), mesh_2d, pipeline="data", microbatches=2)
    with pytest.raises(autoshard.InputError, match="no layer stack to rematerialize"):
        plan_lm(step, (params, batch), mesh_2d, remat="nothing_saveable")


def test_layers_the_stages_do_not_divide_keep_the_error(mesh_2d):
    args = make_lm_args(3)
    with pytest.raises(autoshard.InputError, match="the repeated layers found: 3"):
        plan_lm(lm_step, args, mesh_2d, pipeline="data", microbatches=4)


def test_bf16_layers_are_stacked_and_cross_stages_in_bf16(mesh_2d):
    """The zoo's unrolled GPT (flax nnx, a list of blocks) computes in bf16 over f32
    master weights: each layer's cast is done before the stack, so the stack a stage
    receives (and the gradient it sends back) is bf16; the step matches one device."""
    from autoshard.zoo import models
    case = models.train_case("gpt", "tiny_bf16")
    plan_ = autoshard.plan(case.train_step, *case.args, mesh=mesh_2d, cache=False,
                           progress=False, pipeline="data", microbatches=4)
    assert (plan_.pipeline.stages, plan_.pipeline.layers) == (2, 2)
    jaxpr, _ = jax_compat.split_closed(plan_.program.closed_jaxpr)
    stacked = [e.outvars[0].aval for e in jaxpr.eqns
               if e.primitive.name in ("stack", "concatenate")
               and e.outvars[0].aval.shape == (2, 64, 256)]
    assert stacked and all(a.dtype == jnp.bfloat16 for a in stacked)
    got, want = plan_.jit()(*case.args), jax.jit(case.train_step)(*case.args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=case.rtol, atol=case.atol)


# -- transformers' Flax GPT-2 -----------------------------------------------------------------

@pytest.mark.slow
def test_transformers_gpt2_pipelined_matches_single_device(mesh_2d):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D_MODEL,
                                     n_layer=4, n_head=HEADS, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.FlaxGPT2LMHeadModel(config, seed=0)

    def loss(params, batch):
        logits = model(batch["tokens"], params=params, train=False)[0]
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], axis=-1))

    def step(params, batch):
        value, grads = autoshard.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value
    args = (model.params, make_lm_args(1)[1])
    expected = jax.jit(step)(*args)
    plan_ = plan_lm(step, args, mesh_2d, pipeline="data", microbatches=4)
    assert (plan_.pipeline.stages, plan_.pipeline.layers) == (2, 4)
    assert_matches(plan_.jit()(*args), expected)


@pytest.mark.slow
def test_transformers_llama_with_dropout_rematerialized_matches_single_device(mesh_2d):
    # each layer's dropout key is salted by a literal of its own: stacked like weights
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL,
                                      intermediate_size=FFN, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      max_position_embeddings=2 * D_MODEL // HEADS,
                                      attention_dropout=0.1)
    model = transformers.FlaxLlamaForCausalLM(config, seed=0)

    def loss(params, batch, key):
        logits = model(batch["tokens"], params=params, dropout_rng=key, train=True)[0]
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], axis=-1))

    def step(params, batch, key):
        value, grads = autoshard.value_and_grad(loss)(params, batch, key)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value
    args = (model.params, make_lm_args(1)[1], jax.random.key(3))
    plan_ = plan_lm(step, args, mesh_2d, remat="nothing_saveable")
    assert plan_.microbatching.remat == "nothing_saveable"
    assert_matches(plan_.jit()(*args), jax.jit(step)(*args))


@pytest.mark.slow
def test_equinox_lm_with_a_key_per_layer_rematerialized_matches_single_device(mesh_2d,
                                                                               monkeypatch):
    # the loop cuts each layer's dropout key from a split key array (a slice whose bounds
    # differ between layers): run per layer before the scan, the keys stacked
    eqx = pytest.importorskip("equinox")
    from autoshard.testing import corpus
    monkeypatch.setattr(corpus, "LAYERS", 4)
    arrays, static = eqx.partition(corpus._equinox_model(jax.random.key(0)), eqx.is_array)

    def loss(arrays, key, tokens):
        model = eqx.combine(arrays, static)
        logits = jax.vmap(model)(tokens, jax.random.split(key, tokens.shape[0]))
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    def step(arrays, key, tokens):
        value, grads = autoshard.value_and_grad(loss)(arrays, key, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, arrays, grads), value
    # raw uint32 keys, ahead of the batch (its rows are the last argument's): a stack of
    # typed keys is priced by the cost model's reshards, which read no key dtype yet
    args = (arrays, jax.random.PRNGKey(2), corpus._lm_batch())
    fn, flat = flat_loss(loss, args)
    assert unrolled.find(fn, flat).count == 4
    plan_ = plan_lm(step, args, mesh_2d, remat="nothing_saveable")
    assert plan_.microbatching.remat == "nothing_saveable"
    assert_matches(plan_.jit()(*args), jax.jit(step)(*args))
