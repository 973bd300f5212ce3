"""The scheduling policies over a paged KV cache (spec rules 5, 6 and 11).

Two schedulers implement the :class:`~kvlab.core.scheduler_api.Scheduler` protocol:

* :class:`BaselineScheduler` is the spec's reference :func:`kvlab.reference.build_batch`
  (decode first, then FIFO prefill chunks into what is left of the token budget) wrapped to own
  real requests and real KV. Where KV is ample its batch *is* ``build_batch``'s (tested). When KV
  runs short it does what early engines did: it admits a waiting request only if its first
  chunk fits (head of line: it never skips ahead), and when a running request cannot grow it
  preempts the most recently admitted running request that is not yet scheduled this step
  (recompute: its KV is freed, it waits at the front of the queue and keeps its tokens).
* :class:`ProductionScheduler` shares one token budget between decodes and chunked prefills
  and adds admission control with KV reservation, priority classes, deadlines (EDF), cache
  affinity, ageing with a stated starvation bound, a deterministic preemption victim policy and
  an explicit overload policy. Its policy is documented on the class.

Both are deterministic: no clocks, no randomness, no set-order dependence.

Common rules (:class:`~kvlab.core.scheduler.SchedulerBase`):

* ``add_request`` validates its input (``ValueError``, scheduler unchanged) and then *rejects*
  (status REJECTED, reason in ``status_message``) a request that can never fit: its prompt does
  not fit ``max_model_len``, or prompt + max_tokens needs more KV blocks than the pool has.
  Rejected requests appear in the next output's ``rejected`` and in the list returned by the
  next ``update_from_output``.
* ``num_computed_tokens`` advances in ``update_from_output`` (KV is written when the step ran),
  so ``schedule()`` may not be called again before the previous output was consumed.
* Every non-terminal request is in exactly one queue: ``waiting`` (WAITING or PREEMPTED, holds
  no KV) or ``running`` (RUNNING, holds a block table). ``check_invariants`` checks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvlab.reference import Phase
from kvlab.reference import Request as ReferenceRequest

from .block_pool import OutOfBlocks
from .lifecycle import RUNNING_STATUSES, EventLog
from .scheduler import SchedulerBase
from .scheduler_api import RequestStatus, RuntimeRequest, StepPlan
from .scheduler_config import SchedulerConfig

S = RequestStatus


class BaselineScheduler(SchedulerBase):
    """The spec's decode-first ``build_batch`` as a real scheduler (see the module docstring).

    Per step: every running decode gets one token (running order), then running prefills and
    then waiting requests (FIFO; preempted requests at the front) get
    ``min(tokens left, prefill_chunk, budget left)``; stop at ``max_num_seqs`` entries or an
    exhausted budget, exactly like ``build_batch``. KV: a waiting request is admitted only if its
    first chunk fits (otherwise admission stops: no skipping); a running request that cannot
    grow preempts the newest-admitted running request not yet scheduled this step. No
    reservation, no priorities, no deadlines, no overload limit.
    """

    def _schedule_into(self, plan: StepPlan) -> None:
        chunk_cap = self.config.prefill_chunk
        running = [self._requests[rid] for rid in self.running]
        decodes = [r for r in running if r.is_decoding]
        prefills = [r for r in running if not r.is_decoding]

        def victims() -> list[RuntimeRequest]:
            pool = [self._requests[rid] for rid in self.running if rid not in plan.scheduled]
            return sorted(pool, key=lambda r: -r.admit_seq)

        for request in decodes + prefills:
            if plan.seqs_left == 0 or plan.tokens_left == 0:
                return
            if request.status not in RUNNING_STATUSES:   # preempted earlier in this step
                continue
            n = 1 if request.is_decoding else min(
                request.num_uncomputed_tokens, chunk_cap, plan.tokens_left)
            start = request.num_computed_tokens
            if self._ensure_kv(plan, request, n, victims):
                plan.add_chunk(self._chunk(request, start, n))
        for rid in list(self.waiting):
            if plan.seqs_left == 0 or plan.tokens_left == 0:
                return
            request = self._requests[rid]
            cached = self._uncomputed_prefix_hit(request)
            n = min(request.num_tokens - cached, chunk_cap, plan.tokens_left)
            need = self.kv.blocks_needed(None, cached + n, request.scope, request.all_token_ids)
            if need > self.kv.num_allocatable_blocks():
                return   # head of line: wait for KV, never skip ahead
            try:
                self._admit(plan, request, cached, n)
            except OutOfBlocks:
                return

    def reference_view(self) -> list[ReferenceRequest]:
        """This scheduler's state as the spec's reference ``Request`` list, in the order
        ``build_batch`` must see it (running, then waiting) for the two to agree."""
        view = []
        for rid in self.running + self.waiting:
            r = self._requests[rid]
            phase = (Phase.WAITING if r.status is not S.RUNNING
                     else Phase.DECODE if r.is_decoding else Phase.PREFILL)
            left = r.num_uncomputed_tokens if phase != Phase.WAITING else (
                r.num_tokens - self._uncomputed_prefix_hit(r))
            view.append(ReferenceRequest(rid, left, len(r.output_token_ids), phase))
        return view


OrderKey = Callable[[RuntimeRequest, int, int], tuple]
"""A waiting-queue ordering: ``key(request, prefix_hit_tokens, step) -> sortable tuple``;
smaller first. Used by :class:`ProductionScheduler` for candidates that are not aged."""


def default_order_key(request: RuntimeRequest, hit_tokens: int, step: int) -> tuple:
    """Priority class, then earliest deadline, then longest cached prefix (cache affinity)."""
    deadline = request.deadline if request.deadline is not None else math.inf
    return (request.priority, deadline, -hit_tokens)


class ProductionScheduler(SchedulerBase):
    """Token-budget continuous batching with admission control (the policy, in order).

    1. **Running requests first, each guaranteed one token.** Running requests are ordered by
       (priority, admission order). Each gets one token (a decode, or the next prompt token);
       then running prefills are extended up to ``prefill_chunk`` tokens in that order, within
       the token budget. ``max_num_seqs <= max_num_batched_tokens`` is required, and admission
       keeps at most ``max_num_seqs`` requests running, so every running request advances every
       step.
    2. **KV shortage -> recompute preemption.** If a running request cannot grow, the victim is
       the not-yet-scheduled running request with the largest (priority value, admission order):
       the least important class, newest first. It is freed and re-queued with its tokens
       (prefix-cache hits make recomputation cheaper). With ``admission="reserve"`` this does
       not happen, with one exception: when two running requests compute the same new
       prefix at once, the second keeps private duplicates of the blocks the first cached
       (KVCacheManager: first writer wins) and its lock pins the first one's copies too, which
       the reservation did not count.
    3. **Admission, in order.** Waiting candidates are sorted: aged requests (waited
       ``max_wait_steps`` or more since arrival) first, FIFO; then the rest by ``order_key``
       (default: priority, earliest deadline, longest prefix-cache hit), ties by arrival.
       Each is admitted if a sequence slot and token budget remain and its KV fits:
       ``"reserve"``: blocks for prompt + max_tokens (minus cached) fit beside the blocks running
       requests may still claim; ``"watermark"``: its first chunk fits leaving ``watermark`` of
       the pool free. A candidate that does not fit is skipped, unless it is aged: then
       admission stops (nobody overtakes an aged request for KV).
    4. **Overload.** With ``max_waiting`` set, a request arriving when ``max_waiting`` requests
       already wait beyond the free sequence slots (``max_num_seqs`` minus the running ones) is
       rejected ("queue full"); a request that can never fit is always rejected at arrival.

    **Starvation bound** (ageing on, and no preemption: ``admission="reserve"``, see the
    exception in 2.): let ``T`` be the largest
    ``prompt + max_tokens`` of any request and ``k`` the number of requests that arrived
    before request ``R`` and still wait when ``R`` ages. Then ``R`` is admitted at most
    ``max_wait_steps + (k + 1) * T`` steps after its arrival. Proof sketch: once aged, only
    older aged requests are admitted before ``R``; every running request advances at least one
    token per step and needs at most ``T`` tokens, so the running set drains (and KV frees)
    within ``T`` steps of each head-of-queue admission. :func:`starvation_bound` computes it;
    tests check it on random workloads.
    """

    def __init__(self, kv: Any, config: SchedulerConfig | None = None, *,
                 log: EventLog | None = None, order_key: OrderKey | None = None) -> None:
        super().__init__(kv, config, log=log)   # checks max_num_seqs <= max_num_batched_tokens
        self.order_key: OrderKey = order_key if order_key is not None else default_order_key

    def _overloaded(self, request: RuntimeRequest) -> str | None:
        """"queue full" when ``max_waiting`` requests already wait beyond the free sequence
        slots: a burst that the running set can still take is not a queue."""
        limit = self.config.max_waiting
        if limit is None:
            return None
        seats = max(0, self.config.max_num_seqs - len(self.running))
        queued = len(self.waiting) - seats
        if queued >= limit:
            return (f"queue full: {len(self.waiting)} requests already waiting for {seats} free "
                    f"sequence slots (limit {limit} beyond them)")
        return None

    def _running_order(self) -> list[RuntimeRequest]:
        reqs = [self._requests[rid] for rid in self.running]
        return sorted(reqs, key=lambda r: (r.priority, r.admit_seq))

    def is_aged(self, request: RuntimeRequest) -> bool:
        limit = self.config.max_wait_steps
        return limit is not None and self._step - (request.arrival_step or 0) >= limit

    def reserved_blocks(self) -> int:
        """Blocks that running requests may still claim to reach prompt + max_tokens
        (missing blocks, plus copy-on-write of shared blocks they will write)."""
        return sum(self._still_needs(self._requests[rid]) for rid in self.running)

    def _still_needs(self, request: RuntimeRequest) -> int:
        end = max(request.max_kv_slots, request.num_computed_tokens)
        return self.kv.blocks_needed(request.request_id, end,
                                     write_from=request.num_computed_tokens)

    def waiting_order(self) -> list[tuple[RuntimeRequest, int]]:
        """Waiting candidates in admission order, each with its prefix-hit token count."""
        aged, rest = [], []
        for rid in self.waiting:
            request = self._requests[rid]
            (aged if self.is_aged(request) else rest).append(request)
        aged.sort(key=lambda r: r.arrival_seq)
        # Cheap order first (no lookups), then cache affinity inside a bounded window.
        rest.sort(key=lambda r: (*self.order_key(r, 0, self._step), r.arrival_seq))
        use_hits = self.config.cache_affinity and self.kv.prefix_cache is not None
        window = self.config.affinity_window if use_hits else 0
        head = [(r, self._uncomputed_prefix_hit(r)) for r in rest[:window]]
        head.sort(key=lambda p: (*self.order_key(p[0], p[1], self._step),
                                 p[0].arrival_seq))
        tail = [(r, -1) for r in rest[window:]]
        return [(r, -1) for r in aged] + head + tail

    def _schedule_into(self, plan: StepPlan) -> None:
        cfg = self.config
        ordered = self._running_order()

        def victims() -> list[RuntimeRequest]:
            pool = [self._requests[rid] for rid in self.running if rid not in plan.scheduled]
            return sorted(pool, key=lambda r: (-r.priority, -r.admit_seq))

        # 1. sizes: one token each, then extend prefills in order.
        sizes: dict[str, int] = {}
        budget = plan.token_budget
        for request in ordered[: min(plan.max_seqs, budget)]:
            sizes[request.request_id] = 1
        left = budget - len(sizes)
        for request in ordered:
            rid = request.request_id
            if rid in sizes and not request.is_decoding and left > 0:
                extra = min(request.num_uncomputed_tokens, cfg.prefill_chunk) - 1
                extra = max(0, min(extra, left))
                sizes[rid] += extra
                left -= extra
        # 2. allocate in order; shortages preempt from the tail.
        for request in ordered:
            rid = request.request_id
            if rid not in sizes or request.status not in RUNNING_STATUSES:
                continue
            n = sizes[rid]
            start = request.num_computed_tokens
            if self._ensure_kv(plan, request, n, victims):
                plan.add_chunk(self._chunk(request, start, n))
        # 3. admissions (nothing to order when no admission is possible this step).
        if (not self.waiting or plan.seqs_left == 0 or plan.tokens_left == 0
                or len(self.running) >= cfg.max_num_seqs):
            return
        reserved = self.reserved_blocks() if cfg.admission == "reserve" else 0
        watermark = int(cfg.watermark * self.kv.num_blocks)
        candidates = self.waiting_order()
        if cfg.admission_scan_limit is not None:
            candidates = candidates[: cfg.admission_scan_limit]
        for request, _hit in candidates:
            if (plan.seqs_left == 0 or plan.tokens_left == 0
                    or len(self.running) >= cfg.max_num_seqs):
                break
            # fresh lookup: an admission earlier in this step may have evicted cached blocks
            cached = self._uncomputed_prefix_hit(request)
            n = min(request.num_tokens - cached, cfg.prefill_chunk, plan.tokens_left)
            scope, tokens = request.scope, request.all_token_ids
            available = self.kv.num_allocatable_blocks()
            if available - (reserved if cfg.admission == "reserve" else watermark) <= 0:
                break                                   # nothing at all can be admitted
            # blocks_needed(None, ...) counts fresh blocks plus the evictable cached blocks that
            # admission locks: "need <= available" is exactly when admit() succeeds.
            if cfg.admission == "reserve":
                need = self.kv.blocks_needed(None, request.max_kv_slots, scope, tokens)
                fits = need <= available - reserved
            else:
                need = self.kv.blocks_needed(None, cached + n, scope, tokens)
                fits = need <= available - watermark
            if not fits:
                if self.is_aged(request):
                    break
                continue
            try:
                self._admit(plan, request, cached, n)
            except OutOfBlocks:
                if self.is_aged(request):
                    break
                continue
            if cfg.admission == "reserve":
                reserved += self._still_needs(request)

    def _requeue_preempted(self, rid: str) -> None:
        self.waiting.append(rid)   # order comes from waiting_order(), not from the list


def starvation_bound(config: SchedulerConfig, max_request_tokens: int, older_waiting: int) -> int:
    """Steps within which :class:`ProductionScheduler` admits an aged request (see its docstring).

    ``max_request_tokens``: the largest prompt + max_tokens of the workload; ``older_waiting``:
    requests that arrived earlier and still wait when it ages.
    """
    if config.max_wait_steps is None:
        raise ValueError("without ageing (max_wait_steps=None) there is no starvation bound")
    if config.admission != "reserve":
        raise ValueError("the bound holds for admission='reserve' (no preemption)")
    return config.max_wait_steps + (older_waiting + 1) * max_request_tokens
