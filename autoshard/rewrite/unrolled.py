"""unrolled: a Python loop over a list of layers, found in the jaxpr and rolled into a
``lax.scan`` over their weights stacked inside the program.

Most models run their layers as a Python loop over a list of per-layer weight trees
(transformers' Flax models, keras, haiku, equinox): the loss's jaxpr holds the layer's
equations once per layer, one copy after the other. ``pipeline`` pipelines and
rematerializes a ``lax.scan`` over stacked layers; this module turns such a run of copies
into one, so that the same machinery applies to both.

A *run* is a maximal stretch of consecutive, structurally identical blocks of equations
(same primitives, params, shapes and dtypes, one block a layer; a static slice's bounds may
differ, :data:`OWN_PARAMS`) in which every operand a block reads is, the same way in every
block:

- a value its own block made (the same equation and result in each block);
- a result of the block before it (the *carry*; the first block reads the value the run
  starts from);
- a value from before the run, the same in every block (a *constant*: a mask, a table);
- a value from before the run that differs between blocks (the *layer's own*: its
  weights, an argument of the loss or a cast of one, or a per-layer literal such as a
  dropout key's salt); at least one operand of a run reads weights that way;

and whose results are read only by the next block, except the last block's, which the
program reads after the run. Among the runs covering most equations, the one with the
shortest block wins (the layer, not pairs of layers), then the cut between blocks that
the fewest values cross (the seam between layers, not inside one), then the earliest.

Rolled, the run is ``lax.scan(block, carry, [jnp.stack(w) for each layer-own operand])``:
one block's equations as the body, the carried results as the carry (zeros where the
first block reads none), the constants closed over. A block's cast of its own weights to
a narrower dtype (bf16 compute over f32 master weights) is done per layer before the
stack, so that a pipeline moves the weights and their gradients across stages in bf16; so
is an equation whose params differ between layers, its results stacked.
Autodiff through ``jnp.stack`` hands each listed layer its own gradient, in the user's
structure. Equations before and after the run (embeddings, a first layer unlike the
rest, the head) stay where they were.

Per-layer arguments are the user's, and a sharding spans the whole mesh: no argument
can live on its stage's devices alone. A pipeline's stack is built inside the step, so
each step moves the layers' weights to their stages (or the gradients back), once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autoshard.errors import InputError
from autoshard.frontend import jax_compat
from autoshard.frontend.jax_compat import Literal
from autoshard.solver.coarsen import interner


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run lies in a jaxpr's equations: ``count`` blocks of ``size`` equations
    from equation ``start``."""

    start: int
    size: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.size * self.count

    def block_of(self, index: int) -> int | None:
        """The block equation ``index`` belongs to (None: outside the run)."""
        return (index - self.start) // self.size if self.start <= index < self.end else None


@dataclasses.dataclass
class Roll:
    """A run read off a jaxpr: the block that becomes the scan's body and what it reads.

    ``body`` reads ``consts`` (atoms from before the run), then one value per carry
    (``inits``: what the first block reads, None for zeros), then one slice per stacked
    operand (``layers``: one atom per block); it returns the carries, which the program
    reads after the run as ``results`` (the last block's). ``hoisted``: equations of
    every block run before the scan (casts of the layer's own weights), whose results are
    stacked."""

    layout: Layout
    body: object
    consts: list
    inits: list
    layers: list[tuple]
    results: list
    hoisted: list = dataclasses.field(default_factory=list)   # run per block before the scan


# -- equations as keys ----------------------------------------------------------------------

def aval_key(aval) -> tuple:
    """An aval's shape and dtype (a weak type is no difference between layers)."""
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", aval)))


