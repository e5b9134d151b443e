"""plan: the solver's choice turned into specs, shardings, a cost breakdown and views.

A ``Plan`` is self-contained: specs per argument and output, the constraints ``apply``
inserts (keyed by equation path), the predicted cost and, per argument, why its spec won
(the runner-up specs and what each would cost). It round-trips through JSON exactly.
``Plan.from_solution`` builds it from what the solve stage hands over (a ``Solution``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import time
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from autoshard.cost import CostGraph, operand_reshard_seconds
from autoshard.cost.breakdown import CostItem, cost_breakdown, memory_parts
from autoshard.errors import AutoshardError, MeshError, PlanError
from autoshard.frontend import specs, validate
from autoshard.frontend.specs import Spec
from autoshard.frontend.trace import argument_names, static_as_none
from autoshard.planning.fingerprint import program_fingerprint
from autoshard.rewrite.apply import Decision, make_jit, propagation_gives
from autoshard.solver.request import Evaluation
from autoshard.target.hardware import Hardware
from autoshard.units import axis_sizes, format_bytes

if TYPE_CHECKING:
    from autoshard.planning.options import PlanOptions

FORMAT_VERSION = 2   # 2: "stats" (PlanStats) in place of the "solver" dict
ALTERNATIVES_SHOWN = 4   # runner-up specs kept per argument


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """Predicted per-device cost of one call: seconds and peak bytes."""

    compute_s: float
    comm_s: float
    memory_bytes: float
    reshard_s: float = 0.0   # the part of comm_s spent resharding between operations

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


STAGES = ("trace", "cost", "coarsen", "solve")   # the planner's stages after make_jaxpr


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """How a plan was found: the solver's outcome, the problem's size, seconds per stage.

    ``status``: optimal | priced | time_limit | greedy | trivial (``solve.Result``);
    ``objective_s``, ``tiebreak_s``, ``lower_bound_s``: the solved objective, its memory
    tiebreak and the solver's bound; ``groups``, ``solved_groups`` (after coarsening),
    ``nodes``, ``edges``: the problem's size; ``trace_s`` ... ``solve_s``: each stage's
    seconds, ``jaxpr_s`` JAX's trace, ``plan_s`` the whole call; ``cache``: where a
    cached plan came from (None: solved now); ``settings``: each setting the settings
    search tried (``settings.py``), with its outcome and seconds.
    """

    status: str | None = None
    objective_s: float | None = None
    tiebreak_s: float | None = None
    lower_bound_s: float | None = None
    groups: int | None = None
    solved_groups: int | None = None
    nodes: int | None = None
    edges: int | None = None
    trace_s: float | None = None
    cost_s: float | None = None
    coarsen_s: float | None = None
    solve_s: float | None = None
    jaxpr_s: float | None = None
    plan_s: float | None = None
    cache: str | None = None
    settings: tuple[Mapping[str, Any], ...] = ()

    def stage_seconds(self) -> dict[str, float | None]:
        """Seconds per stage (``STAGES``)."""
        return {stage: getattr(self, f"{stage}_s") for stage in STAGES}

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "settings": [dict(s) for s in self.settings]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> PlanStats:
        """The record of ``to_dict`` (fields it does not know are left out)."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in (d or {}).items() if k in names}
        return cls(**{**known, "settings": tuple(known.get("settings") or ())})


@dataclasses.dataclass(frozen=True)
class ArgumentInfo:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    alternatives: tuple[tuple[Spec, float], ...] = ()   # (spec, extra seconds if chosen)


def spec_to_json(spec: Spec | None):
    return None if spec is None else [list(axes) for axes in spec]


def spec_from_json(obj) -> Spec | None:
    return None if obj is None else tuple(tuple(axes) for axes in obj)


@dataclasses.dataclass(frozen=True)
class PlannedProgram:
    """The program a plan runs: its closed jaxpr (flat arguments in, flat results out) and
    the pytree structures of its arguments and results."""

    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any


