"""What an invariant checker reads and how it reports
(:mod:`kvlab.labs.invariants.spec_invariants`).

:class:`EngineView` is the public state a checker may read; a checker calls :func:`require`,
which raises :class:`Broken`; the monitor turns that into an :class:`InvariantViolation` naming
the invariant, the request or block, and the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.core.request import RuntimeRequest

__all__ = ["Broken", "EngineView", "require"]


class Broken(Exception):
    """Raised by a checker; the monitor turns it into an
    :class:`~kvlab.labs.invariants.spec_invariants.InvariantViolation`."""

    def __init__(self, subject: str, detail: str) -> None:
        super().__init__(subject, detail)
        self.subject, self.detail = subject, detail


def require(condition: bool, subject: str, detail: str) -> None:
    """Checkers' assert: :class:`Broken` naming ``subject`` unless ``condition``."""
    if not condition:
        raise Broken(subject, detail)


@dataclass
class EngineView:
    """What the checkers may read: public objects and probes, no private fields.

    ``scheduler``: the engine's scheduler (a
    :class:`~kvlab.disagg.remote_kv_scheduler.RemoteKVScheduler` wrapper for P/D is fine);
    ``kv``: its KV manager; ``step``: the scheduler's step counter;
    ``last``: the last :class:`~kvlab.core.engine_core.StepResult` (None before the first).
    ``withheld``: blocks taken out of the pool by a fault (KV shrinkage): their owners are
    legitimate and they are not available to admission. ``rollback_probes``: callables
    ``() -> list[(subject, problem)]`` for speculative rollback (KV, RNG, grammar), supplied by
    the engine. ``installs``: ``(request id, entry id, problem or "")`` for every accepted P/D
    install since the previous check, from the install path's own validation.
    """

    scheduler: Any
    kv: Any
    step: int = 0
    last: Any = None
    withheld: Sequence[str] = ()
    rollback_probes: Sequence[Callable[[], list[tuple[str, str]]]] = ()
    installs: Sequence[tuple[str, str, str]] = ()

    def requests(self) -> list[RuntimeRequest]:
        return list(self.scheduler.requests())

    def parked(self) -> tuple[str, ...]:
        return tuple(getattr(self.scheduler, "parked", ()))
