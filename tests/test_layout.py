"""The house rules of the code's layout (shared/STYLE.md): one direction of imports in the
training package, no function a reader must scroll through, and a wheel that ships every
folder of the training package. Pure reading of the sources: no import, no synth."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ROOT / "training"
#: The longest a function may be, in lines (its def to its last line, decorators excluded).
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every module of ``modules`` (``training.*``) that ``path`` imports, at module level or
    inside a function (a lazy import closes a cycle just as well), relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "training":
                continue
            found.add(target)
            # `from training.data import records` imports a module, not a name
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "training")
    return {name for name in found if name in modules and name != module}


def _import_graph() -> dict[str, set[str]]:
    paths = sorted(TRAINING.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports_of(path, modules) for path in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a package importing its own submodules through its
    ``__init__`` is no cycle: the submodules never import the package's ``__init__``)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_training_package_has_no_import_cycle():
    graph = _import_graph()
    # Parent packages re-export their modules; those edges point down and are not the cycle
    # this guards against (a module reaching back up into the driver or the loop).
    for name, targets in graph.items():
        targets.difference_update(t for t in set(targets) if name.startswith(t + ".") and t in graph)
    assert _cycle(graph) is None, f"import cycle in training/: {' -> '.join(_cycle(graph))}"


def test_only_the_driver_imports_the_workers_loop_and_nothing_below_imports_the_driver():
    graph = _import_graph()
    importers = {name for name, targets in graph.items() if "training.loop" in targets}
    assert importers == {"training.train"}
    below = {name for name in graph if name.count(".") >= 2}  # training.<room>.<module>
    reaching_up = sorted(name for name in below if graph[name] & {"training.train", "training.loop"})
    assert reaching_up == [], f"modules of the rooms that import the driver or the loop: {reaching_up}"


def test_the_training_package_imports_nothing_of_the_cdk_side():
    offenders = []
    for path in TRAINING.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "ray_train_eks"]
    assert offenders == []


def test_no_function_is_longer_than_eighty_lines():
    too_long = []
    for folder in (ROOT / "ray_train_eks", TRAINING):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert too_long == [], f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_the_wheel_ships_every_folder_of_the_training_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(project["tool"]["setuptools"]["packages"])
    folders = {"ray_train_eks.training_code" + ("." + ".".join(p.parent.relative_to(TRAINING).parts) if p.parent != TRAINING else "")
               for p in TRAINING.rglob("__init__.py")}
    assert folders - packages == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    code_folders = {p.parent for p in TRAINING.rglob("*.py")}
    assert all((folder / "__init__.py").exists() for folder in code_folders), "a folder of training/ without __init__.py"
