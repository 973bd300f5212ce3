"""``EngineArgs(check_invariants="every_step")``: the spec's invariant set after every step; and
:func:`check_engine`, the invariants of an engine's own bookkeeping (``check_invariants()``).

:func:`attach` validates the argument (None/"off" or "every_step"; ValueError otherwise) and
registers an observer on the engine core that runs :data:`kvlab.core.invariant_set.
SPEC_INVARIANTS` (invariant 2 before each execute, all nine after each step), with the
engine's grammar states as invariant 7's probe; a failed step is checked too. A broken
invariant raises :class:`~kvlab.core.invariant_set.InvariantViolation` from ``step()``.
"""

from __future__ import annotations

from typing import Any

from kvlab.core.interfaces import StepObserver
from kvlab.core.invariant_set import EngineView, InvariantMonitor

MODES = (None, "off", "every_step")


def check_mode(mode: Any) -> str | None:
    if mode not in MODES:
        raise ValueError(f"check_invariants must be None, 'off' or 'every_step', got {mode!r}")
    return None if mode in (None, "off") else mode


class EveryStep(StepObserver):
    """The observer: one :class:`InvariantMonitor` over the engine's core."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.monitor = InvariantMonitor()
        self.withheld: list[str] = []    # KV tables a fault injector holds (kv_shrink)

    def _grammar_probe(self) -> list[tuple[str, str]]:
        problems = []
        samplers = self.engine.executor.samplers
        for r in self.engine.scheduler.requests():
            grammar = getattr(samplers.get(r.request_id), "grammar", None)
            if grammar is not None and not r.status.is_terminal \
                    and grammar.accepted_token_ids != tuple(r.output_token_ids):
                problems.append((f"request {r.request_id}",
                                 f"grammar accepted {grammar.num_accepted} tokens, the request "
                                 f"has {len(r.output_token_ids)}: not rolled back"))
        return problems

    def view(self, core: Any, last: Any = None) -> EngineView:
        s = core.scheduler
        return EngineView(s, s.kv, s.step_count, last, tuple(self.withheld),
                          rollback_probes=(self._grammar_probe,))

    def before_execute(self, core: Any, output: Any) -> None:
        self.monitor.before_execute(self.view(core), output)

    def after_step(self, core: Any, result: Any) -> None:
        self.monitor.check(self.view(core, result))

    def after_failed_step(self, core: Any, output: Any, error: BaseException) -> None:
        self.monitor.check(self.view(core))       # a failed step released its KV cleanly


def attach(engine: Any, mode: Any) -> EveryStep | None:
    """Validate ``mode`` and, for "every_step", register the observer; returns it (or None)."""
    if check_mode(mode) is None:
        return None
    hook = EveryStep(engine)
    engine.core.add_observer(hook)
    return hook


def check_engine(engine: Any) -> None:
    """AssertionError unless the scheduler's and KV manager's invariants hold and the engine's
    bookkeeping agrees with them: every sample has its request and a scheduler entry until it
    ends, the runner's block tables (kept from deltas alone) equal the KV manager's, the runner
    keeps sampler states of live requests only, and grammar states match the output tokens."""
    with engine.core.lock:
        engine.scheduler.check_invariants()
        engine.kv.check_invariants()
        outputs, scheduler, kv = engine.outputs, engine.scheduler, engine.kv
        for rid, (state, sample) in outputs.samples.items():
            assert outputs.requests.get(state.request_id) is state, f"orphan {rid}"
            assert sample.ended is not None or scheduler.find_request(rid) is not None, \
                f"the scheduler lost {rid}"
        batch = engine.executor.input_batch
        rows = batch.row_ids()
        for rid in kv.requests():
            if rid in rows:
                table = kv.block_table(rid)   # (a rollback is sent with the next step)
                assert batch.table(rid)[:len(table)] == table, f"runner's table of {rid}"
        samplers = engine.executor.samplers
        for rid in samplers:
            assert scheduler.find_request(rid) is not None, \
                f"the executor keeps the sampler of forgotten request {rid}"
        engine.structured_outputs.check_states(
            (r.request_id, samplers.get(r.request_id), r.output_token_ids)
            for r in scheduler.requests() if not r.status.is_terminal)
        for state in outputs.requests.values():
            assert state.samples, f"request {state.request_id} has no sample"
