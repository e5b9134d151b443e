"""Rule golden strings: each primitive's einsum factors."""

import jax
import jax.numpy as jnp
import pytest

from autoshard.frontend.trace import trace
from autoshard.rules import rule_for


def einsum_of(fn, *shapes, primitive=None):
    graph = trace(fn, *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    nodes = [n for n in graph.nodes if n.kind == "eqn"
             and (primitive is None or n.primitive == primitive)]
    node = nodes[0]
    return str(rule_for(node, [graph.values[v].shape for v in node.outputs]))


@pytest.mark.parametrize("fn,shapes,primitive,golden", [
    (lambda x, w: x @ w, [(8, 16), (16, 32)], "dot_general", "mk,kn->mn reduce={k}"),
    (lambda x, w: jnp.einsum("bmk,bkn->bmn", x, w), [(2, 8, 16), (2, 16, 4)], "dot_general",
     "bmk,bkn->bmn reduce={k}"),
    (lambda x: jnp.tanh(x), [(8, 16)], "tanh", "ab->ab"),
    (lambda x, y: x * y, [(8, 16), (8, 16)], "mul", "ab,ab->ab"),
    # jnp broadcasts size-1 dims inside the primitive: the kept dim still splits
    (lambda x, y: x - y, [(8, 16), (8, 1)], "sub", "ab,a.->ab"),
    (lambda x: x.sum(axis=1), [(8, 16)], "reduce_sum", "ab->a reduce={b}"),
    (lambda x: x.max(axis=0), [(8, 16)], "reduce_max", "ab->b reduce={a}"),
    (lambda x: jnp.argmax(x, axis=1), [(8, 16)], "argmax", "a.->a"),
    (lambda x: x.reshape(4, 2, 16), [(8, 16)], "reshape", "ab->a.b"),
    (lambda x: x.reshape(128), [(8, 16)], "reshape", "a.->a"),
    (lambda x: x.T, [(8, 16)], "transpose", "ab->ba"),
    (lambda x: jnp.broadcast_to(x, (4, 8, 16)), [(8, 16)], "broadcast_in_dim", "bc->abc"),
    (lambda x: jnp.concatenate([x, x], axis=0), [(8, 16)], "concatenate", ".a,.a->.a"),
    (lambda x: jnp.cumsum(x, axis=1), [(8, 16)], "cumsum", "a.->a."),
    (lambda x: jnp.sort(x, axis=1), [(8, 16)], "sort", "a.->a."),
    (lambda x: x[:, :4], [(8, 16)], "slice", "a.->a."),
    (lambda x: jnp.pad(x, ((0, 0), (1, 1))), [(8, 16)], "pad", "a.,->a."),
])
def test_golden(fn, shapes, primitive, golden):
    assert einsum_of(fn, *shapes, primitive=primitive) == golden


def golden_of(fn, *avals, primitive):
    """The einsum of the last ``primitive`` equation of ``fn`` (in a gradient, the
    backward pass's)."""
    graph = trace(fn, *avals)
    node = [n for n in graph.nodes if n.kind == "eqn" and n.primitive == primitive][-1]
    return str(rule_for(node, [graph.values[v].shape for v in node.outputs]))


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def u32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.uint32)


KEY = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


def max_pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def grouped_conv(groups):
    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=groups,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return conv


