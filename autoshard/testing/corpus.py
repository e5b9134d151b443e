"""Models from the libraries people use, each with a train step written their way.

Every case is a model built from a tiny config with random init (no downloads), a train
step with dropout on and the library's usual optimizer, its arguments, and the expert
layouts a practitioner would write for it (data parallel, FSDP, Megatron as rule lists
on the argument paths ``autoshard.plan`` prints):

- ``gpt2``, ``llama``, ``bert``: Hugging Face transformers Flax models, trained the way
  the transformers Flax examples do (a ``TrainState`` with a dropout key, optax adamw);
- ``equinox_lm``: an ``eqx.Module`` transformer passed whole to the step
  (``eqx.filter_value_and_grad``, optax adamw, ``eqx.apply_updates``);
- ``haiku_lm``: haiku's example transformer (``hk.transform``, a ``TrainingState`` of
  params, opt_state and rng);
- ``keras_lm``: a keras 3 model on JAX trained with ``model.stateless_call`` and keras's
  own AdamW ``stateless_apply``;
- ``linen_cnn``: a flax linen CNN with batch norm, max-pooling and dropout;
- ``haiku_clip``, ``linen_clip``, ``equinox_clip``: haiku's example transformer (with its
  one-hot loss), a flax linen transformer LM and the equinox LM, each stepped with
  ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))``: one global norm
  read over every gradient before any update;
- ``llama_pipelined``: the transformers Llama step with its loss marked by
  ``autoshard.value_and_grad``, planned with ``pipeline=`` the mesh's 'data' axis and 4
  microbatches (``plan_options``): its list of layers pipelined.

Example::

    case = corpus.build("gpt2")
    plan = autoshard.plan(case.fn, *case.args, mesh=mesh)
    compiled = case.compile_expert(mesh, "megatron")

The packages come with ``pip install -e ".[corpus]"``; ``keras_lm`` needs
``KERAS_BACKEND=jax`` set before keras is first imported (``build`` sets it if unset).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.frontend.trace import hold_static_leaves, release_static_leaves
from autoshard.zoo import experts
from autoshard.zoo.experts import BATCH, DATA, MODEL

BATCH_SIZE = 8
SEQ = 16
VOCAB = 256
D_MODEL = 64
# (d_model, batch, seq, vocab) per size: "tiny" for the tests, where one collective's
# latency outweighs the work it would split; "small", haiku's example transformer at
# d_model 256 over batches of 8 x 128 tokens; "medium", where splitting pays
SIZES = {"tiny": (64, 8, 16, 256), "small": (256, 8, 128, 1024),
         "medium": (512, 64, 128, 4096)}


def use_size(size: str) -> None:
    """Build the corpus models at ``size`` (``SIZES``) from now on."""
    global D_MODEL, BATCH_SIZE, SEQ, VOCAB
    D_MODEL, BATCH_SIZE, SEQ, VOCAB = SIZES[size]
@contextlib.contextmanager
def sized(size: str):
    """Build, trace and run the corpus models at ``size`` inside this block (the models
    read the sizes when traced), the sizes before it after."""
    global D_MODEL, BATCH_SIZE, SEQ, VOCAB
    before = D_MODEL, BATCH_SIZE, SEQ, VOCAB
    use_size(size)
    try:
        yield
    finally:
        D_MODEL, BATCH_SIZE, SEQ, VOCAB = before


HEADS = 4
LAYERS = 2
DROPOUT = 0.1
LEARNING_RATE = 1e-3

COLUMN = P(None, MODEL)   # Megatron: split the output features
ROW = P(MODEL, None)      # Megatron: split the input features


@dataclasses.dataclass(frozen=True)
class CorpusCase:
    """A library's model with its train step, arguments and expert layouts.

    ``fn(*args)`` is the step as its library's users write it. ``batch_argnums`` are the
    arguments split on their leading dim by every expert; ``tp_rules`` the Megatron rules
    for the rest. ``carry`` maps an output position to the argument it returns updated
    (the expert gives it that argument's shardings; other outputs are replicated).
    """

    name: str
    library: str
    fn: Callable
    args: tuple
    arg_names: tuple[str, ...]
    batch_argnums: tuple[int, ...]
    tp_rules: tuple = ()
    carry: dict = dataclasses.field(default_factory=dict)
    rtol: float = 2e-4
    atol: float = 2e-5
    # the options its users plan it with (a pipeline: over which axis, how many
    # microbatches), beside the mesh
    plan_options: dict = dataclasses.field(default_factory=dict)
    # outputs (regexes on their paths) whose gradient is zero in exact arithmetic, e.g.
    # attention key biases (softmax ignores a shift shared by every key): Adam turns the
    # rounding noise left in their gradient into a step of up to the learning rate
    zero_gradient_outputs: tuple[str, ...] = ()

    # -- expert layouts ---------------------------------------------------------------
    def expert_names(self) -> tuple[str, ...]:
        return ("data_parallel", "fsdp") + (("megatron",) if self.tp_rules else ())

    def expert_in_shardings(self, mesh: Mesh, name: str) -> tuple:
        """The expert's in_shardings over the arguments (static leaves held, so the tree
        is the one ``jax.jit`` of :meth:`held_fn` takes)."""
        out = []
        for i, (arg, arg_name) in enumerate(zip(self.abstract_args(), self.arg_names)):
            if i in self.batch_argnums:
                role = DATA if name == "megatron" else BATCH
                out.append(experts.shardings_from_rules(arg, mesh, [], prefix=arg_name,
                                                        default=P(role)))
            elif name == "data_parallel":
                out.append(experts.shardings_from_rules(arg, mesh, [], prefix=arg_name))
            elif name == "fsdp":
                out.append(experts.shardings_from_rules(
                    arg, mesh, [], prefix=arg_name,
                    default=lambda shape: experts.largest_dim_spec(shape, mesh, BATCH)))
            elif name == "megatron":
                out.append(experts.shardings_from_rules(arg, mesh, self.tp_rules,
                                                        prefix=arg_name))
            else:
                raise ValueError(f"{self.name} has no expert plan {name!r}")
        return tuple(out)

    def expert_out_shardings(self, mesh: Mesh, in_shardings: tuple):
        outs = jax.eval_shape(self.held_fn, *self.abstract_args())
        replicated = NamedSharding(mesh, P())
        return tuple(in_shardings[self.carry[k]] if k in self.carry else
                     jax.tree.map(lambda _: replicated, out) for k, out in enumerate(outs))

    def compile_expert(self, mesh: Mesh, name: str):
        """``jax.jit`` of the step with the expert's shardings, compiled from abstract args."""
        ins = self.expert_in_shardings(mesh, name)
        jitted = jax.jit(self.held_fn, in_shardings=ins,
                         out_shardings=self.expert_out_shardings(mesh, ins))
        return jitted.lower(*self.abstract_args()).compile()

    # -- arguments --------------------------------------------------------------------
    def held_args(self) -> tuple:
        return hold_static_leaves(self.args)

    def abstract_args(self) -> tuple:
        """The arguments with arrays as ``jax.ShapeDtypeStruct`` (static leaves held)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            self.held_args())

    def held_fn(self, *held):
        """``fn`` over arguments with static leaves held; its outputs held the same way."""
        return hold_static_leaves(self.fn(*release_static_leaves(held)))


def _lm_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, VOCAB, (BATCH_SIZE, SEQ)), jnp.int32)


def _next_token_loss(logits, tokens):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


# ------------------------------------------------------------------ transformers (Flax)


def _hf_train_state(model):
    """The transformers Flax examples' TrainState: params, adamw, and a dropout key."""
    import optax
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        dropout_rng: jax.Array

    return TrainState.create(apply_fn=model.__call__, params=model.params,
                             tx=optax.adamw(LEARNING_RATE, weight_decay=0.01),
                             dropout_rng=jax.random.PRNGKey(1))


