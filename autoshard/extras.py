"""Optional parts of autoshard and the pip extras that install them.

    pip install "autoshard[zoo]"         # flax, optax: autoshard.zoo.models and `autoshard zoo`
    pip install "autoshard[checkpoint]"  # orbax: autoshard.runtime.checkpoint
    pip install "autoshard[viz]"         # matplotlib: plots in autoshard.report.viz
    pip install "autoshard[cuda]"        # JAX's CUDA 12 build

Planning itself needs only jax, numpy, scipy and rich.
"""

from __future__ import annotations

import importlib.util


class MissingExtraError(ImportError):
    """An optional part of autoshard is used without the pip extra that installs it."""


def require(module_name: str, extra: str, part: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` unless ``module_name`` is installed.

    Example::

        require("flax", "zoo", "autoshard.zoo.models")
        # MissingExtraError: autoshard.zoo.models needs flax: pip install "autoshard[zoo]"
    """
    try:
        found = importlib.util.find_spec(module_name) is not None
    except ImportError:        # the parent of a dotted name is missing
        found = False
    if not found:
        raise MissingExtraError(f'{part} needs {module_name}: pip install "autoshard[{extra}]"',
                                name=module_name)
