"""The chaos run for P/D disaggregation (torch-free): transfer faults, step faults, aborts.

:func:`run_pd_chaos` drives a producer and a consumer :class:`~kvlab.core.engine_core.EngineCore`
over the toy KV of :mod:`kvlab.labs.pd.pair` (tokens are read back from what the slots hold, so a
wrong install changes the tokens). The consumer is a
:class:`~kvlab.disagg.remote_kv_scheduler.RemoteKVScheduler` over the **production**
scheduler with prefix caching. The producer prefills every prompt and exports through the
in-process channel under a seeded :class:`~kvlab.disagg.transfer_faults.FaultSchedule` (dropped,
truncated, corrupted, stale, foreign, incompatible, duplicated, reordered entries). The consumer
then serves seeded traffic (``n > 1`` fanned out, random aborts, some applied while a step
executes) under seeded step faults (:class:`~kvlab.labs.faults.step_faults.StepFaultInjector`:
allocation refusal, KV shrinkage, executor errors, abort storms). The invariant set runs after
every step, and invariant 8 reads an independent
:class:`~kvlab.labs.invariants.install_audit.InstallAudit` of every install. At the end every
finished request must equal the single-engine truth, no position may have read wrong KV, and
every block must be free.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.engine_core import EngineCore, StepObserver
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ModelOutput
from kvlab.disagg.channel import EntryExporter, InProcessChannel
from kvlab.disagg.remote_kv_scheduler import RemoteKVPolicy, RemoteKVScheduler
from kvlab.disagg.transfer_faults import DEFAULT_POINT, FaultSchedule, TransferFaultInjector
from kvlab.labs.faults.step_faults import InjectedFault, StepFaultInjector, StepFaultSchedule
from kvlab.labs.invariants.install_audit import InstallAudit
from kvlab.labs.invariants.spec_invariants import EngineView, InvariantMonitor
from kvlab.labs.pd.pair import TOY_FIELDS, TokenKV, TokenKVCodec, TokenKVExecutor

__all__ = ["PD_STEP_FAULTS", "PD_TRANSFER_FAULTS", "PDChaosResult", "run_pd_chaos"]

#: Transfer faults of the run (the send and deliver points; crashes are chapter 10's sweep).
PD_TRANSFER_FAULTS = tuple(k for k, p in DEFAULT_POINT.items()
                           if p in ("send", "deliver") and k != "producer_crash")
#: Step faults that apply to this executor (no speculation, no event-log crash here).
PD_STEP_FAULTS = ("alloc_refusal", "kv_shrink", "executor_error", "abort_storm")
BLOCK = 4


@dataclass
class PDChaosResult:
    seed: int
    steps: int = 0
    checks: int = 0
    installs_audited: int = 0
    transfer: Counter = field(default_factory=Counter)    # consumer decisions by kind
    step_faults: Counter = field(default_factory=Counter)
    finished: int = 0
    mismatches: list[str] = field(default_factory=list)
    wrong_kv_reads: int = 0
    leaked_blocks: int = 0


class _Source:
    """The channel seen through the deliver-point faults."""

    def __init__(self, channel: InProcessChannel, injector: TransferFaultInjector) -> None:
        self.channel, self.injector = channel, injector

    def fetch(self, keys):
        return self.injector.on_deliver(self.channel.fetch(keys))

    def wait(self, timeout: float) -> None:
        pass


class _FaultyExecutor:
    """The toy executor with the step injector's execute-point faults."""

    def __init__(self, inner: TokenKVExecutor, injector: StepFaultInjector, rng: random.Random,
                 abort_rate: float) -> None:
        self.inner, self.injector, self.rng, self.abort_rate = inner, injector, rng, abort_rate
        self.core: Any = None

    def execute(self, output) -> ModelOutput:
        live = [c.request_id for c in output.chunks]
        self.injector.on_execute(self.core, output, live, [])
        if live and self.rng.random() < self.abort_rate:      # a client abort, mid-step
            self.core.abort_request(self.rng.choice(live))
        return self.inner.execute(output)


def _truth(prompts: dict[str, tuple[tuple[int, ...], int]]) -> dict[str, list[int]]:
    kv = KVCacheManager(256, BLOCK)
    sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128))
    core = EngineCore(sched, TokenKVExecutor(sched.get_request, TokenKV(256, BLOCK)),
                      forget_ended=False)
    for rid, (prompt, n) in prompts.items():
        core.add_request(RuntimeRequest(rid, prompt, n))
    while core.has_unfinished_requests():
        core.step()
    return {r.request_id: list(r.output_token_ids) for r in sched.requests()}