def _hf_lm_step(state, batch):
    """run_clm_flax.py's train step: split the dropout key, loss, apply_gradients."""
    dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

    def compute_loss(params):
        logits = state.apply_fn(batch["input_ids"], params=params, dropout_rng=dropout_rng,
                                train=True)[0]
        return _next_token_loss(logits, batch["input_ids"])

    loss, grad = jax.value_and_grad(compute_loss)(state.params)
    new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
    return new_state, loss


def _hf_lm_step_marked(state, batch):
    """run_clm_flax.py's train step as a pipeline asks it written: the loss marked
    (``autoshard.value_and_grad`` for ``jax.value_and_grad``) and handed the batch it
    splits into microbatches, rather than closing over it."""
    from autoshard.rewrite.accumulate import value_and_grad
    dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

    def compute_loss(params, batch):
        logits = state.apply_fn(batch["input_ids"], params=params, dropout_rng=dropout_rng,
                                train=True)[0]
        return _next_token_loss(logits, batch["input_ids"])

    loss, grad = value_and_grad(compute_loss)(state.params, batch)
    new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
    return new_state, loss


def _hf_mlm_step(state, batch):
    """run_mlm_flax.py's train step: masked-token cross entropy weighted by the labels."""
    import optax
    dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

    def compute_loss(params):
        logits = state.apply_fn(batch["input_ids"], params=params, dropout_rng=dropout_rng,
                                train=True)[0]
        weights = (batch["labels"] >= 0).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.maximum(batch["labels"], 0))
        return (losses * weights).sum() / weights.sum()

    loss, grad = jax.value_and_grad(compute_loss)(state.params)
    new_state = state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng)
    return new_state, loss


