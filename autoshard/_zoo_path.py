"""Where ``autoshard.models`` comes from when running from a source checkout.

The zoo lives in the checkout's top-level ``models/`` folder; ``pip install`` maps that
folder onto ``autoshard.models`` (setuptools' ``package-dir``), so installs hold no
top-level ``models`` package. Run from a checkout (``PYTHONPATH`` at its root), there is
no ``autoshard/models`` folder, and this finder names ``models/`` as that package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = "autoshard.models"
_INSTALLED = Path(__file__).parent / "models" / "__init__.py"
_CHECKOUT = Path(__file__).parent.parent / "models" / "__init__.py"


class ZooFinder:
    """A meta path finder for ``autoshard.models`` alone, pointing at ``<checkout>/models``."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname != PACKAGE or _INSTALLED.is_file() or not _CHECKOUT.is_file():
            return None
        return importlib.util.spec_from_file_location(
            PACKAGE, _CHECKOUT, submodule_search_locations=[str(_CHECKOUT.parent)])


if not any(isinstance(f, ZooFinder) or f is ZooFinder for f in sys.meta_path):
    sys.meta_path.insert(0, ZooFinder)
