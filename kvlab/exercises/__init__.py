"""kvlab.exercises: ``check_*`` helpers that chapter exercises call on the reader's answer.

Each chapter's checks live in their own module (``kvlab.exercises.ch03`` ...); every
``check_*`` name is also reachable here, imported on first use so that this package stays light.
A check returns a short success message and raises ``AssertionError`` explaining what is wrong.
"""

from __future__ import annotations

import importlib
import pkgutil


def _chapter_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch"))


def __getattr__(name: str):
    if name.startswith("check_"):
        for module_name in _chapter_modules():
            module = importlib.import_module(f"{__name__}.{module_name}")
            if hasattr(module, name):
                value = getattr(module, name)
                globals()[name] = value
                return value
    raise AttributeError(f"module 'kvlab.exercises' has no attribute {name!r}")
