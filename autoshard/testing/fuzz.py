"""Random JAX programs for fuzzing the planner, and the check every one must pass.

A program is drawn op by op from a ``Draw`` (``RandomDraw`` for a seeded campaign,
``HypothesisDraw`` inside a hypothesis test) and written out as Python source, so a
failure prints as a program a user can run. Its arguments are made lazily, as ops ask
for operands of a shape: undividable and size-1 dims, f32, bf16 and int32. A case adds a
mesh ((8,), (2, 4) or (4, 2)), a hardware model (an H100, or one whose links are so cheap
that splitting tiny arrays pays), and sometimes pins, donation and a memory budget.

``check(case)`` plans the program, runs the plan's jit and compares it with ``jax.jit``
of the unsharded function. Its ``Outcome`` is ``ok``, ``infeasible`` (a clean
``AutoshardError`` where the input has no plan, with the reason), ``crash`` or ``wrong``.

Example::

    case = generate(RandomDraw(seed=7))
    print(case.source)
    print(check(case).kind)

Values that decide something discrete (gather indices, dynamic-slice starts, ``cond``
predicates, loop trip counts) come from int32 arguments: integer arithmetic is exact in
any order, so a sharded run must decide exactly as the unsharded one.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import autoshard
from autoshard.errors import MemoryBudgetError
from autoshard.frontend import specs
from autoshard.report import hlo_report

MESHES = {"8": ((8,), ("a",)), "2x4": ((2, 4), ("x", "y")), "4x2": ((4, 2), ("x", "y"))}
DIMS = (1, 2, 3, 4, 5, 6, 8, 8, 16, 16, 32)
# links so fast and compute so slow that splitting even tiny arrays pays
CHEAP_LINKS = autoshard.Hardware(flops=1e6, hbm_bandwidth=1e6, memory=80e9,
                                 link_bandwidth=1e12, link_latency=1e-12)
HARDWARE = {"h100": autoshard.Hardware(), "cheap_links": CHEAP_LINKS}
TOLERANCE = {"float32": (2e-4, 2e-4), "bfloat16": (2e-2, 1e-2), "int32": (0, 0), "bool": (0, 0)}

PRELUDE = '''import jax
import jax.numpy as jnp
from jax import lax


@jax.custom_jvp
def gelu(x):
    return 0.5 * x * (1 + jnp.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


@gelu.defjvp
def gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return gelu(x), t * jax.grad(lambda y: jnp.sum(
        0.5 * y * (1 + jnp.tanh(0.7978845608 * (y + 0.044715 * y ** 3)))))(x)


@jax.custom_jvp
def relu(x):
    return jnp.maximum(x, 0)


@relu.defjvp
def relu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return relu(x), jnp.where(x > 0, t, jnp.zeros_like(t))
'''


class Draw:
    """Where a program's choices come from."""

    def integer(self, lo: int, hi: int) -> int:   # inclusive
        raise NotImplementedError

    def choice(self, options: Sequence):
        return options[self.integer(0, len(options) - 1)]

    def chance(self, p: float) -> bool:
        return self.integer(0, 999) < p * 1000


class RandomDraw(Draw):
    """Choices from ``random.Random(seed)``: one seed, one program."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)


class HypothesisDraw(Draw):
    """Choices from hypothesis's ``st.data()``, so failures shrink to small programs."""

    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def integer(self, lo, hi):
        return self.data.draw(self.st.integers(lo, hi))


@dataclasses.dataclass(frozen=True)
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str   # "float32", "bfloat16", "int32"
    low: bool = False   # computed from bfloat16 somewhere (itself or an operand, recursively)

    @property
    def is_float(self) -> bool:
        return self.dtype != "int32"


@dataclasses.dataclass(frozen=True)
class Case:
    """A generated program and everything needed to plan and run it."""
    source: str                       # defines ``fn``
    args: tuple[Value, ...]
    mesh: str                         # a key of MESHES
    hardware: str                     # a key of HARDWARE
    pins: tuple[tuple[str, tuple], ...] = ()   # (argument name, spec as PartitionSpec args)
    donate_argnums: tuple[int, ...] = ()
    budget: str | None = None         # None, "tight" or "below_floor"
    value_seed: int = 0
    # per output leaf, whether it is computed from bfloat16 (compared at its tolerance)
    low_outputs: tuple[bool, ...] = ()
    features: tuple[str, ...] = ()    # kinds of op drawn: "grouped_conv", "fft", ...

    def reproducer(self) -> str:
        """A script that plans and runs the program as ``check`` does and prints how far
        the plan's outputs are from the unsharded run's."""
        pins = {name: PartitionSpec(*spec) for name, spec in self.pins}
        args = [make_arg(a.shape, a.dtype, self.value_seed, i) for i, a in enumerate(self.args)]
        made = ", ".join(f"fuzz.make_arg({a.shape}, {a.dtype!r}, {self.value_seed}, {i})"
                         for i, a in enumerate(self.args))
        return "\n".join([
            "import os",
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'",
            self.source,
            "import numpy as np",
            "import autoshard",
            "from jax.sharding import PartitionSpec, PartitionSpec as P",
            "from autoshard.testing import fuzz",
            "",
            f"args = [{made}]",
            f"mesh = autoshard.make_mesh{MESHES[self.mesh]}",
            "plan = autoshard.plan(fn, *args, mesh=mesh, "
            f"hardware=autoshard.{HARDWARE[self.hardware]!r},",
            f"                      pins={pins or None!r}, donate_argnums={self.donate_argnums},",
            f"                      memory_budget={budget_bytes(self, args, pins)!r}, cache=False,",
            "                      progress=False)",
            "got = plan.jit()(*[jax.device_put(x, s) for x, s in zip(args, plan.in_shardings)])",
            "print(fuzz.compare(jax.device_get(got), jax.jit(fn)(*args), "
            f"low_outputs={self.low_outputs}))",
        ])