@dataclasses.dataclass(frozen=True)
class Solution:
    """What the solve stage hands the plan stage: the cost graph the choice is priced on,
    a strategy per group (the solver's choice expanded from its coarsening), the
    ``evaluation`` of that choice, per argument's group the plan's seconds as a function
    of that group's strategy alone (``api.local_costs``: the runner-ups), and
    the solver's record: status, objective and lower bound in seconds, how many groups
    it solved (one per class of repeats), each stage's seconds."""

    cost_graph: CostGraph
    choice: Sequence[int]
    evaluation: Evaluation
    local_seconds: Mapping[int, np.ndarray]   # by group
    status: str
    objective_s: float
    lower_bound_s: float
    solved_groups: int
    stage_seconds: Mapping[str, float]


def decisions_from(cg: CostGraph, chosen) -> dict[tuple, Decision]:
    """Where apply constrains: resharded operands, every result, loop seams. ``chosen``:
    a strategy per node (``CostGraph.node_strategies``)."""
    graph = cg.space.graph
    decisions = {}
    for node in graph.nodes:
        if node.kind in ("arg", "const", "output"):
            continue
        strategy = chosen[node.id]
        in_specs = []
        for i, value_id in enumerate(node.operands):
            if value_id is None:
                in_specs.append(None)
                continue
            value = graph.values[value_id]
            have = chosen[value.producer].out_specs[value.index]
            want = strategy.in_specs[i]
            in_specs.append(want if want != have or node.kind == "boundary" else None)
        # results are pinned: left free, XLA's propagation may pull a spec chosen for one
        # user back into a shared producer, and its other users pay to undo it; except
        # where propagation gives the planned spec anyway (fewer constraints compile faster)
        out_specs = () if propagation_gives(graph, chosen, node) else strategy.out_specs
        if any(s is not None for s in in_specs) or out_specs:
            decisions[node.key] = Decision(tuple(in_specs) if any(
                s is not None for s in in_specs) else (), tuple(out_specs))
    return decisions


def plan_cost(found: Evaluation) -> PlanCost:
    """The plan's cost, read from the ``evaluation`` of its choice (the byte tiebreak,
    no time, aside)."""
    return PlanCost(compute_s=found.compute_s, comm_s=found.comm_s,
                    memory_bytes=found.peak_bytes, reshard_s=found.reshard_s)


def argument_infos(cg: CostGraph, choice, local_seconds) -> list[ArgumentInfo]:
    """Per argument: its chosen spec and the runner-up specs with the seconds each would
    add, read from ``local_seconds`` (``Solution.local_seconds``)."""
    graph = cg.space.graph
    infos = []
    for path, node_id in zip(graph.arg_paths, graph.arg_nodes):
        value = graph.values[graph.nodes[node_id].outputs[0]]
        g = cg.group_of_node[node_id]
        strategies = cg.space.strategies[node_id]
        mine = cg.picks[node_id][choice[g]]
        per_spec: dict = {}
        for s in np.argsort(local_seconds[g], kind="stable"):
            spec = strategies[cg.picks[node_id][s]].out_specs[0]
            per_spec.setdefault(spec, float(local_seconds[g][s] - local_seconds[g][choice[g]]))
        chosen = strategies[mine].out_specs[0]
        alternatives = tuple((s, x) for s, x in per_spec.items() if s != chosen)
        infos.append(ArgumentInfo(path, value.shape, str(np.dtype(value.dtype))
                                  if _is_numpy_dtype(value.dtype) else str(value.dtype),
                                  chosen, alternatives[:ALTERNATIVES_SHOWN]))
    return infos


def _is_numpy_dtype(dtype) -> bool:
    try:
        np.dtype(dtype)
        return True
    except TypeError:
        return False


