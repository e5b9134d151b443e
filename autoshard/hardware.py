"""Per-device hardware model: roofline compute and alpha-beta collectives per mesh axis.

The same functions price the planner's choices (``cost``) and the compiled program
(``inspect``), so a prediction and a measurement differ only in what they count.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence


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
        from autoshard import validate
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Hardware":
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


def _ring(group_size: int) -> float:
    return (group_size - 1) / group_size if group_size > 1 else 0.0


def all_reduce_seconds(num_bytes: float, group_size: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of a ``num_bytes`` buffer on every device of the group."""
    if group_size <= 1:
        return 0.0
    return latency + 2 * _ring(group_size) * num_bytes / bandwidth


def all_gather_seconds(num_bytes_out: float, group_size: int, bandwidth: float, latency: float) -> float:
    """All-gather whose result is ``num_bytes_out`` per device."""
    if group_size <= 1:
        return 0.0
    return latency + _ring(group_size) * num_bytes_out / bandwidth


def reduce_scatter_seconds(num_bytes_in: float, group_size: int, bandwidth: float, latency: float) -> float:
    """Reduce-scatter of a ``num_bytes_in`` buffer per device (result is 1/group_size)."""
    if group_size <= 1:
        return 0.0
    return latency + _ring(group_size) * num_bytes_in / bandwidth


def all_to_all_seconds(num_bytes: float, group_size: int, bandwidth: float, latency: float) -> float:
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