class Builder:
    """Writes a program's body line by line, making arguments as ops ask for them."""

    def __init__(self, draw: Draw, differentiable: bool):
        self.draw = draw
        self.differentiable = differentiable   # value_and_grad: no while loops, no ints out
        self.args: list[Value] = []
        self.values: list[Value] = []
        self.lines: list[str] = []
        self.helpers: list[str] = []
        self.constants: list[str] = []   # module-level arrays the program closes over
        self.kernels: list[Value] = []   # convolution kernels (differentiated too)
        self.ffts: list[Value] = []      # results of Fourier transforms
        self.features: set[str] = set()

    def fresh(self, prefix: str = "v") -> str:
        return f"{prefix}{len(self.values) + len(self.args) + len(self.helpers)}"

    def arg(self, shape, dtype) -> Value:
        value = Value(f"a{len(self.args)}", tuple(shape), dtype, dtype == "bfloat16")
        self.args.append(value)
        self.values.append(value)
        return value

    def emit(self, expr: str, shape, dtype) -> Value:
        """``expr`` as a new value; it is ``low`` where it or an operand it names is."""
        names = set(re.findall(r"\b[av]\d+\b", expr))
        low = dtype == "bfloat16" or any(v.low for v in self.values if v.name in names)
        value = Value(self.fresh(), tuple(int(d) for d in shape), dtype, low)
        self.lines.append(f"{value.name} = {expr}")
        self.values.append(value)
        return value

    def shape(self, rank: int | None = None) -> tuple[int, ...]:
        rank = self.draw.integer(1, 3) if rank is None else rank
        return tuple(self.draw.choice(DIMS) for _ in range(rank))

    def float_dtype(self) -> str:
        return self.draw.choice(("float32", "float32", "bfloat16"))

    def pick(self, floats_only: bool = True, min_rank: int = 0) -> Value:
        found = [v for v in self.values if (v.is_float or not floats_only)
                 and len(v.shape) >= min_rank]
        if found and self.draw.chance(0.85):
            return found[self.draw.integer(max(0, len(found) - 4), len(found) - 1)]
        return self.arg(self.shape(self.draw.integer(max(1, min_rank), 3)), self.float_dtype())

    def like(self, shape, dtype) -> Value:
        """An operand of exactly this shape and dtype: an existing value or a new argument."""
        found = [v for v in self.values if v.shape == tuple(shape) and v.dtype == dtype]
        if found and self.draw.chance(0.5):
            return self.draw.choice(found)
        return self.arg(shape, dtype)

    def index_arg(self, shape=(4,)) -> Value:
        found = [v for v in self.args if v.dtype == "int32" and v.shape == tuple(shape)]
        return found[0] if found else self.arg(shape, "int32")


# --- ops: each reads the builder's values and emits one or a few lines ------------------

def op_unary(b: Builder):
    x = b.pick(floats_only=False)
    if not x.is_float:
        expr = b.draw.choice(("{x} * 2 + 1", "jnp.abs({x})", "{x} % 3", "-{x}"))
        return b.emit(expr.format(x=x.name), x.shape, x.dtype)
    expr = b.draw.choice(("jnp.tanh({x})", "jnp.sin({x})", "relu({x})", "gelu({x})",
                          "jax.nn.relu({x})", "{x} * {x}", "-{x}", "jnp.log1p(jnp.abs({x}))",
                          "jax.nn.sigmoid({x})", "jnp.exp(-jnp.abs({x}))"))
    return b.emit(expr.format(x=x.name), x.shape, x.dtype)


def op_binary(b: Builder):
    x = b.pick()
    if b.draw.chance(0.5):   # broadcast: size-1 dims, or fewer leading dims
        shape = [1 if b.draw.chance(0.4) else d for d in x.shape]
        shape = shape[b.draw.integer(0, len(shape)):] if b.draw.chance(0.3) else shape
        y = b.like(shape, b.draw.choice((x.dtype, x.dtype, "float32")))
    else:
        y = b.like(x.shape, x.dtype)
    dtype = x.dtype if x.dtype == y.dtype else "float32"
    expr = b.draw.choice(("{x} + {y}", "{x} - {y}", "{x} * {y}", "jnp.maximum({x}, {y})",
                          "jnp.where({x} > 0, {x}, 0.5 * {y})"))
    return b.emit(expr.format(x=x.name, y=y.name), jnp.broadcast_shapes(x.shape, tuple(y.shape)),
                  dtype)