class Keys:
    """Structural keys of equations: equal when two equations compute alike from operands
    of the same types (the wiring between blocks is checked apart)."""

    def __init__(self):
        self.intern = interner()
        self.jaxprs: dict[int, tuple] = {}

    def eqn(self, eqn, top: bool = False) -> int:
        """``top``: an equation of the loss itself, where a slice's bounds may differ
        between layers (the layer's own key, cut from a split key array by the loop)."""
        params = () if top and eqn.primitive.name in OWN_PARAMS else self.param(eqn.params)
        return self.intern((eqn.primitive.name, params,
                            tuple(aval_key(v.aval) for v in eqn.invars),
                            tuple(aval_key(v.aval) for v in eqn.outvars)))

    def param(self, value):
        if jax_compat.is_jaxpr(value):
            return ("jaxpr", self.jaxpr(value))
        if isinstance(value, (tuple, list)):
            return tuple(self.param(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((str(k), self.param(v)) for k, v in value.items()))
        if isinstance(value, np.ndarray):
            return ("array", value.dtype.str, value.shape, value.tobytes())
        if callable(value) and not isinstance(value, type):
            # a custom rule's thunk is a new object every trace: alike by name
            return ("fn", getattr(value, "__qualname__", type(value).__name__))
        try:
            hash(value)
            return value
        except TypeError:
            return ("object", type(value).__name__, repr(value))

    def jaxpr(self, closed) -> tuple:
        if id(closed) not in self.jaxprs:
            jaxpr, consts = jax_compat.split_closed(closed)
            number: dict = {}

            def ref(atom):
                if isinstance(atom, Literal):
                    return ("literal", literal_key(atom))
                return number.setdefault(atom, len(number))
            for v in list(jaxpr.constvars) + list(jaxpr.invars):
                ref(v)
            eqns = tuple((self.eqn(e), tuple(ref(v) for v in e.invars),
                          tuple(ref(v) for v in e.outvars)) for e in jaxpr.eqns)
            self.jaxprs[id(closed)] = (
                tuple(aval_key(v.aval) for v in jaxpr.invars), eqns,
                tuple(ref(v) for v in jaxpr.outvars),
                tuple(self.param(np.asarray(c)) if not jax_compat.is_tracer(c) else id(c)
                      for c in consts))
        return self.jaxprs[id(closed)]


# Primitives whose params may differ between the layers of a run (the equation is then
# run per layer before the scan, :func:`hoist`): a static slice.
OWN_PARAMS = ("slice",)


def literal_key(atom) -> tuple:
    value = np.asarray(atom.val)
    return (value.dtype.str, value.shape, value.tobytes())


def same_atom(a, b) -> bool:
    """The same variable, or literals of one value."""
    if isinstance(a, Literal) and isinstance(b, Literal):
        return literal_key(a) == literal_key(b)
    return a is b


# -- finding the run ------------------------------------------------------------------------

def periodic_spans(keys: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Stretches of ``keys`` that repeat with a period of ``size``, as (equations
    covered by whole blocks, size, first start, starts with as many blocks after it),
    most covered first, shorter blocks first."""
    found = []
    for size in range(1, len(keys) // 2 + 1):
        same = np.concatenate([[False], keys[:-size] == keys[size:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for begin, stop in zip(edges[::2], edges[1::2]):
            length = int(stop - begin) + size   # keys[begin:stop + size] repeat
            count = length // size
            if count >= 2:
                found.append((count * size, size, int(begin), length - count * size + 1))
    return sorted(found, key=lambda f: (-f[0], f[1], f[2]))


def find_layout(jaxpr) -> Layout | None:
    """The run of repeated layers in ``jaxpr``'s equations (the module's docstring says
    which), None if there is none."""
    keys = Keys()
    sequence = np.array([keys.eqn(e, top=True) for e in jaxpr.eqns], dtype=np.int64)
    for covered, size, begin, phases in periodic_spans(sequence):
        best = None
        for start in range(begin, begin + phases):
            layout = Layout(start, size, covered // size)
            roll = read_run(jaxpr, layout)
            if roll is not None and (best is None or len(roll.inits) < best[0]):
                best = (len(roll.inits), layout)
        if best is not None:
            return best[1]
    return None


# -- reading the run ------------------------------------------------------------------------

def definitions(jaxpr, layout: Layout) -> dict:
    """Each variable the run makes -> (block, equation in the block, result)."""
    made = {}
    for k in range(layout.count):
        for p in range(layout.size):
            for o, v in enumerate(jaxpr.eqns[layout.start + k * layout.size + p].outvars):
                made[v] = (k, p, o)
    return made


def read_run(jaxpr, layout: Layout) -> Roll | None:
    """The run at ``layout`` as a :class:`Roll`, None where its blocks are not layers
    (the module's docstring says when they are)."""
    made = definitions(jaxpr, layout)
    blocks = [jaxpr.eqns[layout.start + k * layout.size:layout.start + (k + 1) * layout.size]
              for k in range(layout.count)]
    roles = {}   # (equation, operand) -> its role, the same in every block
    for p, template in enumerate(blocks[0]):
        for q in range(len(template.invars)):
            atoms = [block[p].invars[q] for block in blocks]
            role = operand_role(atoms, made)
            if role is None:
                return None
            roles[p, q] = role
    later = read_after(jaxpr, layout, made)   # the whole program: read last
    if later is None:
        return None
    carried = sorted({r[1] for r in roles.values() if r[0] == "carry"} | set(later))
    if not carried or not any(r[0] == "layer" and not all(isinstance(a, Literal) for a in r[1])
                              for r in roles.values()):
        return None
    hoisted = hoist(blocks, roles, carried)
    if hoisted is None:
        return None
    roll = build_roll(jaxpr, layout, blocks, roles, carried, hoisted)
    if roll is not None:
        roll.hoisted = [block[p] for block in blocks for p in hoisted]
    return roll


def hoist(blocks, roles: dict, carried: list) -> list[int] | None:
    """The block's equations run per layer before the stack rather than in the body:

    - those whose params differ between layers (:data:`OWN_PARAMS`), which must read
      only values from before the run (None where one does not);
    - casts of the layer's own weights to a narrower dtype (f32 master weights run in
      bf16): the stack, the weights a stage receives and the gradients it sends back are
      then of the narrow dtype (the gradient of a bf16 use is bf16 either way).

    ``roles`` learns that their readers read a layer's own value."""
    hoisted = []
    for p, eqn in enumerate(blocks[0]):
        own_params = any(block[p].params != eqn.params for block in blocks)
        movable = (all(roles[p, q][0] in ("const", "layer") for q in range(len(eqn.invars)))
                   and not any((p, o) in carried for o in range(len(eqn.outvars))))
        if own_params and not movable:
            return None
        if not own_params and not (movable and eqn.primitive.name == "convert_element_type"
                                   and roles[p, 0][0] == "layer"
                                   and narrower(eqn.outvars[0].aval, eqn.invars[0].aval)):
            continue
        hoisted.append(p)
        for o in range(len(eqn.outvars)):
            own = ("layer", tuple(block[p].outvars[o] for block in blocks))
            for slot, role in roles.items():
                if role == ("inner", (p, o)):
                    roles[slot] = own
    return hoisted


def narrower(aval, than) -> bool:
    return np.dtype(aval.dtype).itemsize < np.dtype(than.dtype).itemsize


def read_after(jaxpr, layout: Layout, made: dict) -> list | None:
    """The last block's results the program reads after the run, as (equation, result);
    None where another block's results are read there, or a block's beyond the next."""
    later = set()
    readers = [(layout.block_of(i), e.invars) for i, e in enumerate(jaxpr.eqns)]
    readers.append((None, jaxpr.outvars))
    for block, atoms in readers:
        for v in atoms:
            if isinstance(v, Literal) or v not in made:
                continue
            k, p, o = made[v]
            if block is None:
                if k != layout.count - 1:
                    return None
                later.add((p, o))
            elif block not in (k, k + 1):
                return None
    return sorted(later)


def operand_role(atoms: Sequence, made: dict) -> tuple | None:
    """What one operand reads in every block: ``("inner", (p, o))`` (its own block's
    equation p, result o), ``("carry", (p, o))`` (the block before's; the first block
    reads from before the run), ``("const", atom)`` or ``("layer", atoms)`` (from before
    the run: one value for all, or one each); None where blocks disagree."""
    inner = [made.get(a) if not isinstance(a, Literal) else None for a in atoms]
    if inner[0] is not None and inner[0][0] == 0:
        where = inner[0][1:]
        if all(m is not None and m == (k,) + where for k, m in enumerate(inner)):
            return ("inner", where)
        return None
    if inner[0] is not None:
        return None
    if len(atoms) > 1 and inner[1] is not None:   # the first block reads from before
        where = inner[1][1:]
        if all(m is not None and m == (k - 1,) + where for k, m in enumerate(inner[1:], 1)):
            return ("carry", where)
        return None
    if any(m is not None for m in inner):
        return None
    if all(same_atom(a, atoms[0]) for a in atoms):
        return ("const", atoms[0])
    return ("layer", tuple(atoms))


def build_roll(jaxpr, layout: Layout, blocks, roles: dict, carried: list,
               hoisted: Sequence[int] = ()) -> Roll | None:
    """The scan's body: the second block's equations (its carries read from the first)
    but the ``hoisted`` ones, reading fresh variables for constants, carries and stacked
    operands."""
    template = blocks[1]
    consts, const_vars, layers, layer_vars, inits = [], [], [], [], [None] * len(carried)
    carry_vars = [jax_compat.new_var(template[p].outvars[o].aval) for p, o in carried]
    position = {c: n for n, c in enumerate(carried)}
    eqns = []
    for p, eqn in enumerate(template):
        if p in hoisted:
            continue
        invars = list(eqn.invars)
        for q, atom in enumerate(eqn.invars):
            kind, what = roles[p, q]
            if kind == "carry":
                n = position[what]
                first = blocks[0][p].invars[q]
                if inits[n] is not None and not same_atom(inits[n], first):
                    return None   # the first block reads two values where one is carried
                inits[n] = first
                invars[q] = carry_vars[n]
            elif kind == "const" and not isinstance(what, Literal):
                n = next((i for i, c in enumerate(consts) if c is what), None)
                if n is None:
                    consts.append(what)
                    const_vars.append(jax_compat.new_var(what.aval))
                    n = len(consts) - 1
                invars[q] = const_vars[n]
            elif kind == "layer":
                n = next((i for i, ws in enumerate(layers)
                          if all(same_atom(a, b) for a, b in zip(ws, what))), None)
                if n is None:
                    layers.append(what)
                    layer_vars.append(jax_compat.new_var(atom.aval))
                    n = len(layers) - 1
                invars[q] = layer_vars[n]
        eqns.append(jax_compat.with_invars(eqn, invars))
    outvars = [template[p].outvars[o] for p, o in carried]
    body = jax_compat.closed_jaxpr([], const_vars + carry_vars + layer_vars, outvars, eqns, [],
                                   jax_compat.part_debug_info(jaxpr))
    results = [blocks[-1][p].outvars[o] for p, o in carried]
    return Roll(layout, body, consts, inits, layers, results)


# -- running the program with the run rolled ------------------------------------------------

def run_rolled(jaxpr, consts: Sequence, args: Sequence, roll: Roll) -> list:
    """``jaxpr`` evaluated with ``roll``'s run as one ``lax.scan``."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    def run(eqns):
        for eqn in eqns:
            env.update(zip(eqn.outvars, jax_compat.eval_eqn(eqn, [read(v) for v in eqn.invars])))
    layout = roll.layout
    run(jaxpr.eqns[:layout.start])
    run(roll.hoisted)
    env.update(zip(roll.results, scan_layers(roll, read)))
    run(jaxpr.eqns[layout.end:])
    return [read(v) for v in jaxpr.outvars]


def scan_layers(roll: Roll, read: Callable) -> list:
    """The run as ``lax.scan`` over the layers' operands stacked along a new leading
    dim, in block order."""
    body, body_consts = jax_compat.split_closed(roll.body)
    carry_avals = [v.aval for v in body.outvars]
    consts = [read(a) for a in roll.consts]
    init = [jnp.zeros(a.shape, a.dtype) if atom is None else jnp.asarray(read(atom), a.dtype)
            for atom, a in zip(roll.inits, carry_avals)]
    stacked = [jnp.stack([jnp.asarray(read(a), a.aval.dtype) for a in atoms])
               for atoms in roll.layers]

    def layer(carry, xs):
        return jax_compat.eval_jaxpr(body, body_consts, *consts, *carry, *xs), None
    final, _ = lax.scan(layer, init, stacked)
    return list(final)


def find(fun: Callable, args: Sequence) -> Layout | None:
    """Where ``fun`` (of flat arguments) runs repeated layers at ``args``, if anywhere."""
    return find_layout(jax_compat.split_closed(jax.make_jaxpr(fun)(*args))[0])


def rolled(fun: Callable, layout: Layout, read: Callable | None = None) -> Callable:
    """``fun`` (of flat arguments) with its repeated layers at ``layout`` run as one
    ``lax.scan`` over their stacked weights. It reads ``fun`` at each call, so that the
    run is read again at other shapes (one microbatch's rows): ``read(args)`` gives its
    jaxpr, the shape of its results and its roll (None: traced and read afresh)."""
    def read_afresh(args):
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        return closed, out_shape, read_run(jax_compat.split_closed(closed)[0], layout)

    def layered(*args):
        closed, out_shape, roll = (read or read_afresh)(args)
        jaxpr, consts = jax_compat.split_closed(closed)
        if roll is None:
            raise InputError(f"the loss's repeated layers ({layout.count} blocks of "
                             f"{layout.size} equations) differ at other shapes")
        outs = run_rolled(jaxpr, consts, args, roll)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return layered
