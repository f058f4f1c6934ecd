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


def _imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports, at module level, inside a function or under
    ``TYPE_CHECKING`` (a lazy import closes a cycle, or starts Node.js, just as well), relative
    imports resolved; for ``from a import b`` both ``a`` and ``a.b`` (b may be a module)."""
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
            found.add(target)
            # `from training.data import records` imports a module, not a name
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports (:func:`_imported_names`)."""
    return {name for name in _imported_names(path) if name in modules and name != _module_name(path)}


def _import_graph(folder: Path = TRAINING) -> dict[str, set[str]]:
    paths = sorted(folder.rglob("*.py"))
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


def _without_parent_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` without a module's edges to its parent packages: a package re-exporting its
    modules points down; the cycle guarded against is a module reaching back up."""
    return {name: {t for t in targets if not (name.startswith(t + ".") and t in graph)} for name, targets in graph.items()}


#: Modules that load jsii, whose first import starts a Node.js process.
NODE_MODULES = ("aws_cdk", "constructs", "jsii", "cdk8s", "cdk8s_plus_36", "cdk_nag")
#: The CDK side of ray_train_eks: what the job command never reaches.
CDK_SIDE = ("ray_train_eks.charts", "ray_train_eks.constructs", "ray_train_eks.stacks", "ray_train_eks.app",
            "ray_train_eks.nag", "ray_train_eks.demo")


def _closure(start: str) -> dict[str, str]:
    """Every module ``start`` can load, each with the module that imports it: the package's own
    modules followed through every import (lazy ones too) and every parent package's
    ``__init__`` (Python runs it first); other packages' top-level names, not followed."""
    paths = {_module_name(path): path for path in sorted((ROOT / "ray_train_eks").rglob("*.py"))}
    by, todo = {start: "(start)"}, [start]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))}
        names = _imported_names(paths[module]) | parents if module in paths else set()
        for name in names:
            target = name if name in paths else name.split(".")[0] if name.split(".")[0] != "ray_train_eks" else None
            if target and target not in by:
                by[target] = module
                if target in paths:
                    todo.append(target)
    return by


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_training_package_has_no_import_cycle():
    graph = _without_parent_edges(_import_graph())
    assert _cycle(graph) is None, f"import cycle in training/: {' -> '.join(_cycle(graph))}"


def test_the_platform_package_has_no_import_cycle_lazy_and_type_checking_imports_included():
    graph = _without_parent_edges(_import_graph(ROOT / "ray_train_eks"))
    assert _cycle(graph) is None, f"import cycle in ray_train_eks/: {' -> '.join(_cycle(graph))}"


def test_the_closure_finds_a_node_module_behind_a_lazy_import_and_a_parent_package():
    # ray_train_eks.charts.ray_workload_chart imports cdk8s; the app module imports aws_cdk at its top.
    assert _closure("ray_train_eks.charts")["ray_train_eks.charts.ray_workload_chart"] == "ray_train_eks.charts"
    assert "cdk8s" in _closure("ray_train_eks.charts.ray_workload_chart")
    assert "aws_cdk" in _closure("ray_train_eks.app")


def test_the_job_command_can_reach_no_cdk_cdk8s_or_jsii_module_not_even_lazily():
    """By construction: ray_train_eks/cli/ imports the workload's builders (ray_train_eks/workload/),
    the platform's configuration and its facts, none of which imports the CDK side, even inside a
    function. A CDK import anywhere the command can reach fails here, with the chain that reaches it."""
    reached = _closure("ray_train_eks.cli")
    offenders = sorted(name for name in reached if name.split(".")[0] in NODE_MODULES or name.startswith(CDK_SIDE))

    def chain(name: str) -> str:
        links = [name]
        while reached[links[-1]] != "(start)":
            links.append(reached[links[-1]])
        return " <- ".join(links)

    assert offenders == [], "the job command reaches the CDK side:\n" + "\n".join(chain(name) for name in offenders)
    # and it does reach what it builds jobs with
    assert {"ray_train_eks.workload.objects", "ray_train_eks.config", "ray_train_eks.cli.kube"} <= set(reached)


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


def test_the_wheel_ships_every_folder_of_the_platform_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(project["tool"]["setuptools"]["packages"])
    platform = ROOT / "ray_train_eks"
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in platform.rglob("__init__.py")}
    assert folders - packages == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert all((folder / "__init__.py").exists() for folder in {p.parent for p in platform.rglob("*.py")})
