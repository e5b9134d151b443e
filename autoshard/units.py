"""units: how sizes and times are written for people, and a mesh's axis sizes.

Every view, table and message spells bytes and seconds through these functions, so a
figure reads the same wherever it is shown.

Example::

    format_bytes(3 * 2**20)     # '3.0 MiB'
    format_seconds(2.5e-6)      # '2.50 µs'
    axis_sizes(mesh)            # {'data': 2, 'model': 4}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.sharding import Mesh

BINARY_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def format_bytes(num_bytes: float) -> str:
    """``format_bytes(3 * 2**20) == "3.0 MiB"``; whole bytes below 1 KiB (``"512 B"``)."""
    value = float(num_bytes)
    for scale, unit in BINARY_UNITS:
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def format_seconds(seconds: float) -> str:
    """``format_seconds(2.5e-6) == "2.50 µs"``."""
    s = abs(seconds)
    if s == 0:
        return "0 s"
    if s >= 1:
        return f"{seconds:.3g} s"
    for scale, unit in ((1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")):
        if s >= scale or unit == "ns":
            return f"{seconds / scale:.2f} {unit}"
    return f"{seconds:.3g} s"


def time_unit(max_seconds: float) -> tuple[float, str]:
    """(scale, unit) that puts ``max_seconds`` in a readable range for a plot's axis."""
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if max_seconds >= scale:
            return scale, unit
    return 1e-9, "ns"


def bytes_unit(max_bytes: float) -> tuple[float, str]:
    """(scale, unit) that puts ``max_bytes`` in a readable range for a plot's axis."""
    for scale, unit in BINARY_UNITS:
        if max_bytes >= scale:
            return scale, unit
    return 1, "B"


def axis_sizes(mesh: Mesh) -> dict[str, int]:
    """``{axis_name: size}`` of a mesh, in its axis order."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def mesh_str(mesh: Mesh) -> str:
    """``"2data×4model"``."""
    return "×".join(f"{n}{name}" for name, n in axis_sizes(mesh).items())
