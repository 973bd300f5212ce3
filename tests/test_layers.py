"""The layering rules of DESIGN.md: imports point down the layers, no import cycles, the
torch-free layers (reference, core, disagg, sim and the chaos labs) never import torch, and
``import kvlab`` loads torch only when a torch-dependent name is first used."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


@pytest.mark.parametrize("statement", [
    "import kvlab.reference",
    "import kvlab, kvlab.reference as r; r.quantize_groups, kvlab.dequantize_groups",
    "import kvlab.reference, pkgutil, importlib, kvlab.reference as r; "
    "[importlib.import_module('kvlab.reference.' + m.name) "
    "for m in pkgutil.iter_modules(r.__path__) if m.name != 'rule08_speculative']",
    "import kvlab.core",
    "import kvlab",
    *(f"import kvlab.{pkg}, pkgutil, importlib, kvlab.{pkg} as p; "
      f"[importlib.import_module('kvlab.{pkg}.' + m.name) "
      "for m in pkgutil.iter_modules(p.__path__)]"
      for pkg in ("core", "disagg", "sim")),
    *(f"import kvlab.labs.{lab}, pkgutil, importlib, kvlab.labs.{lab} as p; "
      f"[importlib.import_module('kvlab.labs.{lab}.' + m.name) "
      "for m in pkgutil.iter_modules(p.__path__)]"
      for lab in ("capacity", "fragmentation", "recovery", "chaos")),
    "import kvlab.labs.slo, kvlab.labs.paging, kvlab.labs.token_trie, kvlab.labs.kv_snapshot, "
    "kvlab.labs.serving",
    "import kvlab.labs.invariants.spec_invariants, kvlab.labs.invariants.install_audit, "
    "kvlab.labs.faults.step_faults, kvlab.labs.invariants, kvlab.labs.faults, "
    "kvlab.labs.pd.pair",
])
def test_metadata_layer_never_imports_torch(statement):
    assert "torch" not in _modules_after(statement)


def test_torch_names_load_lazily_on_first_use():
    for statement in ("import kvlab; kvlab.speculative_step",
                      "import kvlab.reference; kvlab.reference.speculative_step"):
        modules = _modules_after(statement)
        assert "torch" in modules and "kvlab.reference.rule08_speculative" in modules


#: The layers of DESIGN.md, lowest first: a module imports its own package and lower ranks
#: only (siblings of one rank never import each other).
RANK = {"_lazy": -1, "reference": 0, "models": 0, "core": 1, "disagg": 2, "sim": 2,
        "kernels": 2, "engine": 3, "labs": 4, "viz": 5, "exercises": 6, "entrypoints": 7,
        "__main__": 8}


def test_reference_is_the_bottom_layer():
    """kvlab.reference imports nothing else of kvlab but the lazy-export helper."""
    modules = _modules_after(
        "import kvlab.reference, pkgutil, importlib, kvlab.reference as r; "
        "[importlib.import_module('kvlab.reference.' + m.name) "
        "for m in pkgutil.iter_modules(r.__path__)]")
    kvlab_modules = {m for m in modules if m.startswith("kvlab.")}
    assert {m for m in kvlab_modules if not m.startswith("kvlab.reference")} == {"kvlab._lazy"}


def test_engine_api_is_reachable_from_the_top_level():
    modules = _modules_after("import kvlab; kvlab.LLM, kvlab.SamplingParams, kvlab.RequestOutput")
    assert {"kvlab.engine.llm", "kvlab.engine.outputs"} <= modules


def _import_graph() -> dict[str, set[str]]:
    """kvlab module -> the kvlab modules it imports, read from the source: imports inside
    functions count (a lazy import is still a dependency) and so do ``if TYPE_CHECKING`` ones
    (a type a module names is a module it depends on)."""
    import ast
    from pathlib import Path

    import kvlab

    root = Path(kvlab.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                deps |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_kvlab_has_no_import_cycles():
    """No two kvlab modules import each other, directly or through others (lazy and
    ``TYPE_CHECKING`` imports count): every arrow runs one way, so each layer reads on its
    own."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:     # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert len(graph) > 100 and not cycles, cycles


def test_imports_point_down_the_layers():
    """Every import stays in its own top-level package or points to a lower layer of
    :data:`RANK` (the package top level ``kvlab`` is imported by nobody): so ``kvlab.core``
    imports only ``kvlab.reference``, the engine never imports the labs, the figures, the
    exercises or the server, and the labs attach to the engine from outside."""
    assert set(RANK) >= {p.name.removesuffix(".py") for p in _package_dir().iterdir()
                         if p.name not in ("__init__.py", "__pycache__")
                         and (p.is_dir() or p.suffix == ".py")}
    bad = []
    for name, deps in _import_graph().items():
        if name == "kvlab":
            continue
        top = name.split(".")[1]
        for dep in deps:
            if dep == "kvlab":
                bad.append((name, dep))
                continue
            other = dep.split(".")[1]
            if other != top and RANK[other] >= RANK[top]:
                bad.append((name, dep))
    assert not bad, bad


def _package_dir():
    from pathlib import Path

    import kvlab

    return Path(kvlab.__file__).parent


def test_at_most_eleven_top_level_packages():
    """The layout is the architecture: the packages of :data:`RANK`, no more."""
    packages = sorted(p.name for p in _package_dir().iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
    assert len(packages) <= 11, packages
