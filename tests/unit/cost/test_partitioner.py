"""cost.partitioner: XLA's SPMD partitioner's reshard followed on tile assignments,
worked by hand on a 2x4 mesh {"data": 2, "model": 4} (devices 0..7 row-major), and
checked against the compiled programs of every reshard between the specs of a 3-d array
(2x4 and 4x2 meshes) and of a sample on a 2x2x2 mesh."""

import collections
import itertools
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.cost import partitioner
from autoshard.frontend import specs
from autoshard.runtime import cli
from autoshard.testing.reshards import compiled_reshard

SIZES = {"data": 2, "model": 4}


def steps(shape, src, dst, sizes=SIZES):
    return [(s.kind, partitioner.group_axes(s.groups, sizes), s.num_bytes)
            for s in partitioner.reshard_steps(shape, 4, src, dst, sizes)]


def test_a_spec_whose_axes_leave_mesh_order_transposes_the_devices():
    # P(model, data): dim 0's 4 tiles go along model (device ids step by 1), dim 1's 2
    # along data (ids step by 4): the mesh [[0..3], [4..7]] transposed
    t = partitioner.tiling((("model",), ("data",)), SIZES)
    assert t.devices.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]] and not t.partial
    # P(None, model): 4 tiles along model, each held by the 2 devices along data
    t = partitioner.tiling(((), ("model",)), SIZES)
    assert t.devices.tolist() == [[[0, 4], [1, 5], [2, 6], [3, 7]]] and t.partial


def test_moving_an_axis_beside_a_replicated_one_takes_two_all_to_alls():
    # f32[8, 16, 256] (131072 B) from P(None, None, model) to P(model, data, None). The
    # shard counts (1, 1, 4 + 2 replicas) and (4, 2, 1) pair for no all-to-all, no copy
    # can be sliced to the target (dim 2 must shrink), and the replicas cannot all-to-all
    # onto the last dim. The partitioner moves the replicas onto dim 0 instead: a local
    # slice to P(data, None, model), 16384 B a shard. From (2, 1, 4) to (4, 2, 1) the
    # counts pair: one all-to-all over data (dim 0's 2 for dim 1's 1) and one over model
    # (dim 2's 4 onto dim 0), 16384 B each
    assert steps((8, 16, 256), ((), (), ("model",)), (("model",), ("data",), ())) == [
        ("all-to-all", ("data",), 16384), ("all-to-all", ("model",), 16384)]
    # to P(data, model, None), whose axes keep mesh order, one all-to-all moves model
    # from dim 2 to dim 1 after the same slice
    assert steps((8, 16, 256), ((), (), ("model",)), (("data",), ("model",), ())) == [
        ("all-to-all", ("model",), 16384)]


def test_a_partly_replicated_target_gathers_only_its_factor():
    # P((data, model)) -> P(data): dim 0's 8 tiles become 2; each 16384 B shard is
    # gathered 4-fold within the neighbouring tiles (over model) to 131072 / 2 B
    assert steps((8, 16, 256), (("data", "model"), (), ()), (("data",), (), ())) == [
        ("all-gather", ("model",), 65536)]


def test_axes_swapped_on_one_dim_are_a_permute():
    # the same 8 tiles on other devices: each sends its 16384 B shard to the new owner
    assert steps((8, 16, 256), (("data", "model"), (), ()), (("model", "data"), (), ())) == [
        ("collective-permute", ("data", "model"), 16384)]


def test_slicing_a_replicated_array_moves_nothing():
    assert steps((8, 16, 256), ((), (), ()), (("model",), ("data",), ())) == []


def compiled(mesh, shape, src, dst):
    """Each collective (kind, axes, bytes) XLA compiles for the reshard, as apply writes
    it (``testing.reshards``)."""
    return collections.Counter((kind, tuple(sorted(axes)), num_bytes) for kind, axes, num_bytes
                               in compiled_reshard(mesh, cli.cpu_hardware(mesh), shape, src,
                                                   dst))


def predicted(shape, src, dst, sizes):
    return collections.Counter((kind, tuple(sorted(axes)), num_bytes)
                               for kind, axes, num_bytes in steps(shape, src, dst, sizes))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_every_reshard_of_a_3d_array_is_what_xla_compiles(mesh_shape):
    mesh = autoshard.make_mesh(mesh_shape, ("data", "model"))
    sizes = dict(zip(("data", "model"), mesh_shape))
    shape = (8, 16, 32)
    options = list(specs.enumerate_specs(shape, sizes, every_order=True))
    apart = [(src, dst) for src, dst in itertools.permutations(options, 2)
             if predicted(shape, src, dst, sizes) != compiled(mesh, shape, src, dst)]
    assert len(options) == 19 and apart == []