def gpt2() -> CorpusCase:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D_MODEL, n_layer=LAYERS,
                        n_head=HEADS, resid_pdrop=DROPOUT, embd_pdrop=DROPOUT,
                        attn_pdrop=DROPOUT)
    model = FlaxGPT2LMHeadModel(config, seed=0)
    rules = ((r"\['c_attn'\]\['kernel'\]", COLUMN), (r"\['c_fc'\]\['kernel'\]", COLUMN),
             (r"\['c_attn'\]\['bias'\]", P(MODEL)), (r"\['c_fc'\]\['bias'\]", P(MODEL)),
             (r"\['c_proj'\]\['kernel'\]", ROW), (r"\['wte'\]", ROW))
    return CorpusCase("gpt2", "transformers", _hf_lm_step,
                      (_hf_train_state(model), {"input_ids": _lm_batch()}),
                      ("state", "batch"), (1,), rules, {0: 0})


def llama(name: str = "llama", step: Callable = _hf_lm_step, dropout: float = DROPOUT,
          **plan_options) -> CorpusCase:
    from transformers import FlaxLlamaForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=2 * D_MODEL,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS,
                         # transformers' Flax rotary table keeps max_position_embeddings
                         # columns of sin|cos: fewer than 2 * head_dim breaks it
                         max_position_embeddings=max(SEQ, 2 * D_MODEL // HEADS),
                         attention_dropout=dropout)
    model = FlaxLlamaForCausalLM(config, seed=0)
    rules = ((r"\['(q_proj|k_proj|v_proj|gate_proj|up_proj)'\]\['kernel'\]", COLUMN),
             (r"\['(o_proj|down_proj)'\]\['kernel'\]", ROW),
             (r"\['embed_tokens'\]", ROW), (r"\['lm_head'\]\['kernel'\]", COLUMN))
    return CorpusCase(name, "transformers", step,
                      (_hf_train_state(model), {"input_ids": _lm_batch()}),
                      ("state", "batch"), (1,), rules, {0: 0}, plan_options=plan_options)


