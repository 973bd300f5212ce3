"""Lazy package attributes (PEP 562): heavy names load on first use, not at import time."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return the ``__getattr__`` and ``__dir__`` of a package whose ``table`` names load lazily.

    ``table`` maps an attribute name to the module that defines it, absolute (``kvlab.engine.llm``)
    or relative to ``package`` (``.llm``). The first access imports that module and caches the
    value in ``namespace`` (the package's ``globals()``), so later accesses cost nothing. An
    unknown name raises AttributeError naming the package, as a normal module would.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