@pytest.mark.slow
def test_reshards_on_a_three_axis_mesh_are_what_xla_compiles():
    # 120 of the 2352 pairs of 2-d specs on a 2x2x2 mesh, drawn with a fixed seed
    names = ("x", "y", "z")
    mesh = autoshard.make_mesh((2, 2, 2), names)
    sizes = dict.fromkeys(names, 2)
    pairs = list(itertools.permutations(specs.enumerate_specs((8, 16), sizes, every_order=True),
                                        2))
    random.Random(0).shuffle(pairs)
    apart = [(src, dst) for src, dst in pairs[:120]
             if predicted((8, 16), src, dst, sizes) != compiled(mesh, (8, 16), src, dst)]
    assert apart == []


def test_group_axes_name_the_axes_a_group_spans():
    # devices 1 and 5 differ along data; 4..7 along model
    assert partitioner.group_axes(((1, 5),), SIZES) == ("data",)
    assert partitioner.group_axes(((4, 5, 6, 7), (0, 1, 2, 3)), SIZES) == ("model",)
    assert partitioner.group_axes((tuple(np.arange(8)),), SIZES) == ("data", "model")


@st.composite
def reshards(draw):
    """A mesh of 1 to 3 axes (sizes 1 to 4, 3 included: counts that divide unevenly),
    an array of rank 1 to 4 with dims that may not divide, and two specs of it."""
    names = ("a", "b", "c")[:draw(st.integers(1, 3))]
    sizes = {a: draw(st.integers(1, 4)) for a in names}
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12]), min_size=1,
                                max_size=4)))

    def spec():
        dim_of = {a: draw(st.integers(0, len(shape))) for a in names}
        order = draw(st.permutations(names))
        return tuple(tuple(a for a in order if dim_of[a] == d) for d in range(len(shape)))
    return shape, spec(), spec(), sizes