def llama_pipelined() -> CorpusCase:
    """The Llama step with its loss marked, its layers (a Python list in transformers'
    Flax Llama) pipelined over the mesh's 'data' axis in 4 microbatches. Without
    dropout: a microbatch draws its masks from the step's key at its own shape, so a
    pipelined step with dropout is another draw than the step on one device. The
    gradient is summed over microbatches in another order than on one device; where
    it is near zero, adamw's step (about the learning rate, whatever the gradient's
    size) moves by a few percent of the learning rate: ``atol`` a tenth of it."""
    case = llama("llama_pipelined", _hf_lm_step_marked, dropout=0.0, pipeline="data",
                 microbatches=4)
    return dataclasses.replace(case, atol=0.1 * LEARNING_RATE)


def bert() -> CorpusCase:
    from transformers import BertConfig, FlaxBertForMaskedLM
    config = BertConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=2 * D_MODEL,
                        max_position_embeddings=SEQ, hidden_dropout_prob=DROPOUT,
                        attention_probs_dropout_prob=DROPOUT)
    model = FlaxBertForMaskedLM(config, seed=0)
    tokens = _lm_batch()
    masked = np.random.default_rng(1).random(tokens.shape) < 0.15
    batch = {"input_ids": jnp.where(masked, 3, tokens),
             "labels": jnp.where(masked, tokens, -100)}
    rules = ((r"\['(query|key|value)'\]\['kernel'\]", COLUMN),
             (r"\['(query|key|value)'\]\['bias'\]", P(MODEL)),
             (r"\['intermediate'\]\['dense'\]\['kernel'\]", COLUMN),
             (r"\['intermediate'\]\['dense'\]\['bias'\]", P(MODEL)),
             (r"\['output'\]\['dense'\]\['kernel'\]", ROW),
             (r"\['word_embeddings'\]", ROW))
    return CorpusCase("bert", "transformers", _hf_mlm_step, (_hf_train_state(model), batch),
                      ("state", "batch"), (1,), rules, {0: 0})


# ------------------------------------------------------------------------------ equinox


def _equinox_model(key):
    import equinox as eqx

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        dropout: eqx.nn.Dropout
        activation: Callable   # a plain function: a static leaf of the module

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.norm1 = eqx.nn.LayerNorm(D_MODEL)
            self.attn = eqx.nn.MultiheadAttention(HEADS, D_MODEL, dropout_p=DROPOUT, key=k1)
            self.norm2 = eqx.nn.LayerNorm(D_MODEL)
            self.up = eqx.nn.Linear(D_MODEL, 4 * D_MODEL, key=k2)
            self.down = eqx.nn.Linear(4 * D_MODEL, D_MODEL, key=k3)
            self.dropout = eqx.nn.Dropout(DROPOUT)
            self.activation = jax.nn.gelu

        def __call__(self, x, mask, key):
            k1, k2 = jax.random.split(key)
            h = jax.vmap(self.norm1)(x)
            x = x + self.attn(h, h, h, mask=mask, key=k1)
            h = jax.vmap(self.down)(self.activation(jax.vmap(self.up)(jax.vmap(self.norm2)(x))))
            return x + self.dropout(h, key=k2)

    class LM(eqx.Module):
        embed: eqx.nn.Embedding
        pos: jax.Array
        blocks: list
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear
        num_layers: int = eqx.field(static=True)

        def __init__(self, key):
            keys = jax.random.split(key, LAYERS + 3)
            self.embed = eqx.nn.Embedding(VOCAB, D_MODEL, key=keys[0])
            self.pos = 0.02 * jax.random.normal(keys[1], (SEQ, D_MODEL))
            self.blocks = [Block(k) for k in keys[3:]]
            self.norm = eqx.nn.LayerNorm(D_MODEL)
            self.head = eqx.nn.Linear(D_MODEL, VOCAB, use_bias=False, key=keys[2])
            self.num_layers = LAYERS

        def __call__(self, tokens, key):
            x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
            mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
            for block, k in zip(self.blocks, jax.random.split(key, self.num_layers)):
                x = block(x, mask, k)
            return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    return LM(key)


