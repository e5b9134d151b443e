"""autoshard.report.hlo_report: the compiled program, priced.

Snippets under tests/unit/report/hlo/ are real CPU ``compiled.as_text()`` output of this jax version
(explicit_groups, iota_groups, cpu_reduce_scatter, convolution: lightly edited) or
hand-written in the same syntax (mesh_groups, while_nested, empty_groups,
cpu_all_reduce_not_sliced, and async_gpu in the GPU backend's async style).
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from xla_habits import CPU_WIDENS_NARROW_DOTS

from autoshard.report.hlo_report import (
    Report,
    _bytes,
    buffer_bytes,
    held_together,
    hlo_report,
    parse_hlo,
    parse_replica_groups,
    report_from_hlo_text,
)
from autoshard.target.hardware import (
    Hardware,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    collective_permute_seconds,
    reduce_scatter_seconds,
)

HLO = pathlib.Path(__file__).parent / "hlo"
LATENCY = 1e-6
HW = Hardware(flops=1e12, hbm_bandwidth=1e11, memory=16e9,
              link_bandwidth={"x": 1e10, "data": 2e10, "model": 5e10},
              link_latency=LATENCY, default_link_bandwidth=1e9)
F32 = 4


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


@pytest.fixture(scope="module")
def mesh8():
    return _mesh((8,), ("x",))


@pytest.fixture(scope="module")
def mesh2x4():
    return _mesh((2, 4), ("data", "model"))


def _snippet(name, mesh=None, hardware=HW):
    return report_from_hlo_text((HLO / name).read_text(), hardware, mesh)


def _by_name(report):
    return {c.name: c for c in report.collectives}


def _compile(f, mesh, in_specs, out_spec, *args):
    shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
    return jax.jit(f, in_shardings=shardings,
                   out_shardings=NamedSharding(mesh, out_spec)).lower(*args).compile()


def _matmul(x, w):
    return x @ w


# ----------------------------------------------------------------------------- parser


def test_parse_hlo_reads_computations_instructions_and_partitions():
    module = parse_hlo((HLO / "explicit_groups.hlo").read_text())
    assert module.num_partitions == 8
    assert module.entry_name == "main.0_spmd"
    assert set(module.computations) == {"add.clone", "fused_computation", "main.0_spmd"}
    root = module.entry.root
    assert (root.opcode, root.operands, root.shape.dims) == (
        "all-reduce", ("ynn_fusion",), (16, 512))
    fusion = module.entry.by_name["ynn_fusion"]
    assert fusion.called("calls") == ["fused_computation"]
    assert fusion.backend_config()["fusion_config"]["kind"] == "__ynn_fusion"
    dot = module.computations["fused_computation"].root
    assert dot.opcode == "dot" and dot.attrs["lhs_contracting_dims"] == "{1}"


def test_shape_bytes_of_tuples_and_narrow_types():
    module = parse_hlo((HLO / "async_gpu.hlo").read_text())
    permute = module.entry.by_name["collective-permute-start"]
    # (f32[16,128], f32[16,128], u32[], u32[]) = 2*16*128*4 + 2*4
    assert permute.shape.num_bytes == 2 * 16 * 128 * 4 + 2 * 4
    gemm = module.entry.by_name["cublas-gemm.1"]
    assert gemm.shape.elements[1].num_bytes == 4194304  # s8 workspace
    text = "HloModule m\n\nENTRY %e (p: s4[10]) -> bf16[3] {\n  %p = s4[10]{0} parameter(0)\n" \
           "  ROOT %c = bf16[3]{0} convert(%p)\n}\n"
    entry = parse_hlo(text).entry
    assert entry.by_name["p"].shape.num_bytes == 5  # 10 x 4 bits
    assert entry.root.shape.num_bytes == 6  # 3 x 2 bytes


def test_explicit_replica_groups(mesh2x4):
    assert parse_replica_groups("{{0,4},{1,5},{2,6},{3,7}}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    report = _snippet("explicit_groups.hlo", mesh2x4)
    (ar,) = report.collectives
    # x[16,128] @ w[128,512] partial sums over 'data' (devices i and i+4): 16*512*4 bytes
    assert (ar.kind, ar.num_bytes, ar.group_size, ar.axes, ar.count) == (
        "all-reduce", 16 * 512 * F32, 2, ("data",), 1)
    # 1e-6 + 2 * (1/2) * 32768 / 2e10
    assert ar.seconds == pytest.approx(LATENCY + 32768 / 2e10)


def test_iota_replica_groups(mesh2x4):
    # iota over [2,4] = [[0,1,2,3],[4,5,6,7]], transposed -> [[0,4],[1,5],[2,6],[3,7]]
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_replica_groups("[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("[1,8]<=[8]", 8) == [list(range(8))]
    found = _by_name(_snippet("iota_groups.hlo", mesh2x4))
    assert (found["all-reduce"].axes, found["all-reduce"].group_size) == (("data",), 2)
    assert found["all-reduce"].num_bytes == 64 * 128 * F32
    # all-gather result f32[64,512] per device over 'model'
    assert (found["all-gather"].axes, found["all-gather"].group_size) == (("model",), 4)
    assert found["all-gather"].num_bytes == 64 * 512 * F32
    assert found["all-gather"].seconds == pytest.approx(LATENCY + 0.75 * 64 * 512 * F32 / 5e10)


def test_mesh_replica_groups(mesh2x4):
    data, model = [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 8) == model
    assert parse_replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 8) == data
    # device array = iota([2,4]).T reshaped to [4,1,2]: axis_0 runs over 0,1,2,3 (and 4..7)
    assert parse_replica_groups(
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", 8) == model
    # sub-axis (1)2 of an 8-axis: its major factor of 2, stride 4
    assert parse_replica_groups("mesh['axis_0'=8] {'axis_0':(1)2}", 8) == data
    assert parse_replica_groups("mesh['axis_0'=8] {'axis_0':(4)2}", 8) == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    found = _by_name(_snippet("mesh_groups.hlo", mesh2x4))
    assert found["all-gather"].axes == ("model",)
    assert found["all-gather"].num_bytes == 64 * 512 * F32
    assert found["all-reduce.1"].axes == ("model",)
    assert found["all-reduce.2"].axes == ("data",)
    assert found["all-reduce.3"].axes == ("data",)
    assert (found["all-reduce.4"].axes, found["all-reduce.4"].group_size) == (("data", "model"), 8)
    # a collective over both axes runs at the slower link ('data', 2e10)
    assert found["all-reduce.4"].seconds == pytest.approx(
        all_reduce_seconds(16 * 512 * F32, 8, 2e10, LATENCY))


def test_empty_replica_groups_mean_all_devices(mesh8):
    assert parse_replica_groups("{}", 8) == [list(range(8))]
    (ar,) = _snippet("empty_groups.hlo", mesh8).collectives
    # f32[1024] = 4096 bytes over all 8 devices: 1e-6 + 2 * 7/8 * 4096 / 1e10
    assert (ar.num_bytes, ar.group_size, ar.axes) == (4096, 8, ("x",))
    assert ar.seconds == pytest.approx(LATENCY + 2 * 7 / 8 * 4096 / 1e10)


def test_without_mesh_axes_are_unknown_and_use_default_bandwidth():
    (ar,) = _snippet("empty_groups.hlo").collectives
    assert ar.axes == ()
    assert ar.seconds == pytest.approx(all_reduce_seconds(4096, 8, 1e9, LATENCY))


def test_nested_while_multiplies_trip_counts(mesh8):
    report = _snippet("while_nested.hlo", mesh8)
    # outer loop n=3 runs an all-gather; inner loop n=4 runs a dot and an all-reduce
    found = _by_name(report)
    assert found["all-reduce.2"].count == 3 * 4
    assert found["all-gather.1"].count == 3
    assert report.count("all-reduce") == 12 and report.count("all-gather") == 3
    # dot f32[64,32] @ f32[32,256]: 2*64*256*32 = 1048576 flops, 12 times
    assert report.flops == 12 * 2 * 64 * 256 * 32
    # all-reduce buffer 64*256*4 = 65536 bytes, 12 times; all-gather result 65536, 3 times
    assert report.collective_bytes("all-reduce") == 12 * 65536
    assert report.collective_bytes() == 15 * 65536
    assert report.comm_s == pytest.approx(12 * all_reduce_seconds(65536, 8, 1e10, LATENCY)
                                          + 3 * all_gather_seconds(65536, 8, 1e10, LATENCY))
    assert report.warnings == ()


def test_while_without_trip_count_counts_once_and_warns(mesh8):
    text = (HLO / "while_nested.hlo").read_text().replace(',"known_trip_count":{"n":"4"}', "")
    report = report_from_hlo_text(text, HW, mesh8)
    assert _by_name(report)["all-reduce.2"].count == 3  # inner loop unknown: x1
    assert report.flops == 3 * 2 * 64 * 256 * 32
    assert len(report.warnings) == 1 and "while.1" in report.warnings[0]


def test_async_pairs_count_once_at_start(mesh2x4):
    report = _snippet("async_gpu.hlo", mesh2x4)
    found = _by_name(report)
    assert set(found) == {"all-gather-start", "all-reduce-start", "reduce-scatter-start",
                          "collective-permute-start"}
    ag, ar = found["all-gather-start"], found["all-reduce-start"]
    rs, cp = found["reduce-scatter-start"], found["collective-permute-start"]
    # all-gather: result f32[64,256] per device over 'model' (groups of 4)
    assert (ag.kind, ag.num_bytes, ag.group_size, ag.axes) == ("all-gather", 65536, 4, ("model",))
    # all-reduce: buffer f32[16,128] = 8192 bytes over 'data'
    assert (ar.kind, ar.num_bytes, ar.group_size, ar.axes) == ("all-reduce", 8192, 2, ("data",))
    # reduce-scatter wrapped in async-start: input f32[16,128] over 'model'
    assert (rs.kind, rs.num_bytes, rs.group_size, rs.axes) == (
        "reduce-scatter", 8192, 4, ("model",))
    assert rs.seconds == pytest.approx(reduce_scatter_seconds(8192, 4, 5e10, LATENCY))
    # collective-permute ring within each 'model' row
    assert (cp.kind, cp.num_bytes, cp.axes) == ("collective-permute", 8192, ("model",))
    assert cp.seconds == pytest.approx(collective_permute_seconds(8192, 5e10, LATENCY))
    assert all(c.count == 1 for c in report.collectives)
    # cuBLAS gemm f32[16,256] @ f32[256,128]: 2*16*128*256
    assert report.flops == 2 * 16 * 128 * 256


def test_cpu_all_reduce_then_dynamic_slice_reads_as_reduce_scatter(mesh8):
    (rs,) = _snippet("cpu_reduce_scatter.hlo", mesh8).collectives
    # all-reduce of f32[64,512] whose fusion keeps a [8,512] slice: reduce-scatter of the input
    assert (rs.kind, rs.num_bytes, rs.group_size, rs.axes) == (
        "reduce-scatter", 64 * 512 * F32, 8, ("x",))
    # 1e-6 + 7/8 * 131072 / 1e10
    assert rs.seconds == pytest.approx(LATENCY + 7 / 8 * 131072 / 1e10)


def test_combined_all_reduce_reads_its_sliced_results_as_reduce_scatter(mesh8):
    # XLA:CPU's combiner merges an emulated reduce-scatter (element 0, kept as a 1/8
    # slice) with a true all-reduce (element 1, read whole): one op, one latency
    ar, rs = _snippet("cpu_combined_reduce_scatter.hlo", mesh8).collectives
    assert (ar.kind, ar.num_bytes, rs.kind, rs.num_bytes) == (
        "all-reduce", 16 * 128 * F32, "reduce-scatter", 64 * 512 * F32)
    assert ar.seconds + rs.seconds == pytest.approx(
        all_reduce_seconds(16 * 128 * F32, 8, 1e10, LATENCY)
        + reduce_scatter_seconds(64 * 512 * F32, 8, 1e10, LATENCY) - LATENCY)


def test_all_reduce_with_other_uses_or_wrong_slice_stays_all_reduce(mesh8):
    report = _snippet("cpu_all_reduce_not_sliced.hlo", mesh8)
    # all-reduce also returned whole; all-reduce.1 sliced to 1/2, not 1/8
    assert [c.kind for c in report.collectives] == ["all-reduce", "all-reduce"]


def test_convolution_flops():
    report = _snippet("convolution.hlo")
    # out 4*16*16*16 elements * 3x3 window * 4 input features per group (8 / 2 groups) * 2
    assert report.flops == 2 * (4 * 16 * 16 * 16) * 9 * 4
    assert report.collectives == ()


def test_cudnn_backward_convolutions_count_the_forward_flops():
    """XLA:GPU's cuDNN calls for a conv's gradients keep the forward's window and dim
    labels; each does the forward's work: out 4*8*8*16 elements * 3x3 window * 8 input
    features * 2, three times (forward, kernel gradient, input gradient)."""
    report = _snippet("gpu_convolutions.hlo")
    assert report.flops == 3 * 2 * (4 * 8 * 8 * 16) * 9 * 8


# ----------------------------------------------------------------------------- compiled programs


X, W = jnp.ones((64, 256), jnp.float32), jnp.ones((256, 512), jnp.float32)


def test_column_sharded_matmul_has_no_collectives(mesh8):
    compiled = _compile(_matmul, mesh8, [P(), P(None, "x")], P(None, "x"), X, W)
    report = hlo_report(compiled, HW, mesh8)
    # each device: x[64,256] @ w[256,64]: 2*64*256*512/8 = 2097152 flops
    assert report.flops == 2 * 64 * 256 * 512 // 8
    assert report.collectives == () and report.comm_s == 0
    # one fused dot reads 64*256*4 + 256*64*4 and writes 64*64*4 bytes
    assert report.bytes_accessed == 65536 + 65536 + 16384
    assert report.compute_s == pytest.approx(HW.compute_seconds(2097152, 147456))
    assert report.total_s == report.compute_s
    # memory: arguments 65536 + 65536, output 16384, as XLA's memory analysis says
    assert (report.argument_bytes, report.output_bytes) == (131072, 16384)
    assert_memory_is_xlas(report, compiled)
    # bytes as XLA's own cost analysis counts them
    assert report.bytes_accessed == compiled.cost_analysis()["bytes accessed"]


def assert_memory_is_xlas(report, compiled):
    """Each memory field, and their total, as ``memory_analysis()`` gives them."""
    m = compiled.memory_analysis()
    assert (report.argument_bytes, report.output_bytes, report.temp_bytes,
            report.alias_bytes) == (m.argument_size_in_bytes, m.output_size_in_bytes,
                                    m.temp_size_in_bytes, m.alias_size_in_bytes)
    assert report.memory_bytes == (m.argument_size_in_bytes + m.output_size_in_bytes
                                   + m.temp_size_in_bytes - m.alias_size_in_bytes)


def test_row_sharded_matmul_all_reduces_once(mesh8):
    compiled = _compile(_matmul, mesh8, [P(None, "x"), P("x", None)], P(), X, W)
    report = hlo_report(compiled, HW, mesh8)
    assert report.flops == 2 * 64 * 256 * 512 // 8  # contraction split 8 ways
    (ar,) = report.collectives
    # partial out[64,512] f32 summed over all 8 devices: 64*512*4 = 131072 bytes
    assert (ar.kind, ar.num_bytes, ar.group_size, ar.axes, ar.count) == (
        "all-reduce", 64 * 512 * F32, 8, ("x",), 1)
    # 1e-6 + 2 * 7/8 * 131072 / 1e10
    comm_s = LATENCY + 2 * 7 / 8 * 131072 / 1e10
    assert ar.seconds == pytest.approx(comm_s)
    assert report.comm_s == pytest.approx(comm_s)
    # the one fused dot: x[64,32] and w[32,512] read, the partial f32[64,512] written
    compute_s = HW.compute_seconds(2 * 64 * 256 * 512 // 8, (64 * 32 + 32 * 512 + 64 * 512) * F32)
    assert report.compute_s == pytest.approx(compute_s)
    assert report.total_s == pytest.approx(compute_s + comm_s)
    assert report.bytes_accessed == compiled.cost_analysis()["bytes accessed"]
    assert_memory_is_xlas(report, compiled)


def test_2x4_mesh_attributes_axes(mesh2x4):
    # contraction sharded over 'model': partial out[32,512] summed over groups of 4
    compiled = _compile(_matmul, mesh2x4, [P("data", "model"), P("model", None)],
                        P("data", None), X, W)
    (ar,) = hlo_report(compiled, HW, mesh2x4).collectives
    assert (ar.kind, ar.num_bytes, ar.group_size, ar.axes) == (
        "all-reduce", 32 * 512 * F32, 4, ("model",))
    assert ar.seconds == pytest.approx(all_reduce_seconds(65536, 4, 5e10, LATENCY))
    # contraction sharded over 'data': partial out[16,512] summed over pairs
    compiled = _compile(_matmul, mesh2x4, [P("model", "data"), P("data", None)],
                        P("model", None), X, W)
    report = hlo_report(compiled, HW, mesh2x4)
    (ar,) = report.collectives
    assert (ar.kind, ar.num_bytes, ar.group_size, ar.axes) == (
        "all-reduce", 16 * 512 * F32, 2, ("data",))
    assert ar.seconds == pytest.approx(all_reduce_seconds(32768, 2, 2e10, LATENCY))
    # per device x[16,128] @ w[128,512]
    assert report.flops == 2 * 16 * 128 * 512


def test_scan_trip_count_multiplies_collectives_and_flops(mesh8):
    def scan(c, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), c, ws)[0]

    ws = jnp.ones((5, 256, 256), jnp.float32)
    compiled = _compile(scan, mesh8, [P(None, "x"), P(None, "x", None)], P(), X, ws)
    report = hlo_report(compiled, HW, mesh8)
    # per step: c[64,32] @ w[32,256] = 2*64*256*32 = 1048576 flops; 5 steps
    assert report.flops == 5 * 2 * 64 * 256 * 32
    in_loop = [c for c in report.collectives if c.count == 5]
    assert len(in_loop) == 1
    # the partial c@w f32[64,256] (65536 bytes) is summed each step; CPU slices it back
    # to the carry's sharding P(None, "x") (all-reduce + dynamic-slice), so it reads as a
    # reduce-scatter of the 65536-byte input, 5 times; the result, out_sharding P(), is
    # gathered once after the loop
    assert in_loop[0].kind == "reduce-scatter"
    assert (in_loop[0].num_bytes, in_loop[0].group_size, in_loop[0].axes) == (65536, 8, ("x",))
    assert report.count("reduce-scatter") == 5
    assert report.count("all-reduce") == 0
    (after,) = [c for c in report.collectives if c.count == 1]
    assert (after.kind, after.num_bytes, after.axes) == ("all-gather", 65536, ("x",))
    # compute split by how often it runs: the loop's ops run 5 times, and the parts add up
    runs = dict(report.compute_s_by_runs)
    assert set(runs) <= {1, 5} and runs[5] > 0
    assert sum(runs.values()) == pytest.approx(report.compute_s)
    # priced by FLOPs alone (HBM a million times faster), the ops run 5 times are the
    # loop's dots, 5 x 1048576 flops, and nothing outside the loop computes
    flops_only = dataclasses.replace(HW, hbm_bandwidth=HW.hbm_bandwidth * 1e6)
    runs = dict(hlo_report(compiled, flops_only, mesh8).compute_s_by_runs)
    assert runs[5] == pytest.approx(5 * 2 * 64 * 256 * 32 / HW.flops)
    assert runs.get(1, 0.0) == pytest.approx(0.0, abs=1e-3 * runs[5])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scan_reads_one_slice_of_the_stack_per_iteration(dtype):
    """A scan reads one layer of the stacked weights and writes one slice of the stacked
    ys per iteration, in place: bytes grow with the trip count, not with its square. (CPU
    XLA updates a bf16 stack in f32, converting the whole stack around the update, which
    a backend with bf16 updates does not: the update is priced.)"""
    def scan(ws, x):
        def body(c, w):
            y = jnp.tanh(c @ w)
            return y, y
        return jax.lax.scan(body, x, ws)

    per_iteration = []
    for layers in (8, 64):
        ws = jax.ShapeDtypeStruct((layers, 256, 256), dtype)
        x = jax.ShapeDtypeStruct((64, 256), dtype)
        report = hlo_report(jax.jit(scan).lower(ws, x).compile(), HW)
        per_iteration.append(report.bytes_accessed / layers)
    assert per_iteration[1] == pytest.approx(per_iteration[0], rel=0.1)
    # at least the layer's weights (256 KiB in f32) are read each iteration
    assert per_iteration[0] >= 256 * 256 * jnp.dtype(dtype).itemsize


def test_a_loop_fusion_reads_no_more_of_an_operand_than_it_computes():
    """One of the chunks CPU XLA cuts for an all-to-all, cut from an elementwise result:
    the loop computes its 8*32*64 = 16384 elements, each from one element of each operand,
    so it reads 16384 of the 131072 of f32[8,32,512] and of the 1048576 of f32[8,256,512],
    not both whole, once per chunk. A loop with a reduction in it reads what it reduces."""
    module = parse_hlo((HLO / "cpu_all_to_all_chunk.hlo").read_text())
    entry = module.entry
    fusions = {i.name: i for i in entry.instructions if i.opcode == "fusion"}
    chunk = 16384 * F32
    assert _bytes(module, entry, fusions["chunk_fusion"]) == 2 * chunk + 4 + chunk
    assert (_bytes(module, entry, fusions["reduce_fusion"])
            == 8 * 256 * 512 * F32 + 8 * 256 * F32)


def test_cpu_reduce_scatter_prices_like_a_real_reduce_scatter(mesh8):
    # auto-sharded: CPU emits all-reduce + dynamic-slice
    auto = hlo_report(_compile(_matmul, mesh8, [P(None, "x"), P("x", None)], P("x", None), X, W),
                   HW, mesh8)
    # shard_map psum_scatter: a real reduce-scatter op of the same partial product
    f = jax.shard_map(lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True), mesh=mesh8,
                      in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None))
    real = hlo_report(jax.jit(f).lower(X, W).compile(), HW, mesh8)
    (a,), (r,) = auto.collectives, real.collectives
    assert a.kind == r.kind == "reduce-scatter"
    assert (a.num_bytes, a.group_size, a.axes) == (r.num_bytes, r.group_size, r.axes)
    assert a.seconds == r.seconds
    assert a.num_bytes == 64 * 512 * F32


def test_report_helpers(mesh8):
    report = _snippet("while_nested.hlo", mesh8)
    assert isinstance(report, Report)
    assert report.count("reduce-scatter") == 0 and report.collective_bytes("all-to-all") == 0
    assert report.count() == 15
    text = report.summary()
    assert "all-reduce" in text and "x12" in text and "(x)" in text
    d = report.to_dict()
    json.dumps(d)
    assert d["flops"] == report.flops and d["collectives"][0]["axes"] == ["x"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.flops = 0


@CPU_WIDENS_NARROW_DOTS
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rounding_between_a_collective_and_a_dot_is_read_as_such(mesh8, dtype):
    """CPU computes bf16 dots in f32 and rounds each result: the all-reduced partial sum
    of the first dot is rounded in a fusion of its own before the second dot reads it
    (read and written at f32 width); in f32 there is nothing to round."""
    x, w, v = (jnp.ones(s, dtype) for s in ((64, 512), (512, 256), (256, 128)))
    compiled = _compile(lambda x, w, v: (x @ w) @ v, mesh8, (P(None, "x"), P("x", None), P()),
                        P(), x, w, v)
    report = hlo_report(compiled, HW, mesh8)
    assert [c.kind for c in report.collectives] == ["all-reduce"]
    rounded = 2 * 64 * 256 * F32 / HW.hbm_bandwidth if dtype == jnp.bfloat16 else 0.0
    assert report.rounding_s == pytest.approx(rounded)
    assert report.rounding_s < report.compute_s
    assert ("round narrow floats" in report.summary()) == bool(rounded)


def test_all_to_all_num_bytes(mesh2x4):
    f = jax.shard_map(lambda a: jax.lax.all_to_all(a, "model", 0, 1, tiled=True), mesh=mesh2x4,
                      in_specs=P("data", "model"), out_specs=P("data", "model"))
    report = hlo_report(jax.jit(f).lower(jnp.ones((64, 32), jnp.float32)).compile(), HW, mesh2x4)
    (a2a,) = report.collectives
    # the local block f32[32,8] = 1024 bytes, exchanged within each 'model' row
    assert (a2a.kind, a2a.num_bytes, a2a.group_size, a2a.axes) == (
        "all-to-all", 1024, 4, ("model",))
    assert a2a.seconds == pytest.approx(all_to_all_seconds(1024, 4, 5e10, LATENCY))


def test_partition_ids_follow_mesh_device_order():
    # partition i is mesh.devices.flat[i], its coordinates by position, not by device id.
    # Over devices [[0, 4, 1, 5], [2, 6, 3, 7]], the groups {0,4},{1,5},... pair positions
    # (0, j) and (1, j): they differ along data. Read as device ids, devices 0 and 4 sit
    # side by side along model.
    devices = np.array(jax.devices()[:8])[[0, 4, 1, 5, 2, 6, 3, 7]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    (ar,) = _snippet("explicit_groups.hlo", mesh).collectives
    assert ar.axes == ("data",)


ASSIGNMENT = """\
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <0 p0 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 96, preallocated-temp:
 value: <1 a @0> (size=64,offset=0): f32[16]{0}
 value: <2 a.view @0> (size=64,offset=0): f32[16]{0}
 value: <3 b @0> (size=32,offset=64): f32[8]{0}
 value: <4 c @0> (size=48,offset=16): f32[12]{0}
"""
LIVE_RANGES = """\
HloLiveRange (max 4):
  InstructionSequence:
    0:p0
  BufferLiveRange:
    p0{}:0-4
    a{}:1-2
    a.view{}:1-3
    b{}:2-3
    c{}:4-4
"""


def test_bytes_held_together_count_shared_bytes_once():
    # at point 2: the argument (64 B), a and its view (the same 64 B) and b (32 B); at
    # point 4, c reuses a's bytes after it died: 64 + 48
    assert held_together(ASSIGNMENT, LIVE_RANGES) == 64 + 64 + 32


def test_bytes_held_together_lie_between_the_arguments_and_the_allocation():
    def f(x, w):
        h = jnp.tanh(x @ w)
        return jnp.sum(jnp.sin(h) @ w.T)
    x, w = jnp.ones((64, 128)), jnp.ones((128, 256))
    lowered = jax.jit(jax.grad(f, argnums=1)).lower(x, w)
    together, allocated = buffer_bytes(lowered)
    memory = lowered.compile().memory_analysis()
    held = memory.argument_size_in_bytes + memory.output_size_in_bytes
    assert held + 64 * 256 * 4 <= together <= allocated   # the activation h beside them
