"""The import rules between packages (docs/architecture.md, "Which package may import which"), read from the
source with `ast`: no torch, no import side effects.

Every import counts, function-local ones included: a local import does not make a forbidden dependency or a cycle
acceptable. A failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "parallelisms", "models")

#: Files of a model family that wire the model to the trainer and the parallelisms by design: the package's
#: `ModelSpec` registration (`__init__.py`), its parallelize plan, its pipeline split and its memory plan's
#: tensors. Every other model module is model code.
MODEL_ADAPTERS = ("__init__.py", "parallelize.py", "pipeline.py", "memory_plan.py")

#: The config machinery: standard library only, so that every package may import it for its config section.
CONFIG = "trainer.config"

#: Only the comm backends (parallelisms/moe_comm/) may name DeepEP, in code, comments or docstrings.
DEEPEP = re.compile(r"deep_?ep", re.IGNORECASE)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files() -> dict[str, Path]:
    return {_module_name(f): f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _source_files()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported project module, or the external module as written; line) of every import in the file."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[:len(base) - (node.level - 1)]
                module = ".".join(prefix + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                # `from package import submodule` depends on the submodule
                sub = f"{module}.{alias.name}"
                found.append((sub if sub in MODULES else module, node.lineno))
    return found


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _violations(rule) -> list[str]:
    """'file:line imports module' for every import that `rule(file, module) -> bool` forbids."""
    bad = []
    for name, path in MODULES.items():
        for module, line in _imports(name, path):
            if rule(_rel(path), module):
                bad.append(f"{_rel(path)}:{line} imports {module}")
    return bad


def _top(module: str) -> str:
    """The project module an import resolves to, or the name itself."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_model_code(file: str) -> bool:
    parts = file.split("/")
    if parts[0] != "models" or len(parts) < 3:
        return False
    return parts[1] == "common" or parts[-1] not in MODEL_ADAPTERS


def test_model_code_imports_neither_parallelisms_nor_trainer():
    bad = _violations(lambda file, module: _is_model_code(file)
                      and (_under(module, "parallelisms") or _under(module, "trainer")))
    assert not bad, "model code must not import parallelisms or trainer (adapters excepted):\n" + "\n".join(bad)


def test_common_building_blocks_import_no_model_family():
    bad = _violations(lambda file, module: file.startswith("models/common/")
                      and _under(module, "models") and not _under(module, "models.common"))
    assert not bad, "models/common must not import a model family:\n" + "\n".join(bad)


def test_parallelisms_import_neither_trainer_nor_a_model_family():
    bad = _violations(lambda file, module: file.startswith("parallelisms/")
                      and ((_under(module, "trainer") and module != CONFIG)
                           or (_under(module, "models") and module != "models" and not _under(module, "models.common"))))
    assert not bad, ("parallelisms may import models.common and trainer.config, never the rest of trainer or a model "
                     "family:\n" + "\n".join(bad))


def test_the_config_machinery_imports_the_standard_library_only():
    path = MODULES[CONFIG]
    bad = [f"{_rel(path)}:{line} imports {module}" for module, line in _imports(CONFIG, path)
           if module.split(".")[0] not in sys.stdlib_module_names and module not in ("__future__", "tomli")]
    assert not bad, "trainer/config.py must import the standard library only (tomli on Python 3.10):\n" + "\n".join(bad)


def test_trainer_finds_models_through_the_registry_only():
    bad = _violations(lambda file, module: file.startswith("trainer/")
                      and _under(module, "models") and module != "models")
    assert not bad, "the trainer imports model code only by name, through trainer/registry.py:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        edges = {}
        for module, line in _imports(name, path):
            target = _top(module)
            if target and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    cycles = _cycles(graph)
    described = [" -> ".join(f"{_rel(MODULES[a])}:{graph[a][b]} imports {b}" for a, b in zip(c, c[1:] + c[:1]))
                 for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a list of modules) through every strongly connected set of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(_path_within(graph, set(members), v))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _path_within(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A cycle from `start` back to it through `members` (breadth-first, so the shortest)."""
    previous = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in graph[v]:
            if w == start:
                path = [v]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return path[::-1]
            if w in members and w not in previous:
                previous[w] = v
                queue.append(w)
    raise AssertionError("not a cycle")


def test_only_the_comm_backends_name_deepep():
    bad = []
    for path in MODULES.values():
        file = _rel(path)
        if file.startswith("parallelisms/moe_comm/"):
            continue
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if DEEPEP.search(line):
                bad.append(f"{file}:{line_no}: {line.strip()}")
    assert not bad, "only parallelisms/moe_comm/ may name DeepEP:\n" + "\n".join(bad)