def _equinox_step(model, opt_state, tokens, key, make_optimizer=None):
    """The equinox way: filter_value_and_grad over the whole module, vmap over the batch,
    optax adamw (or ``make_optimizer()``) on the module's arrays, apply_updates."""
    import equinox as eqx
    optimizer = (make_optimizer or _equinox_optimizer)()

    def loss_fn(model, tokens, key):
        keys = jax.random.split(key, tokens.shape[0])
        logits = jax.vmap(model)(tokens, keys)
        return _next_token_loss(logits, tokens)

    step_key, next_key = jax.random.split(key)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, step_key)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return loss, model, opt_state, next_key


def _equinox_optimizer():
    import optax
    return optax.adamw(LEARNING_RATE, weight_decay=0.01)


def equinox_lm(name: str = "equinox_lm", make_optimizer=None) -> CorpusCase:
    import equinox as eqx
    model = _equinox_model(jax.random.PRNGKey(0))
    opt_state = (make_optimizer or _equinox_optimizer)().init(eqx.filter(model, eqx.is_array))
    rules = ((r"\.(query_proj|key_proj|value_proj|up)\.weight", ROW),   # (out, in) weights
             (r"\.(output_proj|down)\.weight", COLUMN),
             (r"\.up\.bias", P(MODEL)), (r"\.embed\.weight", ROW))
    step = (_equinox_step if make_optimizer is None
            else functools.partial(_equinox_step, make_optimizer=make_optimizer))
    return CorpusCase(name, "equinox", step,
                      (model, opt_state, _lm_batch(), jax.random.PRNGKey(1)),
                      ("model", "opt_state", "tokens", "key"), (2,), rules, {1: 0, 2: 1})


def equinox_clip() -> CorpusCase:
    """The equinox LM stepped with gradients clipped to a global norm before adamw."""
    return equinox_lm("equinox_clip", _clipped_adamw)


# -------------------------------------------------------------------------------- haiku


def _haiku_forward():
    """haiku's examples/transformer model: pre-norm blocks of MultiHeadAttention and a
    dense block, hk.dropout after each, causal mask, an embedding and an output head."""
    import haiku as hk

    def forward(tokens, is_training: bool):
        dropout_rate = DROPOUT if is_training else 0.0
        init = hk.initializers.VarianceScaling(2 / LAYERS)
        x = hk.Embed(VOCAB, D_MODEL, name="embed")(tokens)
        x = x + hk.get_parameter("positional_embeddings", [SEQ, D_MODEL],
                                 init=hk.initializers.TruncatedNormal(0.02))
        mask = jnp.tril(jnp.ones((1, 1, SEQ, SEQ)))
        for i in range(LAYERS):
            h = hk.LayerNorm(-1, True, True, name=f"h{i}_ln_1")(x)
            h = hk.MultiHeadAttention(HEADS, D_MODEL // HEADS, w_init=init,
                                      name=f"h{i}_attn")(h, h, h, mask=mask)
            x = x + hk.dropout(hk.next_rng_key(), dropout_rate, h)
            h = hk.LayerNorm(-1, True, True, name=f"h{i}_ln_2")(x)
            h = hk.Linear(4 * D_MODEL, w_init=init, name=f"h{i}_mlp_in")(h)
            h = hk.Linear(D_MODEL, w_init=init, name=f"h{i}_mlp_out")(jax.nn.gelu(h))
            x = x + hk.dropout(hk.next_rng_key(), dropout_rate, h)
        x = hk.LayerNorm(-1, True, True, name="ln_f")(x)
        return hk.Linear(VOCAB, name="head")(x)

    return hk.transform(forward)


def _haiku_step(state, tokens, make_optimizer=None, loss=None):
    """haiku's examples/transformer/train.py update: loss_fn(params, rng, data), value_and
    _grad, optax (adamw, or ``make_optimizer()``), a new TrainingState with the next rng.
    ``loss(logits, tokens)``: next-token cross entropy unless given."""
    import optax
    forward = _haiku_forward()
    optimizer = (make_optimizer or (lambda: optax.adamw(LEARNING_RATE, weight_decay=0.01)))()

    def loss_fn(params, rng, tokens):
        logits = forward.apply(params, rng, tokens, is_training=True)
        return (loss or _next_token_loss)(logits, tokens)

    rng, new_rng = jax.random.split(state["rng"])
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], rng, tokens)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "rng": new_rng,
            "step": state["step"] + 1}, loss


