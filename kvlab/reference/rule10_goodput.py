"""Spec rule 10 — goodput: requests per second that met every SLO, not raw throughput."""

from __future__ import annotations

__all__ = ["goodput"]


def goodput(records, window_seconds, slo):
    """records contain ttft, tpot, e2e, quality_ok, status.

    Returns finished, quality-passing requests within the TTFT, TPOT and E2E bounds of ``slo``
    (seconds), per second of ``window_seconds``.
    """
    if window_seconds <= 0:
        raise ValueError("window must be positive")
    ok = [
        r for r in records
        if r["status"] == "finished"
        and r["quality_ok"]
        and r["ttft"] <= slo["ttft"]
        and r["tpot"] <= slo["tpot"]
        and r["e2e"] <= slo["e2e"]
    ]
    return len(ok) / window_seconds
