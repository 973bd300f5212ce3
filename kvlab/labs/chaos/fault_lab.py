"""The fault lab: one small engine, one fault, one implementation (correct or broken), traced.

:func:`run_lab` drives the one step loop (:class:`~kvlab.core.engine_core.EngineCore` over the
production scheduler with a prefix cache and draft-model speculation, tokens from
:class:`~kvlab.labs.chaos.soak.ChaosExecutor`) through a fixed, seeded workload: two tenants sending
the same prompt, requests sharing a prefix, an abort at step 6. A fault from
:data:`LAB_FAULTS` strikes at steps 4 and 9
(:class:`~kvlab.labs.faults.step_faults.StepFaultInjector`). The implementation is the engine as
shipped or one of :data:`MUTATIONS`, each a deliberately broken component that breaks one
invariant. The full set (:data:`~kvlab.labs.invariants.spec_invariants.SPEC_INVARIANTS`) is checked
after every step; the trace records, per step, the block pool, the queues and the checks, and
the first violation (which invariant, which request or block, which step) ends the run.

Chapter 12's widget draws these traces (:mod:`kvlab.viz.invariants`); its exercises ask which
invariant a mutation breaks and grade new checkers against these mutations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.engine_core import EngineCore, StepObserver
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.labs.chaos.soak import ChaosExecutor
from kvlab.labs.faults.step_faults import (
    STEP_FAULTS,
    InjectedFault,
    StepFault,
    StepFaultInjector,
    StepFaultSchedule,
)
from kvlab.labs.invariants.spec_invariants import EngineView, InvariantMonitor, InvariantViolation

__all__ = ["LAB_FAULTS", "MUTATIONS", "LabStep", "LabTrace", "Mutation", "run_lab"]

#: The faults the lab offers ("none" plus the step faults a short run without crashes can
#: show); each strikes at :data:`FAULT_STEPS`.
LAB_FAULTS = ("none", "alloc_refusal", "kv_shrink", "executor_error", "abort_storm",
              "spec_reject_all")
FAULT_STEPS = (4, 9)
TENANT_A = (("model", "lab"), ("security_domain", "tenant-a"))
TENANT_B = (("model", "lab"), ("security_domain", "tenant-b"))


class _Twice(ProductionScheduler):
    """Reports every ended request again in the next step (a retry loop that re-sends)."""

    def update_from_output(self, output, sampled):
        ended = super().update_from_output(output, sampled)
        again, self.previous = getattr(self, "previous", []), list(ended)
        return ended + again


class _Sticky(ProductionScheduler):
    """Aborts a request but leaves its id in the waiting queue."""

    def abort_request(self, request_id):
        r = super().abort_request(request_id)
        if r is not None:
            self.waiting.append(request_id)
        return r


class _Rewrite(ProductionScheduler):
    """'Fixes up' the first output token after the fact (a detokenizer that rewrites)."""

    def update_from_output(self, output, sampled):
        ended = super().update_from_output(output, sampled)
        for r in self.requests():
            if len(r.output_token_ids) >= 3 and not r.status.is_terminal:
                r.output_token_ids[0] = (r.output_token_ids[0] + 1) % 64
        return ended


class _Unscoped(KVCacheManager):
    """A prefix cache whose key forgets the scope (model version, security domain)."""

    def lookup(self, scope, token_ids):
        return super().lookup(TENANT_A, token_ids)

    def find_prefix(self, scope, token_ids):
        return super().find_prefix(TENANT_A, token_ids)

    def admit(self, request_id, scope, token_ids, num_tokens, hit=None):
        return super().admit(request_id, TENANT_A, token_ids, num_tokens, hit)


def _skip_release(sched: Any) -> None:
    pool = sched.kv.pool
    release = pool.release
    pool.release = lambda blocks, owner: release(list(blocks)[1:], owner)


def _keep_tail(sched: Any) -> None:
    sched.kv.truncate = lambda rid, n: []


def _no_reservation(sched: Any) -> None:
    sched.reserved_blocks = lambda: 0


@dataclass(frozen=True)
class Mutation:
    """A deliberately broken component: what it does, the invariant it breaks, how to build it
    (``scheduler_cls``, ``kv_cls``, then ``patch(scheduler)``)."""

    description: str
    breaks: int
    scheduler_cls: type = ProductionScheduler
    kv_cls: type = KVCacheManager
    patch: Callable[[Any], None] | None = None


#: name -> mutation. "correct" is the engine as shipped.
MUTATIONS: dict[str, Mutation] = {
    "correct": Mutation("the engine as shipped", 0),
    "release skips a block": Mutation("freeing a request's table forgets its first block", 1,
                                      patch=_skip_release),
    "finish reported twice": Mutation("every ended request is reported again next step", 3,
                                      _Twice),
    "abort leaves it queued": Mutation("an aborted request stays in the waiting queue", 4,
                                       _Sticky),
    "output rewritten": Mutation("the first output token is rewritten after two more", 5,
                                 _Rewrite),
    "cache ignores the tenant": Mutation("the prefix cache's key drops the scope", 6,
                                         kv_cls=_Unscoped),
    "rollback keeps the tail": Mutation("rejected draft positions keep their blocks", 7,
                                        patch=_keep_tail),
    "admission without reservation": Mutation("admission forgets what running requests may "
                                              "still claim", 9, patch=_no_reservation),
}


@dataclass
class LabStep:
    """What one step left behind: block states by block, queue sizes, faults this step."""

    step: int
    blocks: tuple[str, ...]
    waiting: int
    running: int
    checks: int
    faults: tuple[str, ...] = ()


@dataclass
class LabTrace:
    implementation: str
    fault: str
    steps: list[LabStep] = field(default_factory=list)
    violation: InvariantViolation | None = None
    faults: Counter = field(default_factory=Counter)
    finished: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def caught(self) -> int | None:
        """The number of the invariant that caught the bug (None: nothing broke)."""
        return None if self.violation is None else self.violation.invariant.number


def _workload() -> dict[int, list[RuntimeRequest]]:
    shared = (11, 12, 13, 14, 15, 16, 17, 18)
    def req(rid, prompt, n, scope=TENANT_A):
        return RuntimeRequest(rid, tuple(prompt), n, scope=scope)
    return {1: [req("a", (*shared, 21, 22), 6), req("b", (*shared, 31), 8)],
            2: [req("c", (41, 42, 43), 10)],
            3: [req("d", (*shared, 21, 22), 5, TENANT_B)],
            5: [req("e", (*shared, 51, 52, 53), 7), req("f", (61, 62, 63, 64, 65), 9)],
            7: [req("g", (*shared, 21, 22), 4)]}


ABORT = {6: "f"}


def _block_states(kv: Any, withheld: tuple[str, ...]) -> tuple[str, ...]:
    pool = kv.pool
    held = {b for rid in withheld if kv.has(rid) for b in kv.block_table(rid)}
    return tuple("withheld" if b in held else pool.state(b) for b in range(pool.num_blocks))


def run_lab(implementation: str | Mutation = "correct", fault: str = "none", *,
            steps: int = 30, seed: int = 0) -> LabTrace:
    """Run the lab (module docstring) with a named implementation of :data:`MUTATIONS` or any
    :class:`Mutation`; unknown names raise ValueError before anything runs."""
    if isinstance(implementation, Mutation):
        m, implementation = implementation, implementation.description
    elif implementation in MUTATIONS:
        m = MUTATIONS[implementation]
    else:
        raise ValueError(f"unknown implementation {implementation!r}; known: {list(MUTATIONS)}")
    if fault not in LAB_FAULTS:
        raise ValueError(f"unknown lab fault {fault!r}; known: {list(LAB_FAULTS)}")
    kv = m.kv_cls(14, 4)
    sched = m.scheduler_cls(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                prefill_chunk=8, num_lookahead_tokens=3))
    if m.patch is not None:
        m.patch(sched)
    faults = () if fault == "none" else tuple(StepFault(s, STEP_FAULTS[fault], fault)
                                              for s in FAULT_STEPS)
    injector = StepFaultInjector(StepFaultSchedule(faults, seed))
    monitor = InvariantMonitor()
    executor = ChaosExecutor(sched.get_request, "draft", injector)
    core = EngineCore(sched, executor, forget_ended=False)
    executor.core = core
    trace = LabTrace(implementation, fault)

    def view(last: Any = None) -> EngineView:
        return EngineView(sched, kv, sched.step_count, last, tuple(injector.withheld))

    class Checker(StepObserver):
        def before_execute(self, c: Any, output: Any) -> None:
            monitor.before_execute(view(), output)

        def after_step(self, c: Any, result: Any) -> None:
            monitor.check(view(result))

        def after_failed_step(self, c: Any, output: Any, error: BaseException) -> None:
            monitor.check(view())

    core.add_observer(injector)
    core.add_observer(Checker())
    arrivals = _workload()
    for step in range(1, steps + 1):
        for r in arrivals.get(step, ()):
            core.add_request(r)
        if step in ABORT:
            core.abort_request(ABORT[step])
        before = Counter(injector.injected)
        injector.before_step(step, kv)
        try:
            try:
                core.step()
            except (InjectedFault, ValueError):   # a failed step (its requests end with a
                monitor.check(view())             # reason): the state must still be right
        except InvariantViolation as v:
            trace.violation = v
        hit = tuple((Counter(injector.injected) - before).elements())
        trace.steps.append(LabStep(step, _block_states(kv, tuple(injector.withheld)),
                                   len(sched.waiting), len(sched.running), monitor.checks, hit))
        if trace.violation is not None or (step > max(arrivals) and
                                           not core.has_unfinished_requests()):
            break
    trace.faults = Counter(injector.injected)
    trace.finished = {r.request_id: tuple(r.output_token_ids) for r in sched.requests()
                      if r.status.value == "finished"}
    return trace
