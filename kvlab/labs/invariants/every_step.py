"""The spec's invariant set after every step of a real engine: ``check_every_step(engine)``.

:func:`check_every_step` registers an observer on the engine's core that runs
:data:`kvlab.labs.invariants.spec_invariants.SPEC_INVARIANTS` (invariant 2 before each execute, all
nine after each step), with the engine's grammar states as invariant 7's probe; a failed step is
checked too. A broken invariant raises
:class:`~kvlab.labs.invariants.spec_invariants.InvariantViolation` from ``step()``.
"""

from __future__ import annotations

from typing import Any

from kvlab.core.engine_core import StepObserver
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.structured_outputs.manager import grammar_mismatch
from kvlab.labs.invariants.spec_invariants import EngineView, InvariantMonitor


class EveryStep(StepObserver):
    """The observer: one :class:`InvariantMonitor` over the engine's core."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.monitor = InvariantMonitor()
        self.withheld: list[str] = []    # KV tables a fault injector holds (kv_shrink)

    def _grammar_probe(self) -> list[tuple[str, str]]:
        problems = []
        self.engine.core.wait_executed()   # (overlap: the runner has run the steps in flight)
        samplers = self.engine.executor.requests
        for r in self.engine.scheduler.requests():
            grammar = getattr(samplers.get(r.request_id), "grammar", None)
            if grammar is not None and not r.status.is_terminal \
                    and (problem := grammar_mismatch(grammar, r.output_token_ids)):
                problems.append((f"request {r.request_id}", f"{problem}: not rolled back"))
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


def check_every_step(engine: LLMEngine) -> EveryStep:
    """Register the observer on ``engine``'s core and return it (its ``monitor`` counts the
    checks). A broken invariant then raises from ``engine.step()``."""
    if not isinstance(engine, LLMEngine):
        raise TypeError(f"check_every_step takes an LLMEngine (llm.engine), got "
                        f"{type(engine).__name__}")
    hook = EveryStep(engine)
    engine.core.add_observer(hook)
    return hook
