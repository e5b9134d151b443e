"""options: the keywords of ``autoshard.plan``, checked and resolved once, in one record.

``plan()`` builds a ``PlanOptions`` from its keywords (``PlanOptions.build``) and hands it
on: the settings search (``settings.py``) weighs microbatches, pipelines and remat with it,
and each traced program is planned with it (``api.plan_program``), the cache key reading
the options a plan depends on from it (``PlanOptions.key_options``).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Sequence
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
    Its fields are where the keywords and their defaults are declared: ``plan`` and
    ``auto_shard`` take them as ``**keywords`` and show them (``keyword_signature``).

    ``pins`` is in either form ``plan`` takes until a program is traced, then in the path
    form (``{path: PartitionSpec}``, ``api.pin_paths``). ``seconds_to_beat`` is the step
    seconds of the best plan the settings search has so far: a plan no faster is not
    wanted (``solve.CannotBeat``); None: every plan is.

    Example::

        options = PlanOptions.build(mesh=mesh, memory_budget=16e9, microbatches="auto")
        options.memory_budget, options.searches_settings   # 16e9, True
    """

    mesh: Mesh
    hardware: Hardware | None = None          # None: the profile of the mesh's devices
    memory_budget: float | None = None        # None: the hardware's memory
    pins: Any = None
    donate_argnums: Sequence[int] = ()
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
    seconds_to_beat: float | None = dataclasses.field(default=None, kw_only=True)

    @classmethod
    def build(cls, num_args: int | None = None, **keywords) -> PlanOptions:
        """``autoshard.plan``'s keywords checked (``plan_options``, ``setting_options``;
        ``num_args``: how many arguments ``donate_argnums`` may name) and resolved."""
        given = cls(**known_keywords(keywords))
        plan_options(given, num_args)
        setting_options(given)
        mesh = as_auto_mesh(given.mesh, stacklevel=4)   # the warning names plan()'s caller
        hardware = given.hardware or default_hardware(mesh)
        budget = hardware.memory if given.memory_budget is None else float(given.memory_budget)
        return dataclasses.replace(
            given, mesh=mesh, hardware=hardware, memory_budget=budget,
            donate_argnums=validate.argnums("donate_argnums", given.donate_argnums))

    @property
    def searches_settings(self) -> bool:
        """Whether the marked loss is rewritten: microbatches, a pipeline or remat asked
        for (``settings.plan_settings``), rather than the program planned as written."""
        return (self.microbatches is not None or self.pipeline is not None
                or self.remat is not None)

    def key_options(self) -> dict[str, Any]:
        """The options a plan of one traced program depends on besides the mesh and the
        hardware, as the cache key spells them (``fingerprint.plan_key``). The settings are not
        among them: they change the program traced. Nor is ``seconds_to_beat``: it decides
        whether a plan is wanted, not which."""
        return {"memory_budget": self.memory_budget,
                "donate_argnums": list(self.donate_argnums),
                "pins": sorted((k, repr(v)) for k, v in (self.pins or {}).items()),
                "time_limit_s": self.time_limit_s, "reuse": self.reuse}


# autoshard.plan's keywords: PlanOptions' fields, less what the settings search sets
KEYWORDS = tuple(f.name for f in dataclasses.fields(PlanOptions) if not f.kw_only)


def known_keywords(keywords: dict[str, Any]) -> dict[str, Any]:
    """``keywords`` where each is one of ``autoshard.plan``'s and ``mesh`` is given, or
    ``OptionError`` naming the culprit (and the keyword it resembles)."""
    for name in keywords:
        if name not in KEYWORDS:
            close = difflib.get_close_matches(name, KEYWORDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise OptionError(f"autoshard.plan() has no keyword {name!r}{hint}; it takes "
                              f"{', '.join(KEYWORDS)}")
    if "mesh" not in keywords:
        raise MeshError("autoshard.plan() needs mesh= (e.g. autoshard.make_mesh((2, 4), "
                        "('data', 'model')))")
    return keywords


def keyword_signature(*leading: inspect.Parameter) -> inspect.Signature:
    """A signature of ``leading`` parameters then the plan keywords, with their defaults:
    what ``help(autoshard.plan)`` and ``auto_shard`` show."""
    keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                  default=inspect.Parameter.empty
                                  if f.default is dataclasses.MISSING else f.default,
                                  annotation=f.type)
                for f in dataclasses.fields(PlanOptions) if f.name in KEYWORDS]
    return inspect.Signature([*leading, *keywords])


def plan_options(options: PlanOptions, num_args: int | None = None) -> None:
    """The keywords of ``autoshard.plan`` and ``autoshard.auto_shard`` but the settings."""
    mesh, hardware, memory_budget = options.mesh, options.hardware, options.memory_budget
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a jax.sharding.Mesh (e.g. autoshard.make_mesh((2, 4), "
                        f"('data', 'model'))), got {validate.type_name(mesh)}")
    validate.mesh_axis_names(mesh.axis_names)
    if hardware is not None and not isinstance(hardware, Hardware):
        raise OptionError("hardware must be an autoshard.Hardware, got "
                          f"{validate.type_name(hardware)}")
    if memory_budget is not None:
        validate.number("memory_budget", memory_budget, positive=True, allow_inf=True)
    validate.pin_options(options.pins)
    validate.argnums("donate_argnums", options.donate_argnums, num_args)
    validate.number("time_limit_s", options.time_limit_s, positive=True)
    validate.flag("reuse", options.reuse)
    validate.flag("cache", options.cache)
    validate.flag("progress", options.progress, allow_none=True)
    if options.cache_directory is not None:
        validate.directory_path("cache_directory", options.cache_directory, create=True)


def setting_options(options: PlanOptions) -> None:
    """The settings of ``autoshard.plan`` (``microbatches``, ``pipeline``, ``remat``,
    ``repeats``) on its mesh."""
    microbatches, pipeline, remat = options.microbatches, options.pipeline, options.remat
    repeats, axis_names = options.repeats, options.mesh.axis_names
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
