"""The import rules between packages (docs/architecture.md, "Which package may import which"), read from the
source with `ast`: no torch, no import side effects.

Every import counts, function-local ones included: a local import does not make a forbidden dependency or a cycle
acceptable. A failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: From the bottom up: contracts, quantization and the parallelisms (generic mechanisms), the model families, the
#: trainer (loop, config, tools).
PACKAGES = ("core", "quantization", "parallelisms", "models", "trainer")

#: Files of a model family that wire the model to the parallelisms by design: the package's `ModelSpec`
#: registration (`__init__.py`), its parallelize plan, its pipeline split and its memory plan's tensors. Only the
#: family's own top-level files count: every other model module, a subpackage's `__init__.py` included (the HF
#: interop package `models/deepseek_v3/hf/`), is model code.
MODEL_ADAPTERS = ("__init__.py", "parallelize.py", "pipeline.py", "memory_plan.py")

#: The config machinery (the package and each of its modules): standard library only, so that every package may
#: import it for its config section.
CONFIG = "core.config"

#: Only the comm backends (parallelisms/moe_comm/) may name DeepEP, in code, comments or docstrings.
DEEPEP = re.compile(r"deep_?ep", re.IGNORECASE)

#: The only function-local imports: (file, or a glob of files; imported module or package) -> why the import is not
#: at the top of its module. A local import is for an optional dependency (not installed everywhere) or a slow one
#: (seconds to import, wanted on one path only); every other import sits at the top, where a reader sees what the
#: module depends on (docs/architecture.md).
LOCAL_IMPORTS = {
    ("quantization/fp8/*.py", "torchao"): "optional: torchao, for the rowwise recipe and torchao's FP8 kernels",
    ("parallelisms/moe_comm/deepep.py", "deep_ep"): "optional: built from source on GPU clusters only",
    ("models/deepseek_v3/hf/io.py", "tqdm"): "optional: a progress bar when it is installed",
    ("trainer/data/sources.py", "datasets"): "slow (seconds): only Hugging Face and parquet/json datasets read it",
    ("trainer/launch.py", "torch.distributed"): "slow: the launcher imports torch only in main, after its checks",
    ("trainer/metrics.py", "torch.utils.tensorboard"): "slow: tensorboard's writer, only when a run writes to it",
    ("trainer/metrics.py", "tensorboard"): "slow: tensorboard's reader, only for the tools that read a run back",
    ("trainer/preemption.py", "torch"): "slow: a rank imports this module before torch, to catch a preemption "
                                        "signal during its slow imports",
    ("trainer/tools/dry_run.py", "torch.testing"): "slow: torch's testing package (the fake process group), only "
                                                   "for a dry run",
    ("trainer/tools/plot_memory.py", "matplotlib"): "optional and slow: matplotlib, only to draw",
}


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
    return parts[1] == "common" or len(parts) > 3 or parts[-1] not in MODEL_ADAPTERS


def _ours(module: str) -> bool:
    return any(_under(module, package) for package in PACKAGES)


def test_core_imports_nothing_of_ours():
    bad = _violations(lambda file, module: file.startswith("core/") and _ours(module) and not _under(module, "core"))
    assert not bad, "core/ holds the contracts every layer shares and imports nothing of ours:\n" + "\n".join(bad)


def test_quantization_imports_only_core():
    bad = _violations(lambda file, module: file.startswith("quantization/") and _ours(module)
                      and not (_under(module, "core") or _under(module, "quantization")))
    assert not bad, "quantization/ may import core only:\n" + "\n".join(bad)


def test_parallelisms_import_neither_trainer_nor_models():
    bad = _violations(lambda file, module: file.startswith("parallelisms/")
                      and (_under(module, "trainer") or _under(module, "models")))
    assert not bad, "parallelisms may import core and quantization, never trainer or models:\n" + "\n".join(bad)


def test_models_never_import_the_trainer():
    bad = _violations(lambda file, module: file.startswith("models/") and _under(module, "trainer"))
    assert not bad, "models may import core (and their adapters parallelisms and quantization), never trainer:\n" + \
        "\n".join(bad)


def test_model_code_imports_only_core_and_model_code():
    bad = _violations(lambda file, module: _is_model_code(file)
                      and (_under(module, "parallelisms") or _under(module, "quantization")))
    assert not bad, "model code must not import parallelisms or quantization (adapters excepted):\n" + "\n".join(bad)


def test_common_building_blocks_import_no_model_family():
    bad = _violations(lambda file, module: file.startswith("models/common/")
                      and _under(module, "models") and not _under(module, "models.common"))
    assert not bad, "models/common must not import a model family:\n" + "\n".join(bad)


def test_the_config_machinery_imports_the_standard_library_only():
    package = [name for name in MODULES if _under(name, CONFIG)]
    # Guards against a vacuous pass: the package and its modules must all be found.
    assert CONFIG in package and len(package) > 1, package
    bad = [f"{_rel(MODULES[name])}:{line} imports {module}" for name in package
           for module, line in _imports(name, MODULES[name])
           if not _under(module, CONFIG) and module.split(".")[0] not in sys.stdlib_module_names
           and module not in ("__future__", "tomli")]
    assert not bad, "core/config/ must import the standard library only (tomli on Python 3.10):\n" + "\n".join(bad)


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


def _local_imports(path: Path) -> list[tuple[str, int]]:
    """(module as written, line) of every import inside a function of the file (nested functions included)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif in_function and isinstance(child, ast.ImportFrom):
                found.append(("." * child.level + (child.module or ""), child.lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def _allowed_local_import(file: str, module: str) -> tuple[str, str] | None:
    """The LOCAL_IMPORTS entry that allows `module` imported inside a function of `file`, or None."""
    return next(((files, allowed) for files, allowed in LOCAL_IMPORTS
                 if fnmatch.fnmatchcase(file, files) and _under(module, allowed)), None)


def test_function_local_imports_only_for_optional_or_slow_dependencies():
    found = [(_rel(path), module, line) for path in MODULES.values() for module, line in _local_imports(path)]
    bad = [f"{file}:{line} imports {module} inside a function" for file, module, line in found
           if _allowed_local_import(file, module) is None]
    assert not bad, ("imports inside functions are for optional or slow dependencies only (move these to the top of "
                     "the module, or add them to LOCAL_IMPORTS with the reason):\n" + "\n".join(bad))
    stale = sorted(set(LOCAL_IMPORTS) - {_allowed_local_import(file, module) for file, module, _ in found})
    assert not stale, f"LOCAL_IMPORTS names imports that are no longer local: {stale}"


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


def _self_attributes(files, built_only: bool = False) -> set[str]:
    """Names assigned as `self.<name>` or declared as class fields in `files`; with `built_only`, only those
    assigned an object built by a class (`self.wo = nn.Linear(...)`, `self.experts = GroupedExperts(...)`): the
    modules and parameters of a model, not its numbers."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                built = isinstance(node.value, ast.Call) and _callee(node.value)[:1].isupper()
                names |= {t.attr for t in node.targets
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                          and (built or not built_only)}
            elif (not built_only and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef) and not built_only:
                names |= {st.target.id for st in node.body
                          if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    return names


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


#: A string that could be a module name: identifiers joined by dots.
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.\w+)*$")


def test_the_generic_layers_name_no_model_module():
    """parallelisms/ and quantization/ work on whatever modules a model's plan hands them: no attribute a model
    family defines (`model.layers`, `moe.experts`, `block.w1`) unless the generic layers or the contracts in core/
    define it too (an experts mesh, `ExpertParallelLayer.experts`), and no string that names a model's module
    ("moe.router.gate", "attention.wkv_a"), save the AC op table's own names ("attention", "norm")."""
    model_files = [MODULES[name] for name in MODULES
                   if _is_model_code(_rel(MODULES[name])) and not name.startswith("models.common")]
    generic_files = [path for name, path in MODULES.items() if name.split(".")[0] in ("parallelisms", "quantization")]
    own = _self_attributes(generic_files + [p for n, p in MODULES.items() if n.split(".")[0] == "core"])
    model_names = _self_attributes(model_files, built_only=True) - own
    op_table_names = set(re.findall(r'^    "(\w+)": \(', MODULES["parallelisms.activation_checkpoint.ops"].read_text(),
                                    re.MULTILINE))
    assert {"attention", "mm", "d2h_copy"} <= op_table_names
    bad = []
    for path in generic_files:
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in model_names:
                bad.append(f"{_rel(path)}:{node.lineno}: .{node.attr}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                  and _DOTTED.match(node.value) and node.value not in op_table_names
                  and any(part in model_names for part in node.value.split("."))):
                bad.append(f"{_rel(path)}:{node.lineno}: {node.value!r}")
    assert not bad, "parallelisms/ and quantization/ must not name a model's modules:\n" + "\n".join(bad)
