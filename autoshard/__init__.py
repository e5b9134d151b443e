"""autoshard: automatic sharding for JAX programs.

    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    plan = autoshard.plan(train_step, params, opt_state, batch, mesh=mesh)
    plan.summary()
    step = plan.jit(donate_argnums=(0, 1))
"""

from autoshard import _zoo_path  # noqa: F401  (installs the zoo finder)
from autoshard.target import allow_deviceless_cuda, target_mesh

allow_deviceless_cuda()   # before JAX's backend starts: GPU targets compile on any machine

from autoshard.accumulate import value_and_grad
from autoshard.api import AutoSharded, auto_shard, plan
from autoshard.errors import (AutoshardError, HardwareError, InputError, LaunchError,
                              MemoryBudgetError, MeshError, OptionError, PathError, PinError,
                              PlanError, TraceError)
from autoshard.hardware import H100, Hardware
from autoshard.mesh import make_mesh
from autoshard.plan import Plan, PlanCost

__all__ = ["AutoSharded", "AutoshardError", "H100", "Hardware", "HardwareError", "InputError",
           "LaunchError", "MemoryBudgetError", "MeshError", "OptionError", "PathError", "PinError",
           "Plan", "PlanCost", "PlanError", "TraceError", "auto_shard", "make_mesh", "plan",
           "target_mesh", "value_and_grad"]
__version__ = "0.1.0"
