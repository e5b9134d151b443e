"""viz: views of a Plan for a terminal (rich), a notebook (HTML) and matplotlib figures.

Every view is a small object with ``rows()`` (plain values), ``__str__`` (a text table),
``__rich__`` (a rich Table) and ``_repr_html_`` (an HTML table in a notebook); views with
a picture have ``plot()`` returning a ``matplotlib.figure.Figure`` (no pyplot, no
``show``; the figure renders with Agg wherever it is saved or displayed).

Example::

    plan = autoshard.plan(train_step, params, opt_state, batch, mesh=mesh)
    viz.table(plan)                          # path, shape, spec, bytes/device, sharding
    viz.breakdown(plan).plot()               # compute / collectives / resharding per layer
    viz.memory(plan, plan.report(*args)).plot()   # predicted vs compiled bytes per device
    viz.diff(plan, expert_in_shardings)      # where two plans differ
    viz.what_if(train_step, *args).plot()    # 1x8, 2x4, 4x2, 8x1 meshes side by side
    viz.sharding(plan, "params['embed']")    # which device holds which block
    viz.schedule(pipelined_plan).plot()      # microbatches per stage over time, the bubble
    print(viz.explain(plan, "params['embed']"))

Views work on plans of abstract (``jax.ShapeDtypeStruct``) arguments and on plans loaded
from JSON. Unknown paths and plans that do not match raise ``autoshard.PlanError``.
"""

from __future__ import annotations

import dataclasses
import difflib
import html
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoshard.cost.breakdown import is_index, path_keys
from autoshard.errors import AutoshardError, OptionError, PlanError
from autoshard.frontend import specs, validate
from autoshard.frontend.specs import Spec
from autoshard.planning.plan import Plan
from autoshard.units import (
    axis_sizes,
    bytes_unit,
    format_bytes,
    format_seconds,
    mesh_str,
    time_unit,
)

__all__ = [
    "BreakdownView", "CompareView", "DiffView", "MemoryView", "ScoreboardView", "ShardingView",
    "SummaryView", "TableView", "View", "WhatIfView", "breakdown", "diff", "explain",
    "format_bytes", "format_seconds", "memory", "schedule", "scoreboard", "sharding", "summary",
    "summary_text", "table",
]

COMPUTE_COLOR = "#4c72b0"
RESHARD_COLOR = "#8c8c8c"
COLLECTIVE_COLORS = {"all-reduce": "#dd8452", "reduce-scatter": "#55a868",
                     "all-gather": "#c44e52", "all-to-all": "#8172b3",
                     "collective-permute": "#937860", "other": "#da8bc3"}
MEMORY_COLORS = {"parameters": "#4c72b0", "optimizer state": "#55a868", "data": "#dd8452",
                 "other arguments": "#937860", "arguments": "#64b5cd", "outputs": "#8172b3",
                 "temporaries": "#c44e52", "outputs + temporaries": "#c44e52"}


# -- figures ----------------------------------------------------------------------------------

def new_figure(width_in: float, height_in: float, ncols: int = 1):
    """A matplotlib Figure on the Agg canvas (no pyplot, safe headless)."""
    from autoshard.extras import require
    require("matplotlib", "viz", "autoshard.report.viz plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def stacked_bars(ax, labels: Sequence[str], parts: Mapping[str, Sequence[float]],
                 colors: Mapping[str, str], horizontal: bool = False, offset=None):
    """Draw one stacked bar per label; ``parts`` maps a legend name to its values."""
    positions = np.arange(len(labels)) if offset is None else offset
    bottom = np.zeros(len(labels))
    for name, values in parts.items():
        values = np.asarray(values, float)
        if not values.any():
            continue
        color = colors.get(name)
        if horizontal:
            ax.barh(positions, values, left=bottom, label=name, color=color)
        else:
            ax.bar(positions, values, bottom=bottom, label=name, color=color)
        bottom += values
    return bottom


def budget_line(ax, budget_bytes: float | None, tallest: float, scale: float) -> str:
    """Mark the memory budget; far above the bars, return a note for the title instead."""
    if not budget_bytes:
        return ""
    if budget_bytes <= 4 * max(tallest, 1.0):
        ax.axhline(budget_bytes / scale, color="black", linestyle="--",
                   label=f"budget {format_bytes(budget_bytes)}")
        return ""
    return f"\n(budget {format_bytes(budget_bytes)} per device, off this scale)"


