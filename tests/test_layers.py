"""The layering rules of DESIGN.md: kvlab.reference, kvlab.core (and kvlab.sim) never import
torch, and ``import kvlab`` loads torch only when a torch-dependent name is first used."""

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
    "import kvlab.sim",
    "import kvlab.core, pkgutil, importlib, kvlab.core as c; "
    "[importlib.import_module('kvlab.core.' + m.name) for m in pkgutil.iter_modules(c.__path__)]",
    "import kvlab.sim, pkgutil, importlib, kvlab.sim as s; "
    "[importlib.import_module('kvlab.sim.' + m.name) for m in pkgutil.iter_modules(s.__path__)]",
    *(f"import kvlab.{lab}, pkgutil, importlib, kvlab.{lab} as p; "
      f"[importlib.import_module('kvlab.{lab}.' + m.name) "
      "for m in pkgutil.iter_modules(p.__path__)]"
      for lab in ("capacity", "fragmentation", "recovery", "slo", "disagg")),
    "import kvlab.invariants.spec_invariants, kvlab.invariants.install_audit, "
    "kvlab.faults.step_faults, kvlab.invariants, kvlab.faults",
])
def test_metadata_layer_never_imports_torch(statement):
    assert "torch" not in _modules_after(statement)


def test_torch_names_load_lazily_on_first_use():
    for statement in ("import kvlab; kvlab.speculative_step",
                      "import kvlab.reference; kvlab.reference.speculative_step"):
        modules = _modules_after(statement)
        assert "torch" in modules and "kvlab.reference.rule08_speculative" in modules


def test_core_never_imports_the_chapter_labs():
    """The lab packages (capacity planning, fragmentation, crash recovery, goodput) import the
    engine's core; the core never imports them, nor the simulator, figures, exercises or the
    engine."""
    modules = _modules_after(
        "import kvlab.core, pkgutil, importlib, kvlab.core as c; "
        "[importlib.import_module('kvlab.core.' + m.name) "
        "for m in pkgutil.iter_modules(c.__path__)]")
    above = ("kvlab.capacity", "kvlab.fragmentation", "kvlab.recovery", "kvlab.slo",
             "kvlab.disagg", "kvlab.invariants", "kvlab.faults", "kvlab.sim", "kvlab.viz",
             "kvlab.exercises", "kvlab.engine", "kvlab.entrypoints")
    assert not {m for m in modules if m.startswith(above)}


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
    assert {"kvlab.engine.llm", "kvlab.engine.sampler", "kvlab.engine.outputs"} <= modules


def _import_graph() -> dict[str, set[str]]:
    """kvlab module -> the kvlab modules it imports, read from the source (imports inside
    functions count: a lazy import is still a dependency; ``if TYPE_CHECKING`` ones do not)."""
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
        todo = [ast.parse(path.read_text())]
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                deps |= {base} | {f"{base}.{a.name}" for a in node.names}
            todo.extend(ast.iter_child_nodes(node))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_kvlab_has_no_import_cycles():
    """No two kvlab modules import each other, directly or through others (a lazy import
    inside a function counts): every arrow runs one way, so each layer reads on its own."""
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


def test_the_engine_core_never_imports_upward():
    """kvlab.core imports only kvlab.reference and itself; kvlab.engine never imports the
    package top level, the server, the simulator, figures, exercises or the lab packages
    (invariant monitors and fault injectors attach to it from outside); only its P/D feature,
    kvlab.engine.kv_transfer, builds on the torch-free half in kvlab.disagg."""
    graph = _import_graph()
    for name, deps in graph.items():
        if name.startswith("kvlab.core"):
            assert all(d.startswith(("kvlab.core", "kvlab.reference")) for d in deps), (name, deps)
        if name.startswith("kvlab.engine"):
            bad = {d for d in deps if d == "kvlab" or d.startswith((
                "kvlab.entrypoints", "kvlab.sim", "kvlab.viz", "kvlab.exercises",
                "kvlab.capacity", "kvlab.fragmentation", "kvlab.recovery", "kvlab.slo",
                "kvlab.invariants", "kvlab.faults"))}
            if not name.startswith("kvlab.engine.kv_transfer"):
                bad |= {d for d in deps if d.startswith("kvlab.disagg")}
            assert not bad, (name, bad)


def test_every_kvlab_module_is_at_most_400_lines():
    """Issue 24's bound: a module holds one thing, small enough to read in one sitting."""
    from pathlib import Path

    import kvlab

    root = Path(kvlab.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 100 and not {p: n for p, n in sizes.items() if n > 400}
