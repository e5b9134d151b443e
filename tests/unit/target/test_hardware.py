"""Hardware profiles by device kind, and the defaults taken from a mesh's devices."""

import dataclasses

import numpy as np
import pytest

import autoshard
from autoshard.target import hardware
from autoshard.target.hardware import H100, default_hardware, device_kind_hardware


@pytest.mark.parametrize("kind,memory", [
    ("NVIDIA H100 80GB HBM3", 80e9),
    ("NVIDIA H200", 141e9),
    ("NVIDIA A100-SXM4-40GB", 40e9),
    ("NVIDIA A100-SXM4-80GB", 80e9),
    ("NVIDIA L4", 24e9),
])
def test_device_kinds_name_their_profile(kind, memory):
    hw = device_kind_hardware(kind)
    assert hw is not None and hw.memory == memory


def test_more_specific_kinds_win():
    assert device_kind_hardware("NVIDIA H100 80GB HBM3") is H100
    pcie = device_kind_hardware("NVIDIA H100 PCIe")
    assert pcie.bandwidth("x") < H100.bandwidth("x") and pcie.flops < H100.flops
    assert device_kind_hardware("NVIDIA H200").hbm_bandwidth > H100.hbm_bandwidth
    assert device_kind_hardware("cpu") is None and device_kind_hardware("TFRT_CPU_0") is None


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    device_kind: str
    process_index: int
    bytes_limit: int | None = None
    platform: str = "gpu"

    def memory_stats(self):
        return None if self.bytes_limit is None else {"bytes_limit": self.bytes_limit}


@dataclasses.dataclass
class FakeMesh:
    devices: np.ndarray
    axis_names: tuple


def fake_mesh(kind, shape, names, devices_per_process, bytes_limit=None):
    flat = [FakeDevice(kind, i // devices_per_process, bytes_limit)
            for i in range(int(np.prod(shape)))]
    return FakeMesh(np.array(flat, dtype=object).reshape(shape), names)


def test_default_hardware_from_the_device_kind():
    mesh = fake_mesh("NVIDIA H200", (2, 8), ("data", "model"), devices_per_process=8,
                     bytes_limit=int(100e9))
    hw = default_hardware(mesh)
    assert hw.flops == device_kind_hardware("NVIDIA H200").flops
    assert hw.memory == 100e9                              # what the device reports
    assert hw.bandwidth("data") == hardware.INTER_NODE_BANDWIDTH   # crosses hosts
    assert hw.bandwidth("model") == device_kind_hardware("NVIDIA H200").bandwidth("model")


def test_one_host_keeps_nvlink_on_every_axis():
    hw = default_hardware(fake_mesh("NVIDIA A100-SXM4-80GB", (2, 4), ("data", "model"), 8))
    a100 = device_kind_hardware("NVIDIA A100-SXM4-80GB")
    assert hw.bandwidth("data") == hw.bandwidth("model") == a100.bandwidth("x")
    assert hw.memory == 80e9                               # no memory_stats: the table's


def test_unknown_kinds_and_cpu_default_to_h100(mesh_2d):
    assert default_hardware(fake_mesh("Some Accelerator", (8,), ("data",), 8)) is H100
    assert default_hardware(mesh_2d) is H100
    assert default_hardware(None) is H100


def test_backend_facts_follow_the_platform(mesh_2d):
    cpu = hardware.Backend.of(mesh_2d)
    # XLA:CPU combines only all-reduces, reduces bf16 in f32, and all-reduces then slices
    assert (cpu.platform, cpu.combined, cpu.collective_itemsize, cpu.native_reduce_scatter) \
        == ("cpu", ("all-reduce",), 4, False)
    # its reduce-scatters are all-reduces: a gradient's joins the combined one at the end
    assert cpu.combined_as("reduce-scatter", trailing=True) == "all-reduce"
    assert cpu.combined_as("reduce-scatter") is None
    assert cpu.combined_as("all-gather", trailing=True) is None
    for platform in ("cuda", "rocm", "gpu"):
        mesh = fake_mesh("NVIDIA H100 80GB HBM3", (8,), ("data",), 8)
        mesh.devices.flat[0] = dataclasses.replace(mesh.devices.flat[0], platform=platform)
        gpu = hardware.Backend.of(mesh)
        assert gpu.platform == "gpu" and gpu.native_reduce_scatter
        assert set(gpu.combined) == {"all-reduce", "all-gather", "reduce-scatter"}
        assert gpu.combined_as("reduce-scatter", trailing=True) == "reduce-scatter"
        assert gpu.collective_itemsize == 0                # moves the program's dtype


def test_plan_defaults_to_the_mesh_hardware(mesh_2d):
    import jax.numpy as jnp
    plan = autoshard.plan(lambda x: x * 2, jnp.ones((8, 8)), mesh=mesh_2d)
    assert plan.hardware == H100                           # CPU devices: the H100 profile


def test_slowed_divides_speeds_only():
    hw = dataclasses.replace(H100, link_bandwidth={"data": 4e10}).slowed(1000)
    assert hw.flops == H100.flops / 1000 and hw.hbm_bandwidth == H100.hbm_bandwidth / 1000
    assert hw.bandwidth("data") == 4e7 and hw.bandwidth("other") == H100.bandwidth("x") / 1000
    assert hw.memory == H100.memory and hw.link_latency == H100.link_latency