def legend_below(ax, ncol: int = 3, drop: float = 0.16) -> None:
    """The legend under the axes (below the x label), out of the bars' way."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -drop), ncol=ncol,
              frameon=False)


# -- views ------------------------------------------------------------------------------------

class View:
    """A table of rows with text, rich and HTML renderings.

    Subclasses set ``title`` and ``columns`` and implement ``rows()`` (plain values) and
    ``cells(row)`` (the strings shown).
    """

    title: str = ""
    columns: tuple[str, ...] = ()
    caption: str = ""
    right_aligned: tuple[str, ...] = ()

    def rows(self) -> list[dict]:
        raise NotImplementedError

    def cells(self, row: dict) -> list[str]:
        return [str(row[c]) for c in self.columns]

    def __rich__(self):
        from rich.table import Table
        t = Table(title=self.title, caption=self.caption or None)
        for c in self.columns:
            t.add_column(c, justify="right" if c in self.right_aligned else "left")
        for row in self.rows():
            t.add_row(*self.cells(row))
        return t

    def text(self, width: int = 140) -> str:
        from rich.console import Console
        buffer = io.StringIO()
        Console(file=buffer, width=width, force_terminal=False, color_system=None,
                force_jupyter=False).print(self.__rich__())
        return buffer.getvalue()

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:{self._align(c)}'>{html.escape(c)}</th>"
                       for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:{self._align(c)}'>{html.escape(v)}</td>"
                             for c, v in zip(self.columns, self.cells(row))) + "</tr>"
            for row in self.rows())
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        foot = (f"<p style='font-size:smaller'>{html.escape(self.caption)}</p>"
                if self.caption else "")
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{foot}"

    def _align(self, column: str) -> str:
        return "right" if column in self.right_aligned else "left"


def require_plan(plan, what: str) -> Plan:
    if not isinstance(plan, Plan):
        raise PlanError(f"{what} needs an autoshard.Plan, got {type(plan).__name__}")
    return plan


# -- the plan table ---------------------------------------------------------------------------

class TableView(View):
    """The plan table: one row per argument."""

    columns = ("path", "shape", "dtype", "spec", "bytes/device", "sharding")
    right_aligned = ("bytes/device",)

    def __init__(self, plan: Plan):
        self.plan = require_plan(plan, "viz.table")
        c = plan.cost
        self.title = f"autoshard plan on mesh {mesh_str(plan.mesh)}"
        self.caption = (f"predicted per device: compute {format_seconds(c.compute_s)}, "
                        f"communication {format_seconds(c.comm_s)}, total "
                        f"{format_seconds(c.total_s)}, peak memory {format_bytes(c.memory_bytes)}"
                        + "".join("\n" + line for line in step_lines(plan)))

    def rows(self) -> list[dict]:
        sizes = axis_sizes(self.plan.mesh)
        out = []
        for row in self.plan.rows():
            shards = specs.num_shards(self.plan.argument(row["path"]).spec, sizes)
            out.append(dict(row, num_shards=shards))
        return out

    def cells(self, row: dict) -> list[str]:
        how = f"sharded {row['num_shards']} ways" if row["sharded"] else "replicated"
        return [row["path"], str(tuple(row["shape"])), row["dtype"], row["spec"],
                format_bytes(row["bytes_per_device"]), how]


def step_lines(plan: Plan) -> list[str]:
    """How the step runs beyond the specs: pipeline, microbatches, rematerialization."""
    lines = []
    m = plan.microbatching
    if plan.pipeline is not None:
        lines.append(plan.pipeline.describe())
        if m is not None and m.microbatches > 1:
            lines.append(f"{m.microbatches} accumulation steps, each a pipelined step on "
                         "its share of the batch")
    elif m is not None and m.microbatches > 1:
        replicas = f"{m.replicas} replica" + "s" * (m.replicas != 1)
        lines.append(f"{m.microbatches} microbatches, each split over "
                     f"{', '.join(m.replica_axes) or 'no axis'} ({replicas}); "
                     "gradients reduced once per step")
    if m is not None and m.remat:
        lines.append(f"layer stack rematerialized: jax.checkpoint(policy={m.remat})")
    return lines


def table(plan: Plan) -> TableView:
    """The plan table: path, shape, dtype, spec, bytes per device, sharded or replicated.

    Example::

        viz.table(plan)            # HTML in a notebook
        print(viz.table(plan))     # text in a terminal
    """
    return TableView(plan)


# -- pipeline schedule ------------------------------------------------------------------------

class ScheduleView(View):
    """A pipeline's schedule: per stage, the microbatch it runs at each loop step (forward
    pass; the backward pass runs the same grid in reverse). ``.`` is the bubble. In the
    circular schedule a cell ``3r1`` is microbatch 3 on its repeat 1 (its second pass
    through the stages)."""

    right_aligned = ()

    def __init__(self, pipeline):
        self.pipeline = pipeline
        p = pipeline
        laps = f" x {p.repeats} repeats" if p.repeats > 1 else ""
        self.columns = ("stage",) + tuple(f"t{t}" for t in range(p.iterations))
        self.title = (f"{p.schedule} pipeline over {p.axis!r}: {p.stages} stages x "
                      f"{p.layers_per_pass} layers{laps}, {p.microbatches} microbatches")
        formula = "(S-1)/(M+S-1)" if p.repeats == 1 else "(S-1)/(M*V+S-1)"
        self.caption = (f"{p.iterations} steps; bubble {formula} = "
                        f"{p.bubble_fraction:.1%} of each stage's time"
                        + ("; mRr: microbatch m on repeat r" if p.repeats > 1 else ""))

    def rows(self) -> list[dict]:
        p = self.pipeline
        return [{"stage": s, "work": [p.work(s, t) for t in range(p.iterations)]}
                for s in range(p.stages)]

    def label(self, work: tuple[int, int] | None) -> str:
        """A cell: ``.`` idle, the microbatch, and in the circular schedule its repeat."""
        if work is None:
            return "."
        m, r = work
        return str(m) if self.pipeline.repeats == 1 else f"{m}r{r}"

    def cells(self, row: dict) -> list[str]:
        return [str(row["stage"])] + [self.label(w) for w in row["work"]]

    def plot(self):
        """Stages down, loop steps across; a box per microbatch pass (a colour per
        microbatch, hatched on odd repeats), the bubble left empty."""
        import matplotlib
        p = self.pipeline
        fig, (ax,) = new_figure(max(4.0, 0.45 * p.iterations + 1.5), 0.5 * p.stages + 1.4)
        colors = matplotlib.colormaps["tab20"]
        for row in self.rows():
            for t, work in enumerate(row["work"]):
                if work is None:
                    continue
                ax.broken_barh([(t, 0.95)], (row["stage"] - 0.45, 0.9),
                               facecolors=colors(work[0] % 20),
                               hatch="//" if work[1] % 2 else None)
                ax.text(t + 0.47, row["stage"], self.label(work), ha="center", va="center",
                        fontsize=8 if p.repeats == 1 else 6)
        ax.set_xlim(0, p.iterations)
        ax.set_ylim(p.stages - 0.5, -0.5)
        ax.set_yticks(range(p.stages))
        ax.set_xlabel("loop step (forward)")
        ax.set_ylabel(f"stage (mesh axis {p.axis!r})")
        ax.set_title(f"{self.title}\nbubble {p.bubble_fraction:.1%} (empty cells)",
                     fontsize=9)
        return fig


def schedule(plan) -> ScheduleView:
    """The schedule of a pipelined plan (or of an ``autoshard.rewrite.pipeline.Pipelining``).

    Example::

        plan = autoshard.plan(train_step, *args, mesh=mesh, pipeline="data", microbatches=8)
        print(viz.schedule(plan))        # stages x steps, microbatch numbers, '.' = bubble
        viz.schedule(plan).plot()
    """
    pipeline = plan.pipeline if isinstance(plan, Plan) else plan
    if pipeline is None or not hasattr(pipeline, "busy"):
        raise PlanError("viz.schedule needs a pipelined plan (autoshard.plan(..., "
                        "pipeline=...)) or a Pipelining")
    return ScheduleView(pipeline)

# -- the collapsed plan table -------------------------------------------------------------------

PARAMS_KEYS = ("params", "['params']")


def index_pattern(path: str) -> tuple[str, tuple[int, ...]]:
    """``"p['blocks'][3]['w']"`` -> ``("p['blocks'][*]['w']", (3,))``: a path's list indices
    taken out, so that the same leaf of every layer shares one pattern."""
    head, keys = path_keys(path)
    indices = tuple(int(k[1:-1]) for k in keys if is_index(k))
    return head + "".join("[*]" if is_index(k) else k for k in keys), indices


def index_set_str(values: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2,5"``."""
    values = sorted(set(values))
    runs, start = [], values[0]
    for prev, cur in zip(values, values[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}..{prev}")
            start = cur
    return ",".join(runs)


def pattern_path(pattern: str, index_tuples: Sequence[tuple[int, ...]]) -> str:
    """Fill a pattern's ``[*]`` with the index sets seen at each position."""
    parts = pattern.split("[*]")
    out = parts[0]
    for position, part in enumerate(parts[1:]):
        out += f"[{index_set_str(t[position] for t in index_tuples)}]" + part
    return out


def parameter_suffixes(rows: Sequence[dict]) -> dict[tuple[str, ...], dict]:
    """Parameter rows (under a ``params`` key) by their keys after that key."""
    out = {}
    for row in rows:
        head, keys = path_keys(row["path"])
        tokens = (head, *keys)
        for i, token in enumerate(tokens):
            if token in PARAMS_KEYS and i + 1 < len(tokens):
                out[tokens[i + 1:]] = row
                break
    return out


def followed_parameter(row: dict, params: Mapping[tuple[str, ...], dict]) -> dict | None:
    """The parameter an optimizer-state leaf belongs to: the one whose keys end its path,
    with the same shape (Adam's ``mu``/``nu`` of ``params['w']`` end in ``['w']``)."""
    head, keys = path_keys(row["path"])
    if head in PARAMS_KEYS or any(k in PARAMS_KEYS for k in keys):
        return None
    for start in range(len(keys)):
        param = params.get(keys[start:])
        if param is not None and tuple(param["shape"]) == tuple(row["shape"]):
            return param
    return None


class SummaryView(View):
    """The plan table collapsed: one row per leaf of every layer that shares a pattern
    (``blocks[0..11]['attn']['query']['kernel']``), optimizer state folded into its
    parameter's row where it takes the parameter's spec and otherwise shown as the
    parameter's ``(opt state)`` (Adam's moments together), largest first."""

    columns = ("path", "shape", "dtype", "spec", "leaves", "bytes/device")
    right_aligned = ("leaves", "bytes/device")

    def __init__(self, plan: Plan):
        self.plan = require_plan(plan, "viz.summary")
        full = TableView(plan)
        self.title = full.title
        self.leaf_rows = full.rows()
        groups = self.groups()
        folded = sum(g["followers"] for g in groups)
        self.caption = (f"{len(self.leaf_rows)} arrays in {len(groups)} rows"
                        + (f"; {folded} optimizer-state arrays take their parameter's spec"
                           if folded else "")
                        + "; full table: plan.summary(full=True)\n" + full.caption)

    def groups(self) -> list[dict]:
        params = parameter_suffixes(self.leaf_rows)
        follows, state_of = {}, {}
        for row in self.leaf_rows:
            param = followed_parameter(row, params)
            if param is not None and param["spec"] == row["spec"]:
                follows[row["path"]] = param["path"]
            elif param is not None:
                state_of[row["path"]] = param["path"]
        groups: dict[tuple, dict] = {}
        by_path = {}
        for row in self.leaf_rows:
            if row["path"] in follows:
                continue
            pattern, indices = index_pattern(state_of.get(row["path"], row["path"]))
            if row["path"] in state_of:
                pattern += " (opt state)"
            key = (pattern, tuple(row["shape"]), row["dtype"], row["spec"])
            group = groups.setdefault(key, dict(pattern=pattern, shape=tuple(row["shape"]),
                                                dtype=row["dtype"], spec=row["spec"],
                                                indices=[], leaves=0, followers=0,
                                                bytes_per_device=0.0))
            group["indices"].append(indices)
            group["leaves"] += 1
            group["bytes_per_device"] += row["bytes_per_device"]
            by_path[row["path"]] = group
        for row in self.leaf_rows:
            if row["path"] in follows:
                group = by_path[follows[row["path"]]]
                group["followers"] += 1
                group["bytes_per_device"] += row["bytes_per_device"]
        return list(groups.values())

    def rows(self) -> list[dict]:
        out = [dict(path=pattern_path(g["pattern"], g["indices"]), shape=g["shape"],
                    dtype=g["dtype"], spec=g["spec"], leaves=g["leaves"],
                    followers=g["followers"], bytes_per_device=g["bytes_per_device"])
               for g in self.groups()]
        return sorted(out, key=lambda r: (-r["bytes_per_device"], r["path"]))

    def cells(self, row: dict) -> list[str]:
        leaves = str(row["leaves"]) + (f" +{row['followers']} opt" if row["followers"] else "")
        return [row["path"], str(row["shape"]), row["dtype"], row["spec"], leaves,
                format_bytes(row["bytes_per_device"])]


def summary(plan: Plan, full: bool = False) -> View:
    """The plan table collapsed by layer pattern, optimizer state with its parameter,
    largest first (``full=True``: :func:`table`, a row per argument).

    Example::

        viz.summary(plan)   # blocks[0..11]['attn']['query']['kernel']  (64, 8, 8) ... 12 +24 opt
    """
    return TableView(plan) if full else SummaryView(plan)


def summary_text(plan: Plan, width: int = 150, full: bool = False) -> str:
    """:func:`summary` as plain text ``width`` columns wide (what ``plan.summary()``
    prints)."""
    return summary(plan, full=full).text(width)


# -- cost breakdown ---------------------------------------------------------------------------

class BreakdownView(View):
    """Predicted seconds per device by layer (or primitive): compute, collectives, resharding."""

    right_aligned = ("compute", "collectives", "resharding", "total")

    def __init__(self, plan: Plan, by: str = "layer", top: int | None = None):
        self.plan = require_plan(plan, "viz.breakdown")
        if by not in ("layer", "primitive"):
            raise AutoshardError(f"breakdown by {by!r}: choose 'layer' or 'primitive'")
        if not plan.breakdown:
            raise PlanError("this plan carries no cost breakdown (a plan saved by an older "
                            "autoshard); plan the program again to get one")
        validate.optional_count("viz.breakdown top", top)
        self.by, self.top = by, top
        self.title = f"predicted time per step by {by}, mesh {mesh_str(plan.mesh)}"
        kinds = sorted({k for item in plan.breakdown for k in item.comm_s_by_kind})
        self.kinds = [k for k in COLLECTIVE_COLORS if k in kinds] + [
            k for k in kinds if k not in COLLECTIVE_COLORS]
        self.columns = (by, "compute", *self.kinds, "resharding", "total")
        self.right_aligned = self.columns[1:]

    def rows(self) -> list[dict]:
        acc: dict[str, dict] = {}
        for item in self.plan.breakdown:
            key = item.label if self.by == "layer" else item.primitive
            row = acc.setdefault(key, {"label": key, "compute_s": 0.0, "reshard_s": 0.0,
                                       "comm_s_by_kind": {k: 0.0 for k in self.kinds}})
            row["compute_s"] += item.compute_s
            row["reshard_s"] += item.reshard_s
            for kind, seconds in item.comm_s_by_kind.items():
                row["comm_s_by_kind"][kind] += seconds
        rows = list(acc.values())
        for row in rows:
            row["total_s"] = (row["compute_s"] + row["reshard_s"]
                              + sum(row["comm_s_by_kind"].values()))
        if self.by == "primitive":
            rows.sort(key=lambda r: -r["total_s"])
        if self.top is not None and len(rows) > self.top:
            keep = sorted(rows, key=lambda r: -r["total_s"])[:self.top]
            rows = [r for r in rows if any(r is k for k in keep)]
        return rows

    def cells(self, row: dict) -> list[str]:
        return [row["label"], format_seconds(row["compute_s"]),
                *[format_seconds(row["comm_s_by_kind"][k]) for k in self.kinds],
                format_seconds(row["reshard_s"]), format_seconds(row["total_s"])]

    def plot(self):
        """Horizontal stacked bars, one per layer (or primitive), in time per step."""
        rows = self.rows()
        labels = [r["label"] for r in rows]
        scale, unit = time_unit(max([r["total_s"] for r in rows] + [1e-12]))
        parts = {"compute": [r["compute_s"] / scale for r in rows]}
        for kind in self.kinds:
            parts[kind] = [r["comm_s_by_kind"][kind] / scale for r in rows]
        parts["resharding"] = [r["reshard_s"] / scale for r in rows]
        colors = {"compute": COMPUTE_COLOR, "resharding": RESHARD_COLOR, **COLLECTIVE_COLORS}
        fig, (ax,) = new_figure(9, 1.2 + 0.35 * len(labels))
        stacked_bars(ax, labels, parts, colors, horizontal=True)
        ax.set_yticks(np.arange(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"predicted time per step per device ({unit})")
        ax.set_ylabel(self.by)
        ax.set_title(self.title)
        legend_below(ax, ncol=4)
        return fig


def breakdown(plan: Plan, by: str = "layer", top: int | None = None) -> BreakdownView:
    """Where the predicted step time goes, per layer (``by="layer"``) or per primitive.

    Layers are named after the parameters their equations read
    (``params['layers'][0]``); ``top`` keeps the costliest rows.

    Example::

        view = viz.breakdown(plan)                 # table
        fig = view.plot()                          # stacked bars: compute, all-reduce, ...
        fig.savefig("breakdown.png")
    """
    return BreakdownView(plan, by, top)


# -- memory -------------------------------------------------------------------------------------

def argument_category(path: str, paths: Sequence[str]) -> str:
    """"parameters", "optimizer state", "data" or "other arguments", guessed from paths.

    An argument whose keys end with another argument's keys is optimizer state (Adam's
    ``opt_state['m']['w']`` mirrors ``params['w']``); the argument it mirrors is a
    parameter, as is a path naming params, state or weights; a path naming a batch is data.
    """
    head, keys = path_keys(path)
    key_sets = {p: path_keys(p)[1] for p in paths}
    mirrors = any(len(k) < len(keys) and k and keys[len(keys) - len(k):] == k
                  for p, k in key_sets.items() if p != path)
    mirrored = any(len(k) > len(keys) and keys and k[len(k) - len(keys):] == keys
                   for p, k in key_sets.items() if p != path)
    lowered = path.lower()
    if mirrors or "opt" in head.lower() or "opt_state" in lowered:
        return "optimizer state"
    if mirrored or any(w in lowered for w in ("param", "state", "weight", "kernel")):
        return "parameters"
    if any(w in lowered for w in ("batch", "input", "target", "label", "data", "token")):
        return "data"
    return "other arguments"


class MemoryView(View):
    """Bytes per device: arguments by kind, outputs and temporaries; predicted and compiled."""

    columns = ("part", "predicted", "compiled")
    right_aligned = ("predicted", "compiled")

    def __init__(self, plan: Plan, report=None,
                 categorize: Callable[[str, Sequence[str]], str] | None = None):
        self.plan = require_plan(plan, "viz.memory")
        self.compiled = getattr(report, "compiled", report)   # PlanReport or hlo_report.Report
        if self.compiled is not None and not hasattr(self.compiled, "temp_bytes"):
            raise PlanError(f"viz.memory: report must be plan.report(*args) or an "
                            f"autoshard.report.hlo_report.Report, got {type(report).__name__}")
        if report is not None and getattr(report, "plan", plan) is not plan:
            raise PlanError("viz.memory: the report was made for another plan")
        self.categorize = categorize or argument_category
        budget = plan.memory_budget
        self.title = f"memory per device, mesh {mesh_str(plan.mesh)}"
        self.caption = f"budget {format_bytes(budget)} per device" if budget else ""

    def predicted(self) -> dict[str, float]:
        """Predicted bytes per device by part; the parts add up to the predicted peak."""
        paths = [a.path for a in self.plan.arguments]
        parts: dict[str, float] = {}
        for row in self.plan.rows():
            kind = self.categorize(row["path"], paths)
            parts[kind] = parts.get(kind, 0.0) + row["bytes_per_device"]
        mp = self.plan.memory_parts
        if mp:
            parts["outputs"] = mp.get("outputs", 0.0)
            parts["temporaries"] = mp.get("temporaries", 0.0)
        else:
            rest = self.plan.cost.memory_bytes - sum(parts.values())
            parts["outputs + temporaries"] = max(rest, 0.0)
        return parts

    def compiled_parts(self) -> dict[str, float] | None:
        """XLA's memory analysis: arguments, outputs not aliased to arguments, temporaries."""
        c = self.compiled
        if c is None:
            return None
        return {"arguments": float(c.argument_bytes),
                "outputs": float(max(c.output_bytes - c.alias_bytes, 0)),
                "temporaries": float(c.temp_bytes)}

    def rows(self) -> list[dict]:
        pred, comp = self.predicted(), self.compiled_parts() or {}
        after_args = ("outputs", "temporaries", "outputs + temporaries")
        rows = [{"part": k, "predicted": v, "compiled": None}
                for k, v in pred.items() if k not in after_args]
        rows.append({"part": "arguments", "predicted": sum(r["predicted"] for r in rows),
                     "compiled": comp.get("arguments")})
        rows += [{"part": k, "predicted": v, "compiled": comp.get(k)}
                 for k, v in pred.items() if k in after_args]
        rows.append({"part": "total", "predicted": sum(pred.values()),
                     "compiled": sum(comp.values()) if comp else None})
        return rows

    def cells(self, row: dict) -> list[str]:
        return [row["part"], format_bytes(row["predicted"]),
                "" if row["compiled"] is None else format_bytes(row["compiled"])]

    def plot(self):
        """Stacked bars of bytes per device: predicted, and compiled when a report is given."""
        pred, comp = self.predicted(), self.compiled_parts()
        bars = {"predicted": pred} if comp is None else {"predicted": pred, "compiled": comp}
        names = list(dict.fromkeys(k for parts in bars.values() for k in parts))
        names.sort(key=lambda n: n in ("outputs", "temporaries", "outputs + temporaries"))
        tallest = max(sum(p.values()) for p in bars.values())
        scale, unit = bytes_unit(max(tallest, 1.0))
        parts = {n: [bars[b].get(n, 0.0) / scale for b in bars] for n in names}
        fig, (ax,) = new_figure(6, 4.5)
        stacked_bars(ax, list(bars), parts, MEMORY_COLORS)
        note = budget_line(ax, self.plan.memory_budget, tallest, scale)
        ax.set_xticks(np.arange(len(bars)), list(bars))
        ax.set_ylabel(f"bytes per device ({unit})")
        ax.set_xlabel("source of the figures")
        ax.set_title(self.title + note)
        legend_below(ax)
        return fig


def memory(plan: Plan, report=None, categorize=None) -> MemoryView:
    """Per-device memory: parameters, optimizer state, data, outputs and temporaries.

    ``report`` (``plan.report(*args)``) adds XLA's compiled figures beside the prediction;
    ``categorize(path, all_paths) -> str`` overrides how arguments are grouped.

    Example::

        viz.memory(plan).plot()
        viz.memory(plan, plan.report(*args))      # predicted vs compiled
    """
    require_plan(plan, "viz.memory")
    if categorize is not None:
        validate.function(categorize, "viz.memory categorize")
    return MemoryView(plan, report, categorize)


# -- specs from plans or in_shardings pytrees ---------------------------------------------------

def is_sharding_leaf(x) -> bool:
    return x is None or isinstance(x, (NamedSharding, PartitionSpec))


def spec_of(leaf, rank: int, path: str) -> Spec | None:
    """A NamedSharding / PartitionSpec leaf as a Spec (None: left to the compiler)."""
    if leaf is None:
        return None
    pspec = leaf.spec if isinstance(leaf, NamedSharding) else leaf
    try:
        return specs.from_partition_spec(pspec, rank)
    except ValueError as e:
        raise PlanError(f"{path}: {pspec} has more entries than the array's {rank} dims") from e


def shardings_by_path(plan: Plan, in_shardings) -> dict[str, Any]:
    """Map each of ``plan``'s argument paths to its leaf of ``in_shardings``.

    ``in_shardings`` may be a prefix of the arguments' pytree (one sharding for a whole
    subtree), as ``jax.jit`` accepts.
    """
    paths = [a.path for a in plan.arguments]
    program = plan.program
    if program is not None:
        full = jax.tree_util.tree_unflatten(program.in_tree, paths)
        try:
            pairs = jax.tree.map(lambda s, sub: jax.tree.map(lambda p: (p, s), sub),
                                 in_shardings, full, is_leaf=is_sharding_leaf)
        except (ValueError, TypeError) as e:
            raise PlanError("in_shardings do not match the plan's arguments "
                            f"({len(paths)} leaves, first {paths[0]!r}): {e}") from e
        flat = jax.tree.leaves(pairs, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                               and isinstance(x[0], str))
        return dict(flat)
    leaves = jax.tree.leaves(in_shardings, is_leaf=is_sharding_leaf)
    if len(leaves) != len(paths):
        raise PlanError(f"in_shardings have {len(leaves)} leaves; the plan has {len(paths)} "
                        "arguments (bind the plan to its program to match a prefix pytree)")
    return dict(zip(paths, leaves))


@dataclasses.dataclass(frozen=True)
class SpecSource:
    """One side of a diff: a name, and a spec and mesh per argument path."""

    name: str
    specs: Mapping[str, Spec | None]
    meshes: Mapping[str, Mesh]
    plan: Plan | None = None


def spec_source(x, name: str, reference: Plan) -> SpecSource:
    if isinstance(x, Plan):
        return SpecSource(name, {a.path: a.spec for a in x.arguments},
                          {a.path: x.mesh for a in x.arguments}, x)
    by_path = shardings_by_path(reference, x)
    out, meshes = {}, {}
    for a in reference.arguments:
        leaf = by_path[a.path]
        out[a.path] = spec_of(leaf, len(a.shape), a.path)
        meshes[a.path] = leaf.mesh if isinstance(leaf, NamedSharding) else reference.mesh
    return SpecSource(name, out, meshes)


# -- diff -----------------------------------------------------------------------------------------

class DiffView(View):
    """Per argument path where two plans' specs differ."""

    right_aligned = ()

    def __init__(self, a, b, names: tuple[str, str] = ("a", "b"), show_all: bool = False):
        reference = a if isinstance(a, Plan) else b
        if not isinstance(reference, Plan):
            raise PlanError("viz.diff needs at least one autoshard.Plan to name the arguments")
        self.reference = reference
        self.a, self.b = spec_source(a, names[0], reference), spec_source(b, names[1], reference)
        check_same_arguments(self.a, self.b, reference)
        self.show_all = show_all
        self.columns = ("path", "shape", f"spec ({names[0]})", f"spec ({names[1]})",
                        f"bytes/device ({names[0]})", f"bytes/device ({names[1]})")
        self.right_aligned = self.columns[4:]
        self.title = f"{names[0]} vs {names[1]}: {len(self.changed)} of " \
                     f"{len(reference.arguments)} arguments differ"
        self.caption = self.cost_caption()

    @property
    def changed(self) -> list[str]:
        """The paths whose specs differ."""
        return [a.path for a in self.reference.arguments
                if self.a.specs[a.path] != self.b.specs[a.path]]

    def __len__(self) -> int:
        return len(self.changed)

    def rows(self) -> list[dict]:
        changed = set(self.changed)
        out = []
        for arg in self.reference.arguments:
            if not self.show_all and arg.path not in changed:
                continue
            row = {"path": arg.path, "shape": arg.shape, "changed": arg.path in changed}
            for side, key in ((self.a, "a"), (self.b, "b")):
                spec = side.specs[arg.path]
                row[f"spec_{key}"] = spec
                row[f"bytes_{key}"] = None if spec is None else specs.per_device_bytes(
                    arg.shape, arg.dtype, spec, axis_sizes(side.meshes[arg.path]))
            out.append(row)
        return out

    def cells(self, row: dict) -> list[str]:
        show = lambda s: "(compiler's choice)" if s is None else specs.spec_str(s)
        size = lambda n: "" if n is None else format_bytes(n)
        return [row["path"], str(tuple(row["shape"])), show(row["spec_a"]), show(row["spec_b"]),
                size(row["bytes_a"]), size(row["bytes_b"])]

    def cost_caption(self) -> str:
        parts = []
        for side in (self.a, self.b):
            if side.plan is not None:
                c = side.plan.cost
                parts.append(f"{side.name}: predicted {format_seconds(c.total_s)}/step, "
                             f"{format_bytes(c.memory_bytes)}/device on {mesh_str(side.plan.mesh)}")
        return "; ".join(parts)


def check_same_arguments(a: SpecSource, b: SpecSource, reference: Plan) -> None:
    """Both sides must describe the same arguments (paths and shapes)."""
    for side in (a, b):
        if side.plan is None or side.plan is reference:
            continue
        mine = {x.path: x.shape for x in reference.arguments}
        theirs = {x.path: x.shape for x in side.plan.arguments}
        missing = [p for p in mine if p not in theirs]
        if missing:
            close = difflib.get_close_matches(missing[0], list(theirs), n=1)
            hint = f" (closest: {close[0]})" if close else ""
            raise PlanError(f"plan {side.name!r} has no argument {missing[0]!r}{hint}: the "
                            "plans are for different programs")
        extra = [p for p in theirs if p not in mine]
        if extra:
            raise PlanError(f"plan {side.name!r} has argument {extra[0]!r} the other lacks: "
                            "the plans are for different programs")
        for path, shape in mine.items():
            if tuple(theirs[path]) != tuple(shape):
                raise PlanError(f"argument {path!r} has shape {tuple(shape)} in one plan "
                                f"and {tuple(theirs[path])} in {side.name!r}")


def diff(a, b, names: tuple[str, str] = ("a", "b"), show_all: bool = False) -> DiffView:
    """Where two plans put arguments differently.

    ``a`` and ``b`` are Plans (for one program, on equal or different meshes) or one of
    them is an ``in_shardings`` pytree for the plan's arguments (NamedSharding or
    PartitionSpec leaves, a prefix pytree allowed), e.g. an expert's plan.

    Example::

        d = viz.diff(plan, expert_shardings, names=("auto", "fsdp"))
        d.changed          # paths whose specs differ
        d                  # table in a notebook
    """
    validate.names_pair("viz.diff names", names)
    validate.flag("viz.diff show_all", show_all)
    return DiffView(a, b, names, show_all)


# -- what if: other mesh shapes -----------------------------------------------------------------

class WhatIfView(View):
    """One plan per mesh shape: predicted step time, communication and memory."""

    columns = ("mesh", "compute", "communication", "resharding", "total", "memory/device",
               "fits budget")
    right_aligned = columns[1:6]

    def __init__(self, plans: Mapping[str, Plan], reports: Mapping[str, Any] | None = None):
        self.plans = dict(plans)
        self.reports = dict(reports or {})
        self.title = "predicted cost per mesh shape"
        if self.reports:
            self.columns = WhatIfView.columns + ("compiled total", "compiled memory")
            self.right_aligned = self.columns[1:6] + self.columns[7:]

    def rows(self) -> list[dict]:
        out = []
        for name, plan in self.plans.items():
            c = plan.cost
            row = {"mesh": name, "compute_s": c.compute_s, "comm_s": c.comm_s - c.reshard_s,
                   "reshard_s": c.reshard_s, "total_s": c.total_s,
                   "memory_bytes": c.memory_bytes,
                   "fits": plan.memory_budget is None or c.memory_bytes <= plan.memory_budget}
            report = self.reports.get(name)
            if report is not None:
                row["compiled_total_s"] = report.compiled.total_s
                row["compiled_memory_bytes"] = report.compiled.memory_bytes
            out.append(row)
        return out

    def cells(self, row: dict) -> list[str]:
        cells = [row["mesh"], format_seconds(row["compute_s"]), format_seconds(row["comm_s"]),
                 format_seconds(row["reshard_s"]), format_seconds(row["total_s"]),
                 format_bytes(row["memory_bytes"]), "yes" if row["fits"] else "no"]
        if self.reports:
            cells += ([format_seconds(row["compiled_total_s"]),
                       format_bytes(row["compiled_memory_bytes"])]
                      if "compiled_total_s" in row else ["", ""])
        return cells

    def __getitem__(self, shape) -> Plan:
        """The plan for a mesh shape: ``view[(2, 4)]`` or ``view["2×4"]``."""
        name = shape if isinstance(shape, str) else "×".join(str(int(n)) for n in shape)
        if name not in self.plans:
            raise PlanError(f"no plan for mesh shape {name}; planned: {', '.join(self.plans)}")
        return self.plans[name]

    @property
    def best(self) -> str:
        """The mesh shape with the lowest predicted step time among those that fit."""
        rows = [r for r in self.rows() if r["fits"]] or self.rows()
        return min(rows, key=lambda r: r["total_s"])["mesh"]

    def plot(self):
        """Step time (compute, communication, resharding) and memory per mesh shape."""
        rows = self.rows()
        names = [r["mesh"] for r in rows]
        fig, (ax_t, ax_m) = new_figure(10, 4, ncols=2)
        scale, unit = time_unit(max(r["total_s"] for r in rows))
        stacked_bars(ax_t, names, {
            "compute": [r["compute_s"] / scale for r in rows],
            "collectives": [r["comm_s"] / scale for r in rows],
            "resharding": [r["reshard_s"] / scale for r in rows]},
            {"compute": COMPUTE_COLOR, "collectives": COLLECTIVE_COLORS["all-reduce"],
             "resharding": RESHARD_COLOR})
        if self.reports:
            ax_t.plot(np.arange(len(rows)), [r.get("compiled_total_s", np.nan) / scale
                                             for r in rows], "kD", label="compiled total")
        ax_t.set_xticks(np.arange(len(names)), names)
        ax_t.set_xlabel("mesh shape")
        ax_t.set_ylabel(f"predicted time per step ({unit})")
        ax_t.set_title("step time")
        legend_below(ax_t)
        tallest = max(r["memory_bytes"] for r in rows)
        mscale, munit = bytes_unit(max(tallest, 1.0))
        ax_m.bar(np.arange(len(rows)), [r["memory_bytes"] / mscale for r in rows],
                 color=MEMORY_COLORS["arguments"], label="predicted peak")
        if self.reports:
            ax_m.plot(np.arange(len(rows)), [r.get("compiled_memory_bytes", np.nan) / mscale
                                             for r in rows], "kD", label="compiled")
        budgets = [p.memory_budget for p in self.plans.values() if p.memory_budget]
        note = budget_line(ax_m, min(budgets) if budgets else None, tallest, mscale)
        ax_m.set_xticks(np.arange(len(names)), names)
        ax_m.set_xlabel("mesh shape")
        ax_m.set_ylabel(f"bytes per device ({munit})")
        ax_m.set_title("peak memory" + note)
        legend_below(ax_m)
        return fig


# -- compare: plans and expert in_shardings, by their compiled programs -------------------------

class CompareView(View):
    """Candidates judged by their compiled programs (and the planner's prediction)."""

    columns = ("plan", "predicted total", "compiled compute", "compiled communication",
               "compiled total", "compiled memory", "collectives")
    right_aligned = columns[1:]

    def __init__(self, reports: Mapping[str, Any], predicted: Mapping[str, float],
                 budget: float | None = None, title: str = "plans compared"):
        self.reports = dict(reports)
        self.predicted = dict(predicted)
        self.budget = budget
        self.title = title

    def rows(self) -> list[dict]:
        return [{"plan": name, "predicted_total_s": self.predicted.get(name),
                 "compute_s": r.compute_s, "comm_s": r.comm_s, "total_s": r.total_s,
                 "memory_bytes": r.memory_bytes, "collectives": r.count()}
                for name, r in self.reports.items()]

    def cells(self, row: dict) -> list[str]:
        pred = row["predicted_total_s"]
        return [row["plan"], "" if pred is None else format_seconds(pred),
                format_seconds(row["compute_s"]), format_seconds(row["comm_s"]),
                format_seconds(row["total_s"]), format_bytes(row["memory_bytes"]),
                str(row["collectives"])]

    @property
    def best(self) -> str:
        """The candidate with the lowest compiled step time."""
        return min(self.rows(), key=lambda r: r["total_s"])["plan"]

    def plot(self):
        """Compiled step time (compute + communication) and memory per candidate."""
        rows = self.rows()
        names = [r["plan"] for r in rows]
        fig, (ax_t, ax_m) = new_figure(10, 4, ncols=2)
        scale, unit = time_unit(max(r["total_s"] for r in rows))
        stacked_bars(ax_t, names, {"compute": [r["compute_s"] / scale for r in rows],
                                   "communication": [r["comm_s"] / scale for r in rows]},
                     {"compute": COMPUTE_COLOR, "communication": COLLECTIVE_COLORS["all-reduce"]})
        predicted = [np.nan if r["predicted_total_s"] is None else r["predicted_total_s"] / scale
                     for r in rows]
        if not np.all(np.isnan(predicted)):
            ax_t.plot(np.arange(len(rows)), predicted, "kD", label="predicted total")
        ax_t.set_xticks(np.arange(len(names)), names, rotation=20, ha="right")
        ax_t.set_xlabel("plan")
        ax_t.set_ylabel(f"compiled time per step per device ({unit})")
        ax_t.set_title("step time")
        legend_below(ax_t, drop=0.3)
        tallest = max(r["memory_bytes"] for r in rows)
        mscale, munit = bytes_unit(max(tallest, 1.0))
        ax_m.bar(np.arange(len(rows)), [r["memory_bytes"] / mscale for r in rows],
                 color=MEMORY_COLORS["arguments"], label="compiled")
        note = budget_line(ax_m, self.budget, tallest, mscale)
        ax_m.set_xticks(np.arange(len(names)), names, rotation=20, ha="right")
        ax_m.set_xlabel("plan")
        ax_m.set_ylabel(f"bytes per device ({munit})")
        ax_m.set_title("memory (XLA's analysis)" + note)
        if ax_m.get_legend_handles_labels()[0][1:]:
            legend_below(ax_m, drop=0.3)
        return fig


class ScoreboardView(View):
    """Several programs' comparisons side by side, relative to the best reference plan."""

    columns = ("program", "plan", "compiled total", "÷ fastest other", "compiled memory",
               "÷ smallest other")
    right_aligned = columns[2:]

    def __init__(self, comparisons: Mapping[str, CompareView], candidate: str = "auto"):
        self.comparisons = dict(comparisons)
        self.candidate = candidate
        self.title = f"{candidate} against the best other plan of each program (compiled)"

    def rows(self) -> list[dict]:
        out = []
        for program, view in self.comparisons.items():
            rows = view.rows()
            others = [r for r in rows if r["plan"] != self.candidate]
            best_t = min((r["total_s"] for r in others), default=None)
            best_m = min((r["memory_bytes"] for r in others), default=None)
            for r in rows:
                out.append({"program": program, "plan": r["plan"], "total_s": r["total_s"],
                            "memory_bytes": r["memory_bytes"],
                            "time_ratio": r["total_s"] / best_t if best_t else None,
                            "memory_ratio": r["memory_bytes"] / best_m if best_m else None})
        return out

    def cells(self, row: dict) -> list[str]:
        ratio = lambda x: "" if x is None else f"{x:.2f}×"
        return [row["program"], row["plan"], format_seconds(row["total_s"]),
                ratio(row["time_ratio"]), format_bytes(row["memory_bytes"]),
                ratio(row["memory_ratio"])]

    def summary(self) -> list[dict]:
        """Per program: the candidate's and the best other plan's compiled step time."""
        out = []
        for program in self.comparisons:
            rows = [r for r in self.rows() if r["program"] == program]
            mine = next((r for r in rows if r["plan"] == self.candidate), None)
            others = [r for r in rows if r["plan"] != self.candidate]
            best = min(others, key=lambda r: r["total_s"]) if others else None
            out.append({"program": program, "best_other": best and best["plan"],
                        "best_other_s": best and best["total_s"],
                        "candidate_s": mine and mine["total_s"],
                        "time_ratio": mine and mine["time_ratio"]})
        return out

    def plot(self):
        """Compiled step time of every plan, relative to the best other plan per program."""
        programs = list(self.comparisons)
        plans = list(dict.fromkeys(r["plan"] for r in self.rows()))
        width = 0.8 / max(len(plans), 1)
        fig, (ax,) = new_figure(max(6, 1.6 * len(programs) + 3), 4.5)
        rows = self.rows()
        palette = iter(["#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
                        "#8c8c8c", "#ccb974", "#64b5cd"] * 4)
        for k, name in enumerate(plans):
            values = [next((r["time_ratio"] for r in rows if r["program"] == p
                            and r["plan"] == name), None) for p in programs]
            values = [np.nan if v is None else v for v in values]
            color = COMPUTE_COLOR if name == self.candidate else next(palette)
            ax.bar(np.arange(len(programs)) + (k - (len(plans) - 1) / 2) * width, values,
                   width, label=name, color=color)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(programs)), programs)
        ax.set_xlabel("program")
        ax.set_ylabel("compiled step time ÷ fastest other plan's (log scale)")
        ax.set_title(self.title)
        legend_below(ax, ncol=min(len(plans), 5))
        return fig


