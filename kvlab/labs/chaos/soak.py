"""The chaos run (torch-free): random traffic and scheduled faults, invariants on every step.

:func:`run_chaos` drives one :class:`~kvlab.core.engine_core.EngineCore` (the one step loop)
over a :class:`~kvlab.core.production_scheduler.ProductionScheduler` with prefix caching,
chunked prefill and ``n > 1`` requests (fanned out as LLMEngine does), and a
:class:`ChaosExecutor` that produces tokens from a deterministic function of the context and
**speculates** (a draft "model" that agrees with the target most of the time, or n-gram prompt
lookup), verifying greedily as the real verifier does at temperature 0. Requests arrive and are
aborted at random, some while a step executes. A
:class:`~kvlab.labs.faults.step_faults.StepFaultSchedule` derived from the seed injects every step
fault; a crash is recovered from the event log (after a damaged copy of the log has been
refused, for the ``recover``-point faults). The full invariant set
(:data:`~kvlab.labs.invariants.spec_invariants.SPEC_INVARIANTS`) is checked after every step and
invariant 2 before every execute. At the end: every finished request equals the same request run
alone without faults (and without speculation), and every block is free once the cache is
emptied. With ``ChaosConfig.windows`` the pool is managed per KV cache group by the hybrid
manager of a sliding-window model (:mod:`kvlab.core.hybrid_kv_cache_manager`), and its own
structural invariant set is checked after every step too.

The model is not needed for any of this: what is under test is the metadata (tables,
refcounts, queues, log), which the real engine shares with this run.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.engine_core import EngineCore, StepObserver
from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler
from kvlab.core.request import PLACEHOLDER, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ModelOutput, ScheduledChunk, SchedulerOutput
from kvlab.labs.faults.step_faults import (
    STEP_FAULTS,
    InjectedFault,
    StepFaultInjector,
    StepFaultSchedule,
)
from kvlab.labs.invariants.spec_invariants import EngineView, InvariantMonitor
from kvlab.labs.invariants.structural import check_kv_manager
from kvlab.labs.recovery import recover
from kvlab.labs.recovery.event_log import CorruptLog, EventLog, SimulatedCrash
from kvlab.sim.tokens import hash_token

__all__ = ["OVERLAP_FAULTS", "ChaosConfig", "ChaosExecutor", "ChaosResult", "OverlapChaosExecutor",
           "run_chaos", "solo_tokens"]

S = RequestStatus
#: the faults that strike under overlap scheduling (no event log to crash, no speculation)
OVERLAP_FAULTS = tuple(k for k in STEP_FAULTS
                       if k not in ("crash", "corrupt_log", "truncated_log", "spec_reject_all"))
VOCAB = 64          # small vocabulary: n-gram lookup finds matches, stop tokens do occur
STOP = 5


def target_token(context: tuple[int, ...]) -> int:
    """The 'model': the greedy next token of a context (deterministic)."""
    return hash_token(context, VOCAB)


def draft_token(context: tuple[int, ...]) -> int:
    """The draft 'model': agrees with the target about 70% of the time."""
    t = target_token(context)
    return t if hash_token(context, 10, avoid=None) < 7 else (t + 1) % VOCAB


def ngram_drafts(context: tuple[int, ...], k: int) -> list[int]:
    """Prompt lookup: continue the latest earlier occurrence of the last two tokens."""
    if len(context) < 3:
        return []
    tail = context[-2:]
    for i in range(len(context) - 3, -1, -1):
        if context[i:i + 2] == tail:
            return list(context[i + 2:i + 2 + k])
    return []


@dataclass
class ChaosExecutor:
    """Greedy tokens from :func:`target_token`; speculative chunks verified against it."""

    requests: Any                      # request id -> RuntimeRequest
    method: str = "draft"              # "draft" or "ngram"
    injector: StepFaultInjector | None = None
    core: Any = None
    drafted: int = 0
    accepted: int = 0

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        answer = None
        if self.injector is not None and self.core is not None:
            live = [c.request_id for c in output.chunks]
            answer = self.injector.on_execute(self.core, output, live, [], self.fault_step(output))
        sampled: dict[str, Any] = {}
        for chunk in output.chunks:
            if not chunk.sample:
                continue
            ctx = self.context(chunk)
            k = chunk.num_lookahead
            if k == 0:
                sampled[chunk.request_id] = target_token(ctx)
                continue
            drafts = self._drafts(ctx, k)
            if answer == "spec_reject_all":
                drafts = [(target_token(ctx) + 1) % VOCAB] * k
            emitted: list[int] = []
            for d in drafts:
                t = target_token(ctx)
                emitted.append(t)
                ctx = (*ctx, t)
                if d != t:
                    break
            else:
                emitted.append(target_token(ctx))
            self.drafted += len(drafts)
            self.accepted += len(emitted) - 1
            sampled[chunk.request_id] = tuple(emitted)
        if answer == "sampling_error" and sampled:
            sampled.pop(sorted(sampled)[0])          # the sampler lost one request's token
        return ModelOutput(sampled)

    def context(self, chunk: ScheduledChunk) -> tuple[int, ...]:
        """The tokens of ``chunk``'s request up to the end of the chunk."""
        return tuple(self.requests(chunk.request_id).all_token_ids)

    def fault_step(self, output: SchedulerOutput) -> int | None:
        """The step whose execute-point faults strike (None: the driver's)."""
        return None

    def _drafts(self, ctx: tuple[int, ...], k: int) -> list[int]:
        if self.method == "ngram":
            return ngram_drafts(ctx, k)
        out: list[int] = []
        for _ in range(k):
            d = draft_token(ctx)
            out.append(d)
            ctx = (*ctx, d)
        return out


