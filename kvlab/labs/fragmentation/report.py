"""What the fragmentation simulation reports: where every KV slot went, step by step.

**The accounting**, in token slots, at every step (they sum to ``arena_tokens``):

* ``used``: slots holding a token's K/V now (the paper's "token states");
* ``reserved``: allocated slots the owner will still write (the paper's "reservation");
* ``over_reserved``: reserved by the policy beyond the request's final length, never written;
* ``internal``: allocation-unit rounding never written: the buddy's power-of-two round-up, or
  the unused tail of a request's last block (``over_reserved + internal`` is the paper's
  "internal fragmentation");
* ``external``: free slots in holes too small for the request waiting at the head of the
  queue (0 when nothing waits, and always 0 for paging, where any free block serves);
* ``free``: every other free slot.

Averages are taken over the *saturated* steps, those where a request is left waiting after
admission, i.e. memory is the bottleneck, which is the regime the paper's Figure 2 describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["CATEGORIES", "WasteReport", "waste_table"]

CATEGORIES = ("used", "reserved", "over_reserved", "internal", "external", "free")


@dataclass(frozen=True)
class WasteReport:
    """Mean share of the arena in each category over the saturated steps, plus run facts.

    ``fractions[c]`` for ``c`` in :data:`CATEGORIES` sum to 1. ``trace`` holds per-step slot
    counts (``trace[c][t]``, int64) for every step of the run and ``trace["waiting"][t]``,
    the queue length after admission; the categories sum to ``arena_tokens`` at every step.
    """

    policy: str
    arena: str                  # "buddy", "first_fit" or "paged"
    arena_tokens: int
    block_size: int | None
    steps: int                  # steps until the last request finished (makespan)
    measured_steps: int         # saturated steps the fractions average over
    fractions: dict[str, float]
    preemptions: int
    finished: int
    generated_tokens: int
    mean_running: float         # mean number of running requests over the measured steps
    trace: dict[str, np.ndarray] = field(repr=False, compare=False)
    recomputed_tokens: int = 0  # paged: tokens recomputed after preemptions (free on the clock)

    @property
    def token_states(self) -> float:
        """Share of the arena holding K/V of tokens (the paper's Figure 2 quantity)."""
        return self.fractions["used"]

    @property
    def waste(self) -> float:
        """Share wasted: reserved + over-reserved + internal + external (free excluded)."""
        f = self.fractions
        return f["reserved"] + f["over_reserved"] + f["internal"] + f["external"]

    @property
    def tokens_per_step(self) -> float:
        """Output tokens generated per step over the whole run (a throughput proxy)."""
        return self.generated_tokens / self.steps


def waste_table(reports: dict[str, WasteReport]) -> str:
    """A fixed-width table of the reports: percentages of the arena per category."""
    head = f"{'policy':<8}" + "".join(f"{c:>14}" for c in CATEGORIES) + f"{'waste':>9}"
    lines = [head]
    for name, rep in reports.items():
        cells = "".join(f"{100 * rep.fractions[c]:>13.1f}%" for c in CATEGORIES)
        lines.append(f"{name:<8}{cells}{100 * rep.waste:>8.1f}%")
    return "\n".join(lines)
