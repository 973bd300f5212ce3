"""Argument checks shared by kvlab's public boundaries (torch-free)."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """An int that is not a bool: ``True`` is an int to Python, never a size, id or count."""
    return isinstance(value, int) and not isinstance(value, bool)
