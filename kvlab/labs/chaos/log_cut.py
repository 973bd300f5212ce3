"""A seeded engine for the "log cut at a record boundary" experiment (chapter 12).

:func:`build` runs the one step loop (production scheduler, prefix sharing, draft-model
speculation, :class:`~kvlab.labs.chaos.soak.ChaosExecutor`) for ``steps`` steps, deterministically
from ``seed``, and returns the KV manager, the scheduler (its event log is the log to cut),
each request's ``(prompt, max_tokens)`` and the ids that had finished. Rebuilding with the same
seed gives the same state again, so every cut point can be recovered from a fresh copy.
:func:`make` is the scheduler factory recovery needs.
"""

from __future__ import annotations

import random
from typing import Any

from kvlab.core.engine_core import EngineCore
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.labs.chaos.soak import STOP, ChaosExecutor
from kvlab.labs.recovery.event_log import EventLog

__all__ = ["CONFIG", "build", "make"]

CONFIG = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, prefill_chunk=8,
                         num_lookahead_tokens=3)


def make(kv: Any, log: EventLog) -> ProductionScheduler:
    """An empty scheduler on ``kv`` appending to ``log`` (the factory recovery calls)."""
    return ProductionScheduler(kv, CONFIG, log=log)


def build(seed: int, steps: int = 12) -> tuple[KVCacheManager, ProductionScheduler,
                                               dict[str, tuple[tuple[int, ...], int]], set[str]]:
    """The engine after ``steps`` steps of seeded traffic (module docstring)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    rng = random.Random(seed)
    kv = KVCacheManager(48, 4)
    sched = make(kv, EventLog())
    core = EngineCore(sched, ChaosExecutor(sched.get_request, "draft"), forget_ended=False)
    prompts: dict[str, tuple[tuple[int, ...], int]] = {}
    shared = tuple(rng.randrange(6, 64) for _ in range(8))
    for step in range(steps):
        if rng.random() < 0.7:
            rid = f"r{step}"
            tail = tuple(rng.randrange(6, 64) for _ in range(rng.randrange(1, 6)))
            prompt = (shared + tail) if rng.random() < 0.5 else tail + shared[:3]
            prompts[rid] = (prompt, rng.randrange(2, 10))
            core.add_request(RuntimeRequest(rid, prompt, prompts[rid][1],
                                            scope=(("model", "chaos"),),
                                            stop_token_ids=frozenset({STOP})))
        core.step()
    finished = {r.request_id for r in sched.requests() if r.status.value == "finished"}
    return kv, sched, prompts, finished
