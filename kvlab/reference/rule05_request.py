"""Spec rule 5 — the request state machine: reference ``Phase``, ``ALLOWED`` and ``Request``.

A request is in exactly one phase. ``finish`` (-> FINISHED) and ``cancel`` (-> CANCELLED) are
idempotent: repeating them is a no-op, every other illegal move raises and changes nothing.
The engine's runtime request and its lifecycle are in :mod:`kvlab.core.request` and
:mod:`kvlab.core.request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["ALLOWED", "Phase", "Request"]


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


ALLOWED = {
    Phase.WAITING: {Phase.PREFILL, Phase.CANCELLED, Phase.FAILED},
    Phase.PREFILL: {Phase.DECODE, Phase.CANCELLED, Phase.FAILED},
    Phase.DECODE: {Phase.FINISHED, Phase.CANCELLED, Phase.FAILED},
}


@dataclass
class Request:
    """Reference request: ``prompt_left`` prompt tokens still to prefill, ``generated`` so far."""

    request_id: str
    prompt_left: int
    generated: int = 0
    phase: Phase = Phase.WAITING

    def transition(self, target: Phase) -> None:
        if self.phase == target and target in {Phase.FINISHED, Phase.CANCELLED}:
            return
        if target not in ALLOWED.get(self.phase, set()):
            raise ValueError(f"illegal transition: {self.phase.value} -> {target.value}")
        self.phase = target
