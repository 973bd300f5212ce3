"""A seeded fault injector for the one step loop; its schedule is plain data.

A :class:`StepFault` is ``(step, point, kind)``: at engine step ``step`` (1-based, counted by
the driver), at injection ``point`` of the loop, inject ``kind``. A :class:`StepFaultSchedule`
is a tuple of them derived from a seed (:meth:`StepFaultSchedule.from_seed`) and serialises to
JSON-able data, so a failing run replays exactly from its seed or its dumped schedule.

Points and kinds (:data:`STEP_FAULTS`):

==============  ===================  ======================================================
point           kind                 what happens
==============  ===================  ======================================================
``schedule``    ``alloc_refusal``    every allocatable block is withheld while this step is
                                     scheduled: growth fails, the scheduler must preempt or
                                     wait, nothing leaks
``schedule``    ``kv_shrink``        half the pool is withheld for 8 steps (a preemption
                                     storm), then given back
``execute``     ``executor_error``   the executor raises: the step's requests fail, KV freed
``execute``     ``sampling_error``   the executor answers without a token for one request
                                     (the sampler died): the update refuses it, step fails
``execute``     ``late_copy``        the next copy-on-write copies complete one step late:
                                     their fences must keep the blocks from reuse meanwhile
``execute``     ``abort_storm``      half the live requests are aborted *while the step
                                     executes* (applied at its end), plus finished ids again
``execute``     ``spec_reject_all``  the draft is wrong at every position this step
``update``      ``crash``            the scheduler dies between two event-log appends (a
                                     state transition and the release it implies); recovery
                                     rebuilds it from the log and the surviving KV manager
``recover``     ``corrupt_log``      a record of the log handed to recovery is damaged:
                                     recovery must refuse it and change nothing
``recover``     ``truncated_log``    the last record is torn (data cut): likewise refused
==============  ===================  ======================================================

P/D transfer faults reuse :mod:`kvlab.disagg.transfer_faults` (its own schedule, also data).
The driver that owns the loop applies ``schedule``-point faults with :meth:`StepFaultInjector.
before_step`; the rest act through the engine core's observer hooks and an executor wrapper.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.engine_core import StepObserver
from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager

__all__ = ["STEP_FAULTS", "StepFault", "StepFaultInjector", "StepFaultSchedule"]

STEP_FAULTS: dict[str, str] = {
    "alloc_refusal": "schedule", "kv_shrink": "schedule",
    "executor_error": "execute", "sampling_error": "execute", "late_copy": "execute",
    "abort_storm": "execute", "spec_reject_all": "execute",
    "crash": "update", "corrupt_log": "recover", "truncated_log": "recover",
}
FAULT_SCOPE = ("__fault_injector__",)
SHRINK_STEPS = 8


class InjectedFault(RuntimeError):
    """The exception an injected executor or sampling fault raises."""


@dataclass(frozen=True)
class StepFault:
    step: int
    point: str
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in STEP_FAULTS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {sorted(STEP_FAULTS)}")
        if self.point != STEP_FAULTS[self.kind]:
            raise ValueError(f"fault {self.kind!r} strikes at point {STEP_FAULTS[self.kind]!r}, "
                             f"not {self.point!r}")
        if not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"fault step must be an int >= 1, got {self.step!r}")


@dataclass(frozen=True)
class StepFaultSchedule:
    """Faults by step, plus the seed of the injector's own choices (which requests, where)."""

    faults: tuple[StepFault, ...] = ()
    seed: int = 0

    @classmethod
    def from_seed(cls, seed: int, steps: int, *, rate: float = 0.15,
                  kinds: Sequence[str] = tuple(STEP_FAULTS)) -> StepFaultSchedule:
        """Each step gets a fault with probability ``rate``, kind uniform over ``kinds``
        (a ``recover`` fault comes with the crash it needs)."""
        bad = [k for k in kinds if k not in STEP_FAULTS]
        if bad:
            raise ValueError(f"unknown fault kinds {bad}")
        rng = random.Random(seed)
        faults: list[StepFault] = []
        for step in range(1, steps + 1):
            if rng.random() < rate:
                kind = rng.choice(list(kinds))
                if STEP_FAULTS[kind] == "recover":
                    faults.append(StepFault(step, "update", "crash"))
                faults.append(StepFault(step, STEP_FAULTS[kind], kind))
        return cls(tuple(faults), seed)

    def at(self, step: int, point: str | None = None) -> list[StepFault]:
        return [f for f in self.faults if f.step == step and (point is None or f.point == point)]

    def to_data(self) -> dict:
        return {"seed": self.seed, "faults": [[f.step, f.point, f.kind] for f in self.faults]}

    @classmethod
    def from_data(cls, data: dict) -> StepFaultSchedule:
        return cls(tuple(StepFault(int(s), p, k) for s, p, k in data.get("faults", ())),
                   int(data.get("seed", 0)))


