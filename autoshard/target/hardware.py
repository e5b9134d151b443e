"""Per-device hardware model: roofline compute and alpha-beta collectives per mesh axis.

The same functions price the planner's choices (``cost``) and the compiled program
(``hlo_report``), so a prediction and a measurement differ only in what they count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one device can do, and how fast each mesh axis moves bytes.

    Example::

        hw = autoshard.Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                                link_bandwidth={"data": 4e10, "model": 3.6e11},
                                link_latency=1e-5)

    ``link_bandwidth`` is bytes/s per device along each mesh axis; a float applies to
    every axis. Axes missing from a mapping use ``default_link_bandwidth``.
    """

    flops: float = 4.9e14
    hbm_bandwidth: float = 2.7e12
    memory: float = 80e9
    link_bandwidth: Mapping[str, float] | float = 3.6e11
    link_latency: float = 1e-5
    default_link_bandwidth: float = 3.6e11

    def __post_init__(self):
        if isinstance(self.link_bandwidth, Mapping):
            object.__setattr__(self, "link_bandwidth", dict(self.link_bandwidth))
        from autoshard.frontend import validate
        validate.hardware_fields(self)

    def bandwidth(self, axis_name: str) -> float:
        """Bytes/s one device moves along ``axis_name``."""
        if isinstance(self.link_bandwidth, (int, float)):
            return float(self.link_bandwidth)
        return float(self.link_bandwidth.get(axis_name, self.default_link_bandwidth))

    def group_bandwidth(self, axis_names: Sequence[str]) -> float:
        """A collective over several axes runs at the slowest of their links."""
        return min(self.bandwidth(a) for a in axis_names) if axis_names else float("inf")

    def compute_seconds(self, flops: float, num_bytes: float) -> float:
        """Roofline time of an op doing ``flops`` and touching ``num_bytes`` of HBM."""
        return max(flops / self.flops, num_bytes / self.hbm_bandwidth)

    def slowed(self, factor: float) -> Hardware:
        """This device with ``factor`` times less FLOP/s and bandwidth; memory and latency
        unchanged. A model ``factor`` times smaller then weighs on it about as the full
        model weighs on the real device.

        Example::

            H100.slowed(1000).flops   # 4.9e11
        """
        links = (self.link_bandwidth / factor if isinstance(self.link_bandwidth, (int, float))
                 else {k: v / factor for k, v in self.link_bandwidth.items()})
        return dataclasses.replace(self, flops=self.flops / factor,
                                   hbm_bandwidth=self.hbm_bandwidth / factor,
                                   link_bandwidth=links,
                                   default_link_bandwidth=self.default_link_bandwidth / factor)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Hardware:
        from autoshard.errors import HardwareError
        if not isinstance(d, Mapping):
            raise HardwareError(f"hardware must be a mapping of Hardware fields, got "
                                f"{type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise HardwareError(f"hardware has unknown fields {unknown}; fields: "
                                f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**d)


H100 = Hardware(flops=4.9e14, hbm_bandwidth=2.7e12, memory=80e9,
                link_bandwidth=3.6e11, link_latency=1e-5)


def _gpu(peak_flops: float, hbm_bandwidth: float, memory: float, link_bandwidth: float) -> Hardware:
    """Sustained figures from a data sheet: half the dense bf16 peak, 80 % of the HBM and
    per-GPU NVLink (or PCIe) bandwidth, as the ``H100`` profile takes them."""
    return Hardware(flops=0.5 * peak_flops, hbm_bandwidth=0.8 * hbm_bandwidth, memory=memory,
                    link_bandwidth=0.8 * link_bandwidth, link_latency=1e-5,
                    default_link_bandwidth=0.8 * link_bandwidth)


# JAX's ``device.device_kind`` (lower case) -> per-device profile; the first key contained
# in the kind wins, so the more specific names come first.
DEVICE_KINDS: dict[str, Hardware] = {
    "gh200": _gpu(9.89e14, 4.0e12, 96e9, 4.5e11),
    "h200": _gpu(9.89e14, 4.8e12, 141e9, 4.5e11),
    "h100 pcie": _gpu(7.56e14, 2.0e12, 80e9, 6.4e10),
    "h100": H100,
    "h800": _gpu(9.89e14, 3.35e12, 80e9, 2.0e11),
    "b200": _gpu(2.25e15, 8.0e12, 180e9, 9.0e11),
    "a100-sxm4-40gb": _gpu(3.12e14, 1.555e12, 40e9, 3.0e11),
    "a100-pcie-40gb": _gpu(3.12e14, 1.555e12, 40e9, 3.2e10),
    "a100 80gb pcie": _gpu(3.12e14, 1.935e12, 80e9, 3.2e10),
    "a100": _gpu(3.12e14, 2.039e12, 80e9, 3.0e11),
    "a10g": _gpu(1.25e14, 6.0e11, 24e9, 3.2e10),
    "l40s": _gpu(3.62e14, 8.64e11, 48e9, 3.2e10),
    "l4": _gpu(1.21e14, 3.0e11, 24e9, 3.2e10),
    "v100": _gpu(1.25e14, 9.0e11, 32e9, 1.5e11),
}