@dataclass
class OverlapChaosExecutor(ChaosExecutor):
    """The chaos executor under overlap scheduling: the scheduler's requests hold placeholders
    for the tokens in flight, so it keeps each request's tokens from the outputs alone, as the
    model runner does (a placeholder is the token it sampled last for that request). Its
    faults strike by the scheduler's step number."""

    contexts: dict[str, list[int]] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        for rid in output.finished_ids:
            self.contexts.pop(rid, None)
            self.last.pop(rid, None)
        for new in output.new_requests:
            self.contexts[new.request_id] = [*new.prompt_token_ids, *new.output_token_ids]
        for chunk in output.chunks:
            ctx = self.contexts[chunk.request_id]
            del ctx[chunk.start_pos:]
            ctx.extend(self.last[chunk.request_id] if t == PLACEHOLDER else t
                       for t in chunk.token_ids)
        result = super().execute(output)
        self.last.update(result.sampled)
        return result

    def context(self, chunk: ScheduledChunk) -> tuple[int, ...]:
        return tuple(self.contexts[chunk.request_id])

    def fault_step(self, output: SchedulerOutput) -> int | None:
        return output.step


@dataclass
class ChaosConfig:
    steps: int = 60
    num_blocks: int = 48
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 24
    prefill_chunk: int = 8
    num_lookahead: int = 3
    fault_rate: float = 0.2
    arrival_rate: float = 0.6
    abort_rate: float = 0.08
    check_invariants: bool = True      # False: the same run unchecked (the bench's baseline)
    #: overlap scheduling: no event log (so no crash or recovery faults) and no speculation,
    #: which it refuses; every other fault strikes
    async_scheduling: bool = False
    windows: tuple[int, ...] = ()      # per KV cache group (0: full attention); () one table


@dataclass
class ChaosResult:
    seed: int
    steps: int = 0
    faults: Counter = field(default_factory=Counter)
    checks: int = 0
    violations: int = 0
    finished: dict[str, tuple[int, ...]] = field(default_factory=dict)
    prompts: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    leaked_blocks: int = 0
    recoveries: int = 0
    refused_logs: int = 0
    statuses: Counter = field(default_factory=Counter)
    drafted: int = 0
    accepted: int = 0
    schedule: dict = field(default_factory=dict)


