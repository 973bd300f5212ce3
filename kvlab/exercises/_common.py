"""Shared helpers for exercise checks."""

from __future__ import annotations


class NotYetAnswered(AssertionError):
    """Raised by a check when the reader's answer is still the placeholder (``...`` or None)."""


def require_answer(value, what: str):
    """Raise :class:`NotYetAnswered` naming ``what`` if ``value`` is a placeholder."""
    if value is None or value is Ellipsis:
        raise NotYetAnswered(f"{what}: replace the placeholder with your answer, then re-run.")
    return value


def try_check(check, *args, **kwargs) -> str:
    """Call ``check``; return its message, or a hint when the answer is still a placeholder.

    A wrong (non-placeholder) answer still raises, so the reader sees what is wrong.
    """
    try:
        message = check(*args, **kwargs)
    except NotYetAnswered as hint:
        message = f"Not answered yet — {hint}"
    print(message)
    return message