LETTERS = "ijklmnopqrs"


def op_einsum(b: Builder):
    x = b.pick(min_rank=1)
    rank = len(x.shape)
    roles = [b.draw.choice(("free", "contract", "contract", "batch")) for _ in range(rank)]
    if "contract" not in roles and b.draw.chance(0.7):
        roles[b.draw.integer(0, rank - 1)] = "contract"
    x_labels = LETTERS[:rank]
    new_free = [b.draw.choice(DIMS) for _ in range(b.draw.integer(0, 2))]
    y_labels = ("".join(l for l, r in zip(x_labels, roles) if r != "free")
                + "tuvw"[:len(new_free)])
    y_shape = [d for d, r in zip(x.shape, roles) if r != "free"] + new_free
    if not y_shape:
        y_shape, y_labels, new_free = [4], "t", [4]
    perm = list(range(len(y_shape)))
    if b.draw.chance(0.5):
        random.Random(b.draw.integer(0, 99)).shuffle(perm)
    y_shape = [y_shape[p] for p in perm]
    y_labels = "".join(y_labels[p] for p in perm)
    y = b.like(y_shape, x.dtype)
    out_labels = ("".join(l for l, r in zip(x_labels, roles) if r in ("batch", "free"))
                  + "tuvw"[:len(new_free)])
    sizes = dict(zip(x_labels, x.shape)) | dict(zip(y_labels, y_shape))
    contracted = math.prod(d for l, d in zip(x_labels, x.shape) if l not in out_labels)
    scale = f" * {1 / math.sqrt(contracted):.6g}" if contracted > 1 else ""
    return b.emit(f"jnp.einsum('{x_labels},{y_labels}->{out_labels}', {x.name}, {y.name}){scale}",
                  [sizes[l] for l in out_labels], x.dtype)


def op_closure(b: Builder):
    """Read an array the function closes over (a RoPE table, a mask)."""
    x = b.pick()
    name = f"TABLE{len(b.constants)}"
    shape = [1 if b.draw.chance(0.3) else d for d in x.shape]
    n = math.prod(shape)
    b.constants.append(f"{name} = jnp.linspace(-1.0, 1.0, {n}, dtype=jnp.{x.dtype})"
                       f".reshape({tuple(shape)})")
    return b.emit(f"{x.name} * {name} + {name}", x.shape, x.dtype)


def op_reduce(b: Builder):
    x = b.pick(floats_only=False, min_rank=1)
    axes = tuple(d for d in range(len(x.shape)) if b.draw.chance(0.5)) or (0,)
    keep = b.draw.chance(0.3)
    fn = b.draw.choice(("jnp.sum", "jnp.max", "jnp.min", "jnp.mean") if x.is_float
                       else ("jnp.sum", "jnp.max", "jnp.min"))
    shape = [1 if d in axes else n for d, n in enumerate(x.shape) if keep or d not in axes]
    dtype = "float32" if fn == "jnp.mean" and not x.is_float else x.dtype
    return b.emit(f"{fn}({x.name}, axis={axes}, keepdims={keep})", shape, dtype)