def scoreboard(comparisons: Mapping[str, CompareView], candidate: str = "auto") -> ScoreboardView:
    """Put several ``compare`` views (one per program) side by side.

    Example::

        views = {name: viz.compare(...) for name in models.names()}
        board = viz.scoreboard(views)        # table: each plan vs the best expert
        board.plot()                         # ratios; 1.0 is the best expert
    """
    validate.mapping("viz.scoreboard comparisons", comparisons)
    for name, view in comparisons.items():
        if not isinstance(view, CompareView):
            raise OptionError(f"viz.scoreboard comparisons[{name!r}] must be a viz.compare "
                              f"view, got {type(view).__name__}")
    return ScoreboardView(comparisons, candidate)


# -- one tensor across the mesh -----------------------------------------------------------------

class ShardingView(View):
    """Which block of one argument each device holds."""

    columns = ("device", "block", "bytes")
    right_aligned = ("bytes",)

    def __init__(self, plan: Plan, path: str):
        self.plan = require_plan(plan, "viz.sharding")
        self.arg = plan.argument(path)
        self.shape = tuple(self.arg.shape)
        self.named = NamedSharding(plan.mesh, specs.to_partition_spec(self.arg.spec))
        self.title = (f"{path} {self.arg.dtype}{list(self.shape)} as "
                      f"{specs.spec_str(self.arg.spec)} on mesh {mesh_str(plan.mesh)}")
        self.caption = sharding_sentence(self.arg, plan.mesh)

    def rows(self) -> list[dict]:
        index_map = self.named.devices_indices_map(self.shape)
        per_device = specs.per_device_bytes(self.shape, self.arg.dtype, self.arg.spec,
                                            axis_sizes(self.plan.mesh))
        return [{"device": d.id, "block": tuple(index_map[d]), "bytes": per_device}
                for d in self.plan.mesh.devices.flat]

    def cells(self, row: dict) -> list[str]:
        block = ", ".join(f"{s.start or 0}:{self.shape[i] if s.stop is None else s.stop}"
                          for i, s in enumerate(row["block"])) if row["block"] else "scalar"
        return [str(row["device"]), f"[{block}]", format_bytes(row["bytes"])]

    def shown_dims(self) -> tuple[int, ...]:
        """At most two dims to draw: the split ones first, then the leading ones."""
        split = [d for d, axes in enumerate(self.arg.spec) if axes]
        rest = [d for d in range(len(self.shape)) if d not in split]
        return tuple(sorted((split + rest)[:2]))

    def view_2d(self) -> tuple[tuple[int, ...], NamedSharding]:
        dims = self.shown_dims()
        if not dims:
            return (1,), NamedSharding(self.plan.mesh, PartitionSpec())
        spec = tuple(self.arg.spec[d] for d in dims)
        return tuple(self.shape[d] for d in dims), NamedSharding(
            self.plan.mesh, specs.to_partition_spec(spec))

    def show(self, **kwargs) -> None:
        """Draw the blocks with ``jax.debug.visualize_sharding`` (dims beyond two whole)."""
        shape, named = self.view_2d()
        jax.debug.visualize_sharding(shape, named, **kwargs)

    def grid(self) -> list[list[str]]:
        """Rows × columns of the drawn dims; each cell names the devices holding it."""
        shape, named = self.view_2d()
        index_map = named.devices_indices_map(shape)
        starts = [sorted({(idx[k].start or 0) for idx in index_map.values()})
                  for k in range(len(shape))]
        if len(shape) == 1:
            starts = [[0]] + starts
        cells = [[set() for _ in starts[1]] for _ in starts[0]]
        for device, idx in index_map.items():
            idx = ((slice(0, 1),) + tuple(idx)) if len(shape) == 1 else tuple(idx)
            i = starts[0].index(idx[0].start or 0)
            j = starts[1].index(idx[1].start or 0)
            cells[i][j].add(device.id)
        return [[",".join(map(str, sorted(c))) for c in row] for row in cells]

    def _repr_html_(self) -> str:
        rows = "".join("<tr>" + "".join(
            f"<td style='border:1px solid #888;padding:6px;text-align:center'>devices "
            f"{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.grid())
        dims = self.shown_dims()
        note = (f"dims {', '.join(map(str, dims))} drawn; others whole"
                if len(self.shape) > 2 else "")
        return (f"<p>{html.escape(self.title)}</p><table style='border-collapse:collapse'>"
                f"{rows}</table><p style='font-size:smaller'>{html.escape(self.caption)} "
                f"{html.escape(note)}</p>")


def sharding(plan: Plan, path: str) -> ShardingView:
    """How one argument is laid out across the mesh.

    Example::

        v = viz.sharding(plan, "params['layers'][0]['w1']")
        v              # grid of blocks and the devices holding each, in a notebook
        v.show()       # jax.debug.visualize_sharding of the same
        v.rows()       # device id -> index block
    """
    return ShardingView(plan, path)


# -- explain --------------------------------------------------------------------------------------

def dims_phrase(spec: Spec, sizes: Mapping[str, int]) -> str:
    parts = []
    for d, axes in enumerate(spec):
        if axes:
            names = " and ".join(repr(a) for a in axes)
            parts.append(f"dim {d} over {names} ({specs.dim_shards(axes, sizes)} ways)")
    return ", ".join(parts)


def sharding_sentence(arg, mesh: Mesh) -> str:
    """One sentence: how ``arg`` is split and what each device keeps."""
    sizes = axis_sizes(mesh)
    total = specs.nbytes(arg.shape, arg.dtype)
    per_device = specs.per_device_bytes(arg.shape, arg.dtype, arg.spec, sizes)
    head = f"{arg.path} ({arg.dtype}{list(arg.shape)}, {format_bytes(total)})"
    if not specs.spec_axes(arg.spec):
        return f"{head} is replicated: every device holds all of it."
    unused = [a for a, n in sizes.items() if n > 1 and a not in specs.spec_axes(arg.spec)]
    copies = f", and it is copied across {' and '.join(map(repr, unused))}" if unused else ""
    return (f"{head} is split {specs.spec_str(arg.spec)}: {dims_phrase(arg.spec, sizes)}, so "
            f"each device holds {format_bytes(per_device)}{copies}.")


def explain(plan: Plan, path: str) -> str:
    """Why the argument at ``path`` got its spec, in a sentence or two.

    Example::

        print(viz.explain(plan, "params['layers'][0]['w1']"))
        # params['layers'][0]['w1'] (float32[64, 256], 64.0 KiB) is split P(None, model):
        # dim 1 over 'model' (4 ways), so each device holds 16.0 KiB, and it is copied
        # across 'data'. The next best choice, P(data, model), would make the step 1.20 µs
        # slower; keeping it whole, 3.10 µs slower. (...)
        #   P(data, model)               would cost 1.20 µs more per step
        #   P(None, None)                would cost 3.10 µs more per step
    """
    require_plan(plan, "viz.explain")
    arg = plan.argument(path)
    return "\n".join([choice_sentences(arg, plan.mesh), *runner_up_lines(arg)])


def runner_up_lines(arg) -> list[str]:
    """One line per spec the argument could have taken, with what it would cost."""
    lines = []
    for spec, extra in arg.alternatives:
        more = "the same" if abs(extra) < 1e-12 else (
            f"{format_seconds(abs(extra))} {'more' if extra > 0 else 'less'}")
        lines.append(f"  {specs.spec_str(spec):<28} would cost {more} per step")
    return lines


def choice_sentences(arg, mesh: Mesh) -> str:
    """How ``arg`` is split and why: the next best spec and keeping it whole."""
    first = sharding_sentence(arg, mesh)
    if not arg.alternatives:
        return (first + " No other spec was open to it: it is pinned, too small to split, "
                "or no mesh axis divides its dims.")
    spec, extra = arg.alternatives[0]
    if abs(extra) < 1e-12:
        why = f" {specs.spec_str(spec)} would cost the same per step."
    elif extra < 0:
        why = (f" {specs.spec_str(spec)} would make the step {format_seconds(-extra)} faster, "
               "but the plan needs the memory this spec saves to fit the budget.")
    else:
        why = (f" The next best choice, {specs.spec_str(spec)}, would make the step "
               f"{format_seconds(extra)} slower")
        whole = specs.replicated(len(arg.shape))
        whole_cost = dict(arg.alternatives).get(whole)
        if whole_cost is not None and whole != spec:
            why += f"; keeping it whole, {format_seconds(whole_cost)} slower"
        why += "."
    return first + why + " (Each cost counts the argument's own and its neighbours' " \
                         "work with the rest of the plan held fixed.)"


if __name__ == "__main__":      # python -m autoshard.report.viz: the command ``autoshard view``
    import sys

    from autoshard.runtime.cli import main
    raise SystemExit(main(["view", *sys.argv[1:]]))