def held_elements(shape, spec, sizes) -> np.ndarray:
    """[device, element]: whether the device holds the element (row-major flat index) of
    an array laid out as ``spec``. Devices are numbered row-major over the mesh axes in
    ``sizes``'s order; a dim split k ways over axes (a, b) is cut into tiles of
    ceil(n / k), tile a * size(b) + b on the device at (a, b)."""
    devices = int(np.prod(list(sizes.values())))
    held = np.zeros((devices, int(np.prod(shape))), bool)
    for device in range(devices):
        coords = dict(zip(sizes, np.unravel_index(device, tuple(sizes.values()))))
        index = []
        for n, axes in zip(shape, spec):
            tile_at = 0
            for a in axes:
                tile_at = tile_at * sizes[a] + int(coords[a])
            tile = -(-n // int(np.prod([sizes[a] for a in axes])))
            index.append(slice(tile_at * tile, (tile_at + 1) * tile))
        held[device, np.arange(held.shape[1]).reshape(shape)[tuple(index)].ravel()] = True
    return held


def evenly_split(shape, spec, sizes) -> bool:
    """Whether every dim divides by its split (no padded tiles: XLA aligns those to the
    target by permutes the steps do not follow, e.g. f32[2] from P(("a", "b")) to P("a")
    on {"a": 2, "b": 2} compiles to a permute 1 -> 2 and a gather, not the gather alone)."""
    return all(n % int(np.prod([sizes[a] for a in axes])) == 0 for n, axes in zip(shape, spec))


def replayed(held: np.ndarray, steps) -> np.ndarray:
    """What each device can hold once ``steps`` ran, from ``held``: an all-gather gives
    every member of a group all its members hold, a permute moves a source's elements to
    its target (a device no pair names keeps its own), an all-to-all at most all its
    group holds (which dims it exchanges, the steps do not say)."""
    held = held.copy()
    for step in steps:
        if step.kind == "collective-permute":
            before = held.copy()
            for source, target in step.groups:
                held[target] = before[source]
            continue
        for group in step.groups:
            held[list(group)] = held[list(group)].any(axis=0)
    return held


@example(((1, 4, 1, 1), ((), ("a", "b"), (), ("c",)), ((), ("b",), ("c",), ("a",)),
          {"a": 2, "b": 2, "c": 3}))
# a group's tiling (global device ids) from a partly replicated one, sliced
@example(((1, 1, 1), (("c",), (), ("a",)), (("a",), ("c",), ("b",)), {"a": 2, "b": 3, "c": 2}))
@settings(max_examples=300, deadline=None)
@given(reshards())
def test_every_reshard_is_some_collectives_over_the_mesh(case):
    # any two specs on any mesh: no exception, and each collective runs over devices of
    # the mesh in groups of one size, moving a positive number of bytes; replayed on what
    # each device holds, the steps leave every device all of its tile of the target, so
    # that a local slice finishes the reshard
    shape, src, dst, sizes = case
    found = partitioner.reshard_steps(shape, 4, src, dst, sizes)
    devices = int(np.prod(list(sizes.values())))
    for step in found:
        assert step.kind in ("all-gather", "all-to-all", "collective-permute")
        assert step.num_bytes > 0 and len({len(g) for g in step.groups}) == 1
        assert all(0 <= d < devices for g in step.groups for d in g)
        if step.kind == "all-gather":    # told on the array's dims, split ones too
            assert 0 <= step.gathered_dim < len(shape) and len(step.local_shape) == len(shape)
    if evenly_split(shape, src, sizes) and evenly_split(shape, dst, sizes):
        held = replayed(held_elements(shape, src, sizes), found)
        missing = np.argwhere(held_elements(shape, dst, sizes) & ~held)
        assert len(missing) == 0, f"device {missing[0][0]} lacks element {missing[0][1]}"
    if src == dst:
        assert found == ()


def test_group_axes_of_a_step_are_the_axes_its_groups_vary_along():
    # on {"a": 2, "b": 3, "c": 2} (devices row-major), each device's coordinates by hand
    sizes = {"a": 2, "b": 3, "c": 2}
    coords = list(itertools.product(range(2), range(3), range(2)))
    for groups in [((0, 6),), ((0, 2, 4), (1, 3, 5)), ((0, 1), (2, 3)), ((0, 7),),
                   (tuple(range(12)),)]:
        varying = {name for k, name in enumerate(sizes)
                   if any(len({coords[d][k] for d in g}) > 1 for g in groups)}
        assert set(partitioner.group_axes(groups, sizes)) == varying, groups


@st.composite
def wide_reshards(draw):
    """As ``reshards``, with some dims multiples of the device count (the ones
    ``canonical_shape`` replaces)."""
    shape, src, dst, sizes = draw(reshards())
    devices = int(np.prod(list(sizes.values())))
    shape = tuple(devices * draw(st.sampled_from([2, 3, 5, 8])) if draw(st.booleans()) else n
                  for n in shape)
    return shape, src, dst, sizes


@settings(max_examples=300, deadline=None)
@given(wide_reshards())
def test_a_canonical_shape_takes_the_same_steps_with_bytes_scaled(case):
    # the steps followed on the canonical shape are those of the array itself: the same
    # kinds over the same device groups, gathering the same dims, each moving the bytes
    # of the array's step divided by the scale
    shape, src, dst, sizes = case
    canonical, scale = partitioner.canonical_shape(shape, sizes)
    direct = partitioner.reshard_steps(shape, 4, src, dst, sizes)
    found = partitioner.cached_reshard_steps(canonical, 4, src, dst, sizes)
    assert [(s.kind, s.groups, s.gathered_dim) for s in found] == \
        [(s.kind, s.groups, s.gathered_dim) for s in direct]
    assert [s.num_bytes * scale for s in found] == pytest.approx([s.num_bytes for s in direct])
    assert [[n > 1 for n in s.local_shape] for s in found] == \
        [[n > 1 for n in s.local_shape] for s in direct]


@st.composite
def reshards_with_unit_dims(draw):
    """As ``reshards``, with runs of size-1 dims that neither spec splits inserted
    (a [1, seq, d] slice, a [b, s, 1, 1] mask)."""
    shape, src, dst, sizes = draw(reshards())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(shape)))
        shape = shape[:at] + (1,) + shape[at:]
        src, dst = (s[:at] + ((),) + s[at:] for s in (src, dst))
    return shape, src, dst, sizes


