"""cost.kept: what a process keeps between the cost graphs it builds, per Hardware.

The programs one plan weighs (its pricings of copies, its microbatch and remat settings),
and later plans, reshard arrays of the same shapes between the same specs and repeat
most of their equations. Their reshard seconds (``reshard.ReshardPrices``) and their
nodes' strategies (``strategies.build_strategies``) are kept here, each in a store per
Hardware: by its id, the object kept alongside so that its id stays its own.
"""

from __future__ import annotations

from autoshard.target.hardware import Hardware

HARDWARE_MAX = 8   # Hardware kept for, at most, per store

_STORES: dict[str, dict[int, tuple[Hardware, dict]]] = {}


def kept(store: str, hw: Hardware, most: int) -> dict:
    """The dict ``store`` keeps for ``hw``: emptied once it holds more than ``most``
    entries, and every Hardware's once ``HARDWARE_MAX`` are kept."""
    by_hw = _STORES.setdefault(store, {})
    found = by_hw.get(id(hw))
    if found is None or found[0] is not hw or len(found[1]) > most:
        if len(by_hw) >= HARDWARE_MAX:
            by_hw.clear()
        found = by_hw[id(hw)] = (hw, {})
    return found[1]


def forget() -> None:
    """Drop every store."""
    _STORES.clear()