INTER_NODE_BANDWIDTH = 4e10
"""Bytes/s per device along a mesh axis whose devices sit in different processes (hosts):
80 % of a 400 Gb/s network link per GPU."""


def device_kind_hardware(device_kind: str) -> Hardware | None:
    """The profile of a JAX ``device_kind`` such as ``"NVIDIA H100 80GB HBM3"``; None if unknown.

    Example::

        device_kind_hardware("NVIDIA A100-SXM4-40GB").memory   # 4e10
    """
    kind = device_kind.lower()
    return next((hw for key, hw in DEVICE_KINDS.items() if key in kind), None)


def _crosses_processes(mesh, axis: int) -> bool:
    """Whether devices along mesh axis ``axis`` belong to more than one process."""
    import numpy as np
    ids = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return bool((np.moveaxis(ids, axis, -1) != np.moveaxis(ids, axis, -1)[..., :1]).any())


def default_hardware(mesh=None) -> Hardware:
    """The hardware of ``mesh``'s devices, from their kind (H100, H200, A100, ...).

    Axes whose devices span processes (hosts) get ``INTER_NODE_BANDWIDTH``; memory is what
    the device reports where it reports it. Devices of unknown kind (CPU included) get the
    ``H100`` profile.

    Example::

        hw = default_hardware(autoshard.make_mesh((2, 8), ("data", "model")))
    """
    if mesh is None:
        return H100
    device = mesh.devices.flat[0]
    hw = device_kind_hardware(getattr(device, "device_kind", ""))
    if hw is None:
        return H100
    links = {name: INTER_NODE_BANDWIDTH if _crosses_processes(mesh, i) else hw.bandwidth(name)
             for i, name in enumerate(mesh.axis_names)}
    return dataclasses.replace(hw, link_bandwidth=links, memory=_reported_memory(device, hw))


# Collective kinds each backend's XLA combines when they are independent of each other.
COMBINED_COLLECTIVES = {"cpu": ("all-reduce",),
                        "gpu": ("all-reduce", "all-gather", "reduce-scatter"),
                        "tpu": ("all-reduce", "all-gather", "reduce-scatter")}