def output_specs(graph, chosen) -> list[Spec]:
    """A spec per result: its output node's, or replicated where no node computes it."""
    return [specs.replicated(len(aval.shape)) if node_id is None
            else chosen[node_id].out_specs[0]
            for node_id, aval in zip(graph.output_nodes, graph.out_avals)]


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A sharding plan for one program on one mesh. Frozen: a change (a bound program,
    a setting's microbatching) is a new plan (``dataclasses.replace``).

    Example::

        plan = autoshard.plan(train_step, params, opt_state, batch, mesh=mesh)
        plan.summary()
        params, opt_state, loss = plan.jit(donate_argnums=(0, 1))(params, opt_state, batch)
    """

    mesh: Mesh
    hardware: Hardware
    arguments: tuple[ArgumentInfo, ...]
    out_specs: tuple[Spec, ...]
    decisions: Mapping[tuple, Decision]
    cost: PlanCost
    fingerprint: str
    memory_budget: float | None = None
    donate_argnums: tuple[int, ...] = ()
    stats: PlanStats = PlanStats()
    breakdown: tuple[CostItem, ...] = ()                 # CostItem per (group, layer)
    memory_parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    microbatching: Any = None   # accumulate.Microbatching when planned with microbatches
    program: PlannedProgram | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        for name in ("arguments", "out_specs", "donate_argnums", "breakdown"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("decisions", "memory_parts"):
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))

    def with_stats(self, **changes) -> Plan:
        """The plan with ``changes`` to its ``PlanStats`` (seconds, cache, settings tried)."""
        return dataclasses.replace(self, stats=dataclasses.replace(self.stats, **changes))

    @classmethod
    def from_solution(cls, solution: Solution, options: PlanOptions, fingerprint: str,
                      started: float) -> Plan:
        """The plan of ``solution`` (the solve stage's), planned with ``options`` for the
        program of ``fingerprint``; ``started``: ``time.perf_counter()`` when planning
        began (``stats.plan_s``)."""
        cg, found, choice = solution.cost_graph, solution.evaluation, solution.choice
        graph = cg.space.graph
        chosen = cg.node_strategies(choice)
        reshards = operand_reshard_seconds(cg, chosen)
        stats = PlanStats(
            status=solution.status, objective_s=solution.objective_s,
            tiebreak_s=found.tiebreak_s, lower_bound_s=solution.lower_bound_s,
            groups=cg.num_groups, solved_groups=solution.solved_groups,
            nodes=len(graph.nodes), edges=len(cg.edges),
            **{f"{stage}_s": s for stage, s in solution.stage_seconds.items()},
            plan_s=time.perf_counter() - started)
        return cls(mesh=options.mesh, hardware=options.hardware,
                   arguments=argument_infos(cg, choice, solution.local_seconds),
                   out_specs=output_specs(graph, chosen), decisions=decisions_from(cg, chosen),
                   cost=plan_cost(found), fingerprint=fingerprint,
                   memory_budget=options.memory_budget, donate_argnums=options.donate_argnums,
                   stats=stats, breakdown=cost_breakdown(cg, chosen, reshards, found.latency_s),
                   memory_parts=memory_parts(cg, choice, found.peak_bytes),
                   program=PlannedProgram(graph.closed_jaxpr, graph.in_tree, graph.out_tree))

    @property
    def pipeline(self):
        """The pipeline the layer stack runs as (``autoshard.rewrite.pipeline.Pipelining``: stage
        axis, stages, layers per stage, microbatches, schedule and repeats V, bubble
        fraction), or None."""
        return None if self.microbatching is None else self.microbatching.pipeline

    # -- shardings ---------------------------------------------------------------------
    def _sharding(self, spec: Spec) -> NamedSharding:
        return NamedSharding(self.mesh, specs.to_partition_spec(spec))

    @property
    def in_specs(self) -> tuple[Spec, ...]:
        return tuple(a.spec for a in self.arguments)

    @property
    def in_shardings(self):
        """Pytree of NamedSharding matching the arguments (None at the static leaves of
        equinox modules)."""
        tree = self.require_program("in_shardings").in_tree
        return static_as_none(
            jax.tree_util.tree_unflatten(tree, [self._sharding(s) for s in self.in_specs]))

    @property
    def out_shardings(self):
        """Pytree of NamedSharding matching the outputs."""
        tree = self.require_program("out_shardings").out_tree
        return static_as_none(
            jax.tree_util.tree_unflatten(tree, [self._sharding(s) for s in self.out_specs]))

    def require_program(self, what: str) -> PlannedProgram:
        """The program the plan runs; ``what`` names the caller in the error raised on a
        plan loaded from JSON and not bound."""
        if self.program is None:
            raise PlanError(f"{what} needs the program: plan = plan.bind(fn, *args) on a "
                            "plan loaded from JSON")
        return self.program

    def bind(self, fn, *args) -> Plan:
        """The plan with the program attached (a plan loaded from JSON has none); checks it
        is the program the plan was made for."""
        from autoshard.frontend.trace import flatten_args, hold_static_leaves, release_static_leaves
        from autoshard.rewrite.accumulate import microbatching
        validate.function(fn)
        leaves, _, in_tree = flatten_args(fn, args)
        if len(leaves) == len(self.arguments):
            try:
                validate.arguments_match(self.arguments, in_tree, args)
            except PlanError as e:
                raise PlanError(f"the plan (program fingerprint {self.fingerprint}) was made "
                                f"for another program: {e}") from e

        def flat_fn(*flat):
            out = fn(*release_static_leaves(jax.tree_util.tree_unflatten(in_tree, flat)))
            return hold_static_leaves(out)
        names = argument_names(fn, len(args))
        with validate.tracing(fn, dict(zip(names, args))), microbatching(self.microbatching,
                                                                         mesh=self.mesh):
            closed, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
        found = program_fingerprint(closed, leaves)
        if found != self.fingerprint:
            raise PlanError(f"program fingerprint {found} differs from the plan's "
                            f"{self.fingerprint}: the plan was made for another program")
        program = PlannedProgram(closed, in_tree, jax.tree_util.tree_structure(out_shapes))
        return dataclasses.replace(self, program=program)

    def jit(self, donate_argnums: Sequence[int] | None = None):
        """jax.jit of the rewritten function with the plan's in/out shardings."""
        program = self.require_program("jit")
        closed, in_tree, out_tree = program.closed_jaxpr, program.in_tree, program.out_tree
        donate = self.donate_argnums if donate_argnums is None else validate.argnums(
            "donate_argnums", donate_argnums, len(in_tree.children()))
        arguments = self.arguments
        return make_jit(closed, in_tree, out_tree, self.decisions, self.mesh, self.in_specs,
                        self.out_specs, donate,
                        check_args=lambda args: validate.arguments_match(arguments, in_tree, args))

    def report(self, *args, donate_argnums: Sequence[int] | None = None):
        """Compile the plan and put the prediction beside what XLA compiled."""
        from autoshard.report.hlo_report import hlo_report
        compiled = self.jit(donate_argnums).lower(*args).compile()
        return PlanReport(self, hlo_report(compiled, self.hardware, self.mesh))

    # -- views -------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        sizes = axis_sizes(self.mesh)
        out = []
        for a in self.arguments:
            per_device = specs.per_device_bytes(a.shape, a.dtype, a.spec, sizes)
            out.append(dict(path=a.path, shape=a.shape, dtype=a.dtype,
                            spec=specs.spec_str(a.spec), bytes_per_device=per_device,
                            sharded=bool(specs.spec_axes(a.spec))))
        return out

    def summary_text(self, width: int = 150, full: bool = False) -> str:
        """What :meth:`summary` prints (``viz.summary_text``)."""
        from autoshard.report import viz
        return viz.summary_text(self, width=width, full=full)

    def summary(self, full: bool = False) -> None:
        """Print the plan table and the predicted cost: one row per layer pattern
        (``blocks[0..11]['attn']['query']['kernel']``), optimizer state folded into its
        parameter where it takes the same spec, largest first; ``full=True``: every array."""
        print(self.summary_text(full=full))

    def argument(self, path: str) -> ArgumentInfo:
        if not isinstance(path, str):
            raise PlanError(f"an argument path is a str such as "
                            f"{self.arguments[0].path if self.arguments else 'x'!r}, got "
                            f"{type(path).__name__} {path!r}")
        for a in self.arguments:
            if a.path == path:
                return a
        close = difflib.get_close_matches(path, [a.path for a in self.arguments], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise PlanError(f"no argument at path {path!r}{hint}")

    def explain(self, path: str) -> str:
        """Why the argument at ``path`` got its spec: how it is split, the runner-up specs
        and what they would cost (``viz.explain``)."""
        from autoshard.report import viz
        return viz.explain(self, path)

    def diff(self, other, names: tuple[str, str] = ("this", "other"), show_all: bool = False):
        """Where this plan and ``other`` (a Plan or an in_shardings pytree) differ, per path.

        Example::

            d = plan.diff(expert_in_shardings, names=("auto", "fsdp"))
            d.changed      # paths whose specs differ; ``d`` renders as a table
        """
        from autoshard.report import viz
        return viz.diff(self, other, names=names, show_all=show_all)

    def _repr_html_(self) -> str:
        from autoshard.report import viz
        return viz.summary(self)._repr_html_()

    # -- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "mesh": {"axis_names": list(self.mesh.axis_names),
                     "shape": list(self.mesh.devices.shape)},
            "hardware": self.hardware.to_dict(),
            "memory_budget": self.memory_budget,
            "donate_argnums": list(self.donate_argnums),
            "cost": dataclasses.asdict(self.cost),
            "arguments": [{"path": a.path, "shape": list(a.shape), "dtype": a.dtype,
                           "spec": spec_to_json(a.spec),
                           "alternatives": [[spec_to_json(s), x] for s, x in a.alternatives]}
                          for a in self.arguments],
            "outputs": [spec_to_json(s) for s in self.out_specs],
            "decisions": [{"key": list(k),
                           "in": [spec_to_json(s) for s in d.in_specs],
                           "out": [spec_to_json(s) for s in d.out_specs]}
                          for k, d in self.decisions.items()],
            "stats": self.stats.to_dict(),
            "breakdown": [item.to_dict() for item in self.breakdown],
            "memory_parts": dict(self.memory_parts),
            **({"microbatching": dataclasses.asdict(self.microbatching)}
               if self.microbatching is not None else {}),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str, mesh: Mesh) -> Plan:
        d = validate.plan_text(text)
        if d.get("format") != FORMAT_VERSION:
            raise PlanError(f"plan format {d.get('format')} is not {FORMAT_VERSION}")
        if not isinstance(mesh, Mesh):
            raise MeshError(f"Plan.from_json needs the jax.sharding.Mesh to run on, got "
                            f"{type(mesh).__name__}")
        try:
            want = dict(zip(d["mesh"]["axis_names"], d["mesh"]["shape"]))
        except (KeyError, TypeError) as e:
            raise PlanError(f"plan JSON field 'mesh' is malformed: {d['mesh']!r:.80}") from e
        have = dict(zip(mesh.axis_names, mesh.devices.shape))
        if want != have:
            raise PlanError(f"plan was made for mesh {want}; got mesh {have}")
        try:
            return cls._from_dict(d, mesh)
        except AutoshardError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"plan JSON is malformed: {type(e).__name__} {e}") from e

    @classmethod
    def _from_dict(cls, d: Mapping, mesh: Mesh) -> Plan:
        with json_field("arguments"):
            arguments = [argument_from_json(k, a, mesh) for k, a in enumerate(d["arguments"])]
        with json_field("outputs"):
            out_specs = [output_spec_from_json(k, s, mesh) for k, s in enumerate(d["outputs"])]
        with json_field("decisions"):
            decisions = dict(decision_from_json(x, mesh) for x in d["decisions"])
        with json_field("hardware"):
            hardware = Hardware.from_dict(d["hardware"])
        with json_field("cost"):
            cost = PlanCost(**d["cost"])
        with json_field("donate_argnums"):
            donate_argnums = tuple(int(k) for k in d["donate_argnums"])
        with json_field("breakdown"):
            breakdown = [CostItem.from_dict(x) for x in d.get("breakdown", ())]
        with json_field("stats"):
            stats = PlanStats.from_dict(d.get("stats"))
        microbatching = None
        if d.get("microbatching"):
            with json_field("microbatching"):
                microbatching = microbatching_from_json(d["microbatching"])
        return cls(mesh=mesh, hardware=hardware, arguments=arguments, out_specs=out_specs,
                   decisions=decisions, cost=cost, fingerprint=d["fingerprint"],
                   memory_budget=d["memory_budget"], donate_argnums=donate_argnums,
                   stats=stats, breakdown=breakdown, memory_parts=d.get("memory_parts") or {},
                   microbatching=microbatching)

    def __repr__(self) -> str:
        c = self.cost
        return (f"Plan({len(self.arguments)} arguments, mesh "
                f"{dict(zip(self.mesh.axis_names, self.mesh.devices.shape))}, predicted "
                f"{c.total_s * 1e3:.3f} ms/step, {format_bytes(c.memory_bytes)}/device)")


