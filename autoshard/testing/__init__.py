"""Test helpers for autoshard: example programs with known-good numerics.

See :mod:`autoshard.testing.programs`.
"""

from autoshard.testing import programs
from autoshard.testing.programs import RTOL, Program, all_programs

__all__ = ["RTOL", "Program", "all_programs", "programs"]
