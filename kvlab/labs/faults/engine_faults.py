"""Seeded step faults on the real engine: a
:class:`~kvlab.labs.faults.step_faults.StepFaultInjector`
attached to an :class:`~kvlab.engine.llm_engine.LLMEngine` (the chaos test's glue).

:func:`attach_faults` registers the injector as the first observer of the engine's core (so a
late copy lands before the invariant hook looks at the next execute), wraps the executor's
``execute`` for the ``execute``-point faults, and tells the invariant hook which KV tables
the injector withholds. The driver calls :meth:`EngineFaults.before_step` before each
``engine.step()`` (``schedule``-point faults) and :meth:`EngineFaults.release_all` at the end.

Faults on the real engine: ``alloc_refusal``, ``kv_shrink``, ``executor_error``,
``sampling_error`` (one request's tokens dropped from the model output: the update refuses
it and the step fails), ``late_copy``, ``abort_storm`` (through ``engine.abort_request``,
so the engine's outputs see it; seq ids ``r#i`` map to ``r``) and ``spec_reject_all`` (every
draft token replaced by a different token, so greedy verification rejects it). ``crash`` and
the ``recover``-point log faults are refused: the engine's executor, output processor and
P/D wrapper are bound to the live scheduler, and rebuilding them from the event log is not
supported (the torch-free :func:`kvlab.labs.chaos.soak.run_chaos` covers recovery).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from typing import Any

from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.faults.step_faults import STEP_FAULTS, StepFaultInjector, StepFaultSchedule
from kvlab.labs.invariants.every_step import EveryStep

__all__ = ["ENGINE_FAULTS", "EngineFaults", "attach_faults"]

ENGINE_FAULTS = tuple(k for k, p in STEP_FAULTS.items() if p in ("schedule", "execute"))


class _EngineAborts:
    """What the injector's abort storm calls ``core``: aborts through the engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.outputs: dict[str, Any] = {}

    def abort_request(self, seq_id: str) -> None:
        rid = seq_id.split("#", 1)[0]
        if rid in self.outputs:
            return                                  # another sample of it already aborted
        with contextlib.suppress(KeyError):        # ended already: aborting it is a no-op
            self.outputs[rid] = self.engine.abort_request(rid)


class EngineFaults:
    """The injector on one engine; ``injector.injected`` counts faults by kind,
    ``storm_aborts`` holds the outputs of the requests an abort storm cancelled,
    ``rejected_all`` counts the forced-rejection steps whose verification accepted nothing."""

    def __init__(self, engine: LLMEngine, schedule: StepFaultSchedule,
                 invariants: EveryStep | None = None) -> None:
        bad = sorted({f.kind for f in schedule.faults} - set(ENGINE_FAULTS))
        if bad:
            raise ValueError(f"faults {bad} are not supported on the real engine "
                             f"(supported: {list(ENGINE_FAULTS)})")
        self.engine = engine
        self.injector = StepFaultInjector(schedule)
        self.aborts = _EngineAborts(engine)
        self.rejected_all = 0
        self.step = 0
        self._execute = engine.executor.execute
        engine.executor.execute = self._faulty_execute
        engine.core.observers.insert(0, self.injector)
        if invariants is not None:       # the tables kv_shrink holds are not leaks
            invariants.withheld = self.injector.withheld

    @property
    def injected(self) -> Counter:
        return self.injector.injected

    @property
    def storm_aborts(self) -> dict[str, Any]:
        return self.aborts.outputs

    def before_step(self) -> None:
        self.step += 1
        self.injector.before_step(self.step, self.engine.kv)

    def release_all(self) -> None:
        self.injector.release_all(self.engine.kv)

    def _faulty_execute(self, output: Any) -> Any:
        live = [c.request_id for c in output.chunks]
        answer = self.injector.on_execute(self.aborts, output, live, [])
        if answer == "spec_reject_all" and getattr(self.engine.executor, "proposer", None):
            result = self._rejecting(output)
        else:
            result = self._execute(output)
        if answer == "sampling_error" and result.sampled:
            sampled = dict(result.sampled)
            sampled.pop(sorted(sampled)[0])          # the sampler lost one request's tokens
            result = replace(result, sampled=sampled)
        return result

    def _rejecting(self, output: Any) -> Any:
        proposer = self.engine.executor.proposer
        propose = proposer.propose
        vocab = self.engine.config.vocab_size

        def wrong(chunks: Any, rows: Any, tables: Any) -> Any:
            return {rid: replace(p, tokens=tuple((t + 1) % vocab for t in p.tokens), q=None)
                    for rid, p in propose(chunks, rows, tables).items()}
        proposer.propose = wrong
        try:
            result = self._execute(output)
        finally:
            del proposer.propose                     # the bound method shows through again
        spec = result.drafts
        if spec and all(accepted == 0 for _, accepted in spec.values()):
            self.rejected_all += 1
        return result


def attach_faults(engine: LLMEngine, schedule: StepFaultSchedule,
                  invariants: EveryStep | None = None) -> EngineFaults:
    """Attach ``schedule``'s faults to ``engine`` (ValueError for crash/log faults), telling
    ``invariants`` (attached first, :func:`kvlab.labs.invariants.check_every_step`) what they
    hold."""
    return EngineFaults(engine, schedule, invariants)
