"""xla: what XLA does to a program that the cost model must know, one place for each fact.

Which values XLA keeps in memory rather than fusing them (its fusion passes), which
static slices it fuses into their readers, which operands it copies into another layout
before a dot or convolution, which transposes it folds into dots, which collectives its
combiner merges into one, what it hoists out of loops, and the width a backend moves
narrow floats at in collectives and stores them at around dots (and where it rounds them
in a pass of their own). ``strategies`` prices strategies with them and ``cost`` builds
memory terms and shared latencies from them; ``hlo_report`` reads what XLA did in the
compiled program. Backend facts read from the device (reduce-scatter formed or emulated,
collectives combined, those widths) live in ``hardware.Backend``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from autoshard.frontend.graph import Graph, Node
from autoshard.frontend.specs import dim_shards

if TYPE_CHECKING:
    from autoshard.cost.strategies import Strategy


# -- what XLA's partitioner splits -------------------------------------------------------

@functools.cache
def partitions_fft() -> bool:
    """Whether XLA's partitioner computes an FFT on each device's block of its batch dims.

    Older XLA (jax 0.10's) gathers an FFT's operand and computes it whole, whatever its
    sharding; where it gathers a split of a middle dim, XLA:CPU's layout assignment may
    hand the FFT a layout it refuses to run (a RET_CHECK in its FFT thunk). Newer XLA
    keeps the batch dims split. Read from a two-device rfft compiled on this process's
    CPUs; False where it has one CPU device (an FFT kept whole is right on either)."""
    import jax

    text = _compiled_on_two_cpus(jax.numpy.fft.rfft, (("batch",),), ("batch",), (2, 8))
    return text is not None and "c64[1,5]" in text and "c64[2,5]" not in text


def _compiled_on_two_cpus(fn, in_specs, out_spec, *shapes) -> str | None:
    """The compiled program of ``fn`` on f32 arguments of ``shapes`` for two of this
    process's CPUs, a mesh of one axis, "batch": each argument split as its entry of
    ``in_specs`` says (a PartitionSpec's entries), the result as ``out_spec``. None where
    the process has one CPU device."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices("cpu")[:2]
    if len(devices) < 2:
        return None
    mesh = Mesh(np.array(devices), ("batch",))
    compiled = jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, PartitionSpec(*spec))
                                              for spec in in_specs),
                       out_shardings=NamedSharding(mesh, PartitionSpec(*out_spec)))
    avals = [jax.ShapeDtypeStruct(shape, np.float32) for shape in shapes]
    return compiled.lower(*avals).compile().as_text()


def fft_on_cpu(primitive: str, params, platform: str) -> str | None:
    """How a plan runs an FFT on XLA:CPU (``rewrite.apply``); None for other nodes and
    platforms.

    XLA:CPU's FFT thunk runs only the default layout (a RET_CHECK fails otherwise), and
    its layout assignment lets an FFT take the layout of its neighbours: its operand's
    producer (an all-gather of a middle dim makes that dim the major one), or readers far
    downstream, which its result hands back to the operand. So an FFT is "copied": its
    operand and result through identity gathers, which XLA copies into and out of the
    layouts the neighbours want. An FFT of one point per transform is "elementwise": it
    is the value (as complex, or its real part), and its dims may all be of one element
    on a device, a layout no gather copies out of (one of one element is a bitcast)."""
    if primitive != "fft" or platform != "cpu":
        return None
    return "elementwise" if all(n == 1 for n in params["fft_lengths"]) else "copied"


@functools.cache
def partitions_grouped_conv() -> bool:
    """Whether XLA's partitioner computes a grouped convolution (more than one input
    feature a group, a window over more than one element) on each device's block of its
    batch. Neither jax 0.10's nor 0.12's does, on CPU or GPU: it gathers the operands
    and computes the conv whole, whatever their specs, batch or groups split (a
    depthwise conv, one input feature a group, splits). Read from a two-device conv
    compiled on this process's CPUs; True where it has one CPU device."""
    import jax

    def grouped(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=2,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    text = _compiled_on_two_cpus(grouped, (("batch",), ()), ("batch",), (2, 4, 4, 4),
                                 (3, 3, 2, 4))
    return text is None or "all-gather" not in text


@functools.cache
def cpu_partitions_top_k() -> bool:
    """Whether XLA:CPU's partitioner computes a top_k on each device's block of its batch
    dims. Neither jax 0.10's nor 0.12's does: it gathers the operand, computes the top_k
    whole and slices the result (XLA:GPU's keeps a leading batch dim split). Read from a
    two-device top_k compiled on this process's CPUs; True where it has one CPU device
    (nothing to tell)."""
    import jax

    text = _compiled_on_two_cpus(lambda x: jax.lax.top_k(x, 2)[0], (("batch",),),
                                 ("batch",), (4, 16))
    return text is None or "all-gather" not in text


@functools.cache
def cpu_contraction_itemsize() -> int:
    """The bytes per element XLA:CPU runs a bf16 dot at: 4 where it converts the operands
    to f32 and writes an f32 result (jax 0.10's XLA), 0 where it runs bf16 dots at their
    own width (jax 0.12's, through YNNPACK). Read from a compiled bf16 dot.

    ``hardware.Backend`` still prices CPU dots at 4 bytes, as 0.10's XLA runs them: the
    rest of 0.12's habits around narrow dots (where it still converts, what it fuses) are
    not yet read, and pricing 0 alone put mixed-precision steps further off."""
    import jax

    dot = jax.jit(jax.numpy.matmul, backend="cpu")
    narrow = jax.ShapeDtypeStruct((64, 64), jax.numpy.bfloat16)
    text = dot.lower(narrow, narrow).compile().as_text()
    return 4 if "f32[64,64]" in text else 0


def combined_all_reduce_copies(devices) -> int:
    """How many times XLA on ``devices`` copies the bytes of a combined all-reduce
    besides reducing them. XLA:CPU passes the operands as a tuple: 0. XLA:GPU's combiner
    concatenates them into one buffer (1), and splits the reduced buffer back into each
    result's own by a slice kernel apiece, even where an elementwise op reads it next (2).
    Each copy reads and writes the bytes once. Read from two partial sums, each scaled
    after, compiled for two of the devices; 0 on one device, and where they compile
    nothing (devices that only describe a kind)."""
    devices = tuple(devices)
    try:
        return _combined_all_reduce_copies(devices[:2]) if len(devices) > 1 else 0
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return 0


@functools.cache
def _combined_all_reduce_copies(devices: tuple) -> int:
    import re

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices), ("d",))
    cols, rows = (NamedSharding(mesh, PartitionSpec(*spec)) for spec in ((None, "d"), ("d",)))
    two_sums = jax.jit(lambda x, w, y, v: (2 * (x @ w), 3 * (y @ v)),
                       in_shardings=(cols, rows) * 2,
                       out_shardings=NamedSharding(mesh, PartitionSpec()))
    square = jax.ShapeDtypeStruct((64, 64), np.float32)
    text = two_sums.lower(*[square] * 4).compile().as_text()
    reduced = re.search(r"^\s*(%[\w.-]+) = \S+ all-reduce(?:-start)?\((%[\w.-]+)", text,
                        re.MULTILINE)
    if reduced is None:
        return 0
    made = re.search(rf"^\s*{re.escape(reduced.group(2))} = .*$", text, re.MULTILINE)
    if made is None or "concatenate" not in made.group(0):
        return 0
    result = reduced.group(1)
    done = re.search(rf"^\s*(%[\w.-]+) = .*all-reduce-done\({re.escape(result)}\)", text,
                     re.MULTILINE)
    result = done.group(1) if done else result
    sliced = re.search(rf"^\s*%[\w.-]+ = \S+ fusion\({re.escape(result)}\).*"
                       r"calls=(%[\w.-]+)", text, re.MULTILINE)
    if sliced is None:
        return 1
    body = re.search(rf"^{re.escape(sliced.group(1))} .*?^}}", text, re.MULTILINE | re.DOTALL)
    ops = re.findall(r"^\s*(?:ROOT )?%[\w.-]+ = \S+ ([\w-]+)\(", body.group(0) if body else "",
                     re.MULTILINE)
    return 2 if ops and set(ops) <= {"parameter", "slice", "bitcast"} else 1