class _Checker(StepObserver):
    """The observer that runs the invariant set on the live core."""

    def __init__(self, monitor: InvariantMonitor, injector: StepFaultInjector,
                 enabled: bool = True) -> None:
        self.monitor, self.injector, self.enabled = monitor, injector, enabled

    def view(self, core: Any, last: Any = None) -> EngineView:
        s = core.scheduler
        return EngineView(s, s.kv, s.step_count, last, tuple(self.injector.withheld))

    def before_execute(self, core: Any, output: Any) -> None:
        if self.enabled:
            self.monitor.before_execute(self.view(core), output)

    def after_step(self, core: Any, result: Any) -> None:
        if self.enabled:
            self.monitor.check(self.view(core, result))
            if isinstance(core.scheduler.kv, HybridKVCacheManager):
                check_kv_manager(core.scheduler.kv)     # the per-group structural set too

    def after_failed_step(self, core: Any, output: Any, error: BaseException) -> None:
        if self.enabled and not isinstance(error, SimulatedCrash):
            self.monitor.check(self.view(core))


_SOLO: dict[tuple, tuple[int, ...]] = {}


def solo_tokens(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The request run alone, without faults or speculation, on the baseline scheduler."""
    key = (prompt, max_tokens)
    if key not in _SOLO:
        kv = KVCacheManager(64, 4)
        sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                                      prefill_chunk=64))
        core = EngineCore(sched, ChaosExecutor(sched.get_request), forget_ended=False)
        core.add_request(_request("solo", prompt, max_tokens))
        while core.has_unfinished_requests():
            core.step()
        _SOLO[key] = tuple(sched.get_request("solo").output_token_ids)
    return _SOLO[key]


def _request(rid: str, prompt: tuple[int, ...], max_tokens: int) -> RuntimeRequest:
    return RuntimeRequest(rid, prompt, max_tokens, scope=(("model", "chaos"),),
                          stop_token_ids=frozenset({STOP}))


def run_chaos(seed: int, config: ChaosConfig | None = None, *, method: str = "draft",
              schedule: StepFaultSchedule | None = None) -> ChaosResult:
    """One seeded chaos run (see the module docstring). Raises InvariantViolation at the first
    broken invariant; otherwise returns the figures (mismatches and leaks are reported)."""
    cfg = config if config is not None else ChaosConfig()
    overlap = cfg.async_scheduling
    rng = random.Random(seed)
    schedule = schedule or StepFaultSchedule.from_seed(
        seed, cfg.steps, rate=cfg.fault_rate, kinds=OVERLAP_FAULTS if overlap else STEP_FAULTS)
    result = ChaosResult(seed, schedule=schedule.to_data())
    injector = StepFaultInjector(schedule)
    monitor = InvariantMonitor()
    kv: Any = (KVCacheManager(cfg.num_blocks, cfg.block_size) if not cfg.windows else
               HybridKVCacheManager(cfg.num_blocks, cfg.block_size, cfg.windows,
                                    chunk_tokens=cfg.max_num_batched_tokens))
    sconf = SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens,
                            prefill_chunk=cfg.prefill_chunk,
                            num_lookahead_tokens=0 if overlap else cfg.num_lookahead,
                            async_scheduling=overlap)

    def make(kv: Any, log: EventLog) -> Any:
        return ProductionScheduler(kv, sconf, log=None if overlap else log)

    holder: dict[str, Any] = {}
    executor = (OverlapChaosExecutor if overlap else ChaosExecutor)(
        lambda rid: holder["core"].scheduler.get_request(rid), method, injector)
    checker = _Checker(monitor, injector, cfg.check_invariants)

    def new_core(scheduler: Any) -> EngineCore:
        core = EngineCore(scheduler, executor, overlap=overlap)
        core.add_observer(injector)
        core.add_observer(checker)
        holder["core"] = executor.core = core
        return core

    core = new_core(make(kv, EventLog()))
    prefixes = [tuple(rng.randrange(6, VOCAB) for _ in range(rng.choice((4, 8, 9))))
                for _ in range(4)]
    live: list[str] = []
    serial = 0

    def collect(requests: Any) -> None:
        for r in requests:
            result.statuses[r.status.value] += 1
            if r.status is S.FINISHED:
                result.finished[r.request_id] = tuple(r.output_token_ids)
            if r.request_id in live:
                live.remove(r.request_id)

    step = 0
    while step < cfg.steps or core.has_unfinished_requests():
        step += 1
        if step > cfg.steps * 20:
            raise RuntimeError(f"seed {seed}: not drained after {step} steps")
        traffic = step <= cfg.steps
        if traffic and rng.random() < cfg.arrival_rate:
            serial += 1
            prompt = rng.choice(prefixes) + tuple(rng.randrange(6, VOCAB)
                                                  for _ in range(rng.randrange(0, 6)))
            max_tokens, n = rng.randrange(1, 12), rng.choice((1, 1, 2, 3))
            for i in range(n):
                rid = f"q{serial}" + (f"#{i}" if i else "")
                core.add_request(_request(rid, prompt, max_tokens))
                result.prompts[rid] = (prompt, max_tokens)
                live.append(rid)
        if traffic and live and rng.random() < cfg.abort_rate:
            collect([r for r in [core.abort_request(rng.choice(live))] if r is not None
                     and r.status.is_terminal])
        injector.before_step(step, core.scheduler.kv)
        offset = injector.crash_offset() if traffic else None
        sched = core.scheduler
        if offset is not None:   # (never with overlap: it keeps no log)
            sched.log.crash_at = len(sched.log) + offset
        try:
            res = core.step()
            collect([*res.ended, *res.aborted])
        except (InjectedFault, ValueError):
            pass                                   # the step failed; reported next step
        except SimulatedCrash:
            core = _recover(sched, make, injector, monitor, result, new_core)
            collect([r for r in core.scheduler.requests() if r.status.is_terminal])
        finally:
            if sched.log is not None:
                sched.log.crash_at = None
        result.steps += 1
    injector.release_all(core.scheduler.kv)
    if cfg.check_invariants:
        monitor.check(checker.view(core))
    result.faults = Counter(injector.injected)
    result.checks = monitor.checks
    result.drafted, result.accepted = executor.drafted, executor.accepted
    for rid, tokens in result.finished.items():
        prompt, max_tokens = result.prompts[rid]
        if tokens != solo_tokens(prompt, max_tokens):
            result.mismatches.append(rid)
    kv = core.scheduler.kv
    result.leaked_blocks = kv.pool.num_blocks - kv.num_allocatable_blocks()
    return result


def _recover(dead: Any, make: Any, injector: StepFaultInjector, monitor: InvariantMonitor,
             result: ChaosResult, new_core: Any) -> EngineCore:
    kv = dead.kv
    durable = dead.log.durable()
    damaged = injector.damage(durable)
    if damaged is not None:
        before = kv.state_tuple()
        try:
            recover(damaged[1], kv, make)
        except CorruptLog:
            result.refused_logs += 1
        else:
            raise AssertionError(f"recovery accepted a {damaged[0]} event log")
        assert kv.state_tuple() == before, "a refused recovery changed the KV manager"
    scheduler, _ = recover(durable, kv, make)
    result.recoveries += 1
    injector.injected["crash"] += 1
    injector.reset_after_recovery()
    for rid in list(injector.withheld):      # recovery freed the tables the log cannot explain
        if not kv.has(rid):
            injector.withheld.remove(rid)
    monitor.reset({r.request_id: len(kv.block_table(r.request_id))
                   - -(-r.num_computed_tokens // kv.block_size)   # table minus ceil(computed)
                   for r in scheduler.requests() if kv.has(r.request_id)})
    return new_core(scheduler)
