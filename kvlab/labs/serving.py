"""Serving set-ups on the simulator: colocated replicas, disaggregated prefill/decode, SLOs.

Every instance is the real engine loop (:func:`~kvlab.sim.executor.simulate`: the scheduler
and KV manager of :mod:`kvlab.core` on a simulated clock priced by a roofline). Instances are
independent, so a set-up of several is simulated one instance at a time:

* **Colocated** (:func:`run_colocated`): ``replicas`` identical instances, requests dealt round
  robin; each runs prefill and decode in the same batches (vLLM's and SGLang's default).
* **Disaggregated** (:func:`run_disaggregated`, DistServe's and Splitwise's design): a prefill
  pool computes each prompt and its first token; the prompt's KV then travels to a decode pool
  (``kv_bytes / transfer_bandwidth + transfer_latency``), which installs it and generates the
  rest. On a decode instance a prompt chunk costs nothing to compute (its KV arrived), except
  that the chunk that samples computes one token: the first token, fed back to produce the
  second (:class:`InstalledPrefillCost`). Round robin in both pools. Not modelled: the prefill
  instance keeps the KV until it is sent (here it frees it at the first token), transfers
  sharing a link, and the decode pool refusing transfers when full (they queue instead).

Results are :class:`~kvlab.labs.slo.LatencyRecord` lists for
:func:`~kvlab.labs.slo.evaluate_slo`; :func:`rate_at_attainment` finds the highest request rate
whose SLO attainment still reaches a target (DistServe's measure of capacity).

A simulation is a pure function of its inputs (frozen values: the specs, the cost model, the
scheduler configuration and factory), so :func:`run_colocated` and :func:`chunk_sweep` keep
the last results of each instance they simulated (an LRU of :data:`MEMO_SIZE` entries) and
return a fresh copy when asked again: a check that re-runs the reader's simulation, or a
sweep run twice, costs nothing the second time. Inputs that cannot be hashed are simulated
every time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ScheduledChunk
from kvlab.labs.slo import FailureKind, LatencyRecord
from kvlab.sim.costmodel import RooflineCostModel, StepCost
from kvlab.sim.executor import RequestRecord, SimResult, simulate
from kvlab.sim.workload import RequestSpec

__all__ = ["InstalledPrefillCost", "chunk_sweep", "rate_at_attainment", "records_from_sim",
           "run_colocated", "run_disaggregated"]

#: ``(kv, config) -> Scheduler``: BaselineScheduler, ProductionScheduler or alike.
SchedulerFactory = Callable[..., Any]

_STATUS = {"finished": "finished", "rejected": FailureKind.REJECTED.value,
           "cancelled": FailureKind.CANCELLED.value, "failed": FailureKind.ENGINE_ERROR.value}


def _latency(rec: RequestRecord) -> LatencyRecord:
    status = _STATUS.get(rec.status, FailureKind.TIMEOUT.value)   # unfinished at `until`
    if status != "finished":
        return LatencyRecord(rec.request_id, rec.arrival, status,
                             prompt_tokens=rec.prompt_len, output_tokens=rec.output_tokens)
    return LatencyRecord(rec.request_id, rec.arrival, ttft=rec.ttft, tpot=rec.tpot,
                         e2e=rec.e2e, output_tokens=rec.output_tokens,
                         prompt_tokens=rec.prompt_len)


def records_from_sim(result: SimResult) -> list[LatencyRecord]:
    """One :class:`LatencyRecord` per simulated request (requests still queued or running
    when the simulation stopped count as timeouts)."""
    return [_latency(r) for r in result.requests]


def _instance(cost: RooflineCostModel, config: SchedulerConfig, block_size: int,
              num_blocks: int | None, scheduler: SchedulerFactory):
    blocks = num_blocks if num_blocks is not None else cost.kv_blocks(block_size)
    kv = KVCacheManager(blocks, block_size, enable_prefix_caching=False)
    return scheduler(kv, config)   # no event log: a simulation never recovers


#: How many instance simulations :func:`run_colocated` and :func:`chunk_sweep` remember.
MEMO_SIZE = 256


def _memoised(fn):
    """``fn`` behind an LRU of :data:`MEMO_SIZE` results keyed by its (hashable) arguments;
    unhashable arguments bypass it. ``fn`` must return an immutable value."""
    cached = functools.lru_cache(maxsize=MEMO_SIZE)(fn)

    @functools.wraps(fn)
    def call(*args):
        try:
            hash(args)
        except TypeError:
            return fn(*args)
        return cached(*args)

    call.cache_clear = cached.cache_clear    # type: ignore[attr-defined]
    call.cache_info = cached.cache_info      # type: ignore[attr-defined]
    return call


@_memoised
def _colocated_instance(part: tuple[RequestSpec, ...], cost: RooflineCostModel,
                        config: SchedulerConfig, block_size: int, num_blocks: int | None,
                        scheduler: SchedulerFactory,
                        until: float | None) -> tuple[LatencyRecord, ...]:
    sched = _instance(cost, config, block_size, num_blocks, scheduler)
    return tuple(records_from_sim(simulate(sched, part, cost, record_steps=False,
                                           until=until)))


def _deal(workload: Sequence[RequestSpec], n: int) -> list[list[RequestSpec]]:
    specs = sorted(workload, key=lambda s: (s.arrival_time, s.request_id))
    return [specs[i::n] for i in range(n)]


def run_colocated(workload: Sequence[RequestSpec], cost: RooflineCostModel,
                  config: SchedulerConfig, *, replicas: int = 1, block_size: int = 16,
                  num_blocks: int | None = None,
                  scheduler: SchedulerFactory = BaselineScheduler,
                  until: float | None = None) -> list[LatencyRecord]:
    """``replicas`` colocated instances, requests dealt round robin in arrival order (each
    instance's result memoised, see the module docstring)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    out: list[LatencyRecord] = []
    for part in _deal(workload, replicas):
        if part:
            out += _colocated_instance(tuple(part), cost, config, block_size, num_blocks,
                                       scheduler, until)
    return out


@dataclasses.dataclass(frozen=True)
class InstalledPrefillCost:
    """The cost model of a decode instance: prompt KV arrives by transfer, so a prefill chunk
    is free, except that the sampling chunk computes one token (the first output token, whose
    KV the decode instance writes while producing the second)."""

    base: RooflineCostModel

    def step_cost(self, chunks: Sequence[ScheduledChunk],
                  padding: Sequence[tuple[int, int]] = ()) -> StepCost:
        work = []
        for c in chunks:
            if not c.is_prefill:
                work.append((c.num_tokens, c.start_pos, c.sample))
            elif c.sample:
                work.append((1, c.start_pos + c.num_tokens - 1, True))
        work += [(n, s, False) for n, s in padding if n > 0]
        return self.base.cost(work)


def run_disaggregated(workload: Sequence[RequestSpec], prefill_cost: RooflineCostModel,
                      decode_cost: RooflineCostModel, prefill_config: SchedulerConfig,
                      decode_config: SchedulerConfig, *, prefill_instances: int = 1,
                      decode_instances: int = 1, transfer_bandwidth: float = 50e9,
                      transfer_latency_s: float = 1e-4, block_size: int = 16,
                      scheduler: SchedulerFactory = BaselineScheduler
                      ) -> list[LatencyRecord]:
    """A prefill pool and a decode pool (see the module docstring). ``transfer_bandwidth``:
    bytes/s from a prefill to a decode instance (default 50 GB/s, a 400 Gb/s NIC)."""
    if prefill_instances < 1 or decode_instances < 1:
        raise ValueError("need at least one prefill and one decode instance")
    if not transfer_bandwidth > 0 or transfer_latency_s < 0:
        raise ValueError("transfer_bandwidth must be > 0 and transfer_latency_s >= 0")
    specs = {s.request_id: s for s in workload}
    first: dict[str, RequestRecord] = {}
    for part in _deal(workload, prefill_instances):
        if not part:
            continue
        sched = _instance(prefill_cost, prefill_config, block_size, None, scheduler)
        pre = [dataclasses.replace(s, output_len=1) for s in part]
        for rec in simulate(sched, pre, prefill_cost, record_steps=False).requests:
            first[rec.request_id] = rec
    per_token = prefill_cost.kv_bytes_per_token     # the whole prompt KV, all layers
    handoff: list[RequestSpec] = []
    out: list[LatencyRecord] = []
    for rid, rec in first.items():
        spec = specs[rid]
        if rec.status != "finished":
            out.append(_latency(rec))
            continue
        if spec.output_len == 1:
            out.append(LatencyRecord(rid, spec.arrival_time, ttft=rec.ttft, e2e=rec.ttft,
                                     output_tokens=1, prompt_tokens=spec.prompt_len))
            continue
        ready = rec.first_token + transfer_latency_s + spec.prompt_len * per_token \
            / transfer_bandwidth
        handoff.append(dataclasses.replace(spec, arrival_time=ready,
                                           prompt_len=spec.prompt_len + 1,
                                           output_len=spec.output_len - 1))
    decode = InstalledPrefillCost(decode_cost)
    for part in _deal(handoff, decode_instances):
        if not part:
            continue
        sched = _instance(decode_cost, decode_config, block_size, None, scheduler)
        for rec in simulate(sched, part, decode, record_steps=False).requests:  # type: ignore
            spec, pre = specs[rec.request_id], first[rec.request_id]
            if rec.status != "finished":
                out.append(dataclasses.replace(_latency(rec), arrival=spec.arrival_time,
                                               prompt_tokens=spec.prompt_len))
                continue
            e2e = rec.finish - spec.arrival_time
            tokens = rec.output_tokens + 1
            out.append(LatencyRecord(rec.request_id, spec.arrival_time, ttft=pre.ttft,
                                     tpot=(e2e - pre.ttft) / (tokens - 1), e2e=e2e,
                                     output_tokens=tokens, prompt_tokens=spec.prompt_len))
    return sorted(out, key=lambda r: (r.arrival, r.request_id))


def rate_at_attainment(rates: Sequence[float], attainments: Sequence[float],
                       target: float = 0.9) -> float:
    """The highest rate at which attainment still reaches ``target``, interpolating linearly
    between the last sampled rate that meets it and the first that does not (attainment is
    taken as falling with rate; the curve is cut at its first crossing). 0 if even the lowest
    rate misses, ``rates[-1]`` if none does."""
    if len(rates) != len(attainments) or not rates:
        raise ValueError("rates and attainments must be non-empty and of equal length")
    if list(rates) != sorted(rates):
        raise ValueError("rates must be increasing")
    if attainments[0] < target:
        return 0.0
    for i in range(1, len(rates)):
        a0, a1 = attainments[i - 1], attainments[i]
        if a1 < target:
            r0, r1 = rates[i - 1], rates[i]
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1) if a0 != a1 else r0
    return float(rates[-1]) if not math.isnan(attainments[-1]) else 0.0


