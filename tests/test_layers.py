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
      for lab in ("capacity", "fragmentation", "recovery", "slo")),
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
             "kvlab.sim", "kvlab.viz", "kvlab.exercises", "kvlab.engine", "kvlab.entrypoints")
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
