"""autoshard: automatic sharding for JAX programs.

    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    plan = autoshard.plan(train_step, params, opt_state, batch, mesh=mesh)
    plan.summary()
    step = plan.jit(donate_argnums=(0, 1))
"""

from autoshard.target.deviceless import allow_deviceless_cuda, target_mesh

allow_deviceless_cuda()   # before JAX's backend starts: GPU targets compile on any machine

from autoshard.errors import (
    AutoshardError,
    CheckpointError,
    DistributedError,
    HardwareError,
    InputError,
    LaunchError,
    MemoryBudgetError,
    MeshError,
    OptionError,
    PathError,
    PinError,
    PlanError,
    PlanMismatchError,
    TraceError,
)
from autoshard.planning.api import AutoSharded, auto_shard, plan
from autoshard.planning.plan import Plan, PlanCost
from autoshard.rewrite.accumulate import value_and_grad
from autoshard.target.hardware import H100, Hardware
from autoshard.target.mesh import make_mesh

__all__ = ["AutoSharded", "AutoshardError", "CheckpointError", "DistributedError", "H100",
           "Hardware", "HardwareError", "InputError", "LaunchError", "MemoryBudgetError",
           "MeshError", "OptionError", "PathError", "PinError", "Plan", "PlanCost", "PlanError",
           "PlanMismatchError", "TraceError", "auto_shard", "make_mesh", "plan", "target_mesh",
           "value_and_grad"]
__version__ = "0.1.0"
