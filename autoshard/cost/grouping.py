"""cost.grouping: nodes that simply follow an operand (elementwise chains, reshapes,
converts, loop seams) join their producer's group, so the solver picks one strategy
per group; a node's strategy per strategy of its group is its ``picks``
(``group_nodes`` -> ``Groups``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from autoshard.frontend.specs import Spec

if TYPE_CHECKING:
    from autoshard.cost.reshard import ReshardPrices


@dataclasses.dataclass(frozen=True, eq=False)
class Menu:
    """A node's strategies in the order of its group's: per group strategy, the node's
    seconds, the spec each operand is read in and the spec each result is written in.
    Nodes with the same strategies and the same picks (a repeated layer's) share one.
    Lists of specs are numbered (``ReshardPrices.spec_list``): caches key them by number."""
    seconds: np.ndarray
    compute: np.ndarray          # the part of ``seconds`` spent computing
    comm: np.ndarray             # the part spent in collectives
    in_lists: tuple[int, ...]    # per operand
    out_lists: tuple[int, ...]   # per result


@dataclasses.dataclass(frozen=True, eq=False)
class Groups:
    """The grouping of a program's nodes: per node its group and its picks (group strategy
    -> node strategy) and its ``Menu``; per group its member nodes, root first. Nodes
    sharing a menu share one ``Menu`` object. ``spec_lists`` resolves the menus' numbers
    (``ReshardPrices.spec_list``)."""
    group_of_node: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    picks: tuple[np.ndarray, ...]
    menus: tuple[Menu, ...]
    spec_lists: tuple[tuple[Spec, ...], ...]

    def out_specs(self, node_id: int, index: int) -> tuple[Spec, ...]:
        """The spec of a node's result per strategy of its group."""
        return self.spec_lists[self.menus[node_id].out_lists[index]]

    def in_specs(self, node_id: int, i: int) -> tuple[Spec, ...]:
        """The spec a node reads operand ``i`` in per strategy of its group."""
        return self.spec_lists[self.menus[node_id].in_lists[i]]

    def group_size(self, g: int) -> int:
        return len(self.picks[self.groups[g][0]])


def group_nodes(space, prices: ReshardPrices,
                donated_arg_of_output: Mapping[int, int]) -> Groups:
    """Each node in program order: a follower (``_Grouper.main_operand``) joins its
    operand's group, picking per strategy of that group the one it takes the operand in;
    any other node roots a group of its own. ``donated_arg_of_output`` maps a node
    written into a donated argument's buffer to that argument's node."""
    return _Grouper(space, prices, donated_arg_of_output).build()