def chunk_sweep(workload: Sequence[RequestSpec], cost: RooflineCostModel,
                chunks: Sequence[int], *, max_num_seqs: int = 128, block_size: int = 16,
                scheduler: SchedulerFactory = BaselineScheduler) -> list[dict]:
    """Sarathi-Serve's knob: the step's token budget (= the prefill chunk) swept over
    ``chunks`` on one colocated instance. Per chunk size: output-token throughput over the
    makespan, TPOT and TTFT percentiles (linear), from one simulation each (memoised, see the
    module docstring)."""
    specs = tuple(workload)
    return [dict(_chunk_row(specs, cost, chunk, max_num_seqs, block_size, scheduler))
            for chunk in chunks]


@_memoised
def _chunk_row(specs: tuple[RequestSpec, ...], cost: RooflineCostModel, chunk: int,
               max_num_seqs: int, block_size: int,
               scheduler: SchedulerFactory) -> tuple[tuple[str, float], ...]:
    from kvlab.labs.slo import percentile

    cfg = SchedulerConfig(max_num_seqs=min(max_num_seqs, chunk),
                          max_num_batched_tokens=chunk, prefill_chunk=chunk)
    sched = _instance(cost, cfg, block_size, None, scheduler)
    res = simulate(sched, specs, cost, record_steps=False)
    done = [r for r in res.requests if r.status == "finished"]
    tpots = [r.tpot for r in done if r.tpot is not None]
    return (("chunk", chunk), ("finished", len(done)),
            ("throughput_tok_s", sum(r.output_tokens for r in done) / res.makespan),
            ("tpot_p50_s", percentile(tpots, 50)), ("tpot_p99_s", percentile(tpots, 99)),
            ("ttft_p50_s", percentile([r.ttft for r in done], 50)),
            ("ttft_p99_s", percentile([r.ttft for r in done], 99)))