@dataclasses.dataclass(frozen=True)
class Backend:
    """What the backend's XLA does to a partitioned program that its price depends on,
    beside the device's speeds (:class:`Hardware`).

    ``combined``: the collective kinds XLA combines when they are independent of each
    other. ``collective_itemsize``: the bytes per element its collectives move narrower
    floats at (CPU XLA converts bf16 and f16 to f32 around every all-reduce, all-gather,
    all-to-all and collective-permute, doubling their bytes; 0: the dtype's own).
    ``contraction_itemsize``: the bytes per element its dots and convolutions run
    narrower floats at (CPU XLA runs them in f32, so what they read and write is stored
    in f32: ``xla.stored_widening``; 0: the dtype's own). ``native_reduce_scatter``:
    whether XLA forms reduce-scatter (CPU all-reduces and keeps a slice).
    ``all_reduce_copies``: how many times XLA copies a combined all-reduce's bytes (GPU:
    into one buffer, and back out by slices: ``xla.combined_all_reduce_copies``).
    ``duplicated``: the expensive elementwise primitives XLA computes again in each
    fusion reading them instead of holding their result (GPU: tanh, exp, ...:
    ``xla.duplicated_elementwise``). ``broadcast_ops_written``: whether XLA writes
    an elementwise op that reads a broadcast (a layer norm's x - mean, its rsqrt(var)
    times its scale) to memory for the fusions reading it (CPU), or computes it again
    in each (GPU: ``xla.broadcast_ops_written``). ``widened_contractions``: the
    primitives XLA runs on narrow floats at ``contraction_itemsize`` in memory too: each
    narrow operand held in memory is read through a wide copy, each result written wide
    (CPU: ``xla.cpu_widened_contractions``).
    ``whole_primitives``: the primitives XLA's partitioner computes whole whatever their
    specs, gathering their operands (CPU: top_k, ``xla.cpu_partitions_top_k``)."""

    platform: str
    combined: tuple[str, ...]
    collective_itemsize: int
    native_reduce_scatter: bool
    contraction_itemsize: int = 0
    all_reduce_copies: int = 0
    duplicated: frozenset[str] = frozenset()
    broadcast_ops_written: bool = True
    widened_contractions: tuple[str, ...] = ()
    whole_primitives: tuple[str, ...] = ()

    @property
    def merges_all_gathers(self) -> bool:
        """Whether the combiner merges all-gathers (XLA:GPU's, not XLA:CPU's)."""
        return "all-gather" in self.combined

    def combined_as(self, kind: str, trailing: bool = False) -> str | None:
        """The kind XLA's combiner merges a collective of ``kind`` into, None where it
        leaves it alone. Without reduce-scatter a reduce-scatter is an all-reduce whose
        slice is kept: at the end of a computation (``trailing``: a gradient's) it joins
        the combined all-reduce there."""
        if kind == "reduce-scatter" and not self.native_reduce_scatter and trailing:
            kind = "all-reduce"
        return kind if kind in self.combined else None

    @classmethod
    def bare(cls) -> Backend:
        """A backend that combines nothing, reduces each dtype at its own width and forms
        reduce-scatter: the plain prices of hand-built programs."""
        return cls(platform="bare", combined=(), collective_itemsize=0,
                   native_reduce_scatter=True)

    @classmethod
    def of(cls, mesh) -> Backend:
        """The backend ``mesh``'s devices run on."""
        platform = mesh.devices.flat[0].platform
        family = "gpu" if platform in ("cuda", "rocm") else platform
        from autoshard.target.xla import (
            broadcast_ops_written,
            combined_all_reduce_copies,
            cpu_partitions_top_k,
            cpu_widened_contractions,
            duplicated_elementwise,
        )
        cpu = family == "cpu"
        return cls(platform=family, combined=COMBINED_COLLECTIVES.get(family, ()),
                   collective_itemsize=4 if cpu else 0,
                   native_reduce_scatter=not cpu,
                   contraction_itemsize=4 if cpu else 0,
                   all_reduce_copies=combined_all_reduce_copies(mesh.devices.flat)
                   if family == "gpu" else 0,
                   # read for GPUs only: the probe says XLA:CPU duplicates exp and float
                   # division too, which the CPU memory tables have not been checked on
                   duplicated=duplicated_elementwise(mesh.devices.flat)
                   if family == "gpu" else frozenset(),
                   broadcast_ops_written=broadcast_ops_written(mesh.devices.flat),
                   widened_contractions=cpu_widened_contractions() if cpu else (),
                   whole_primitives=("top_k",) if cpu and not cpu_partitions_top_k() else ())


def _reported_memory(device, hw: Hardware) -> float:
    try:
        stats = device.memory_stats() or {}
    except Exception:           # backends without memory_stats raise various errors
        stats = {}
    return float(stats.get("bytes_limit", hw.memory))


def _ring(group_size: int) -> float:
    return (group_size - 1) / group_size if group_size > 1 else 0.0


def all_reduce_seconds(num_bytes: float, group_size: int, bandwidth: float,
                       latency: float) -> float:
    """Ring all-reduce of a ``num_bytes`` buffer on every device of the group."""
    if group_size <= 1:
        return 0.0
    return latency + 2 * _ring(group_size) * num_bytes / bandwidth


def all_gather_seconds(num_bytes_out: float, group_size: int, bandwidth: float,
                       latency: float) -> float:
    """All-gather whose result is ``num_bytes_out`` per device."""
    if group_size <= 1:
        return 0.0
    return latency + _ring(group_size) * num_bytes_out / bandwidth


def reduce_scatter_seconds(num_bytes_in: float, group_size: int, bandwidth: float,
                           latency: float) -> float:
    """Reduce-scatter of a ``num_bytes_in`` buffer per device (result is 1/group_size)."""
    if group_size <= 1:
        return 0.0
    return latency + _ring(group_size) * num_bytes_in / bandwidth


def all_to_all_seconds(num_bytes: float, group_size: int, bandwidth: float,
                       latency: float) -> float:
    """All-to-all of a ``num_bytes`` buffer per device: each sends (n-1)/n of it."""
    if group_size <= 1:
        return 0.0
    return latency + _ring(group_size) * num_bytes / bandwidth


def collective_permute_seconds(num_bytes: float, bandwidth: float, latency: float) -> float:
    """Point-to-point send of ``num_bytes`` per device."""
    return latency + num_bytes / bandwidth


COLLECTIVE_SECONDS = {
    "all-reduce": all_reduce_seconds,
    "all-gather": all_gather_seconds,
    "reduce-scatter": reduce_scatter_seconds,
    "all-to-all": all_to_all_seconds,
}


def collective_seconds(kind: str, num_bytes: float, group_size: int, bandwidth: float,
                       latency: float) -> float:
    """Price one collective by kind. ``num_bytes`` is as each function above defines it."""
    if kind == "collective-permute":
        return collective_permute_seconds(num_bytes, bandwidth, latency)
    return COLLECTIVE_SECONDS[kind](num_bytes, group_size, bandwidth, latency)
