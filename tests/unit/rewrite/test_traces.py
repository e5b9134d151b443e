"""The program around a marked loss, kept across the settings one plan weighs
(``rewrite.traces``): each setting's program is the first one with the marked call traced
alone and put in its place, and it must be the program a trace of the whole step gives.

The steps are written as their users write them: a plain-JAX LM over a list of layer
dicts stepped by optax's Adam, the same step under ``jax.jit``, a step whose loss closes
over its batch, and one that calls its marked loss twice.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard
from autoshard.frontend.trace import trace_program
from autoshard.planning.fingerprint import program_fingerprint
from autoshard.rewrite.accumulate import Microbatching, TraceRecord, microbatching
from autoshard.rewrite.traces import Traces

D, ROWS, SEQ, VOCAB, LAYERS = 16, 8, 4, 32, 3


def loss_fn(params, batch):
    x = params["embed"][batch["tokens"]]
    for layer in params["layers"]:
        x = x + jnp.tanh(x @ layer["up"]) @ layer["down"]
    logits = x @ params["embed"].T
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], axis=-1))


TX = optax.adamw(1e-3)


def adam_step(state, batch):
    loss, grads = autoshard.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def closing_step(state, batch):
    loss, grads = autoshard.value_and_grad(lambda p: loss_fn(p, batch))(state["params"])
    return jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads), loss


def twice_step(state, batch):
    first, grads = autoshard.value_and_grad(loss_fn)(state["params"], batch)
    second, more = autoshard.value_and_grad(loss_fn)(state["params"], batch)
    return jax.tree.map(lambda g, h: g + h, grads, more), first + second


def args():
    layer = {"up": jax.ShapeDtypeStruct((D, 2 * D), jnp.float32),
             "down": jax.ShapeDtypeStruct((2 * D, D), jnp.float32)}
    params = {"embed": jax.ShapeDtypeStruct((VOCAB, D), jnp.float32),
              "layers": [layer] * LAYERS}
    state = {"params": params, "opt": jax.eval_shape(TX.init, params)}
    return state, {"tokens": jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32)}


SETTINGS = [None, Microbatching(1, remat="dots_saveable"),
            Microbatching(1, remat="nothing_saveable"), Microbatching(2, ("data",), 2),
            Microbatching(2, ("data",), 2, remat="nothing_saveable")]


def jitted(step):
    """``step`` under a ``jax.jit`` of its own: a jit keeps its first trace, so each
    program needs a fresh one."""
    return lambda: jax.jit(lambda state, batch: step(state, batch))


# name -> (a fresh step, whether the program around its loss is kept)
STEPS = {"adam": (lambda: adam_step, True), "jitted adam": (jitted(adam_step), True),
         "closing over the batch": (lambda: closing_step, False),
         "called twice": (lambda: twice_step, False)}


@pytest.mark.parametrize("name", STEPS)
def test_each_settings_program_is_the_one_a_trace_of_the_whole_step_gives(name, mesh_2d):
    fresh, kept = STEPS[name]
    step, runs = fresh(), []

    def counted(*a):
        runs.append(1)
        return step(*a)
    traces, steps = Traces(), []
    for setting in SETTINGS:
        if name == "closing over the batch" and setting and setting.microbatches > 1:
            continue   # its loss takes no batch to split
        with microbatching(setting, TraceRecord(), mesh_2d, traces):
            kept_program = traces.program(counted, args())
        with microbatching(setting, TraceRecord(), mesh_2d, None):
            whole = trace_program(fresh(), *args())
        assert (program_fingerprint(kept_program.closed_jaxpr, kept_program.leaves)
                == program_fingerprint(whole.closed_jaxpr, whole.leaves)), setting
        assert "autoshard_marked_loss" not in str(kept_program.closed_jaxpr)
        steps.append(setting)
    # the step's own Python runs once where the program around its loss is kept
    assert len(runs) == (1 if kept else len(steps))


def test_a_kept_step_plans_and_runs_as_one_device(mesh_2d):
    """The settings search over the kept Adam step: every setting planned, the plan
    matching one device."""
    import numpy as np
    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 2)
    params = {"embed": jax.random.normal(keys[0], (VOCAB, D)) / 4,
              "layers": [{"up": jax.random.normal(keys[1 + 2 * i], (D, 2 * D)) / 4,
                          "down": jax.random.normal(keys[2 + 2 * i], (2 * D, D)) / 6}
                         for i in range(LAYERS)]}
    state = {"params": params, "opt": TX.init(params)}
    batch = {"tokens": jax.random.randint(keys[-1], (ROWS, SEQ), 0, VOCAB)}
    plan_ = autoshard.plan(adam_step, state, batch, mesh=mesh_2d, cache=False, progress=False,
                           remat="auto", microbatches="auto")
    assert len(plan_.stats.settings) >= 3
    got, want = plan_.jit()(state, batch), jax.jit(adam_step)(state, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