class _Grouper:
    """``group_nodes``'s state while it walks the program, and its caches."""

    def __init__(self, space, prices: ReshardPrices, donated_arg_of_output: Mapping[int, int]):
        self.space, self.graph, self.prices = space, space.graph, prices
        self.donated_arg_of_output = donated_arg_of_output
        self.value_num_bytes = [v.num_bytes for v in self.graph.values]
        self.group_of_node: list[int] = []
        self.groups: list[list[int]] = []
        self.picks: list[np.ndarray] = []   # per node: group strategy -> node strategy
        self.menus: list[Menu] = []         # per node, once its group strategies are known
        self._menus: dict = {}
        self._follows: dict = {}
        self._all_picks: dict = {}

    def build(self) -> Groups:
        for node in self.graph.nodes:
            i = self.main_operand(node)
            if i is None:
                self.group_of_node.append(len(self.groups))
                self.groups.append([node.id])
                self.picks.append(self.all_picks(len(self.space.strategies[node.id])))
            else:
                g = self.group_of_node[self.graph.values[node.operands[i]].producer]
                self.picks.append(self.follow(node, i))
                self.group_of_node.append(g)
                self.groups[g].append(node.id)
            self.menus.append(self.menu_of(node.id))
        return Groups(tuple(self.group_of_node), tuple(tuple(g) for g in self.groups),
                      tuple(self.picks), tuple(self.menus), tuple(self.prices.spec_lists.items))

    def menu_key(self, node_id: int) -> tuple:
        """Nodes of one key have one menu: the same strategies, picked alike."""
        return self.space.menu_ids[node_id], self.picks[node_id].tobytes()

    def all_picks(self, num_strategies: int) -> np.ndarray:
        """The picks of a group's root: every strategy of its own, one array per count."""
        if num_strategies not in self._all_picks:
            self._all_picks[num_strategies] = np.arange(num_strategies, dtype=np.int32)
        return self._all_picks[num_strategies]

    def menu_of(self, node_id: int) -> Menu:
        strategies, picks = self.space.strategies[node_id], self.picks[node_id]
        key = self.menu_key(node_id)
        found = self._menus.get(key)
        if found is None:
            chosen = [strategies[c] for c in picks]
            node = self.graph.nodes[node_id]
            found = self._menus[key] = Menu(
                np.array([s.seconds for s in strategies])[picks],
                np.array([s.compute_s for s in strategies])[picks],
                np.array([s.comm_s for s in strategies])[picks],
                tuple(self.prices.spec_list(tuple(s.in_specs[i] for s in chosen))
                      for i in range(len(node.operands))),
                tuple(self.prices.spec_list(tuple(s.out_specs[k] for s in chosen))
                      for k in range(len(node.outputs))))
        return found

    def out_specs(self, node_id: int, index: int) -> tuple[Spec, ...]:
        return self.prices.spec_lists.items[self.menus[node_id].out_lists[index]]

    def main_operand(self, node) -> int | None:
        einsum = self.space.einsums[node.id]
        if node.kind == "arg" or node.kind == "const" or einsum is None or not einsum.fusible:
            return None
        best, best_bytes = None, -1
        for i, v in enumerate(node.operands):
            if v is not None and self.graph.values[v].producer < node.id:
                if self.value_num_bytes[v] > best_bytes:
                    best, best_bytes = i, self.value_num_bytes[v]
        if best is None:
            return None
        producer = self.graph.values[node.operands[best]].producer
        if self.graph.nodes[producer].kind == "arg" and len(self.space.strategies[node.id]) > 1:
            # an argument's spec is where it arrives, not where its readers compute: a
            # replicated argument may be read in slices for free (Adam's update of a
            # replicated moment, split over the batch axes). Following it would keep
            # those plans out of the search, which pinning the argument opens.
            return None
        fixed = len(self.picks[self.groups[self.group_of_node[producer]][0]]) == 1
        if fixed and len(self.space.strategies[node.id]) > 1:
            return None   # a group with one strategy would decide this node's alone
        if not self.can_keep_donated_spec(node, node.operands[best]):
            return None
        out_bytes = max(self.value_num_bytes[o] for o in node.outputs)
        return best if out_bytes <= best_bytes else None

    def can_keep_donated_spec(self, node, value_id: int) -> bool:
        """Whether an output written into a donated argument can follow its operand: only
        if every spec the argument may take is one the operand comes in. A pinned argument
        whose spec the operand never has (a scan stacks it whole on the layer dim) needs
        the output resharded into it, so the output keeps a group of its own."""
        arg = self.donated_arg_of_output.get(node.id)
        if arg is None:
            return True
        value = self.graph.values[value_id]
        available = set(self.out_specs(value.producer, value.index))
        return all(s.out_specs[0] in available for s in self.space.strategies[arg])

    def follow(self, node, i) -> np.ndarray:
        value = self.graph.values[node.operands[i]]
        u = value.producer
        strategies = self.space.strategies[node.id]
        srcs = self.out_specs(u, value.index)
        key = (self.space.menu_ids[node.id], i, self.prices.value_array[value.id],
               self.menus[u].out_lists[value.index])
        if key in self._follows:
            return self._follows[key]
        picks, by_spec = [], {}
        for src in srcs:
            if src not in by_spec:
                # take the operand as it comes when a strategy can; slicing it further
                # is a decision for the solver, not for a follower
                same = [k for k, t in enumerate(strategies) if t.in_specs[i] == src]
                if same:
                    by_spec[src] = min(same, key=lambda k: strategies[k].seconds)
                else:
                    reshard = self.prices.reshard
                    by_spec[src] = int(np.argmin([reshard(value.id, src, t.in_specs[i])
                                                  + t.seconds for t in strategies]))
            picks.append(by_spec[src])
        self._follows[key] = np.asarray(picks, dtype=np.int32)
        return self._follows[key]