def haiku_lm() -> CorpusCase:
    import optax
    tokens = _lm_batch()
    params = _haiku_forward().init(jax.random.PRNGKey(0), tokens, is_training=True)
    opt_state = optax.adamw(LEARNING_RATE, weight_decay=0.01).init(params)
    state = {"params": params, "opt_state": opt_state, "rng": jax.random.PRNGKey(1),
             "step": jnp.zeros((), jnp.int32)}
    rules = ((r"_attn/(query|key|value)'\]\['w'\]", COLUMN),
             (r"_attn/(query|key|value)'\]\['b'\]", P(MODEL)),
             (r"_attn/linear'\]\['w'\]", ROW), (r"_mlp_in'\]\['w'\]", COLUMN),
             (r"_mlp_in'\]\['b'\]", P(MODEL)), (r"_mlp_out'\]\['w'\]", ROW),
             (r"\['embed'\]\['embeddings'\]", ROW))
    return CorpusCase("haiku_lm", "haiku", _haiku_step, (state, tokens), ("state", "tokens"),
                      (1,), rules, {0: 0},
                      zero_gradient_outputs=(r"_attn/key'\]\['b'\]",))


def _one_hot_loss(logits, tokens):
    """haiku's examples/transformer loss: one-hot next-token targets against log_softmax,
    the log likelihood averaged over the tokens that are not padding (id 0)."""
    targets = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    log_likelihood = jnp.sum(targets * jax.nn.log_softmax(logits[:, :-1]), axis=-1)
    mask = jnp.greater(tokens[:, :-1], 0)
    return -jnp.sum(log_likelihood * mask) / jnp.sum(mask)


def haiku_clip() -> CorpusCase:
    """haiku's example transformer trained as its example trains it: one-hot cross
    entropy, gradients clipped to a global norm before the optimizer (adamw here)."""
    step = functools.partial(_haiku_step, make_optimizer=_clipped_adamw, loss=_one_hot_loss)
    case = haiku_lm()
    state = dict(case.args[0], opt_state=_clipped_adamw().init(case.args[0]["params"]))
    return dataclasses.replace(case, name="haiku_clip", fn=step, args=(state, case.args[1]))


# -------------------------------------------------------------------------------- keras


def _keras_model():
    import keras
    keras.utils.set_random_seed(0)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, D_MODEL, name="embed")(tokens)
    for i in range(LAYERS):
        h = keras.layers.LayerNormalization(name=f"ln1_{i}")(x)
        h = keras.layers.MultiHeadAttention(HEADS, D_MODEL // HEADS, dropout=DROPOUT,
                                            name=f"attn_{i}")(h, h, use_causal_mask=True)
        x = x + keras.layers.Dropout(DROPOUT)(h)
        h = keras.layers.LayerNormalization(name=f"ln2_{i}")(x)
        h = keras.layers.Dense(4 * D_MODEL, activation="gelu", name=f"mlp_in_{i}")(h)
        h = keras.layers.Dense(D_MODEL, name=f"mlp_out_{i}")(h)
        x = x + keras.layers.Dropout(DROPOUT)(h)
    x = keras.layers.LayerNormalization(name="ln_f")(x)
    logits = keras.layers.Dense(VOCAB, name="head")(x)
    return keras.Model(tokens, logits)


