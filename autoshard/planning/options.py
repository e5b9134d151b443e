"""options: the keywords of ``autoshard.plan``, checked and resolved once, in one record.

``plan()`` builds a ``PlanOptions`` from its keywords (``PlanOptions.build``) and hands it
on: the settings search (``settings.py``) weighs microbatches, pipelines and remat with it,
and each traced program is planned with it (``api.plan_program``), the cache key reading
the options a plan depends on from it (``PlanOptions.key_options``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from autoshard.errors import InputError, MeshError, OptionError
from autoshard.frontend import validate
from autoshard.rewrite.pipeline import REMAT_POLICIES
from autoshard.target.hardware import Hardware, default_hardware
from autoshard.target.mesh import as_auto_mesh


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How to plan: ``autoshard.plan``'s keywords, checked, with the defaults resolved
    (the mesh's axes Auto, the hardware of its devices, the budget the hardware's memory).

    ``pins`` is in either form ``plan`` takes until a program is traced, then in the path
    form (``{path: PartitionSpec}``, ``api.pin_paths``). ``seconds_to_beat`` is the step
    seconds of the best plan the settings search has so far: a plan no faster is not
    wanted (``solve.CannotBeat``); None: every plan is.

    Example::

        options = PlanOptions.build(mesh=mesh, memory_budget=16e9, microbatches="auto")
        options.memory_budget, options.searches_settings   # 16e9, True
    """

    mesh: Mesh
    hardware: Hardware
    memory_budget: float
    pins: Any = None
    donate_argnums: tuple[int, ...] = ()
    time_limit_s: float = 60.0
    reuse: bool = True
    cache: bool = True
    cache_directory: str | os.PathLike | None = None
    progress: bool | None = None
    # the settings searched over (``settings.py``): the marked loss's program transforms
    microbatches: int | str | None = None
    pipeline: str | None = None
    remat: str | None = None
    repeats: int | str | None = None
    seconds_to_beat: float | None = None

    @classmethod
    def build(cls, *, mesh: Mesh, hardware: Hardware | None = None,
              memory_budget: float | None = None, pins: Mapping[str, Any] | None = None,
              donate_argnums: Sequence[int] = (), time_limit_s: float = 60.0,
              reuse: bool = True, cache: bool = True,
              cache_directory: str | os.PathLike | None = None,
              progress: bool | None = None, microbatches: int | str | None = None,
              pipeline: str | None = None, remat: str | None = None,
              repeats: int | str | None = None, num_args: int | None = None) -> PlanOptions:
        """``autoshard.plan``'s keywords checked (``plan_options``,
        ``setting_options``; ``num_args``: how many arguments ``donate_argnums``
        may name) and resolved."""
        plan_options(mesh=mesh, hardware=hardware, memory_budget=memory_budget,
                              pins=pins, donate_argnums=donate_argnums,
                              time_limit_s=time_limit_s, reuse=reuse, cache=cache,
                              cache_directory=cache_directory, progress=progress,
                              num_args=num_args)
        setting_options(microbatches=microbatches, pipeline=pipeline, remat=remat,
                                 repeats=repeats, axis_names=mesh.axis_names)
        mesh = as_auto_mesh(mesh, stacklevel=4)   # the warning names plan()'s caller
        hardware = hardware or default_hardware(mesh)
        return cls(mesh=mesh, hardware=hardware,
                   memory_budget=hardware.memory if memory_budget is None
                   else float(memory_budget),
                   pins=pins, donate_argnums=validate.argnums("donate_argnums", donate_argnums),
                   time_limit_s=time_limit_s, reuse=reuse, cache=cache,
                   cache_directory=cache_directory, progress=progress,
                   microbatches=microbatches, pipeline=pipeline, remat=remat, repeats=repeats)

    @property
    def searches_settings(self) -> bool:
        """Whether the marked loss is rewritten: microbatches, a pipeline or remat asked
        for (``settings.plan_settings``), rather than the program planned as written."""
        return (self.microbatches is not None or self.pipeline is not None
                or self.remat is not None)

    def key_options(self) -> dict[str, Any]:
        """The options a plan of one traced program depends on besides the mesh and the
        hardware, as the cache key spells them (``cache.plan_key``). The settings are not
        among them: they change the program traced. Nor is ``seconds_to_beat``: it decides
        whether a plan is wanted, not which."""
        return {"memory_budget": self.memory_budget,
                "donate_argnums": list(self.donate_argnums),
                "pins": sorted((k, repr(v)) for k, v in (self.pins or {}).items()),
                "time_limit_s": self.time_limit_s, "reuse": self.reuse}


def plan_options(*, mesh, hardware, memory_budget, pins, donate_argnums, time_limit_s,
                 reuse, cache, cache_directory, progress, num_args: int | None = None) -> None:
    """The keywords of ``autoshard.plan`` and ``autoshard.auto_shard``."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a jax.sharding.Mesh (e.g. autoshard.make_mesh((2, 4), "
                        f"('data', 'model'))), got {validate.type_name(mesh)}")
    validate.mesh_axis_names(mesh.axis_names)
    if hardware is not None and not isinstance(hardware, Hardware):
        raise OptionError("hardware must be an autoshard.Hardware, got "
                          f"{validate.type_name(hardware)}")
    if memory_budget is not None:
        validate.number("memory_budget", memory_budget, positive=True, allow_inf=True)
    validate.pin_options(pins)
    validate.argnums("donate_argnums", donate_argnums, num_args)
    validate.number("time_limit_s", time_limit_s, positive=True)
    validate.flag("reuse", reuse)
    validate.flag("cache", cache)
    validate.flag("progress", progress, allow_none=True)
    if cache_directory is not None:
        validate.directory_path("cache_directory", cache_directory, create=True)


def setting_options(*, microbatches, pipeline, remat, repeats, axis_names) -> None:
    """The settings of ``autoshard.plan`` (``microbatches``, ``pipeline``, ``remat``,
    ``repeats``) on a mesh with axes ``axis_names``."""
    if repeats is not None and pipeline is None:
        raise InputError(f"repeats={repeats!r} sets a pipeline's schedule: pass pipeline= "
                         "too")
    if pipeline is not None and pipeline != "auto" and pipeline not in axis_names:
        raise InputError(f"pipeline names mesh axis {pipeline!r}; the mesh has "
                         f"{list(axis_names)} (or pass 'auto')")
    validate.count_or_auto("microbatches", microbatches)
    validate.count_or_auto("repeats", repeats, " (1: GPipe, V >= 2: the circular schedule)")
    if remat not in (None, "auto") and remat not in REMAT_POLICIES:
        raise InputError(f"remat must be None, 'auto' or one of {sorted(REMAT_POLICIES)}, "
                         f"not {remat!r}")
