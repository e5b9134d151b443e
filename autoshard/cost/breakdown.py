"""breakdown: where a plan's predicted time and memory go, per layer and per collective.

After solving, ``cost_breakdown`` turns the CostGraph and the chosen strategies into one
``CostItem`` per (group, layer): the group's compute seconds, its collectives' seconds by
kind, and the resharding its operands need. ``memory_parts`` splits the predicted peak
into arguments, outputs and temporaries. Both travel on the ``Plan`` (``plan.breakdown``,
``plan.memory_parts``) so views can draw them without the program.

Layers are named after the parameters an equation reads: ``params['layers'][0]['wq']``
belongs to layer ``params['layers'][0]``, the optimizer state of a parameter to the
parameter's layer, and an equation reading no parameter to the layer of its largest
operand.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from autoshard.cost import CostGraph, reshard_collectives

KEY_PATTERN = re.compile(r"\[[^\]]*\]|\.[A-Za-z_]\w*")


@dataclasses.dataclass(frozen=True)
class CostItem:
    """Predicted seconds per device of one group of equations in one layer.

    ``comm_s_by_kind`` maps a collective kind ("all-reduce", "reduce-scatter", ...) to
    the seconds the group's own collectives take; ``reshard_s`` is the time spent moving
    its operands into the specs it wants, and ``reshard_s_by_kind`` the same split by the
    collectives that move them. Seconds include loop trip counts; ``weight`` is how many
    times the group's first equation runs per call.
    """

    label: str
    primitive: str
    compute_s: float
    comm_s_by_kind: Mapping[str, float]
    reshard_s: float
    weight: float = 1.0
    reshard_s_by_kind: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def comm_s(self) -> float:
        return float(sum(self.comm_s_by_kind.values()))

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s

    def to_dict(self) -> dict:
        return {"label": self.label, "primitive": self.primitive, "compute_s": self.compute_s,
                "comm_s_by_kind": dict(self.comm_s_by_kind), "reshard_s": self.reshard_s,
                "weight": self.weight, "reshard_s_by_kind": dict(self.reshard_s_by_kind)}

    @classmethod
    def from_dict(cls, d: Mapping) -> CostItem:
        return cls(d["label"], d["primitive"], float(d["compute_s"]),
                   {k: float(v) for k, v in d["comm_s_by_kind"].items()},
                   float(d["reshard_s"]), float(d.get("weight", 1.0)),
                   {k: float(v) for k, v in d.get("reshard_s_by_kind", {}).items()})


# -- layers from argument paths ---------------------------------------------------------------

def path_keys(path: str) -> tuple[str, tuple[str, ...]]:
    """``"opt_state['m'][0].value"`` -> ``("opt_state", ("['m']", "[0]", ".value"))``."""
    match = KEY_PATTERN.search(path)
    head = path if match is None else path[:match.start()]
    return head, tuple(KEY_PATTERN.findall(path[len(head):]))


CONTAINER_KEYS = ("['params']", "['param']", "['model']", "['weights']")


def is_index(key: str) -> bool:
    return re.fullmatch(r"\[\d+\]", key) is not None


def layer_of(path: str) -> str:
    """The layer an argument path belongs to: its keys up to the last list index, else
    its first key (after a ``['params']``-like container).

    Example::

        layer_of("params['layers'][0]['wq']")                 # "params['layers'][0]"
        layer_of("params['ln_f']['scale']")                   # "params['ln_f']"
        layer_of("params['layers']['wq']")                    # "params['layers']" (stacked)
        layer_of("state['params']['embed']['embedding'].value")   # "state['params']['embed']"
    """
    head, keys = path_keys(path)
    while keys and keys[-1].startswith("."):      # .value of nnx variables
        keys = keys[:-1]
    container = 1 if keys[:1] and keys[0] in CONTAINER_KEYS and len(keys) > 1 else 0
    indices = [i for i, k in enumerate(keys) if is_index(k)]
    if indices:
        return head + "".join(keys[:indices[-1] + 1])
    return head + "".join(keys[:container + 1])


def mirrors(a_head: str, a_prefix: Sequence[str], b_head: str) -> bool:
    """Whether keys ``a_prefix`` in front of another argument's keys mark optimizer state:
    a separate argument (``opt_state``), or an ``opt``/attribute key (``.mu``)."""
    return a_head != b_head or any("opt" in k.lower() or k.startswith(".") for k in a_prefix)


def argument_layers(paths: Sequence[str]) -> list[str]:
    """Per argument path, its layer; optimizer state joins the parameter it mirrors.

    ``opt_state['m']['layers'][0]['wq']`` ends with the keys of
    ``params['layers'][0]['wq']`` behind a longer prefix, so both belong to
    ``params['layers'][0]``; so do ``state['opt_state'][0].mu['blocks'][0]['w']`` and
    ``state['params']['blocks'][0]['w']``.
    """
    keyed = [path_keys(p) for p in paths]
    by_suffix: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for n, (_, keys) in enumerate(keyed):
        for j in range(len(keys)):
            by_suffix.setdefault(keys[j:], []).append((j, n))
    layers = []
    for path, (head, keys) in zip(paths, keyed):
        twin = path
        for start in range(1, len(keys)):
            suffix = keys[start:]
            if all(k.startswith(".") for k in suffix):
                break
            found = [(j, n) for j, n in by_suffix.get(suffix, ())
                     if j < start and mirrors(head, keys[:start], keyed[n][0])]
            if found:
                twin = paths[min(found)[1]]
                break
        layers.append(layer_of(twin))
    return layers


def node_layers(cg: CostGraph) -> list[str]:
    """A layer per node: from the parameters it reads, else from its largest operand;
    equations without operands (iota, constants) join the layer of their first user."""
    graph = cg.space.graph
    arg_layer = dict(zip(graph.arg_nodes, argument_layers(graph.arg_paths)))
    labels: list[str | None] = []
    for node in graph.nodes:
        if node.id in arg_layer:
            labels.append(arg_layer[node.id])
            continue
        from_params, from_data = [], []
        for value_id in node.operands:
            if value_id is None:
                continue
            value = graph.values[value_id]
            num_bytes = value.num_bytes
            root = cg.groups[cg.group_of_node[value.producer]][0]
            if root in arg_layer:
                from_params.append((num_bytes, arg_layer[root]))
            if value.producer < node.id and labels[value.producer] is not None:
                from_data.append((num_bytes, labels[value.producer]))
        found = from_params or from_data
        labels.append(max(found, key=lambda t: t[0])[1] if found else None)
    for node in reversed(graph.nodes):
        if labels[node.id] is None:
            users = [u for v in node.outputs for u, _ in graph.users[v]
                     if labels[u] is not None]
            labels[node.id] = labels[min(users)] if users else "(constants)"
    return labels


# -- the breakdown ------------------------------------------------------------------------------

LATENCY_LABEL = "(combined collectives)"


def cost_breakdown(cg: CostGraph, chosen: Sequence, reshards: Sequence[Sequence[float]],
                   latency_s: float = 0.0) -> tuple[CostItem, ...]:
    """One CostItem per (group, layer) with any cost under ``chosen`` (a strategy per node,
    ``CostGraph.node_strategies``); ``reshards`` holds the seconds resharding each node's
    operands take (``cost.operand_reshard_seconds``). The latencies of combined
    collectives, paid once for many nodes (``Evaluation.latency_s``), are one item of
    their own.

    The items add up to the plan's cost: compute to ``PlanCost.compute_s``, collectives
    plus resharding to ``PlanCost.comm_s``, resharding alone to ``PlanCost.reshard_s``.
    """
    graph = cg.space.graph
    layers = node_layers(cg)
    acc: dict[tuple[int, str], dict] = {}
    for node in graph.nodes:
        g = cg.group_of_node[node.id]
        entry = acc.get((g, layers[node.id]))
        if entry is None:
            entry = acc[(g, layers[node.id])] = {
                "primitive": node.primitive, "weight": node.weight, "compute_s": 0.0,
                "comm": {}, "reshard_s": 0.0, "reshards": {}, "heaviest": -1.0}
        s = chosen[node.id]
        entry["compute_s"] += s.compute_s
        listed = 0.0
        for c in s.collectives:
            entry["comm"][c.kind] = entry["comm"].get(c.kind, 0.0) + c.seconds
            listed += c.seconds
        if s.comm_s - listed > 1e-18:
            entry["comm"]["other"] = entry["comm"].get("other", 0.0) + s.comm_s - listed
        seconds = 0.0
        for x in reshards[node.id]:
            seconds += x
        entry["reshard_s"] += seconds
        if seconds:
            for kind, x in reshard_kinds(cg, chosen, node, reshards[node.id]).items():
                entry["reshards"][kind] = entry["reshards"].get(kind, 0.0) + x
        if s.seconds > entry["heaviest"] and node.kind == "eqn":
            entry["primitive"], entry["weight"], entry["heaviest"] = (node.primitive,
                                                                      node.weight, s.seconds)
    items = []
    for (_, label), e in acc.items():
        if e["compute_s"] or e["comm"] or e["reshard_s"]:
            items.append(CostItem(label, e["primitive"], e["compute_s"], e["comm"],
                                  e["reshard_s"], e["weight"], e["reshards"]))
    if latency_s:
        items.append(CostItem(LATENCY_LABEL, "latency", 0.0, {"latency": latency_s}, 0.0))
    return tuple(items)


def reshard_kinds(cg: CostGraph, chosen: Sequence, node,
                  seconds: Sequence[float]) -> dict[str, float]:
    """The seconds resharding a node's operands takes (``seconds``, one per operand that is
    no literal), split by the kind of the collectives that move each."""
    graph, out = cg.space.graph, {}
    operands = [(i, v) for i, v in enumerate(node.operands) if v is not None]
    for (i, value_id), x in zip(operands, seconds):
        if not x:
            continue
        value = graph.values[value_id]
        found = reshard_collectives(value.shape, value.dtype,
                                    chosen[value.producer].out_specs[value.index],
                                    chosen[node.id].in_specs[i], cg.space.axis_sizes,
                                    cg.space.hardware)
        total = sum(c.seconds for c in found)
        for c in found:
            out[c.kind] = out.get(c.kind, 0.0) + x * c.seconds / total
    return out


def memory_parts(cg: CostGraph, choice: Sequence[int], peak_bytes: float) -> dict[str, float]:
    """The predicted peak bytes per device split into arguments, outputs and temporaries.

    Outputs written into donated arguments count nothing of their own.
    """
    num_args = len(cg.space.graph.arg_nodes)
    fixed = [float(cg.memory_terms[t].num_bytes[choice[cg.memory_terms[t].group]])
             for t in cg.fixed_terms]
    arguments, outputs = sum(fixed[:num_args]), sum(fixed[num_args:])
    return {"arguments": arguments, "outputs": outputs,
            "temporaries": max(float(peak_bytes) - arguments - outputs, 0.0)}
