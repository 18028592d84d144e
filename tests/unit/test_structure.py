"""The package's shape, checked from its source: imports point one way (layers <-
models/data <- checkpoint <- training <- cli <- benchmarks), modules import no circle, and
functions and files of the package stay short enough to read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_multilora"
# Each part of the package and its level: a part imports only parts of lower levels.
LEVELS = {
    "errors": 0,
    "deprecation": 0,
    "validation": 0,
    "atomic_files": 0,
    "ops": 0,
    "platform": 0.5,  # what megatron needs without CUDA or TE; its stand-ins' math is in ops
    "parallel": 1,
    "layers": 2,
    "models": 3,
    "data": 3,
    "checkpoint": 4,
    "training": 5,
    "api": 5.5,  # the training service: the engine over training's step, its HTTP front
    "cli": 6,
    "benchmarks": 7,  # the benchmark package, above all of the package
}
FACADE_LEVEL = 6.5  # ``import megatron_multilora as mm``: the public API, for what stands above
# Sizes in statements, which the formatter's wrapping does not change: 45 and 270 are what 60
# and 400 lines held when the code was wrapped by hand, before ruff format.
MAX_FUNCTION_STATEMENTS, MAX_FILE_STATEMENTS = 45, 270


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(p): p for root in (PACKAGE, REPO / "benchmarks") for p in sorted(root.rglob("*.py"))
}


def imported_modules(path: Path) -> set[str]:
    """The package's modules ``path`` imports, anywhere in it (a function's import too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import module`` names a module; ``from module import name`` not
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        out.update(name for name in names if name in MODULES)
    return out


def part(module: str) -> str:
    if module.split(".")[0] == "benchmarks":
        return "benchmarks"
    return module.split(".")[1] if "." in module else "__init__"


def test_every_part_of_the_package_has_a_level():
    parts = {part(m) for m in MODULES} - {"__init__"}
    assert parts == set(LEVELS), f"give {sorted(parts - set(LEVELS))} a level in LEVELS"


def test_imports_point_down():
    upward = []
    for module, path in MODULES.items():
        if module == "megatron_multilora":  # the facade: it exposes the public API lazily
            continue
        for target in imported_modules(path):
            mine, theirs = part(module), part(target)
            level = FACADE_LEVEL if theirs == "__init__" else LEVELS[theirs]
            if mine != theirs and level >= LEVELS[mine]:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports that run back up or sideways:\n" + "\n".join(sorted(upward))


def test_no_module_imports_a_circle():
    graph = {m: imported_modules(p) - {m} for m, p in MODULES.items()}
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


def statements(node: ast.AST) -> int:
    return sum(isinstance(n, ast.stmt) for n in ast.walk(node))


def test_functions_and_files_are_short():
    long = []
    for module, path in MODULES.items():
        if part(module) == "benchmarks":
            continue
        tree = ast.parse(path.read_text())
        if statements(tree) > MAX_FILE_STATEMENTS:
            long.append(f"{path.name}: {statements(tree)} statements")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if statements(node) > MAX_FUNCTION_STATEMENTS:
                    long.append(f"{module}.{node.name}: {statements(node)} statements")
    assert not long, (
        f"functions of over {MAX_FUNCTION_STATEMENTS} statements or files of over "
        f"{MAX_FILE_STATEMENTS}:\n" + "\n".join(long)
    )


# The training service's HTTP side: requests, keys, futures, the wire format, listings.
HTTP_SIDE = [
    "front",
    "listings",
    "routes",
    "request_checks",
    "call_queue",
    "futures",
    "wire",
    "checkpoint_index",
    "api_keys",
    "calls",
    "training_front",
    "weights_front",
    "sampling_front",
]


def test_the_apis_http_side_imports_no_torch():
    """Importing it with torch and megatron made unimportable succeeds (the tinker SDK itself
    falls back without torch): only the engine's side needs them."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'megatron'):\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        + "".join(f"import megatron_multilora.api.{m}\n" for m in HTTP_SIDE)
        + "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", blocker], cwd=REPO, capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_no_two_folders_import_each_other_at_any_depth():
    """Within every folder of the package, its children (subfolders and modules) import
    without a circle: e.g. training/step may import training/objectives, not both ways (a
    module-level circle is caught above; this catches folders whose modules import each
    other's without one)."""
    folders = sorted(
        m for m, p in MODULES.items() if p.name == "__init__.py" and part(m) != "benchmarks"
    )
    circles = []
    for folder in folders:
        edges: dict[str, set[str]] = {}
        for module, path in MODULES.items():
            mine = _child_of(folder, module)
            for target in imported_modules(path) if mine else ():
                theirs = _child_of(folder, target)
                if theirs and theirs != mine:
                    edges.setdefault(mine, set()).add(theirs)
        circles += _circles(edges)
    assert not circles, "folders importing each other:\n" + "\n".join(circles)


def _child_of(folder: str, module: str) -> str | None:
    """The child of ``folder`` (a subfolder or module) that holds ``module``, if any."""
    if not module.startswith(folder + "."):
        return None
    return ".".join(module.split(".")[: folder.count(".") + 2])


def _circles(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    found = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                found.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_two_modules_share_a_name():
    """A module's name says what it does, so two modules of one name in different folders
    (the service's inbox beside the trainer's), or a module named as a folder (the
    service's calls as ``api/ops.py`` beside the ``ops/`` kernels), would be two things
    under one word. (``cli/`` names its modules for the commands they add: ``mmlora api``.)"""
    by_name: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if part(module) in ("benchmarks", "__init__"):
            continue
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, []).append(module)
        if path.name == "__init__.py" or part(module) == "cli":
            continue
        folder = PACKAGE / path.stem
        if folder.is_dir() and folder != path.parent:
            by_name.setdefault(path.stem, []).append(f"{module} beside the folder {path.stem}/")
    shared = {name: mods for name, mods in by_name.items() if len(mods) > 1}
    assert not shared, f"rename one of each: {shared}"


def test_no_model_type_is_tested_outside_its_family():
    """A family's knowledge lives in its module of ``models/families``: elsewhere no code
    compares a model type with a family's name (``model_type == "phi3"``, ``in (...)``)."""
    from megatron_multilora.models.families import FAMILIES

    found = []
    for module, path in MODULES.items():
        if module.startswith("megatron_multilora.models.families"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            names = {
                c.value
                for side in (node.left, *node.comparators)
                for c in ast.walk(side)
                if isinstance(c, ast.Constant)
            }
            if names & FAMILIES.keys():
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"model types tested outside models/families: {found}"