def run_pd_chaos(seed: int, *, steps: int = 40, num_blocks: int = 64,
                 transfer_rate: float = 0.5, step_fault_rate: float = 0.15,
                 abort_rate: float = 0.05,
                 transfer_kinds: tuple[str, ...] = PD_TRANSFER_FAULTS) -> PDChaosResult:
    """One seeded P/D chaos run (module docstring). Raises InvariantViolation at the first
    broken invariant; mismatches, wrong KV reads and leaks are reported in the result."""
    rng = random.Random(seed)
    result = PDChaosResult(seed)
    prefixes = [tuple(rng.randrange(10, 900) for _ in range(rng.choice((8, 12))))
                for _ in range(3)]
    prompts = sorted({p + tuple(rng.randrange(10, 900) for _ in range(rng.randrange(1, 6)))
                      for p in prefixes for _ in range(3)})
    transfer = TransferFaultInjector(FaultSchedule.random(seed, len(prompts), rate=transfer_rate,
                                                     kinds=transfer_kinds))
    channel = InProcessChannel()
    # the producer: prefill every prompt, export its full blocks
    pkv, pmem = KVCacheManager(256, BLOCK), TokenKV(256, BLOCK)
    exporter = EntryExporter(TokenKVCodec(pmem).export, TOY_FIELDS, channel, transfer)
    psched = RemoteKVScheduler(BaselineScheduler(pkv, SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=256)), RemoteKVPolicy(TOY_FIELDS, produce=True),
        exporter=exporter)
    producer = EngineCore(psched, TokenKVExecutor(psched.get_request, pmem))
    for i, p in enumerate(prompts):
        producer.add_request(RuntimeRequest(f"p{i}", p, 1))
    while producer.has_unfinished_requests():
        producer.step()
    exporter.flush()
    # the consumer
    kv, mem = KVCacheManager(num_blocks, BLOCK), TokenKV(num_blocks, BLOCK)
    audit = InstallAudit(TOY_FIELDS)
    clock = [0.0]
    inner = ProductionScheduler(kv, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32,
                                                    prefill_chunk=8))
    sched = RemoteKVScheduler(inner, RemoteKVPolicy(TOY_FIELDS, consume=True, timeout_s=3),
                              source=audit.source(_Source(channel, transfer)),
                              writer=TokenKVCodec(mem), clock=lambda: clock[0])
    injector = StepFaultInjector(StepFaultSchedule.from_seed(seed, steps, rate=step_fault_rate,
                                                         kinds=PD_STEP_FAULTS))
    toy = TokenKVExecutor(sched.get_request, mem)
    executor = _FaultyExecutor(toy, injector, rng, abort_rate)
    core = EngineCore(sched, executor, forget_ended=False)
    executor.core = core
    monitor = InvariantMonitor()

    def view(last: Any = None, audit_now: bool = True) -> EngineView:
        installs = audit.records(sched) if audit_now else ()   # each install audited once,
        return EngineView(sched, kv, sched.step_count, last,   # by a full check
                          tuple(injector.withheld), installs=installs)

    class Checker(StepObserver):
        def before_execute(self, c: Any, output: Any) -> None:
            monitor.before_execute(view(audit_now=False), output)

        def after_step(self, c: Any, res: Any) -> None:
            monitor.check(view(res))

        def after_failed_step(self, c: Any, output: Any, error: BaseException) -> None:
            monitor.check(view())

    core.add_observer(injector)
    core.add_observer(Checker())
    asked: dict[str, tuple[tuple[int, ...], int]] = {}
    step = 0
    while step < steps or core.has_unfinished_requests():
        step += 1
        clock[0] = float(step)
        if step > 40 * steps:
            raise RuntimeError(f"seed {seed}: not drained after {step} steps")
        if step <= steps and rng.random() < 0.5:
            prompt, max_tokens = rng.choice(prompts), rng.randrange(1, 8)
            for i in range(rng.choice((1, 1, 2))):
                rid = f"q{step}" + (f"#{i}" if i else "")
                asked[rid] = (prompt, max_tokens)
                core.add_request(RuntimeRequest(rid, prompt, max_tokens))
        live = [r.request_id for r in sched.requests() if not r.status.is_terminal]
        if step <= steps and live and rng.random() < abort_rate:
            core.abort_request(rng.choice(live))
        injector.before_step(step, kv)
        with contextlib.suppress(InjectedFault):   # the step's requests failed with a reason
            core.step()
        result.steps += 1
    injector.release_all(kv)
    monitor.check(view())
    truth = _truth(asked)
    for r in sched.requests():
        if r.status is RequestStatus.FINISHED:
            result.finished += 1
            if list(r.output_token_ids) != truth[r.request_id]:
                result.mismatches.append(r.request_id)
    result.checks, result.installs_audited = monitor.checks, audit.audited
    result.transfer = Counter(sched.stats)
    result.step_faults = Counter(injector.injected)
    result.wrong_kv_reads = len(toy.violations)
    result.leaked_blocks = kv.pool.num_blocks - kv.num_allocatable_blocks()
    return result