@contextlib.contextmanager
def json_field(name: str):
    """Names the field of a plan's JSON being read in any error reading it raises."""
    try:
        yield
    except AutoshardError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanError(f"plan JSON field {name!r} is malformed: {type(e).__name__} {e}"
                        ) from e


def argument_from_json(k: int, a: Mapping, mesh: Mesh) -> ArgumentInfo:
    """Argument ``k`` of a plan's JSON, its path, shape and dtype checked for type."""
    with json_field(f"arguments[{k}]"):
        if not isinstance(a["path"], str):
            raise TypeError(f"path {a['path']!r} is not a string")
        if not all(isinstance(n, int) and n >= 0 for n in a["shape"]):
            raise TypeError(f"shape {a['shape']!r} is not a list of sizes")
        if not isinstance(a["dtype"], str):
            raise TypeError(f"dtype {a['dtype']!r} is not a string")
        validate.spec_axes(f"plan argument {a['path']}", a["spec"], mesh.axis_names)
        return ArgumentInfo(a["path"], tuple(a["shape"]), a["dtype"], spec_from_json(a["spec"]),
                            tuple((spec_from_json(s), x) for s, x in a["alternatives"]))


def output_spec_from_json(k: int, spec, mesh: Mesh) -> Spec:
    validate.spec_axes(f"plan output {k}", spec, mesh.axis_names)
    return spec_from_json(spec)


