"""Where KV memory goes: contiguous pre-reservation vs paged allocation, measured over time.

A small-scale, simulated reproduction of Figure 2 of the PagedAttention paper (Kwon et al.,
SOSP 2023): with one contiguous reservation per request only about 20–38% of KV memory holds
token states; with paged allocation about 96% does. One module per job:

* :mod:`.workload` — :class:`WorkloadRequest` and the seeded :func:`sharegpt_like_workload`;
* :mod:`.arenas` — the contiguous allocators :class:`BuddyArena` and :class:`FirstFitArena`;
* :mod:`.simulation` — :func:`simulate` one policy (:data:`POLICIES`) step by step, and
  :func:`compare_policies` on one workload;
* :mod:`.report` — :class:`WasteReport`, the accounting :data:`CATEGORIES` and
  :func:`waste_table`.
"""

from __future__ import annotations

from kvlab.labs.fragmentation.arenas import ARENAS, BuddyArena, FirstFitArena
from kvlab.labs.fragmentation.report import CATEGORIES, WasteReport, waste_table
from kvlab.labs.fragmentation.simulation import POLICIES, compare_policies, reservation, simulate
from kvlab.labs.fragmentation.workload import WorkloadRequest, sharegpt_like_workload

__all__ = [
    "ARENAS",
    "CATEGORIES",
    "POLICIES",
    "BuddyArena",
    "FirstFitArena",
    "WasteReport",
    "WorkloadRequest",
    "compare_policies",
    "reservation",
    "sharegpt_like_workload",
    "simulate",
    "waste_table",
]