def op_reshape(b: Builder):
    x = b.pick(floats_only=False, min_rank=1)
    shape = list(x.shape)
    kind = b.draw.choice(("merge", "split", "transpose", "flatten"))
    if kind == "merge" and len(shape) >= 2:
        d = b.draw.integer(0, len(shape) - 2)
        shape[d:d + 2] = [shape[d] * shape[d + 1]]
    elif kind == "split" and any(n % 2 == 0 for n in shape):
        d = next(i for i, n in enumerate(shape) if n % 2 == 0)
        shape[d:d + 1] = [2, shape[d] // 2]
    elif kind == "transpose" and len(shape) >= 2:
        perm = list(range(len(shape)))
        random.Random(b.draw.integer(0, 99)).shuffle(perm)
        return b.emit(f"jnp.transpose({x.name}, {tuple(perm)})", [shape[p] for p in perm],
                      x.dtype)
    else:
        shape = [math.prod(shape)]
    return b.emit(f"{x.name}.reshape({tuple(shape)})", shape, x.dtype)


def op_concat_slice(b: Builder):
    x = b.pick(floats_only=False, min_rank=1)
    d = b.draw.integer(0, len(x.shape) - 1)
    if b.draw.chance(0.5):
        other = list(x.shape)
        other[d] = b.draw.choice(DIMS)
        y = b.like(other, x.dtype)
        shape = list(x.shape)
        shape[d] += other[d]
        return b.emit(f"jnp.concatenate([{x.name}, {y.name}], axis={d})", shape, x.dtype)
    n = x.shape[d]
    start = b.draw.integer(0, n - 1)
    stop = b.draw.integer(start + 1, n)
    index = ", ".join([":"] * d + [f"{start}:{stop}"])
    shape = list(x.shape)
    shape[d] = stop - start
    return b.emit(f"{x.name}[{index}]", shape, x.dtype)


def op_gather(b: Builder):
    x = b.pick(floats_only=False, min_rank=1)
    d = b.draw.integer(0, len(x.shape) - 1)
    n = x.shape[d]
    k = b.draw.choice((1, 3, 4, 8))
    idx = b.index_arg((k,))
    ids = b.emit(f"jnp.abs({idx.name} * 7 + 3) % {n}", (k,), "int32")
    if b.draw.chance(0.5):
        shape = list(x.shape)
        shape[d] = k
        return b.emit(f"jnp.take({x.name}, {ids.name}, axis={d})", shape, x.dtype)
    if len(x.shape) >= 2 and d == 0 and b.draw.chance(0.5):   # take_along_axis
        last = len(x.shape) - 1
        m = x.shape[last]
        ids2 = b.emit(f"jnp.broadcast_to(({ids.name}[:1] + jnp.arange({m})) % {m}, "
                      f"{x.shape})", x.shape, "int32")
        return b.emit(f"jnp.take_along_axis({x.name}, {ids2.name}, axis={last})", x.shape,
                      x.dtype)
    shape = list(x.shape)
    shape[d] = k
    index = ", ".join([":"] * d + [ids.name])
    return b.emit(f"{x.name}[{index}]", shape, x.dtype)


def op_dynamic_slice(b: Builder):
    x = b.pick(floats_only=False, min_rank=1)
    d = b.draw.integer(0, len(x.shape) - 1)
    n = x.shape[d]
    size = b.draw.integer(1, n)
    idx = b.index_arg()
    # a computed start that may fall outside [0, n - size]: the slice is then clamped
    start = b.emit(f"jnp.sum({idx.name}) % {n + 3} - 1", (), "int32")
    if b.draw.chance(0.5):
        return b.emit(f"lax.dynamic_slice_in_dim({x.name}, {start.name}, {size}, axis={d})",
                      [size if i == d else s for i, s in enumerate(x.shape)], x.dtype)
    upd = b.like([size if i == d else s for i, s in enumerate(x.shape)], x.dtype)
    return b.emit(f"lax.dynamic_update_slice_in_dim({x.name}, {upd.name}, {start.name}, "
                  f"axis={d})", x.shape, x.dtype)


def op_sort(b: Builder):
    x = b.pick(min_rank=1)
    d = b.draw.integer(0, len(x.shape) - 1)
    kind = b.draw.choice(("sort", "top_k", "cumsum", "cumsum"))
    if kind == "sort":
        return b.emit(f"jnp.sort({x.name}, axis={d})", x.shape, x.dtype)
    if kind == "top_k":
        k = b.draw.integer(1, x.shape[-1])
        return b.emit(f"lax.top_k({x.name}, {k})[0]", x.shape[:-1] + (k,), x.dtype)
    return b.emit(f"jnp.cumsum({x.name}, axis={d})", x.shape, x.dtype)


def op_loop(b: Builder):
    x = b.pick(min_rank=1)
    kinds = ["scan", "fori", "cond", "checkpoint"] + ([] if b.differentiable else ["while"])
    kind = b.draw.choice(kinds)
    name = b.fresh("f")
    b.helpers.append(name)
    if kind == "scan":
        w = b.like(x.shape[1:], x.dtype)
        b.lines += [f"def {name}(c, xs):",
                    "    c = jnp.tanh(c * 0.5 + xs)",
                    "    return c, c * 2"]
        out = b.emit(f"lax.scan({name}, {w.name}, {x.name}, reverse={b.draw.chance(0.3)})[1]",
                     x.shape, x.dtype)
        return out
    if kind == "fori":
        steps = b.draw.integer(1, 4)
        b.lines += [f"def {name}(i, c):",
                    "    return jnp.sin(c) * 0.9 + 0.1 * c"]
        return b.emit(f"lax.fori_loop(0, {steps}, {name}, {x.name})", x.shape, x.dtype)
    if kind == "while":
        idx = b.index_arg()
        b.lines += [f"def {name}(state):",
                    "    i, c = state",
                    "    return i + 1, jnp.cos(c) + c * 0.5"]
        return b.emit(f"lax.while_loop(lambda s: s[0] < jnp.sum({idx.name}) % 4, {name}, "
                      f"(jnp.int32(0), {x.name}))[1]", x.shape, x.dtype)
    if kind == "cond":
        idx = b.index_arg()
        b.lines += [f"def {name}(c):",
                    "    return jnp.tanh(c) * 2"]
        return b.emit(f"lax.cond(jnp.sum({idx.name}) % 2 == 0, {name}, lambda c: c * c, "
                      f"{x.name})", x.shape, x.dtype)
    b.lines += ["@jax.checkpoint",
                f"def {name}(c):",
                "    return jnp.sin(c) * jnp.tanh(c) + c"]
    return b.emit(f"{name}({x.name})", x.shape, x.dtype)


CONV_LAYOUTS = {1: (("NWC", "WIO", "NWC"), ("NCW", "OIW", "NCW")),
                2: (("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW"))}


def _layout_shape(spec: str, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[c] for c in spec)


def _conv_padding(b: Builder, spatial: int, lhs_dilated: bool):
    """"VALID", "SAME" or explicit (low, high) pads; explicit where the input is dilated
    (JAX takes no padding string for a transposed convolution)."""
    kind = "explicit" if lhs_dilated else b.draw.choice(("VALID", "SAME", "explicit"))
    if kind != "explicit":
        return repr(kind)
    return repr(tuple((b.draw.integer(0, 2), b.draw.integer(0, 2)) for _ in range(spatial)))


def op_conv(b: Builder):
    """A convolution: 1 or 2 spatial dims, channels first or last, grouped by features
    (or, as a kernel gradient is, by batch), strided, dilated (the window, or the input as
    a transposed convolution is), padded. Its kernel is a new argument, so a
    differentiated program takes the kernel's gradient too."""
    spatial = b.draw.choice((1, 2, 2))
    lhs_spec, rhs_spec, out_spec = b.draw.choice(CONV_LAYOUTS[spatial])
    groups = b.draw.choice((1, 2, 3, 3, 4))
    by_batch = groups > 1 and b.draw.chance(0.25)
    window = [b.draw.choice((1, 2, 3)) for _ in range(spatial)]
    strides = tuple(b.draw.choice((1, 1, 2, 3)) for _ in range(spatial))
    rhs_dilation = tuple(b.draw.choice((1, 1, 2)) for _ in range(spatial))
    lhs_dilation = tuple(b.draw.choice((1, 1, 1, 2)) for _ in range(spatial))
    extent = [(k - 1) * d + 1 for k, d in zip(window, rhs_dilation)]
    sizes = {"N": (groups if by_batch else 1) * b.draw.choice((1, 2, 3, 4)),
             "C": (1 if by_batch else groups) * b.draw.choice((1, 2, 4)),
             "O": groups * b.draw.choice((1, 2, 3))}
    sizes["I"] = sizes["C"] // (1 if by_batch else groups)
    for c, e in zip("HW" if spatial == 2 else "W", extent):
        sizes[c] = b.draw.choice((e, e + 1, e + 2, 5, 6, 8, 9))
    in_shape = _layout_shape(lhs_spec, sizes)
    kernel_sizes = dict(sizes, **dict(zip("HW" if spatial == 2 else "W", window)))
    kernel_shape = _layout_shape(rhs_spec, kernel_sizes)
    dtype = b.float_dtype()
    x = b.like(in_shape, dtype)
    k = b.arg(kernel_shape, dtype)
    b.kernels.append(k)
    padding = _conv_padding(b, spatial, any(d > 1 for d in lhs_dilation))
    counts = (f"batch_group_count={groups}" if by_batch else f"feature_group_count={groups}")
    fan_in = sizes["I"] * math.prod(window)
    expr = (f"lax.conv_general_dilated({x.name}, {k.name}, {strides}, {padding}, "
            f"lhs_dilation={lhs_dilation}, rhs_dilation={rhs_dilation}, "
            f"dimension_numbers={(lhs_spec, rhs_spec, out_spec)!r}, {counts})"
            f" * {1 / math.sqrt(fan_in):.6g}")
    try:
        out = _eval_shape(expr, {x.name: x, k.name: k})
    except Exception:   # padding or strides leave no output: a plain convolution instead
        expr = (f"lax.conv_general_dilated({x.name}, {k.name}, {(1,) * spatial}, 'SAME', "
                f"dimension_numbers={(lhs_spec, rhs_spec, out_spec)!r}, {counts})")
        strides, lhs_dilation, rhs_dilation = (1,) * spatial, (1,) * spatial, (1,) * spatial
        out = _eval_shape(expr, {x.name: x, k.name: k})
    if 0 in out.shape:
        return None
    b.features.update(name for name, drawn in (
        ("grouped_conv", groups > 1 and not by_batch), ("batch_grouped_conv", by_batch),
        ("strided_conv", max(strides) > 1), ("dilated_conv", max(rhs_dilation) > 1),
        ("transposed_conv", max(lhs_dilation) > 1), ("conv", True)) if drawn)
    return b.emit(expr, out.shape, dtype)


def _eval_shape(expr: str, values: dict[str, Value]) -> jax.ShapeDtypeStruct:
    """The shape and dtype ``expr`` computes from ``values`` (by name), traced abstractly."""
    names = list(values)
    fn = eval(f"lambda {', '.join(names)}: {expr}", {"jax": jax, "jnp": jnp, "lax": jax.lax})
    return jax.eval_shape(fn, *[jax.ShapeDtypeStruct(values[n].shape, jnp.dtype(values[n].dtype))
                                for n in names])


def op_fft(b: Builder):
    """A Fourier transform along one axis (or the last two), its complex result read back
    as floats; bfloat16 is transformed in float32, as XLA takes no narrower FFT."""
    x = b.pick(min_rank=1)
    d = b.draw.integer(0, len(x.shape) - 1)
    src = x.name if x.dtype == "float32" else f"{x.name}.astype(jnp.float32)"
    kinds = ["rfft_abs", "fft_real", "irfft", "ifft_imag"] + (["fft2_abs"] if len(x.shape) >= 2
                                                               else [])
    kind = b.draw.choice(kinds)
    n, shape = x.shape[d], list(x.shape)
    if kind == "rfft_abs":
        shape[d] = n // 2 + 1
        expr = f"jnp.abs(jnp.fft.rfft({src}, axis={d}))"
    elif kind == "fft_real":
        expr = f"jnp.fft.fft({src}, axis={d}).real"
    elif kind == "irfft":
        expr = f"jnp.fft.irfft(jnp.fft.rfft({src}, axis={d}) * 0.5, n={n}, axis={d})"
    elif kind == "ifft_imag":
        expr = f"jnp.fft.ifft({src}, axis={d}).imag"
    else:
        expr = f"jnp.abs(jnp.fft.fft2({src}))"
    b.features.add("fft")
    value = b.emit(expr, shape, "float32")
    b.ffts.append(value)
    return value


OPS = ((op_conv, 2), (op_fft, 1), (op_unary, 3), (op_binary, 3), (op_closure, 1),
       (op_einsum, 3), (op_reduce, 2), (op_reshape, 2),
       (op_concat_slice, 2), (op_gather, 2), (op_dynamic_slice, 2), (op_sort, 2),
       (op_loop, 3))
_OP_TABLE = [op for op, weight in OPS for _ in range(weight)]


def generate(draw: Draw, max_ops: int = 6) -> Case:
    """Draw one program and its planning options."""
    differentiable = draw.chance(0.3)
    b = Builder(draw, differentiable)
    b.arg(b.shape(), b.float_dtype() if differentiable else
          draw.choice(("float32", "float32", "bfloat16", "int32")))
    for _ in range(draw.integer(1, max_ops)):
        draw.choice(_OP_TABLE)(b)
    produced = [v for v in b.values if v not in b.args] or b.values
    if differentiable:
        floats = [v for v in produced if v.is_float] or [b.pick()]
        terms = [v for v in floats[-2:]]
        loss = " + ".join(f"jnp.sum({v.name}.astype(jnp.float32) ** 2)" for v in terms)
        body = b.lines + [f"return {loss}"]
        header = f"def loss({', '.join(a.name for a in b.args)}):"
        # the gradients of the first argument and of every convolution kernel
        argnums = tuple(sorted({0} | {b.args.index(k) for k in b.kernels}))
        if len(argnums) > 1:
            b.features.add("conv_grad")
        source = "\n".join([PRELUDE, *b.constants, "", header] + ["    " + l for l in body] +
                           ["", "", f"fn = jax.value_and_grad(loss, argnums="
                            f"{argnums if len(argnums) > 1 else 0})", ""])
        # every gradient reads every value of the loss
        low_outputs = (any(v.low for v in b.values),) * (1 + len(argnums))
    else:
        out_values = produced[-draw.integer(1, 2):]
        if b.ffts and b.ffts[-1] not in out_values and draw.chance(0.5):
            out_values = [b.ffts[-1]] + out_values   # a transform's result pinned below
        outs = [v.name for v in out_values]
        low_outputs = tuple(v.low and v.is_float for v in out_values)
        header = f"def fn({', '.join(a.name for a in b.args)}):"
        body = b.lines + [f"return ({', '.join(outs)},)"]
        source = "\n".join([PRELUDE, *b.constants, "", header] + ["    " + l for l in body]
                           + [""])
    args = tuple(b.args)
    first_out = args[0] if differentiable else out_values[0]
    mesh = draw.choice(tuple(MESHES))
    sizes = dict(zip(MESHES[mesh][1], MESHES[mesh][0]))
    pins = []
    # convolutions and transforms drawn with budgets and pins more often
    weighted = bool(b.ffts or b.kernels)
    if draw.chance(0.35 if weighted else 0.2):
        a = draw.choice(args)
        options = list(specs.enumerate_specs(a.shape, sizes))
        spec = draw.choice(options)
        pins.append((a.name, tuple(ax if len(ax) > 1 else (ax[0] if ax else None)
                                   for ax in spec)))
    donate = tuple(i for i in range(len(args)) if draw.chance(0.15))
    budget = draw.choice((None,) * (3 if weighted else 6) + ("tight", "below_floor"))
    pin_chance = 0.5 if weighted else 0.15
    if not donate and budget is None and draw.chance(pin_chance):   # an output pin
        spec = draw.choice(list(specs.enumerate_specs(first_out.shape, sizes)))
        path = "out[0]" if not differentiable else "out[1][0]" if b.kernels else "out[1]"
        pins.append((path, tuple(ax if len(ax) > 1 else (ax[0] if ax else None)
                                 for ax in spec)))
    return Case(source, args, mesh, draw.choice(("h100", "cheap_links")), tuple(pins),
                donate, budget, draw.integer(0, 2 ** 16), low_outputs,
                tuple(sorted(b.features)))


def make_arg(shape, dtype, value_seed: int, index: int) -> np.ndarray:
    rng = np.random.default_rng([value_seed, index])
    if dtype == "int32":
        return rng.integers(-5, 6, size=shape).astype(np.int32)
    return rng.standard_normal(shape).astype(jnp.dtype(dtype))


def mesh_sizes(case: Case) -> dict[str, int]:
    shape, names = MESHES[case.mesh]
    return dict(zip(names, shape))


def floor_bytes(arrays: Sequence, sizes, pins: dict) -> float:
    """Bytes per device no plan can go below: every array held, split as far as it
    divides (or as pinned). ``arrays``: arguments (None where jax.jit drops one) then
    outputs; ``pins`` by argument name (``a0``, ``a1``, ...)."""
    total = 0.0
    for i, a in enumerate(arrays):
        if a is None:   # an argument jax.jit drops
            continue
        shape, dtype = np.shape(a), jnp.dtype(a.dtype)
        name = f"a{i}"
        if name in pins:
            spec = specs.from_partition_spec(pins[name], len(shape))
            total += specs.per_device_bytes(shape, dtype, spec, sizes)
        else:
            total += min(specs.per_device_bytes(shape, dtype, s, sizes)
                         for s in specs.enumerate_specs(shape, sizes))
    return total


def kept_arguments(fn, args) -> list:
    """The arguments ``jax.jit(fn)`` keeps (``keep_unused=False``): those some output
    depends on, by JAX's own dead-code elimination of the jaxpr; the others are left as
    None, so ``floor_bytes`` still names them ``a0``, ``a1``, ... by position."""
    from autoshard.frontend.jax_compat import used_inputs
    used = used_inputs(jax.make_jaxpr(fn)(*args))
    return [a if keep else None for a, keep in zip(args, used)]


def budget_bytes(case: Case, args, pins: dict) -> float | None:
    """``below_floor``: half of what the arguments need at their most split, so no plan
    fits. ``tight``: halfway from what arguments and outputs need at their most split to
    holding them whole, and 4 KiB for temporaries."""
    if case.budget is None:
        return None
    sizes = mesh_sizes(case)
    fn = compile_source(case.source)
    kept = kept_arguments(fn, args)
    if case.budget == "below_floor":
        return floor_bytes(kept, sizes, pins) / 2
    outs = jax.tree.leaves(jax.eval_shape(fn, *args))
    floor = floor_bytes(kept + outs, sizes, pins)
    whole = sum(specs.nbytes(np.shape(a), a.dtype) for a in kept + outs if a is not None)
    return floor + (whole - floor) / 2 + 4096


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str            # "ok", "infeasible", "refused", "crash", "wrong", "over_budget"
    detail: str = ""
    splits: bool = False   # the plan splits some value over a mesh axis
    overrun: float = 0.0   # over_budget: compiled allocation / budget - 1

    @property
    def failed(self) -> bool:
        return self.kind in ("crash", "wrong", "over_budget")


def compile_source(source: str):
    namespace: dict[str, Any] = {}
    exec(compile(source, "<fuzz program>", "exec"), namespace)
    return namespace["fn"]


def check(case: Case) -> Outcome:
    """Plan, run and compare one case; never raises."""
    try:
        fn = compile_source(case.source)
        args = [make_arg(a.shape, a.dtype, case.value_seed, i) for i, a in enumerate(case.args)]
        want = jax.jit(fn)(*args)
    except Exception:   # the generator wrote a program JAX refuses: a fuzzer bug
        return Outcome("crash", "the generated program does not run under jax.jit:\n"
                       + traceback.format_exc(limit=3))
    pins = {name: PartitionSpec(*spec) for name, spec in case.pins}
    budget = budget_bytes(case, args, pins)
    mesh = autoshard.make_mesh(*MESHES[case.mesh])
    try:
        plan = autoshard.plan(fn, *args, mesh=mesh, hardware=HARDWARE[case.hardware],
                              pins=pins or None, donate_argnums=case.donate_argnums,
                              memory_budget=budget, cache=False, progress=False)
    except MemoryBudgetError as e:
        if case.budget == "below_floor":
            return Outcome("infeasible", f"budget {budget:.0f} B is below the {2 * budget:.0f} B "
                           f"the arguments need at their most split: {e}")
        return refused(fn, args, budget, e)
    except Exception:
        return Outcome("crash", "planning raised:\n" + traceback.format_exc())
    if case.budget == "below_floor":
        return Outcome("wrong", f"planned within {budget:.0f} B, half of what the arguments "
                       f"need at their most split (the plan claims {plan.cost.memory_bytes:.0f} B)")
    try:
        placed = [jax.device_put(x, s) for x, s in zip(args, plan.in_shardings)]
        if budget is None:
            got, memory = plan.jit()(*placed), None
        else:   # compiled once, with XLA's buffer assignment read back
            compiled, *memory = compile_with_buffer_bytes(plan.jit().lower(*placed))
            got = compiled(*placed)
        got = jax.device_get(got)
    except Exception:
        return Outcome("crash", "running the plan raised:\n" + traceback.format_exc())
    untouched = [i for i in range(len(args)) if i not in case.donate_argnums]
    for i in untouched:
        if not np.array_equal(np.asarray(jax.device_get(placed[i])), args[i]):
            return Outcome("wrong", f"argument a{i} (not donated) was altered")
    outcome = compare(got, want, case.low_outputs)
    if outcome.kind == "ok" and memory is not None:
        outcome = within_budget(plan, budget, *memory)
    return dataclasses.replace(outcome, splits=splits(plan))


def compile_with_buffer_bytes(lowered):
    """``lowered`` compiled, with XLA's peak of live bytes and its allocation
    (``memory_analysis()``: arguments + outputs + temporaries - aliased), as
    ``hlo_report.buffer_bytes`` reads them from XLA's dump."""
    with tempfile.TemporaryDirectory(prefix="xla-dump-") as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        live, _ = hlo_report.read_buffer_bytes(dump)
    m = compiled.memory_analysis()
    allocated = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)
    return compiled, live, allocated