def _keras_rules(model, optimizer) -> tuple:
    """Megatron rules on the state's list positions, found from the variables' paths."""
    by_name = ((r"attn_\d+/(query|key|value)/kernel", P(None, MODEL, None)),
               (r"attn_\d+/(query|key|value)/bias", P(MODEL, None)),
               (r"attn_\d+/attention_output/kernel", P(MODEL, None, None)),
               (r"mlp_in_\d+/kernel", COLUMN), (r"mlp_in_\d+/bias", P(MODEL)),
               (r"mlp_out_\d+/kernel", ROW), (r"embed/embeddings", ROW))

    def spec_of(path):
        return next((spec for pattern, spec in by_name if re.search(pattern, path)), None)

    rules = []
    for k, v in enumerate(model.trainable_variables):
        if spec_of(v.path) is not None:
            rules.append((rf"^state\[0\]\[{k}\]$", spec_of(v.path)))
    # keras's Adam-family optimizers hold, per trainable variable in order, a momentum
    # and a velocity of its shape (after the scalar iteration count and learning rate)
    slots = [k for k, v in enumerate(optimizer.variables) if len(v.shape)]
    trainable = list(model.trainable_variables)
    if len(slots) == 2 * len(trainable):
        for j, k in enumerate(slots):
            spec = spec_of(trainable[j // 2].path)
            if spec is not None:
                rules.append((rf"^state\[2\]\[{k}\]$", spec))
    return tuple(rules)


def keras_lm() -> CorpusCase:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    model = _keras_model()
    optimizer = keras.optimizers.AdamW(LEARNING_RATE, weight_decay=0.01)
    optimizer.build(model.trainable_variables)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compute_loss_and_updates(trainable, non_trainable, tokens):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, tokens,
                                                     training=True)
        return loss_object(tokens[:, 1:], logits[:, :-1]), non_trainable

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    def train_step(state, tokens):
        """keras's "training loop from scratch in JAX": stateless_call, then the optimizer's
        stateless_apply."""
        trainable, non_trainable, optimizer_variables = state
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, tokens)
        trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads,
                                                                   trainable)
        return loss, (trainable, non_trainable, optimizer_variables)

    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    return CorpusCase("keras_lm", "keras", train_step, (state, _lm_batch()), ("state", "tokens"),
                      (1,), _keras_rules(model, optimizer), {1: 0})


# ------------------------------------------------------------ clipped by the global norm


def _clipped_adamw():
    """The optimizer most optax train steps chain: gradients scaled down to a global norm
    of at most 1 (one norm read over every gradient before any update), then adamw."""
    import optax
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(LEARNING_RATE, weight_decay=0.01))


# --------------------------------------------------------------------------- flax linen


def _linen_lm():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask, train: bool):
            h = nn.LayerNorm()(x)
            h = nn.MultiHeadDotProductAttention(HEADS, dropout_rate=DROPOUT,
                                                deterministic=not train)(h, h, mask=mask)
            x = x + nn.Dropout(DROPOUT, deterministic=not train)(h)
            h = nn.Dense(4 * D_MODEL)(nn.LayerNorm()(x))
            h = nn.Dense(D_MODEL)(nn.gelu(h))
            return x + nn.Dropout(DROPOUT, deterministic=not train)(h)

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens, train: bool):
            x = nn.Embed(VOCAB, D_MODEL)(tokens)
            x = x + self.param("pos", nn.initializers.normal(0.02), (SEQ, D_MODEL))
            mask = nn.make_causal_mask(tokens)
            for _ in range(LAYERS):
                x = Block()(x, mask, train)
            return nn.Dense(VOCAB)(nn.LayerNorm()(x))

    return LM()