# the expensive elementwise primitives (jax.lax's names) a probe reads, and the HLO
# opcode XLA names each by (ops XLA expands into others are not read)
PROBED_ELEMENTWISE = {
    "exp": "exponential", "expm1": "exponential-minus-one", "log": "log",
    "log1p": "log-plus-one", "tanh": "tanh", "sqrt": "sqrt", "rsqrt": "rsqrt",
    "cbrt": "cbrt", "logistic": "logistic", "div": "divide", "pow": "power",
    "atan2": "atan2", "erf": "erf"}


def duplicated_elementwise(devices) -> frozenset[str]:
    """The expensive elementwise primitives (``Einsum.expensive``) XLA on ``devices``
    computes again inside every fusion that reads them, rather than write their result
    once: XLA:GPU's priority fusion duplicates a tanh into the forward's fusion and the
    backward's, so the tanh a gradient reads is never held. Read from one program
    compiled for one of the devices, where each op is read by a dot's fusion and by an
    elementwise one after it; empty where it compiles nothing (devices that only
    describe a kind)."""
    devices = tuple(devices)
    try:
        return _duplicated_elementwise(devices[:1]) if devices else frozenset()
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return frozenset()


@functools.cache
def _duplicated_elementwise(devices: tuple) -> frozenset[str]:
    import re

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    def op(name, x):
        if name in ("div", "pow", "atan2"):
            return getattr(jax.lax, name)(x, x + 2.0)
        return getattr(jax.lax, name)(x)

    def readers(x, w, g):   # each op read before a dot and after it
        outs = []
        for name in PROBED_ELEMENTWISE:
            t = op(name, x)
            outs.append((1 - t * t) * (((t + 1) @ w) @ w) * g)
        return outs
    replicated = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec())
    square = jax.ShapeDtypeStruct((128, 128), np.float32)
    text = jax.jit(readers, in_shardings=replicated, out_shardings=replicated).lower(
        square, square, square).compile().as_text()
    computations = re.split(r"\n(?=\S)", text)
    return frozenset(name for name, opcode in PROBED_ELEMENTWISE.items()
                     if sum(f" {opcode}(" in c for c in computations) > 1)


def broadcast_ops_written(devices) -> bool:
    """Whether XLA on ``devices`` writes the result of an elementwise op that reads a
    broadcast (an operand smaller than its result: a layer norm's x - mean, and its
    rsqrt(var) times its scale) to a buffer of its own, which the fusions reading it
    read from memory (XLA:CPU), or computes it again in each of them, never holding it
    (XLA:GPU). Read from a layer norm compiled for one of the devices, whose centred
    input and scale are read by its reductions, by a dot's fusion and by reductions
    after two dots; True (as XLA:CPU) where it compiles nothing (devices that only
    describe a kind)."""
    devices = tuple(devices)
    try:
        return _broadcast_ops_written(devices[:1]) if devices else True
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return True


@functools.cache
def _broadcast_ops_written(devices: tuple) -> bool:
    import re

    import jax
    from jax import numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = 128

    def readers(x, g, w):
        centred = x - jnp.mean(x, axis=1, keepdims=True)
        scale = jax.lax.rsqrt(jnp.mean(centred * centred, axis=1, keepdims=True)) * g
        y = jnp.tanh((centred * scale) @ w) @ w
        return jnp.sum(y * scale, axis=1), jnp.sum(y * centred, axis=0)
    replicated = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec())
    shapes = [(n, n), (n,), (n, n)]
    text = jax.jit(readers, in_shardings=replicated, out_shardings=replicated).lower(
        *[jax.ShapeDtypeStruct(s, np.float32) for s in shapes]).compile().as_text()
    full = f"f32[{n},{n}]"
    for computation in re.split(r"\n(?=\S)", text):
        header = computation.split("\n", 1)[0]
        root = re.search(r"ROOT %\S+ = (\S+?)\{[^}]*\} (\w+)\(", computation)
        if "ENTRY" in header or root is None or root.group(1) != full:
            continue
        params = header.partition(") -> ")[0]
        sizes = [math.prod(int(d) for d in dims.split(",") if d)
                 for dims in re.findall(r"f32\[([\d,]*)\]", params)]
        if root.group(2) == "subtract" or sizes and max(sizes) < n * n:
            return True   # the centred input, or the scale alone, is written
    return False


