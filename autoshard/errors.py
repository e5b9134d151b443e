"""Errors raised by autoshard. Every one names the culprit."""


class AutoshardError(Exception):
    """Base class of every error autoshard raises on bad input."""


class MeshError(AutoshardError):
    """The mesh cannot be used (wrong axis types, unknown axis names, bad shape)."""


class PinError(AutoshardError):
    """A pin names a path or mesh axis that does not exist, or cannot be honored."""


class InputError(AutoshardError):
    """An argument is not an array-like leaf (or a jax.ShapeDtypeStruct)."""


class MemoryBudgetError(AutoshardError):
    """No plan fits the memory budget; carries the smallest memory the planner reached."""

    def __init__(self, message: str, budget_bytes: float, smallest_bytes: float):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.smallest_bytes = smallest_bytes


class PlanError(AutoshardError):
    """A plan does not match the program or mesh it is used with."""


class OptionError(AutoshardError):
    """A keyword argument has the wrong type or value (a NaN budget, a str time limit)."""


class HardwareError(AutoshardError, ValueError):
    """A ``Hardware`` number is NaN, infinite, zero or negative, or of the wrong type."""


class PathError(AutoshardError):
    """A file or directory autoshard must read or write is missing or not writable."""


class TraceError(AutoshardError):
    """The user's function raised while JAX traced it; ``frame`` is the user's own frame
    (file, line, function) and the original exception is chained as ``__cause__``."""

    def __init__(self, message: str, frame=None):
        super().__init__(message)
        self.frame = frame


class LaunchError(AutoshardError):
    """``autoshard launch`` cannot start the command it was given."""


class CheckpointError(AutoshardError):
    """A checkpoint is missing, or does not fit the state it is restored into."""


class DistributedError(AutoshardError):
    """The processes of a multi-process run cannot start or do not agree."""


class PlanMismatchError(DistributedError):
    """Processes traced different programs, built different meshes or planned differently."""


class UnknownModelError(InputError):
    """A model name or size that the zoo does not have."""