def _linen_lm_step(state, tokens):
    """The flax docs' train step: a dropout rng folded from the step, value_and_grad of
    the loss, apply_gradients through TrainState (whose tx clips, then adamw)."""
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, tokens, train=True,
                                rngs={"dropout": dropout_key})
        return _next_token_loss(logits, tokens)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def linen_clip() -> CorpusCase:
    """A flax linen transformer LM stepped with optax.chain(clip_by_global_norm, adamw).
    Its gradients are reduced over the mesh in another order than on one device; where
    one is near zero, adamw's step (about the learning rate, whatever the gradient's
    size) moves by a few percent of the learning rate (4.2e-5 measured on jax 0.12.0.1,
    one element of a value kernel's 4,096): ``atol`` a tenth of it."""
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        key: jax.Array

    model, tokens = _linen_lm(), _lm_batch()
    variables = model.init(jax.random.PRNGKey(0), tokens, train=False)
    state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                              tx=_clipped_adamw(), key=jax.random.PRNGKey(1))
    rules = ((r"\['(query|key|value)'\]\['kernel'\]", P(None, MODEL, None)),
             (r"\['(query|key|value)'\]\['bias'\]", P(MODEL, None)),
             (r"\['out'\]\['kernel'\]", P(MODEL, None, None)),
             (r"\['Dense_0'\]\['kernel'\]", COLUMN), (r"\['Dense_0'\]\['bias'\]", P(MODEL)),
             (r"\['Dense_1'\]\['kernel'\]", ROW), (r"\['Embed_0'\]\['embedding'\]", ROW))
    return CorpusCase("linen_clip", "flax.linen", _linen_lm_step, (state, tokens),
                      ("state", "tokens"), (1,), rules, {0: 0},
                      zero_gradient_outputs=(r"\['key'\]\['bias'\]",),
                      atol=0.1 * LEARNING_RATE)



def _linen_cnn():
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            for features in (16, 32):
                x = nn.Conv(features, (3, 3), use_bias=False)(x)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
                x = nn.relu(x)
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            x = nn.Dense(64)(x)
            x = nn.relu(x)
            x = nn.Dropout(DROPOUT, deterministic=not train)(x)
            return nn.Dense(10)(x)

    return CNN()


def _linen_step(state, batch):
    """The flax docs' batch-norm train step: apply with mutable batch_stats and a dropout
    rng folded from the step, optax adamw through TrainState."""
    import optax
    dropout_key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"], train=True,
            mutable=["batch_stats"], rngs={"dropout": dropout_key})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, loss


def linen_cnn() -> CorpusCase:
    import optax
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        batch_stats: Any
        key: jax.Array

    model = _linen_cnn()
    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.normal(size=(BATCH_SIZE, 16, 16, 3)), jnp.float32),
             "label": jnp.asarray(rng.integers(0, 10, BATCH_SIZE), jnp.int32)}
    variables = model.init(jax.random.PRNGKey(0), batch["image"], train=False)
    state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                              batch_stats=variables["batch_stats"],
                              tx=optax.adamw(LEARNING_RATE, weight_decay=0.01),
                              key=jax.random.PRNGKey(1))
    rules = ((r"\['Conv_\d'\]\['kernel'\]", P(None, None, None, MODEL)),
             (r"\['BatchNorm_\d'\]", P(MODEL)),
             (r"\['Dense_0'\]\['kernel'\]", COLUMN), (r"\['Dense_0'\]\['bias'\]", P(MODEL)),
             (r"\['Dense_1'\]\['kernel'\]", ROW))
    return CorpusCase("linen_cnn", "flax.linen", _linen_step, (state, batch),
                      ("state", "batch"), (1,), rules, {0: 0})


CASES: dict[str, Callable[[], CorpusCase]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "equinox_lm": equinox_lm,
    "haiku_lm": haiku_lm, "keras_lm": keras_lm, "linen_cnn": linen_cnn,
    # steps whose optimizer clips the gradients to a global norm first
    "haiku_clip": haiku_clip, "linen_clip": linen_clip, "equinox_clip": equinox_clip,
    # the loss marked, its layers pipelined
    "llama_pipelined": llama_pipelined,
}


def build(name: str) -> CorpusCase:
    """The corpus case ``name`` (one of ``CASES``), built from its tiny config."""
    return CASES[name]()


def primitives_without_rule(case: CorpusCase) -> set[str]:
    """The primitives of the case's traced step that fall back to replication."""
    from autoshard.frontend.trace import trace
    from autoshard.rules import RULES
    graph = trace(case.fn, *case.args)
    return {n.primitive for n in graph.nodes if n.kind == "eqn" and n.primitive not in RULES}