@dataclass
class StepFaultInjector(StepObserver):
    """Applies a :class:`StepFaultSchedule` to one engine core (an observer plus helpers the
    driver calls). ``injected`` counts faults by kind; ``withheld`` names the KV tables the
    injector holds (KV shrinkage), which the invariant view treats as legitimate owners."""

    schedule: StepFaultSchedule
    injected: Counter = field(default_factory=Counter)
    withheld: list[str] = field(default_factory=list)
    step: int = 0
    rng: random.Random = field(init=False)
    _late: list[tuple[int, int]] = field(default_factory=list)
    _release_at: dict[str, int] = field(default_factory=dict)
    _serial: int = 0
    _armed_late: bool = False

    def __post_init__(self) -> None:
        self.rng = random.Random(self.schedule.seed ^ 0x5EED)

    def has(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.schedule.at(self.step))

    # ------------------------------------------------------------------ schedule point
    def before_step(self, step: int, kv: Any) -> None:
        """Called by the driver just before step ``step`` is scheduled."""
        self.step = step
        if self.has("late_copy"):
            self._armed_late = True
        for rid, until in list(self._release_at.items()):
            if step >= until:
                self._give_back(kv, rid)
        for fault in self.schedule.at(step, "schedule"):
            n = kv.num_allocatable_blocks()
            if fault.kind == "kv_shrink":
                n //= 2
            if n <= 0:
                continue
            rids = self._withhold(kv, n)
            for rid in rids:
                self._release_at[rid] = step + (SHRINK_STEPS if fault.kind == "kv_shrink" else 1)
            if rids:
                self.injected[fault.kind] += 1

    def _withhold(self, kv: Any, n: int) -> list[str]:
        """Hold ``n`` allocatable blocks in fake requests: one of ``n`` blocks, or with a
        hybrid manager as many as it takes, each taking a block per group and computing at
        most the tokens of one step (what bounds its window groups)."""
        if not isinstance(kv, HybridKVCacheManager):
            sizes = [n]
        else:
            per = max(1, (kv.chunk_tokens or n * kv.block_size) // kv.block_size)
            blocks = n // kv.num_groups
            sizes = [min(per, blocks - i) for i in range(0, blocks, per)]
        rids = []
        for size in sizes:
            self._serial += 1
            rid = f"__withheld_{self._serial}"
            tokens = [self._serial % 97] * (size * kv.block_size)
            try:
                kv.admit(rid, FAULT_SCOPE, tokens, len(tokens))
            except OutOfBlocks:
                break
            self.withheld.append(rid)
            rids.append(rid)
        return rids

    def _give_back(self, kv: Any, rid: str) -> None:
        kv.free(rid)                 # idempotent: recovery may have freed it already
        self._release_at.pop(rid, None)
        if rid in self.withheld:
            self.withheld.remove(rid)

    def release_all(self, kv: Any) -> None:
        for rid in list(self.withheld):
            self._give_back(kv, rid)
        if self._late:
            kv.complete_copies(self._late)
            self._late = []

    # ------------------------------------------------------------------ observer hooks
    def before_execute(self, core: Any, output: Any) -> None:
        if self._late:                 # the late copies land before anything writes again
            still = Counter(core.scheduler.kv.pending_copies()) & Counter(self._late)
            if still:
                core.scheduler.kv.complete_copies(list(still.elements()))
            self._late = []

    def defer_copies(self, core: Any, output: Any) -> bool:
        """A ``late_copy`` fault stays armed until a step has copies to delay."""
        if self._armed_late and output.copies:
            self._armed_late = False
            self._late.extend(output.copies)
            self.injected["late_copy"] += 1
            return True
        return False

    def reset_after_recovery(self) -> None:
        """Recovery completed the pending copies and freed tables the log does not know."""
        self._late = []

    # ------------------------------------------------------------------ execute point
    def on_execute(self, core: Any, output: Any, live: Sequence[str], ended: Sequence[str],
                   step: int | None = None) -> str | None:
        """Called by the executor wrapper inside ``execute``: raises for executor faults,
        aborts for a storm (mid-step: applied at the step's end); returns ``"sampling_error"``
        when the wrapper must drop one request's token, ``"spec_reject_all"`` when drafts must
        all be wrong, else None. ``step``: the step whose faults strike (default: the driver's
        step; overlap scheduling executes a step while the driver plans the next)."""
        answer = None
        step = self.step if step is None else step
        for fault in self.schedule.at(step, "execute"):
            kind = fault.kind
            if kind == "executor_error" and output.chunks:
                self.injected[kind] += 1
                raise InjectedFault(f"injected executor failure at step {step}")
            if kind == "sampling_error" and any(c.sample for c in output.chunks):
                self.injected[kind] += 1
                answer = kind
            elif kind == "abort_storm" and live:
                self.injected[kind] += 1
                victims = self.rng.sample(list(live), max(1, len(live) // 2))
                victims += list(ended[-3:])            # aborting ended ids: a no-op
                for rid in victims:
                    core.abort_request(rid)
            elif kind == "spec_reject_all":
                self.injected[kind] += 1
                answer = answer or kind
        return answer

    def crash_offset(self) -> int | None:
        """If this step crashes: after how many further log appends (seeded)."""
        if self.has("crash"):
            return self.rng.randrange(0, 24)
        return None

    def damage(self, events: list[Any]) -> tuple[str, list[Any]] | None:
        """The damaged log a ``recover``-point fault hands to recovery (or None)."""
        from dataclasses import replace

        for fault in self.schedule.at(self.step, "recover"):
            if not events:
                return None
            self.injected[fault.kind] += 1
            damaged = list(events)
            if fault.kind == "truncated_log":
                last = damaged[-1]
                damaged[-1] = replace(last, data=last.data[:-1] if last.data else ("",))
            else:
                i = self.rng.randrange(len(damaged))
                damaged[i] = replace(damaged[i], step=damaged[i].step + 1 + self.rng.randrange(9))
            return fault.kind, damaged
        return None