def decision_from_json(x: Mapping, mesh: Mesh) -> tuple[tuple, Decision]:
    """One decision of a plan's JSON: (its key, its specs)."""
    for spec in list(x["in"]) + list(x["out"]):
        validate.spec_axes(f"plan decision at {x['key']}", spec, mesh.axis_names)
    return tuple(x["key"]), Decision(tuple(spec_from_json(s) for s in x["in"]),
                                     tuple(spec_from_json(s) for s in x["out"]))


def microbatching_from_json(m: Mapping):
    from autoshard.rewrite.accumulate import Microbatching
    from autoshard.rewrite.pipeline import Pipelining
    staged = Pipelining(**{**m["pipeline"], "replica_axes": tuple(
        m["pipeline"].get("replica_axes", ()))}) if m.get("pipeline") else None
    return Microbatching(m["microbatches"], tuple(m["replica_axes"]), m["replicas"], staged,
                         m.get("remat"))


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """A plan's prediction beside its compiled program's figures."""

    plan: Plan
    compiled: Any   # autoshard.report.hlo_report.Report

    def rows(self) -> list[tuple[str, float, float]]:
        p, c = self.plan.cost, self.compiled
        return [("compute_s", p.compute_s, c.compute_s), ("comm_s", p.comm_s, c.comm_s),
                ("total_s", p.total_s, c.total_s),
                ("memory_bytes", p.memory_bytes, c.memory_bytes)]

    def __str__(self) -> str:
        lines = [f"{'':14}{'predicted':>14}{'compiled':>14}{'ratio':>8}"]
        for name, pred, comp in self.rows():
            ratio = pred / comp if comp else float("nan")
            lines.append(f"{name:14}{pred:>14.4g}{comp:>14.4g}{ratio:>8.2f}")
        return "\n".join(lines)
