"""The package's shape, read from its own source (docs/architecture.md, "Floors"): imports only run down the floors,
no module rewrites another at run time, functions stay short enough to read in one sitting, and comments cite the
architecture by section name, not by a number kept somewhere else."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpitrain"

# Bottom to top: a module may import its own floor and the floors below it. The longest matching prefix decides.
FLOORS = [
    ("mpitrain", "mpitrain.errors", "mpitrain.backend", "mpitrain.tiles"),  # foundation: arrays, errors, threads
    # what a run asks for, checked before anything starts
    ("mpitrain.config", "mpitrain.config_checks", "mpitrain.config_moe", "mpitrain.config_rules",
     "mpitrain.layout_checks"),
    ("mpitrain.comm", "mpitrain.data", "mpitrain.profile"),  # moving bytes, reading tokens, measuring
    ("mpitrain.state",),  # parameters, gradients and where their shards live
    ("mpitrain.optim", "mpitrain.layers", "mpitrain.kernels"),  # updates; forward/backward pairs and their kernels
    ("mpitrain.model",),  # a stage's units assembled from layers
    ("mpitrain.parallel",),  # schedules, the pipeline executor, context and thread replicas
    ("mpitrain.checkpoint", "mpitrain.resilience"),  # saving, restoring, surviving faults
    ("mpitrain.generate", "mpitrain.train", "mpitrain.train_loop", "mpitrain.run", "mpitrain.plan",
     "mpitrain.plan.cost_sharding", "mpitrain.launcher", "mpitrain.doctor"),  # whole programs
    ("mpitrain.lab", "mpitrain.cli", "mpitrain.cli_common", "mpitrain.cli_doctor", "mpitrain.cli_bench",
     "mpitrain.__main__"),  # the commands a person types
]
MAX_UPWARD, MAX_CIRCLES, MAX_FUNCTION_LINES = 3, 1, 80


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = module_files()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def floor_of(module: str) -> int:
    best, floor = -1, None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), level
    assert floor is not None, f"{module} is on no floor: add it to FLOORS and to docs/architecture.md"
    return floor


def imported_modules(module: str, node) -> set[str]:
    """The package's modules that an import statement in `module` names (a submodule where it is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            keep = len(parts) - node.level + (1 if MODULES[module].name == "__init__.py" else 0)
            base = ".".join(parts[:keep] + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return {name for name in names if name in MODULES and name != module}


def import_graph() -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= imported_modules(name, node)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), leaving out a package and its own
    submodules (a package's __init__ that re-exports them is its face, not a knot)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [c for c in found if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]


def test_every_module_is_on_a_floor():
    for name in MODULES:
        floor_of(name)


def test_at_most_one_import_circle():
    found = circles(import_graph())
    assert len(found) <= MAX_CIRCLES, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_run_down_the_floors():
    upward = sorted(f"{source} -> {target}" for source, targets in import_graph().items() for target in targets
                    if floor_of(target) > floor_of(source))
    assert len(upward) <= MAX_UPWARD, f"{len(upward)} imports run up the floors:\n" + "\n".join(upward)


def test_no_module_rewrites_another_at_run_time():
    """Kernels are chosen where the ops are defined, never installed by assigning to another module's attributes."""
    patched = []
    for name, tree in TREES.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({(a.asname or a.name): a.name for a in node.names if a.name in MODULES})
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    targets = imported_modules(name, ast.ImportFrom(node.module, [alias], node.level))
                    modules = [t for t in targets if t.endswith("." + alias.name)]
                    if modules:
                        aliases[alias.asname or alias.name] = modules[0]
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in aliases:
                    patched.append(f"{MODULES[name]}:{node.lineno} assigns {aliases[target.value.id]}.{target.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases:
                patched.append(f"{MODULES[name]}:{node.lineno} setattr on module {aliases[node.args[0].id]}")
    assert not patched, "\n".join(patched)


def test_functions_read_in_one_sitting():
    long = [f"{MODULES[name]}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("root", ["mpitrain", "tests", "launch", "slurm", "benchmarks", "docs"])
def test_comments_cite_sections_not_numbers(root):
    """The design lives in docs/architecture.md and is cited by section name; a number from a list kept elsewhere
    (a design decision, an issue) means nothing to a reader of this repository."""
    pattern = re.compile(r"design decision \d|\bissue \d+|\bdesign \d+\b", re.IGNORECASE)
    folder = PACKAGE.parent / root
    cites = [f"{path.relative_to(PACKAGE.parent)}:{number}"
             for path in sorted(folder.rglob("*")) if path.suffix in (".py", ".md", ".sh", ".toml", ".sbatch")
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if pattern.search(line) and path.name != "test_architecture.py"]
    assert not cites, "\n".join(cites)


def test_architecture_document_names_every_floor():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for prefixes in FLOORS:
        for prefix in prefixes:
            short = prefix.removeprefix("mpitrain.").replace(".", "/")
            if short != "mpitrain":
                assert short in text, f"docs/architecture.md does not place {short} on a floor"