# [1, 4, 1, 1] from P(None, (a, b), None, c) to P(None, b, c, a) on {a: 2, b: 2, c: 3}:
# dims 1 and 3 trade shards 4, 3 for 2, 2, so dim 1 is split in two ([2, 2]) and the
# gathers run on the split array; they are told on the array's own dims (and with a cut
# dim ahead of the split one, on the kept ones)
@example(((1, 4, 1, 1), ((), ("a", "b"), (), ("c",)), ((), ("b",), ("c",), ("a",)),
          {"a": 2, "b": 2, "c": 3}), 1)
@example(((1, 1, 4, 1, 1), ((), (), ("a", "b"), (), ("c",)), ((), (), ("b",), ("c",), ("a",)),
          {"a": 2, "b": 2, "c": 3}), 4)
@settings(max_examples=400, deadline=None)
@given(reshards_with_unit_dims(), st.sampled_from([1, 2, 4]))
def test_a_canonical_reshard_takes_the_same_steps(case, itemsize):
    # the reshard with each run of unsplit size-1 dims cut to one, of one-byte elements,
    # takes the array's own steps: the same kinds over the same device groups, gathering
    # the same dim (counted among the kept ones), bytes divided by the scale
    shape, src, dst, sizes = case
    canonical, c_src, c_dst, scale = partitioner.canonical_reshard(shape, itemsize, src,
                                                                   dst, sizes)
    direct = partitioner.reshard_steps(shape, itemsize, src, dst, sizes)
    found = partitioner.reshard_steps(canonical, 1, c_src, c_dst, sizes)
    cut = [d for d in range(1, len(shape)) if shape[d] == shape[d - 1] == 1
           and not src[d] and not dst[d] and not src[d - 1] and not dst[d - 1]]
    kept = [d for d in range(len(shape)) if d not in cut]
    assert [(s.kind, s.groups) for s in found] == [(s.kind, s.groups) for s in direct]
    assert [s.num_bytes * scale for s in found] == pytest.approx([s.num_bytes for s in direct])
    assert [s.gathered_dim for s in found] == [
        None if s.gathered_dim is None else kept.index(s.gathered_dim) for s in direct]
    assert [[n > 1 for n in s.local_shape] for s in found] == \
        [[n > 1 for k, n in enumerate(s.local_shape) if k in kept] for s in direct]


@st.composite
def reshards_on_equal_axes(draw):
    """As ``reshards``, on a mesh whose axes often share one size (those a renaming
    swaps)."""
    shape, src, dst, sizes = draw(reshards())
    size = draw(st.integers(2, 4))
    return shape, src, dst, {a: size if draw(st.booleans()) else n for a, n in sizes.items()}


def renamed_device(device: int, back: dict, sizes) -> int:
    """The device at a renamed mesh's ``device``, on the mesh itself: each axis's
    coordinate is its new name's (``back``: each new name's old one)."""
    at = dict(zip(sizes, np.unravel_index(device, tuple(sizes.values()))))
    renamed = {old: new for new, old in back.items()}
    return int(np.ravel_multi_index([at[renamed[old]] for old in sizes],
                                    tuple(sizes.values())))


# P(model, fsdp) to P(fsdp) on three axes of 8: the specs leave 'data' and then 'data'
# and 'model' unnamed, in that order; no renaming that swaps them takes the same steps
@example(((64, 32, 128), (("model",), ("fsdp",), ()), (("fsdp",), (), ()),
          {"data": 8, "fsdp": 8, "model": 8}))
@settings(max_examples=400, deadline=None)
@given(reshards_on_equal_axes())
def test_a_renamed_reshard_takes_the_same_steps_over_the_relabeled_devices(case):
    # the least renaming of the reshard: the same kinds moving the same bytes, each over
    # the devices of the array's own step once relabeled, spanning the axes renamed back
    shape, src, dst, sizes = case
    new_src, new_dst, back = partitioner.relabelled(src, dst, sizes)
    assert sorted(back) == sorted(sizes) and sorted(back.values()) == sorted(sizes)
    assert all(sizes[new] == sizes[old] for new, old in back.items())
    direct = partitioner.reshard_steps(shape, 4, src, dst, sizes)
    found = partitioner.reshard_steps(shape, 4, new_src, new_dst, sizes)

    def told(step, relabel):
        groups = {frozenset(relabel(d) for d in g) for g in step.groups}
        return step.kind, step.num_bytes, step.gathered_dim, step.local_shape, groups
    assert [told(s, int) for s in direct] == \
        [told(s, lambda d: renamed_device(d, back, sizes)) for s in found]
    assert [set(s.axes) for s in direct] == [{back[a] for a in s.axes} for s in found]
