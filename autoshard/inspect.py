"""Deprecated: the module is ``autoshard.hlo_report`` (this name shadowed the standard
library's ``inspect``), and ``autoshard.inspect.inspect`` is
``autoshard.hlo_report.hlo_report``. Importing this module warns."""

import warnings

from autoshard.hlo_report import *  # noqa: F401,F403
from autoshard.hlo_report import CompiledCollective as Collective  # noqa: F401
from autoshard.hlo_report import hlo_report as inspect  # noqa: F401

warnings.warn("autoshard.inspect is now autoshard.hlo_report (autoshard.inspect.inspect is "
              "autoshard.hlo_report.hlo_report)", DeprecationWarning, stacklevel=2)
