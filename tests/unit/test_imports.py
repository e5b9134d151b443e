"""The package's folders are its layers, and they import downwards only: the solver at the
bottom (numbers, no jax), then the frontend (jaxprs), the target (devices and XLA's habits),
the rules, the cost stage, the rewrite, planning, the reports, the zoo, the test programs
and the runtime on top. No module imports in a cycle, and each imports on its own in a
fresh interpreter."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "autoshard"

# The layers, lowest first: a module imports from its own layer and the ones below.
LAYERS = (("errors", "units", "extras"), ("solver",), ("frontend",), ("target",), ("rules",),
          ("cost",), ("rewrite",), ("planning",), ("report",), ("zoo",), ("testing",),
          ("runtime",))
# Imports made when a function runs that point back up the layers, each for a reason. Each
# closes a cycle of two: the target imports the source and nothing that leads back to it.
UPWARD = {
    ("autoshard.planning.plan", "autoshard.report.viz"):
        "Plan.summary / explain / diff hand over to viz",
    ("autoshard.planning.plan", "autoshard.report.hlo_report"):
        "Plan.report compiles the plan and reads its program",
}
NO_JAX = ("jax", "jaxlib", "flax")   # what the solver's modules never reach


def module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def is_guard(node) -> bool:
    """``if __name__ == "__main__":`` (the command line) or ``if TYPE_CHECKING:``."""
    if not isinstance(node, ast.If):
        return False
    text = ast.unparse(node.test)
    return "__main__" in text or "TYPE_CHECKING" in text


def imported(tree, names) -> set[str]:
    """The package's modules that ``tree`` imports, anywhere but under a guard."""
    found, stack = set(), [tree]
    while stack:
        node = stack.pop()
        if is_guard(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(names)
            found |= subs or {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & set(names)


def import_graph(skip=()) -> dict[str, set[str]]:
    """Module -> the modules it imports (a module always imports its parent packages
    first, so those edges are left out), less the ``skip`` edges."""
    names = module_names()
    graph = {}
    for name, path in names.items():
        targets = imported(ast.parse(path.read_text()), names)
        graph[name] = {t for t in targets if not (name + ".").startswith(t + ".")
                       and (name, t) not in skip}
    return graph


def find_cycle(graph) -> list[str] | None:
    state, path = {}, []

    def visit(u):
        state[u] = "open"
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return path[path.index(v):] + [v]
            if v not in state and (cycle := visit(v)):
                return cycle
        path.pop()
        state[u] = "done"
        return None

    for u in sorted(graph):
        if u not in state and (cycle := visit(u)):
            return cycle
    return None


def reaches(graph, start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        u = stack.pop()
        if u == goal:
            return True
        if u not in seen:
            seen.add(u)
            stack.extend(graph[u])
    return False


def layer_of(module: str) -> int:
    """The rank of ``module``'s layer (``autoshard.<folder or module>...``)."""
    first = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if first in names)


def test_layers_import_downwards():
    graph = import_graph(skip=UPWARD)
    upward = [(source, target) for source, targets in graph.items() if source != "autoshard"
              for target in targets if layer_of(target) > layer_of(source)]
    assert not upward, upward


def test_every_module_has_a_layer():
    for name in module_names():
        if name != "autoshard":
            layer_of(name)


def external_imports(path: pathlib.Path) -> set[str]:
    """The top-level packages outside autoshard that a module imports, guards included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
    return found - {"autoshard"}


def test_the_solver_imports_no_jax():
    """The solver reads numbers: nothing it reaches imports jax, so it is tested and
    reasoned about without JAX's tracing."""
    names, graph = module_names(), import_graph()
    solver = [n for n in names if n.startswith("autoshard.solver")]
    reached, stack = set(), list(solver)
    while stack:
        module = stack.pop()
        if module not in reached:
            reached.add(module)
            stack.extend(t for t in graph[module] if t != "autoshard")
    culprits = {m: external_imports(names[m]) & set(NO_JAX) for m in reached}
    assert not {m: c for m, c in culprits.items() if c}
    assert all(m.startswith("autoshard.solver") or m == "autoshard.errors" for m in reached), \
        reached


def test_an_upward_import_is_found(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", LAYERS[::-1])
    with pytest.raises(AssertionError):
        test_layers_import_downwards()


def test_no_import_cycles():
    graph = import_graph(skip=UPWARD)
    assert find_cycle(graph) is None
    for source, target in UPWARD:      # e.g. viz -> api -> plan would close a longer cycle
        around = [v for v in graph[target] if v != source and reaches(graph, v, source)]
        assert not around, f"{target} reaches {source} through {around}"


def test_the_upward_imports_are_still_there():
    graph = import_graph()
    for source, target in UPWARD:
        assert target in graph[source], f"{source} no longer imports {target}: drop it"


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(module_names()))
def test_module_imports_alone(name):
    if name.startswith("autoshard.testing.corpus"):
        pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout
