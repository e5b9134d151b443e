"""Markers for tests of one XLA release's habits, read from compiled programs."""

import pytest

from autoshard.target.xla import cpu_contraction_itemsize

# XLA:CPU's habits around bf16 dots as jax 0.10's XLA has them (f32 operands, results,
# stacked residuals and roundings); jax 0.12's runs bf16 dots at bf16, which the cost
# model does not read yet
CPU_WIDENS_NARROW_DOTS = pytest.mark.skipif(
    cpu_contraction_itemsize() == 0, reason="this XLA:CPU runs bf16 dots at bf16")