def within_budget(plan, budget: float, live_bytes: int, allocated_bytes: int) -> Outcome:
    """``over_budget`` where XLA's compiled program allocates more than the budget the
    plan was made for (the bytes it holds together at its peak, which the planner
    predicts, said too)."""
    if allocated_bytes <= budget:
        return Outcome("ok")
    return Outcome("over_budget", f"compiled {allocated_bytes} B allocated ({live_bytes} B "
                   f"held together at the peak) over the budget of {budget:.0f} B; the plan "
                   f"predicted {plan.cost.memory_bytes:.0f} B",
                   overrun=allocated_bytes / budget - 1)


def whole_program_bytes(fn, args) -> float:
    """What XLA holds on one device running ``fn`` unsplit: arguments, outputs and
    temporaries, less what outputs alias."""
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def refused(fn, args, budget: float, error: MemoryBudgetError) -> Outcome:
    """A ``tight`` budget the planner found no plan for. A crash where running the program
    unsplit fits it (a plan the planner should have found); otherwise ``refused``: above
    what the arguments need at their most split, so not proven infeasible, but below what
    the program needs unsplit, and no plan the planner can express fits."""
    whole = whole_program_bytes(fn, args)
    if whole <= budget:
        return Outcome("crash", f"the planner refused a budget of {budget:.0f} B that the "
                       f"unsplit program fits ({whole:.0f} B): {error}")
    return Outcome("refused", f"budget {budget:.0f} B: the unsplit program needs {whole:.0f} B "
                   f"and {error}")


def splits(plan) -> bool:
    """Whether the plan splits any argument, output or constrained value."""
    found = list(plan.in_specs) + list(plan.out_specs) + [
        s for d in plan.decisions.values() for s in d.in_specs + d.out_specs if s is not None]
    return any(axes for spec in found for axes in spec)


def compare(got, want, low_outputs: Sequence[bool] = ()) -> Outcome:
    """Match outputs within their precision path's tolerance: ``low_outputs[k]`` says
    output leaf ``k`` is computed from bfloat16 somewhere and takes bfloat16's; the others
    take their own dtype's (floats: ``|got - want| <= rtol |want| + atol max|want|``)."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        return Outcome("wrong", f"{len(got_leaves)} outputs, expected {len(want_leaves)}")
    low = tuple(low_outputs) + (False,) * (len(want_leaves) - len(low_outputs))
    for k, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            return Outcome("wrong", f"output {k}: {g.dtype}{g.shape}, expected {w.dtype}{w.shape}")
        dtype = "bfloat16" if low[k] and np.issubdtype(w.dtype, np.inexact) else w.dtype
        rtol, atol = TOLERANCE[str(dtype)]
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(w64), initial=0.0, where=np.isfinite(w64))))
        if not np.allclose(g64, w64, rtol=rtol, atol=atol * scale, equal_nan=True):
            err = np.abs(g64 - w64)
            at = np.unravel_index(int(np.nanargmax(np.where(np.isnan(err), np.inf, err))),
                                  w.shape) if w.size else ()
            return Outcome("wrong", f"output {k} {w.dtype}{w.shape} ({dtype} tolerance): "
                           f"largest error {float(np.nanmax(err)) if w.size else 0:.4g} at {at} "
                           f"(got {g64[at] if w.size else None}, "
                           f"want {w64[at] if w.size else None})")
    return Outcome("ok")