@pytest.mark.parametrize("fn,avals,primitive,golden", [
    # random bits: the key stays whole, the bits split like the array they fill
    (lambda k: jax.random.bits(k, (8, 16)), [KEY], "random_bits", "->ab"),
    # rbg's bits are made whole on every device by XLA: priced whole
    (lambda k: jax.random.bits(k, (8, 16)), [jax.ShapeDtypeStruct((), jax.random.key(
        0, impl="rbg").dtype)], "random_bits", "->.."),
    (lambda k: jax.random.uniform(k, (8, 16)), [KEY], "shift_right_logical", "ab,->ab"),
    (lambda x: jax.lax.bitcast_convert_type(x, jnp.float32), [u32(8, 16)],
     "bitcast_convert_type", "ab->ab"),
    # to a narrower type: a new minor dim holds each element's bytes and stays whole
    (lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8), [u32(8, 16)],
     "bitcast_convert_type", "ab->ab."),
    (lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32),
     [jax.ShapeDtypeStruct((8, 16, 4), jnp.uint8)], "bitcast_convert_type", "ab.->ab"),
    (lambda k: jax.random.fold_in(k, 3), [KEY], "random_fold_in", ",->"),
    (lambda k: jax.lax.rng_bit_generator(k, (8, 16)), [u32(4)], "rng_bit_generator", ".->.,.."),
    # pooling: the window spans the spatial dims; batch and channels split
    (max_pool, [f32(4, 8, 8, 16)], "reduce_window_max", "a..b->a..b"),
    (lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
     [f32(4, 8, 8, 16)], "reduce_window_sum", "a..b->a..b"),
    (lambda x: jax.lax.reduce_window(x, 1.0, jax.lax.mul, (1, 3, 3, 1), (1, 1, 1, 1), "SAME"),
     [f32(4, 8, 8, 16)], "reduce_window", "a..b,->a..b"),
    (jax.grad(lambda x: max_pool(x).sum()), [f32(4, 8, 8, 16)], "select_and_scatter_add",
     "a..b,a..b->a..b"),
    (lambda x, t: jax.jvp(max_pool, (x,), (t,))[1], [f32(4, 8, 8, 16), f32(4, 8, 8, 16)],
     "select_and_gather_add", "a..b,a..b->a..b"),
    # depthwise convs split on groups (g) with nothing to reduce; a grouped conv of 4
    # input features a group is computed whole, as XLA's partitioner computes it
    (grouped_conv(16), [f32(4, 8, 8, 16), f32(3, 3, 1, 32)], "conv_general_dilated",
     "a..g,...g->a..g"),
    (grouped_conv(4), [f32(4, 8, 8, 16), f32(3, 3, 4, 32)], "conv_general_dilated",
     "....,....->...."),
    # the kernel gradient of a depthwise conv (batch_group_count): groups split, batch summed
    (jax.grad(lambda x, k: grouped_conv(16)(x, k).sum(), argnums=1),
     [f32(4, 8, 8, 16), f32(3, 3, 1, 32)], "conv_general_dilated", "a..g,a..g->...g reduce={a}"),
    (lambda x: jax.lax.top_k(x, 3), [f32(8, 16)], "top_k", "a.->a.,a."),
    (lambda x: jax.lax.approx_max_k(x, 3), [f32(8, 16)], "approx_top_k", "a.->a.,a."),
    (lambda x: jnp.argsort(x, axis=0), [f32(8, 16)], "sort", ".a,.a->.a,.a"),
    (lambda x: jax.lax.cummax(x, axis=0), [f32(8, 16)], "cummax", ".a->.a"),
    (lambda x: jax.lax.cumlogsumexp(x, axis=1), [f32(8, 16)], "cumlogsumexp", "a.->a."),
    (lambda x, y: jax.lax.reduce((x, y), (0.0, 1.0), lambda a, b: (a[0] + b[0], a[1] * b[1]),
                                 (1,)), [f32(8, 16), f32(8, 16)], "reduce", "a.,a.,,->a,a"),
    (lambda x: jax.lax.pad(x, 0.0, ((0, 0, 0), (1, 1, 1))), [f32(8, 16)], "pad", "a.,->a."),
    (lambda x: jax.lax.rev(x, (1,)), [f32(8, 16)], "rev", "a.->a."),
    (lambda x: jax.lax.clamp(0.0, x, 1.0), [f32(8, 16)], "clamp", ",ab,->ab"),
    (lambda x: jax.lax.erf_inv(x), [f32(8, 16)], "erf_inv", "ab->ab"),
    (lambda x: jax.lax.reduce_precision(x, 5, 10), [f32(8, 16)], "reduce_precision", "ab->ab"),
    (lambda x, y: jax.lax.nextafter(x, y), [f32(8, 16), f32(8, 16)], "nextafter", "ab,ab->ab"),
    (lambda x: jax.lax.population_count(x), [u32(8, 16)], "population_count", "ab->ab"),
    (lambda x: jnp.split(x, 2, axis=1), [f32(8, 16)], "split", "a.->a.,a."),
    (lambda x: jnp.tile(x, (1, 2)), [f32(8, 16)], "tile", "a.->a."),
    (lambda x: jnp.argmin(x, axis=0), [f32(8, 16)], "argmin", ".a->a"),
    (lambda x: jnp.any(x > 0, axis=1), [f32(8, 16)], "reduce_or", "ab->a reduce={b}"),
])
def test_golden_ordinary_model_primitives(fn, avals, primitive, golden):
    assert golden_of(fn, *avals, primitive=primitive) == golden


