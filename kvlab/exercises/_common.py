"""Shared helpers for exercise checks: the placeholder test, and how a check's verdict is shown.

A check raises ``AssertionError`` with one sentence when an answer is wrong. In a notebook that
sentence is what the reader needs, not the 25 lines of traceback through the check's own code,
so :func:`try_check` re-raises it as :class:`WrongAnswer`, which IPython renders as the sentence
alone (``_render_traceback_``). The cell still fails (an nbgrader test cell scores 0, Run All
stops at a wrong answer); an answer that is still the placeholder only prints a hint, so Run All
goes on past exercises nobody has tried yet.
"""

from __future__ import annotations


class _OneLine(AssertionError):
    """An ``AssertionError`` that IPython shows as one red line instead of a traceback."""

    label = "Check"

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of formatting the traceback; the lines go to the
        # notebook's error output (ename and evalue are kept, so graders still see the class).
        return [f"\x1b[0;31m{self.label}:\x1b[0m {self}"]


class NotYetAnswered(_OneLine):
    """Raised by a check when the reader's answer is still the placeholder (``...`` or None)."""

    label = "Not answered yet"


class WrongAnswer(_OneLine):
    """A check's verdict on a wrong answer: its one sentence, shown without a traceback."""

    label = "Not right yet"


def require_answer(value, what: str):
    """Raise :class:`NotYetAnswered` naming ``what`` if ``value`` is a placeholder."""
    if value is None or value is Ellipsis:
        raise NotYetAnswered(f"{what}: replace the placeholder with your answer, then re-run.")
    return value


def try_check(check, *args, **kwargs) -> str:
    """Call ``check``; print and return its message, or a hint when an answer is a placeholder.

    A wrong (non-placeholder) answer raises :class:`WrongAnswer` carrying the check's sentence
    (the check's own frames are dropped: they would show how the truth is computed). Errors that
    are not a check's verdict (a ``TypeError`` inside the reader's function, say) propagate with
    their traceback, which is then about the reader's code.
    """
    try:
        message = check(*args, **kwargs)
    except NotYetAnswered as hint:
        message = f"Not answered yet — {hint}"
    except WrongAnswer:
        raise
    except AssertionError as verdict:
        raise WrongAnswer(str(verdict) or "the answer does not pass the check.") from None
    print(message)
    return message
