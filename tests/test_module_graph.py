"""The package's own import graph: no cycles, and the pure side never reaches torch or the runtime.

Every ``import`` and ``from ... import`` in every module counts, at the top or inside a
function (a lazy import is still a dependency). Read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import torchpipedream

PACKAGE = Path(torchpipedream.__file__).resolve().parent

#: Modules that plan, prove and simulate without torch: graph → plan → schedule → simulator.
PURE = {"util.jsonio", "util.units", "model.graph", "model.pipedream_profile", "model.profiles",
        "plans.kinds", "plans.plan", "plans.memory", "plans.topology", "schedule.placement", "schedule.actions",
        "schedule.build", "schedule.orders", "schedule.versions", "schedule.validate", "schedule.torch_text",
        "sim.costs", "sim.simulator", "sim.trace", "sim.draw",
        "search.planner", "search.auto", "host.tuning", "host.huge_pages", "host.freed_memory"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for type hints only)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module this one imports at run time: torchpipedream modules by name, others by
    top package."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(alias.name if alias.name.startswith("torchpipedream") else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("torchpipedream"):
                out.add(target.split(".")[0])
                continue
            for alias in node.names:  # `from . import commands` imports a module
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycles() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = _graph()
    graph["torchpipedream.model.graph"] = graph["torchpipedream.model.graph"] | {"torchpipedream.search.planner"}
    cycle = _find_cycle(graph)
    assert cycle is not None and "torchpipedream.model.graph" in cycle and "torchpipedream.search.planner" in cycle


#: The flow's layers, lowest first: a module may import its own layer or a lower one, never a
#: higher one. util and host hold helpers; model describes and measures the model; plans say what
#: a plan is; schedule turns a plan into action lists; sim interprets them without torch; search
#: chooses plans by simulating them; runtime runs them; train and cli are the jobs on top.
LAYERS = [("util", "host"), ("model", "models"), ("plans",), ("schedule",), ("sim",), ("search",), ("runtime",),
          ("train",), ("cli",)]


def _layer(module: str) -> int:
    """The layer index of a torchpipedream module (the package's own __init__/__main__ is on top)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in ("__main__",):
        return len(LAYERS)
    for index, folders in enumerate(LAYERS):
        if parts[1] in folders:
            return index
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{src} ({LAYERS[_layer(src)][0]}) imports {dst} ({LAYERS[_layer(dst)][0]})"
                  for src, targets in graph.items() if _layer(src) < len(LAYERS)
                  for dst in targets if dst.startswith("torchpipedream.") and _layer(dst) > _layer(src))


def test_every_module_sits_in_a_layer_folder() -> None:
    for name in _modules():
        _layer(name)  # raises for a module outside the layer folders


def test_no_module_imports_one_above_it_in_the_flow() -> None:
    bad = _upward_imports(_graph())
    assert not bad, "imports against the flow:\n" + "\n".join(bad)


def test_the_layer_check_finds_a_planted_upward_import() -> None:
    graph = _graph()
    graph["torchpipedream.plans.plan"] = graph["torchpipedream.plans.plan"] | {"torchpipedream.schedule.build"}
    assert any(line.startswith("torchpipedream.plans.plan (plans) imports torchpipedream.schedule.build")
               for line in _upward_imports(graph))


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_modules_never_reach_torch_or_the_runtime(module: str) -> None:
    graph = _graph()
    reached = _reachable(graph, f"torchpipedream.{module}")
    bad = sorted(m for m in reached if m == "torch" or m.startswith(("torchpipedream.runtime", "torchpipedream.train",
                                                                       "torchpipedream.model.profiler",
                                                                       "torchpipedream.models")))
    assert not bad, f"torchpipedream.{module} reaches {bad}"


def test_the_command_line_starts_and_plans_without_importing_torch() -> None:
    code = ("import sys\n"
            "from torchpipedream.cli import main\n"
            "assert main(['plan', 'vgg16', '--topology', 'A']) == 0\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("NO TORCH"), result.stdout[-500:]