# -- the width a backend moves and stores narrow floats at -----------------------------

@functools.cache
def cpu_top_k_scratch(dtype) -> float:
    """The bytes per operand element XLA:CPU holds while it runs a top_k of ``dtype``:
    none where it calls its TopK kernel (f32), else those of the sort it runs instead
    (the keys packed with their indices, then sorted: 4 to 8 bytes, by dtype and by
    XLA). Read from the temporaries of a compiled [64, 128] top_k."""
    import jax

    top = jax.jit(lambda x: jax.lax.top_k(x, 4), backend="cpu")
    compiled = top.lower(jax.ShapeDtypeStruct((64, 128), dtype)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (64 * 128)


def cpu_batched_scatter_indices(node, platform: str) -> float:
    """How many times the bytes of its indices XLA:CPU writes anew for a scatter with
    batching dims (JAX's transpose of a sort or of ``take_along_axis``): XLA makes the
    batching dims explicit (its batched gather/scatter normalizer), each index vector of
    k components concatenated with one iota per batching dim, and XLA:CPU writes those
    indices before the scatter reads them: (k + batching dims) / k. 0 for other nodes,
    and on XLA:GPU, which computes them inside its scatter fusion. The gradient of a
    sort along dim 1 of f32[64, 256, 32] writes u32[524288, 3] (6 MiB)."""
    if platform != "cpu" or not node.primitive.startswith("scatter"):
        return 0.0
    dn = node.params["dimension_numbers"]
    batching = len(getattr(dn, "operand_batching_dims", ()))
    if not batching:
        return 0.0
    index_vector = len(dn.scatter_dims_to_operand_dims)
    return (index_vector + batching) / max(index_vector, 1)


def dot_operand_dims(node, i: int) -> tuple[list[int], list[int], list[int]]:
    """The batch, free and contracting dims of operand ``i`` of a dot_general."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    contract, batch = list((lc, rc)[i]), list((lb, rb)[i])
    free = [d for d in range(len(node.operand_shapes[i])) if d not in contract + batch]
    return batch, free, contract


DOT_PROBE_SIZE = 256   # sizes above it are probed at it (``cpu_dot_widened``)


def cpu_dot_widened(node) -> bool:
    """Whether XLA:CPU runs a narrow-float dot_general in f32 where it runs most bf16 dots
    at their own width (jax 0.12's, through YNNPACK; ``cpu_contraction_itemsize`` 0):
    YNNPACK turns down small and matrix-vector dots, and XLA converts those to f32 in
    memory. Which it turns down differs between XLA versions (on jax 0.12: a side of one
    row, every side under 8, a contraction under 4), so this compiles a dot of the
    node's sizes, each operand flattened to [batch, rows, contraction] (lhs) or [batch,
    contraction, rows] (rhs), and reads it. An operand read in another order is copied
    into that one first, at its own width (the weight gradient of x @ w contracts x's
    leading dims: a bf16 copy, then a bf16 dot). A matrix-vector dot of bf16 [16] by
    [16, 6] is run in f32, its operands copied."""
    sizes = []
    for i, shape in enumerate(node.operand_shapes):
        batch_size, rows, depth = (math.prod(shape[d] for d in dims)
                                   for dims in dot_operand_dims(node, i))
        # the thresholds are small: one compile answers every large dot
        sizes.append((min(batch_size, 2), min(rows, DOT_PROBE_SIZE), min(depth, DOT_PROBE_SIZE)))
    return _cpu_dot_widened(*sizes)


@functools.lru_cache(maxsize=256)
def _cpu_dot_widened(lhs: tuple[int, int, int], rhs: tuple[int, int, int]) -> bool:
    import jax
    import jax.numpy as jnp

    (batch, rows, contract), (_, cols, _) = lhs, rhs
    operands = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
                for shape in ((batch, rows, contract), (batch, contract, cols))]
    dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (([2], [1]), ([0], [0]))),
                  backend="cpu")
    text = dot.lower(*operands).compile().as_text()
    return "f32" in text[text.index("ENTRY"):]


def cpu_widened_contractions() -> tuple[str, ...]:
    """The contractions XLA:CPU runs on narrow floats in f32, in memory as well: it
    converts each narrow operand in memory to an f32 copy (with its layout transpose,
    if any) and writes an f32 result its readers convert back. Convolutions on either
    JAX; dots where it converts them (``cpu_contraction_itemsize``: jax 0.10's XLA)."""
    dots = ("dot_general",) if cpu_contraction_itemsize() else ()
    return ("conv_general_dilated", *dots)


def widening(dtype, itemsize: int) -> float:
    """How much wider than ``dtype`` a backend that runs narrow floats at ``itemsize``
    bytes per element (0: at their own width) moves or stores it: 2 for bf16 at 4 bytes;
    1 for wider floats and for every other dtype."""
    try:
        return _widening(dtype, itemsize)
    except TypeError:   # a dtype that does not hash
        return _widening.__wrapped__(dtype, itemsize)


@functools.lru_cache(maxsize=1024)   # asked for every operand of every strategy
def _widening(dtype, itemsize: int) -> float:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return 1.0
    if not np.issubdtype(dtype, np.floating) and dtype.name not in ("bfloat16",):
        return 1.0
    return max(1.0, itemsize / dtype.itemsize)


def collective_widening(dtype, collective_itemsize: int) -> float:
    """How much wider than ``dtype`` the backend's collectives move it: CPU XLA converts
    bf16 and f16 to f32 before every collective (and back after), so they move 2x the
    program's bytes; 1 elsewhere."""
    return widening(dtype, collective_itemsize)


def wire_dtype(dtype, collective_itemsize: int):
    """The dtype a backend's collectives move ``dtype`` in (``collective_widening``)."""
    if collective_widening(dtype, collective_itemsize) > 1.0:
        return np.dtype(f"float{8 * collective_itemsize}")
    return dtype


def stored_widening(graph: Graph, einsums, materialized, contraction_itemsize: int
                    ) -> list[float]:
    """Per value, how much wider than its dtype XLA writes it to memory.

    CPU XLA runs dots and convolutions on narrow floats in f32 (its float normalization):
    the fusion producing an operand of one converts to f32 before writing it, and the
    contraction writes its result in f32 for its readers to convert back. So a bf16 value
    in memory that a contraction reads (directly, or through a transpose folded into it)
    or writes takes twice its bytes to write and to read. A scan stacks such a value wide
    too (the residual a backward dot reads), and slices that stack wide. Every other
    value, and every value on a backend with narrow-float dots (``contraction_itemsize``
    0), takes its own."""
    widened = [1.0] * len(graph.values)
    if not contraction_itemsize:
        return widened
    for value in graph.values:
        if materialized[value.id] and (contraction(einsums[value.producer])
                                       or read_by_contraction(graph, einsums, value)):
            widened[value.id] = widening(value.dtype, contraction_itemsize)
    for node in graph.nodes:   # in order: a stack before the loops that slice it
        if node.primitive in ("loop_ys", "loop_xs") and node.operands[0] is not None:
            out = node.outputs[0]
            widened[out] = max(widened[out], widened[node.operands[0]])
    return widened


def read_by_contraction(graph: Graph, einsums, value) -> bool:
    """Whether a dot or convolution reads ``value``, directly or through a transpose XLA
    folds into it (``folded_into_dots``)."""
    for user, _ in graph.users[value.id]:
        if contraction(einsums[user]):
            return True
        node = graph.nodes[user]
        if node.outputs and folded_into_dots(graph, graph.values[node.outputs[0]]):
            return True
    return False


# -- loop-invariant code motion: what XLA hoists out of a loop's body -------------------

# ops XLA's loop-invariant code motion hoists only with a user it hoists (it leaves them in
# the body for simplification and fusion there): WhileLoopInvariantCodeMotion's
# NotWorthHoistingIndividually, in JAX's primitives
NOT_WORTH_HOISTING = frozenset({"transpose", "reshape", "broadcast_in_dim", "iota", "rev",
                                "squeeze", "expand_dims", "slice", "sharding_constraint",
                                "loop_xs"})


def hoisted_runs(graph: Graph, stored: Sequence[float]) -> list[float]:
    """Per node, how many times XLA runs it a call: its weight, or less where XLA hoists
    it out of a loop's body (``WhileLoopInvariantCodeMotion``).

    A node in a loop's body whose operands are all made outside it (the loop's constants,
    constants, or nodes hoisted the same way) is invariant: it runs as often as the
    operands are made. XLA hoists it if it is worth hoisting on its own, or if a user it
    hoists reads it. Reshapes, transposes, broadcasts and slices are not worth hoisting
    on their own, save where the backend widens their result for a dot (``stored``: the
    convert CPU adds, which is). A scan unrolled whole slices its stack at static offsets
    (its ``loop_xs`` seams marked ``static``): invariant where the stack is, each run
    making one slice a layer."""
    inf = float("inf")
    made = [inf] * len(graph.values)    # per value: how often it is made, if invariant
    invariant: list[float | None] = [None] * len(graph.nodes)
    for node in graph.nodes:
        if node.kind == "arg":
            runs = node.weight
        elif node.kind == "const":
            runs = 1.0
        elif node.primitive == "loop_const":
            runs = node.weight   # made outside the body
        elif node.kind == "boundary" and not (node.primitive == "loop_xs"
                                              and node.params.get("static")):
            continue   # what varies from one trip to the next, or leaves the loop
        else:
            runs = max((made[v] for v in node.operands if v is not None), default=1.0)
            if runs >= node.weight:
                continue
            invariant[node.id] = runs
            if node.kind == "boundary":   # each run slices the stack into its layers
                runs *= node.operand_shapes[0][0]
        for v in node.outputs:
            made[v] = runs
    hoisted = [False] * len(graph.nodes)
    for node in reversed(graph.nodes):
        if invariant[node.id] is None:
            continue
        worth = node.primitive not in NOT_WORTH_HOISTING or any(
            stored[v] > 1.0 for v in node.outputs)
        hoisted[node.id] = worth or any(hoisted[user] for v in node.outputs
                                        for user, _ in graph.users[v])
    return [invariant[n.id] if hoisted[n.id] else n.weight for n in graph.nodes]


@functools.cache
def copies_bitcast_loop_operands() -> bool:
    """Whether XLA copies a loop's stacked operand that is a bitcast of an argument (a
    transpose moving only dims of one element) into the loop's state, a buffer held
    while the loop runs: jax 0.10's XLA does (its copy insertion does not see that the
    loop only reads it); jax 0.12's reads the argument's buffer. Read from a scan over
    such a transpose compiled on this process's CPU (copy insertion is the same pass on
    every backend)."""
    import jax

    def scan_transposed(w, x):
        stacked = jax.numpy.transpose(w[None], (1, 0, 2, 3))
        return jax.lax.scan(lambda h, wi: (h @ wi[0], None), x, stacked)[0]
    f32 = np.float32
    text = jax.jit(scan_transposed, backend="cpu").lower(
        jax.ShapeDtypeStruct((4, 8, 8), f32), jax.ShapeDtypeStruct((2, 8), f32)
    ).compile().as_text()
    return any(" copy(" in line and "f32[4,1,8,8]" in line for line in text.splitlines())


# -- layouts: operands XLA copies into another layout before a dot or convolution ------

def dot_read_order(node, i: int) -> tuple[int, ...]:
    """The order in which XLA reads the dims (of more than one element) of operand ``i``
    of a dot_general: sorted where it reads the operand in place.

    XLA rewrites a dot that is not a (batched) matrix product as one over operands
    transposed to [batch, free, contracting] (lhs) and [batch, contracting, free] (rhs);
    an operand whose dims are not in that order already is copied, unless it is a
    matrix behind leading batch dims (read transposed in place). A weight [d, heads, k]
    read by the backward pass's dot contracting (heads, k) is copied, and so is
    q [b, t, heads, k] read by the scores' dot (batch b, heads); [d, f] or
    [experts, d, f] is not.
    """
    shape = node.operand_shapes[i]
    batch, free, contract = dot_operand_dims(node, i)
    order = [*batch, *free, *contract] if i == 0 else [*batch, *contract, *free]
    kept = [d for d in order if shape[d] != 1]
    nb = sum(shape[d] != 1 for d in batch)
    matrix_behind_batch = kept[:nb] == sorted(kept)[:nb] and len(kept) - nb <= 2
    return tuple(sorted(kept) if matrix_behind_batch else kept)


def reshapes_dot_result(node) -> bool:
    """Whether XLA reshapes a dot_general's result after computing it: it computes a dot
    as [batch, lhs free, rhs free] with each side's free dims flattened into one, so a
    side with more than one free dim (of more than one element) is unflattened after
    it. A rounding convert pair (f32 to bf16 and back) around that reshape is not
    adjacent, and XLA's simplifier does not drop it."""
    if node.primitive != "dot_general":
        return False
    return any(sum(shape[d] > 1 for d in dot_operand_dims(node, i)[1]) > 1
               for i, shape in enumerate(node.operand_shapes))


def conv_read_order(node, i: int) -> tuple[int, ...]:
    """The order in which XLA reads the dims (of more than one element) of operand ``i``
    of a convolution.

    XLA:CPU convolves inputs laid out [batch, spatial..., feature] with kernels
    [spatial..., in, out]; an operand whose dims come in another order is copied: the
    kernel of a backward-data convolution, the activations of a weight-gradient one.
    Batch groups XLA turns into a spatial dim (``batch_groups_as_spatial``) are read
    after the other spatial dims: the input's batch and the kernel's output features.
    """
    dn = node.params["dimension_numbers"]
    spec, shape = (dn.lhs_spec, dn.rhs_spec)[i], node.operand_shapes[i]
    if batch_groups_as_spatial(node):
        order = [*spec[2:], spec[0], spec[1]]
    else:
        order = [spec[0], *spec[2:], spec[1]] if i == 0 else [*spec[2:], spec[1], spec[0]]
    return tuple(d for d in order if shape[d] != 1)


def batch_groups(node) -> tuple[int, int, int]:
    """(batch group count, input batch, kernel output features) of a convolution."""
    dn = node.params["dimension_numbers"]
    return (node.params.get("batch_group_count", 1), node.operand_shapes[0][dn.lhs_spec[0]],
            node.operand_shapes[1][dn.rhs_spec[0]])


def batch_groups_as_spatial(node) -> bool:
    """Whether XLA's convolution group converter makes a convolution's G batch groups a
    spatial dim: the input's batch split [G, batch / G] and the kernel's output features
    [G, features / G], each G a window over the new dim (``HandleBatchGroupCount``).
    It does so for every G > 1 but where the batch and the features are both G
    (``cpu_batch_groups_expanded``). The input and kernel are then copied with G among
    the spatial dims: f32[6, 9, 6, 4] (NHWC) over 2 batch groups is copied whole to
    [3, 9, 6, 2, 4]."""
    groups, batch, features = batch_groups(node)
    return groups > 1 and not batch == groups == features


def conv_result_transposed(node, shape: Sequence[int], platform: str) -> bool:
    """Whether XLA:CPU writes a convolution's result (of ``shape``) in another layout
    than a program output's and then copies it out. It writes [batch, spatial...,
    feature]; a result whose dims come in another order (NCHW, or a kernel gradient's
    HWIO) is transposed from there: a program output made of it is a copy, and even an
    elementwise one (the optimizer's update) is not written in place of it."""
    if node.primitive != "conv_general_dilated" or platform != "cpu":
        return False
    spec = node.params["dimension_numbers"].out_spec
    order = [spec[0], *spec[2:], spec[1]]
    kept = [d for d in order if shape[d] != 1]
    return kept != sorted(kept)


def cpu_batch_groups_expanded(node, platform: str) -> int:
    """How many times its result's size XLA:CPU computes a convolution with batch groups
    in before it keeps the result: the batch group count G where the input batch and the
    kernel's output features are both G (a grouped convolution's kernel gradient over a
    batch of G), else 1. XLA's convolution group converter then convolves every batch
    element with every output feature (a result G times the size), masks the pairs of
    other groups and sums over the batch (``HandleBatchGroupCount``); elsewhere it
    makes the groups a spatial dim (``batch_groups_as_spatial``). A kernel
    gradient of a 3-group convolution over a batch of 3, f32[1, 3, 5, 7] (420 B), is
    written whole as f32[3, 5, 7, 3] (1,260 B) first. XLA:GPU gives it to cuDNN as it is."""
    if node.primitive != "conv_general_dilated" or platform != "cpu":
        return 1
    groups = batch_groups(node)[0]
    return groups if groups > 1 and not batch_groups_as_spatial(node) else 1


def layout_copies_made_when_written(platform: str) -> bool:
    """Whether XLA makes a computed value's layout copy (``transposed_operands``) as soon
    as the value is written, before the readers that read it as it is. XLA:CPU's schedule
    puts the transposed activation that a weight-gradient convolution reads right after
    the forward pass writes it, before the next layer's convolution: activation and copy
    are held together through the rest of the forward pass (an FSDP CNN on 8 devices
    holds 11.89 MB together at its peak: 10.84 MB predicted with each copy counted from
    its reader's earlier reader on, 11.37 MB from the write on). XLA:GPU's does not (the
    same CNN on 8x2 H100s holds 5.96 MB: 6.52 MB predicted the first way, 7.08 MB the
    second)."""
    return platform == "cpu"


READ_ORDERS = {"dot_general": dot_read_order, "conv_general_dilated": conv_read_order}


def read_order(node: Node, i: int) -> tuple[int, ...] | None:
    """The order in which XLA reads the dims (of more than one element) of operand ``i``
    of a node, where it reads them in an order of its own (``READ_ORDERS``); else None."""
    order = READ_ORDERS.get(node.primitive)
    return None if order is None or node.operands[i] is None else order(node, i)


def transposed_operands(node: Node) -> tuple[bool, ...]:
    """Per operand of a node: whether XLA copies it into another layout before reading it."""
    orders = [read_order(node, i) for i in range(len(node.operands))]
    return tuple(order is not None and list(order) != sorted(order) for order in orders)


def moves_no_data(node, in_specs, axis_sizes) -> bool:
    """Whether a transpose, on one device's shard (``in_specs[0]``), only moves dims of one
    element: then its dims of more than one keep their order, and XLA's algebraic
    simplifier makes it a bitcast of its operand. A stage-sharded stack
    [layers, stages, ...] read as [stages, layers, ...] on one stage's devices is one."""
    if node.primitive != "transpose":
        return False
    shape, spec = node.operand_shapes[0], in_specs[0] or ((),) * len(node.operand_shapes[0])
    local = [n // dim_shards(axes, axis_sizes) for n, axes in zip(shape, spec)]
    kept = [d for d in node.params["permutation"] if local[d] > 1]
    return kept == sorted(kept)


def transposes_dot_result(graph: Graph, node: Node) -> bool:
    """Whether ``node`` transposes a dot's result [batch, lhs free, rhs free] to [batch,
    rhs free, lhs free], the dot read by nothing else: XLA's algebraic simplifier computes
    the dot with its operands swapped instead, writing the transposed result. JAX's
    gradient of ``x @ w`` with respect to ``w`` is such a pair."""
    if node.primitive != "transpose" or node.operands[0] is None:
        return False
    value = graph.values[node.operands[0]]
    dot = graph.nodes[value.producer]
    if (dot.primitive != "dot_general" or len(graph.users[value.id]) != 1
            or value.id in graph.outputs):
        return False
    (lc, rc), (lb, _) = dot.params["dimension_numbers"]
    nb = len(lb)
    lhs_free = len(dot.operand_shapes[0]) - len(lc) - nb
    rhs_free = len(dot.operand_shapes[1]) - len(rc) - nb
    swapped = [*range(nb), *range(nb + lhs_free, nb + lhs_free + rhs_free),
               *range(nb, nb + lhs_free)]
    return list(node.params["permutation"]) == swapped


# -- fusion: which values XLA keeps in memory ------------------------------------------

def folded_into_dots(graph: Graph, value) -> bool:
    """A transpose read only by dots: XLA folds it into their dimension numbers (its
    transpose-folding pass) and never writes it."""
    users = graph.users[value.id]
    return (graph.nodes[value.producer].primitive == "transpose" and bool(users)
            and value.id not in graph.outputs
            and all(graph.nodes[u].primitive == "dot_general" for u, _ in users))


def materialized_values(graph: Graph, einsums, duplicated: frozenset = frozenset()
                        ) -> list[bool]:
    """Which values XLA keeps in memory: not those fused between elementwise ops.

    Transposes read only by dots are not (``folded_into_dots``). Values crossing a loop
    or branch seam are in memory: the loop state, and the slices a body reads from
    stacked xs or writes into stacked ys, every iteration (a scan unrolled whole stacks
    nothing: its ys are read where the body wrote them, in memory or not). So are the
    results of expensive ops read by several nodes (XLA computes them once; not those
    the backend computes in each reader: ``duplicated``), and what a reduction does not
    fuse (``kept_from_reduction``)."""
    outputs = set(v for v in graph.outputs if v is not None)

    def seam(node_id):
        return graph.nodes[node_id].kind == "boundary"

    def stacked_by_a_loop(node_id):   # a seam an unrolled scan's results pass freely
        return seam(node_id) and not graph.nodes[node_id].params.get("unrolled")
    flags = []
    for value in graph.values:
        if folded_into_dots(graph, value):
            flags.append(False)
            continue
        producer = einsums[value.producer]
        if (producer is None or not producer.fusible or value.id in outputs
                or seam(value.producer)):
            flags.append(True)
            continue
        users = {u for u, _ in graph.users[value.id]}
        flags.append(any(einsums[u] is None or not einsums[u].fusible or stacked_by_a_loop(u)
                         for u in users)
                     or expensive(einsums[value.producer], graph.nodes[value.producer],
                                  duplicated) and len(users) > 1)
    feeds, statistics = feeds_reductions(graph, einsums), statistics_of(graph, einsums)
    squared = feeds_reductions(graph, einsums, unary_only=True)
    for value in graph.values:
        if feeds[value.id] and not flags[value.id]:
            flags[value.id] = kept_from_reduction(graph, graph.nodes[value.producer], value,
                                                  einsums, statistics, squared[value.id])
    return flags


def fused_static_slices(graph: Graph, einsums) -> list[bool]:
    """Per node: a scan unrolled whole's static slice of its stack (a ``loop_xs`` seam
    marked ``static``) that XLA fuses into its readers: every reader is an elementwise
    op, which reads its layer's part of the stack where it lies. The slice then costs no
    pass of its own. A dot or convolution reads a buffer of its own (on CPU, its operand
    converted to f32), and a loop reads its state whole, so a slice they read is copied.
    Seen in a pipeline's stage loop: each layer's residuals sliced from the stage's
    stack by the fusions that use them."""
    fused = [False] * len(graph.nodes)
    for node in graph.nodes:
        if node.primitive != "loop_xs" or not node.params.get("static"):
            continue
        readers = [u for v in node.outputs for u, _ in graph.users[v]]
        fused[node.id] = bool(readers) and all(
            graph.nodes[u].kind == "eqn" and einsums[u] is not None and einsums[u].fusible
            and not contraction(einsums[u]) for u in readers)
    return fused


def expensive(einsum, node, duplicated: frozenset = frozenset()) -> bool:
    """An elementwise op XLA fuses into one consumer only (``Einsum.expensive``): read by
    several, its result is written to memory. Not one the backend computes again in
    each reader (``Backend.duplicated``)."""
    return einsum is not None and einsum.expensive and node.primitive not in duplicated


def reduction(einsum) -> bool:
    """A reduction whose elementwise producers XLA fuses in (``Einsum.reduction``)."""
    return einsum is not None and einsum.reduction


def contraction(einsum) -> bool:
    """A dot or convolution (``Einsum.contraction``)."""
    return einsum is not None and einsum.contraction


def feeds_reductions(graph: Graph, einsums, unary_only: bool = False) -> list[bool]:
    """Per value: read by a reduction, directly or through elementwise (fusible) nodes;
    with ``unary_only``, through nodes reading nothing else (a square)."""
    reduces = [reduction(einsum) for einsum in einsums]
    fused = [node.kind == "eqn" and einsum is not None and einsum.fusible
             and (not unary_only or sum(v is not None for v in node.operands) == 1)
             for node, einsum in zip(graph.nodes, einsums)]
    feeds = [False] * len(graph.values)
    for value in reversed(graph.values):
        for user, _ in graph.users[value.id]:
            if reduces[user] or fused[user] and any(feeds[o] for o in graph.nodes[user].outputs):
                feeds[value.id] = True
                break
    return feeds


def statistics_of(graph: Graph, einsums) -> list[bool]:
    """Per value: computed from a reduction's result by elementwise ops (a mean, a
    variance, an inverse norm)."""
    flags = []
    for value in graph.values:
        node = graph.nodes[value.producer]
        fused = node.kind == "eqn" and einsums[node.id] is not None and einsums[node.id].fusible
        flags.append(reduction(einsums[node.id])
                     or fused and any(v is not None and flags[v] for v in node.operands))
    return flags


def spreads(graph: Graph, node: Node, value, einsums) -> bool:
    """Whether ``value`` spreads smaller arrays over a bigger shape: a broadcast, or an
    elementwise op all of whose array operands are smaller (rsqrt[b, t, 1] * scale[d])."""
    einsum = einsums[node.id]
    if node.kind != "eqn" or einsum is None or not einsum.fusible:
        return False
    sizes = [math.prod(graph.values[v].shape) for v in node.operands if v is not None]
    return bool(sizes) and max(sizes) < math.prod(value.shape)


def kept_from_reduction(graph: Graph, node: Node, value, einsums, statistics,
                        squared: bool) -> bool:
    """Whether XLA keeps in memory a value a reduction reads through fused elementwise
    ops. The reduction takes the elementwise chain in, but not a broadcast (the norm scale
    or the inverse norm, spread over the activation), nor an activation centred on one of
    its statistics (x - mean), nor an op combining two activations that other nodes read
    too when the reduction reads it through ops of one operand (the residual sum a norm
    squares): those are written to memory, often for the backward pass."""
    if spreads(graph, node, value, einsums):
        return True
    if node.kind != "eqn" or einsums[node.id] is None or not einsums[node.id].fusible:
        return False
    size = math.prod(value.shape)
    operands = [graph.values[v] for v in node.operands if v is not None]
    if node.primitive in ("sub", "add") and any(
            math.prod(v.shape) < size and statistics[v.id] for v in operands):
        return True
    full = [v for v in operands if math.prod(v.shape) == size]
    return squared and len(full) >= 2 and len({u for u, _ in graph.users[value.id]}) > 1


# -- the combiner: which collectives XLA merges into one -------------------------------

def loop_scope(node: Node) -> tuple:
    """The key of the innermost loop body holding ``node`` (``()`` outside any loop).
    A loop body is a computation of its own: XLA combines collectives within it, once
    per iteration, never with those outside. Loop seams belong to the outside."""
    key = node.key
    for i in range(len(key) - 1, -1, -1):
        if key[i] == "body":
            return key[:i + 1]
    return ()


def independent_gather(graph: Graph, value, trailing: Sequence[bool]) -> bool:
    """Whether the all-gathers resharding ``value`` depend on no other reshard's
    all-gather of their computation, nor any on them: ``value`` is an input of the
    computation (an argument of the step, or a loop body's constant or its slice of a
    stacked operand: a weight FSDP gathers for its layer), or only trailing nodes read it
    (``trailing_nodes``: an updated weight ZeRO-1 gathers, which no contraction reads
    after). A backend whose combiner merges all-gathers (XLA:GPU's) merges those of one
    computation's inputs into one, and those its trailing nodes read into another, paying
    each latency once per run of the computation
    (``cost.shared.combined_gather_latencies``). A property of the value, so that every
    read of it, and the copy its readers share, is priced alike."""
    producer = graph.nodes[value.producer]
    if producer.kind == "arg" or producer.primitive in ("loop_const", "loop_xs"):
        return True
    users = graph.users[value.id]
    return bool(users) and all(trailing[u] for u, _ in users)


def trailing_nodes(graph: Graph, einsums) -> list[bool]:
    """Nodes no contraction of their own computation depends on (weight gradients feeding
    an optimizer update, or a scan's per-layer gradients stacked by loop_ys): their
    collectives are independent of each other, so XLA's combiner merges them.

    A value entering a loop body, or carried to its next iteration, feeds the body's
    contractions; one stacked by loop_ys leaves the iteration that made it."""
    scopes = [loop_scope(node) for node in graph.nodes]
    trailing = [True] * len(graph.nodes)
    for node in reversed(graph.nodes):
        for value_id in node.outputs:
            for user, _ in graph.users[value_id]:
                u = graph.nodes[user]
                if scopes[user] != scopes[node.id]:
                    leaves = u.primitive == "loop_ys" and len(scopes[user]) < len(scopes[node.id])
                    if not leaves:
                        trailing[node.id] = False
                elif contraction(einsums[user]) or not trailing[user]:
                    trailing[node.id] = False
    return trailing


def reduction_waves(graph: Graph, strategies: Sequence[Sequence[Strategy]],
                    menu_ids: Sequence[int]) -> list[int]:
    """Per node, how many nodes that may reduce across devices precede it on the longest
    path within its computation. Two reducing nodes of one wave depend on neither: XLA's
    combiner merges their like collectives into one (the input gradients of q, k and v
    summed after three row-parallel dots)."""
    scopes = [loop_scope(node) for node in graph.nodes]
    reducing: dict[int, bool] = {}   # per number of nodes' strategies (``menu_ids``)
    for found, number in zip(strategies, menu_ids):
        if number not in reducing:
            reducing[number] = any(c.kind in ("all-reduce", "reduce-scatter")
                                   for s in found for c in s.collectives)
    reduces = [reducing[number] for number in menu_ids]
    wave = [0] * len(graph.nodes)
    for node in graph.nodes:
        for v in node.operands:
            if v is None:
                continue
            p = graph.values[v].producer
            if scopes[p] == scopes[node.id]:
                wave[node.id] = max(wave[node.id], wave[p] + reduces[p])
    return wave


def combiner_order(graph: Graph) -> list[int]:
    """Per node, its place in the order XLA's combiner walks a computation: its post
    order (``HloComputation::MakeInstructionPostOrder``), depth first from the outputs in
    order, each node after its operands, taken in order. A node no output reads gets -1
    (XLA drops it). A loop's carry reads its body's result, a node after it: that edge
    back is not followed (XLA's computations have none)."""
    place = [-1] * len(graph.nodes)
    count = 0
    entered = [False] * len(graph.nodes)
    for out in graph.outputs:
        if out is None or place[graph.values[out].producer] >= 0:
            continue
        stack = [(graph.values[out].producer, False)]
        while stack:
            node_id, expanded = stack.pop()
            if place[node_id] >= 0 or (entered[node_id] and not expanded):
                continue
            entered[node_id] = True
            if expanded:
                place[node_id] = count
                count += 1
                continue
            stack.append((node_id, True))
            for v in reversed(graph.nodes[node_id].operands):   # the first taken first
                if v is not None and place[graph.values[v].producer] < 0:
                    stack.append((graph.values[v].producer, False))
    return place


def combined_kinds(graph: Graph, strategies: Sequence[Sequence[Strategy]]) -> list[frozenset]:
    """Per node, the combined collectives (kind, axes) some strategy of it makes."""
    kinds: dict[int, frozenset] = {}   # identical nodes share their strategies
    out = []
    for found in strategies:
        if id(found) not in kinds:
            kinds[id(found)] = frozenset(k for s in found for k in s.combined)
        out.append(kinds[id(found)])
    return out


def trailing_ancestors(graph: Graph, strategies: Sequence[Sequence[Strategy]],
                       trailing: Sequence[bool]) -> list[dict]:
    """Per trailing node, per combined collective (kind, axes): the trailing nodes of its
    computation before it that may make that collective and that XLA's combiner may
    still hold in the combined op it is filling when it reaches the node, so that the
    node's collective starts another. XLA's combiner merges like collectives none of
    which depends on another: an all-reduced input gradient of the first layer and a
    layer norm's statistic summed from it run as two, however late; the loss's sum over
    the batch joins the weight gradients, on no collective of its kind.

    The combiner walks the computation in post order (``combiner_order``) and fills one
    op with like collectives until it reaches one that depends on a collective in it;
    that one starts the next op (``CombineInstructionsByKey``). So each collective that
    depends on a like one since the last such collective before it costs one op more.
    A global norm over sharded gradients (``clip_by_global_norm``) reaches each
    gradient's all-reduce just before the all-reduce of its sum of squares: one op per
    gradient. A sum that reads every gradient after all of them costs one op more."""
    scopes = [loop_scope(node) for node in graph.nodes]
    kinds = combined_kinds(graph, strategies)
    ancestors: list[dict] = [{} for _ in graph.nodes]
    for node in graph.nodes:
        if not trailing[node.id]:
            continue
        merged = ancestors[node.id]
        for v in node.operands:
            if v is None:
                continue
            p = graph.values[v].producer
            if not trailing[p] or scopes[p] != scopes[node.id]:
                continue
            for key, nodes in ancestors[p].items():
                merged[key] = merged[key] | nodes if key in merged else nodes
            for key in kinds[p]:
                merged[key] = merged.get(key, frozenset()) | {p}
    return since_last_dependent(graph, ancestors, kinds, scopes)


def since_last_dependent(graph: Graph, ancestors: list[dict], kinds, scopes) -> list[dict]:
    """``ancestors`` (per node, per combined collective, the like trailing nodes it depends
    on) kept to those the combiner reaches at or after the last node before it, in its
    post order, that may make that collective depending on a like one: a node where the
    combiner may have started another op, which that node opens."""
    place = combiner_order(graph)
    last: dict[tuple, int] = {}   # per (collective, computation): the last dependent's place
    before: list[dict] = [{} for _ in graph.nodes]
    for node_id in sorted((n for n in range(len(graph.nodes)) if place[n] >= 0),
                          key=place.__getitem__):
        for key, nodes in ancestors[node_id].items():
            if key not in kinds[node_id]:
                continue
            since = last.get((key, scopes[node_id]), -1)
            kept = frozenset(p for p in nodes if place[p] >= since)
            if kept:
                before[node_id][key] = kept
            last[key, scopes[node_id]] = place[node_id]
    return before