@pytest.mark.parametrize("fn, avals, split_golden", [
    (lambda x: jnp.fft.fft(x), [f32(8, 16)], "a.->a."),
    (lambda x: jnp.fft.rfft2(x), [f32(4, 8, 16)], "a..->a.."),
    (lambda x: jnp.fft.irfft(x), [jax.ShapeDtypeStruct((8, 9), jnp.complex64)], "a.->a."),
])
def test_golden_fft_splits_its_batch_dims_where_xla_does(fn, avals, split_golden):
    """Newer XLA computes an FFT on each device's block of its batch dims, older XLA
    computes it whole (``xla.partitions_fft``, read from a compiled program)."""
    from autoshard.target.xla import partitions_fft
    golden = split_golden if partitions_fft() else split_golden.replace("a", ".")
    assert golden_of(fn, *avals, primitive="fft") == golden


@pytest.mark.parametrize("strides, padding, kernel, rhs_dilation", [
    ((1, 1), "VALID", (1, 1), (1, 1)),   # a dot in every spatial dim: split
    ((1, 3), "VALID", (1, 1), (1, 1)),   # a 1x1 window at stride 3: a conv
    ((1, 1), ((0, 0), (0, 1)), (1, 1), (1, 1)),   # padded
    ((1, 1), "VALID", (8, 3), (1, 1)),   # a window as large as the input: contracted
    ((1, 1), "VALID", (3, 3), (1, 1)),
    ((1, 1), "VALID", (1, 1), (2, 1)),   # a window of one, dilated: still a dot
])
def test_a_grouped_conv_is_computed_whole_where_xla_gathers_it(strides, padding, kernel,
                                                               rhs_dilation):
    """A grouped conv of several input features a group on a batch split over two CPUs:
    the rule computes it whole (every dim unsplit) exactly where XLA's partitioner
    gathers its operands, which it does for every conv it does not read as a dot
    (``conv.dot_in_every_spatial_dim``). A 1x1 window at stride 3 was read as a dot."""
    from autoshard.rules.conv import partitioner_gathers
    from autoshard.target.xla import _compiled_on_two_cpus

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, strides, padding, rhs_dilation=rhs_dilation,
                                            feature_group_count=3,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    shapes = [(4, 8, 3, 12), (*kernel, 4, 3)]
    graph = trace(conv, *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    node = next(n for n in graph.nodes if n.primitive == "conv_general_dilated")
    text = _compiled_on_two_cpus(conv, (("batch",), ()), ("batch",), *shapes)
    if text is None:
        pytest.skip("one CPU device")
    assert partitioner_gathers(node, 3) == ("all-gather" in text)


RELEASE_0_12 = pytest.mark.skipif(not hasattr(jax.lax, "polynomial"),
                                  reason="primitives JAX defines since 0.12")


@RELEASE_0_12
@pytest.mark.parametrize("fn,avals,primitive,golden", [
    (lambda x: jax.lax.log2(x), [f32(8, 16)], "log2", "ab->ab"),
    # tanh's derivative
    (jax.grad(lambda x: jnp.tanh(x).sum()), [f32(8, 16)], "one_minus_square", "ab->ab"),
    # Horner's rule: scalar coefficients stay whole, a coefficient of size-1 dims broadcasts
    (lambda x: jax.lax.polynomial(x, [1.0, 2.0, 3.0]), [f32(8, 16)], "polynomial",
     "ab,,,->ab"),
    (lambda x, c: jax.lax.polynomial(x, [c, 2.0 * c]), [f32(8, 16), f32(8, 1)], "polynomial",
     "ab,a.,a.->ab"),
])
def test_golden_primitives_of_jax_0_12(fn, avals, primitive, golden):
    assert golden_of(fn, *avals, primitive=primitive) == golden


@RELEASE_0_12
def test_polynomial_counts_its_multiply_adds():
    from autoshard.rules.elementwise import elementwise
    graph = trace(lambda x: jax.lax.polynomial(x, [1.0, 2.0, 3.0, 4.0]), f32(8, 16))
    (node,) = [n for n in graph.nodes if n.kind == "eqn" and n.primitive == "polynomial"]
    einsum = elementwise(node, [(8, 16)])
    assert einsum.flops == 3 * 2 * 8 * 16 and einsum.fusible and not einsum.expensive


def test_embedding_gather_is_vocab_parallel():
    def fn(table, ids):
        return jnp.take(table, ids, axis=0)
    graph = trace(fn, jax.ShapeDtypeStruct((128, 32), jnp.float32),
                  jax.ShapeDtypeStruct((4, 8), jnp.int32))
    node = next(n for n in graph.nodes if n.primitive == "gather")
    einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    # table [vocab, d] split on vocab gives partial sums; ids' batch dims split with output
    assert str(einsum) == "dc,ab.->abc reduce={d}"


def test_gather_of_whole_slices_splits_them(mesh_2d):
    """A vmapped dynamic index (a stage picking its layer) gathers whole slices of the
    layer's dims, whose starts XLA clamps to 0: they split, and the partitioned gather
    needs no collective."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from autoshard import H100
    from autoshard.report.hlo_report import hlo_report

    def fn(w, i):
        return jax.vmap(lambda ws, ii: jax.lax.dynamic_index_in_dim(ws, ii, 0,
                                                                    keepdims=False))(w, i)
    w, i = f32(4, 2, 16, 32), jax.ShapeDtypeStruct((4,), jnp.int32)
    # w [stage a, layer ., rows b, cols c]: only the indexed layer dim stays whole
    assert golden_of(fn, w, i, primitive="gather") == "a.bc,a.->a.bc"
    spec = NamedSharding(mesh_2d, P("data", None, None, "model"))
    jitted = jax.jit(fn, in_shardings=(spec, NamedSharding(mesh_2d, P("data"))),
                     out_shardings=NamedSharding(mesh_2d, P("data", None, "model")))
    assert hlo_report(jitted.lower(w, i).compile(), H100, mesh_2d).count() == 0
    x = jax.random.normal(jax.random.key(0), w.shape)
    index = jnp.array([1, 0, 3, -1], jnp.int32)          # out of range: clamped
    assert jnp.array_equal(jitted(x, index), fn(x, index))


def test_scatter_splits_the_indexed_operand_dim():
    """The gradient of take_along_axis scatters into the vocabulary: each device applies
    the updates that land in its rows, so the vocabulary splits with nothing to sum."""
    def fn(log_probs, labels):
        return jax.grad(lambda lp: jnp.take_along_axis(lp, labels[..., None], axis=-1).sum())(
            log_probs)
    graph = trace(fn, jax.ShapeDtypeStruct((4, 16, 512), jnp.float32),
                  jax.ShapeDtypeStruct((4, 16), jnp.int32))
    node = next(n for n in graph.nodes if n.primitive == "scatter-add")
    einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "abc,ab..,ab.->abc"


def test_conv_batch_and_features():
    def fn(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    graph = trace(fn, jax.ShapeDtypeStruct((8, 16, 16, 4), jnp.float32),
                  jax.ShapeDtypeStruct((3, 3, 4, 16), jnp.float32))
    node = next(n for n in graph.nodes if n.primitive == "conv_general_dilated")
    einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "a..c,..cb->a..b reduce={c}"


def test_unknown_primitive_warns_and_replicates():
    from jax.extend.core import Primitive
    unknown = Primitive("made_up_for_this_test")
    unknown.def_abstract_eval(lambda x: x)
    graph = trace(lambda x: unknown.bind(x), jax.ShapeDtypeStruct((8, 8), jnp.float32))
    node = next(n for n in graph.nodes if n.primitive == "made_up_for_this_test")
    with pytest.warns(UserWarning, match="made_up_for_this_test"):
        einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "..->.."


def test_replicated_on_purpose_does_not_warn():
    """A primitive of the replicated table (with its reason) stays whole, silently."""
    import warnings

    from autoshard.rules.replicated import REPLICATED
    graph = trace(lambda x: jnp.linalg.cholesky(x), jax.ShapeDtypeStruct((8, 8), jnp.float32))
    node = next(n for n in graph.nodes if n.primitive == "cholesky")
    assert "cholesky" in REPLICATED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        einsum = rule_for(node, [graph.values[v].shape for v in node.outputs])
    assert str(einsum) == "..->.."


def test_random_bits_whole_when_threefry_is_not_partitionable():
    """Without partitionable threefry XLA makes the bits whole on every device."""
    with jax.threefry_partitionable(False):
        assert golden_of(lambda k: jax.random.bits(k, (8, 16)), KEY,
                         primitive="random_bits") == "->.."
    assert golden_of(lambda k: jax.random.bits(k, (8, 16)), KEY,
                     primitive="random_bits") == "->ab"


@pytest.mark.parametrize("primitive,params,avals,golden", [
    ("stack", {"axis": 1}, [f32(4, 8), f32(4, 8)], "ab,ab->a.b"),
    ("unstack", {"axis": 0}, [f32(2, 8)], ".a->a,a"),
    ("tie", {}, [f32(4, 8), f32(4, 8)], "ab,cd->cd"),
])
def test_golden_primitives_without_a_public_wrapper(primitive, params, avals, golden):
    from jax._src.lax import lax as lax_internals
    prim = getattr(lax_internals, f"{primitive}_p")
    assert golden_of(lambda *xs: prim.bind(*xs, **params), *avals, primitive=primitive) == golden


def test_ragged_dot_keeps_the_ragged_and_group_dims_whole():
    """Forward, lhs gradient and kernel gradient of lax.ragged_dot: the ragged rows and the
    kernels' group dim stay whole; contraction and free dims split as in a dot."""
    def loss(lhs, rhs, group_sizes):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes).sum()
    graph = trace(jax.grad(loss, argnums=(0, 1)), f32(16, 8), f32(4, 8, 32),
                  jax.ShapeDtypeStruct((4,), jnp.int32))
    nodes = [n for n in graph.nodes if n.primitive == "ragged_dot_general"]
    einsums = [rule_for(n, [graph.values[v].shape for v in n.outputs]) for n in nodes]
    assert [str(e) for e in einsums] == [
        ".k,.kn,.->.n reduce={k}",     # forward: rows grouped, k contracted
        ".m,.n,.->.mn",                # kernel gradient: contracts the ragged rows per group
        ".k,.nk,.->.n reduce={k}",     # lhs gradient
    ]
    assert [e.flops for e in einsums] == [2.0 * 16 * 8 * 32] * 3
