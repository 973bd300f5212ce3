"""An opt-in policy: token-budget continuous batching with admission control (spec rules 6, 11).

One token budget shared by decodes and chunked prefills, with KV reservation, priority classes,
deadlines (EDF), cache affinity, ageing with a stated starvation bound, a deterministic
preemption victim policy and an explicit overload policy (all on the class). Deterministic: no
clocks, no randomness, no set-order dependence. The default policy is :mod:`.baseline_scheduler`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.request import RUNNING_STATUSES, RequestLog, RequestStatus, RuntimeRequest
from kvlab.core.scheduler import SchedulerBase, StepPlan
from kvlab.core.scheduler_config import SchedulerConfig

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager

S = RequestStatus


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

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig | None = None, *,
                 log: RequestLog | None = None, order_key: OrderKey | None = None) -> None:
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
        runnable = [r for r in ordered if self._can_run(r)]   # (overlap: last token in flight)
        for request in runnable[: min(plan.max_seqs, budget)]:
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
            available = self.kv.num_allocatable_blocks()
            if available - (reserved if cfg.admission == "reserve" else watermark) <= 0:
                break                                   # nothing at all can be admitted
            # fresh lookup: an admission earlier in this step may have evicted cached blocks
            hit = self.kv.find_prefix(request.scope, request.all_token_ids)
            cached = hit.cached
            n = min(request.num_tokens - cached, cfg.prefill_chunk, plan.tokens_left)
            # blocks_needed counts fresh blocks plus the evictable cached blocks that admission
            # locks: "need <= available" is exactly when admit() succeeds.
            if cfg.admission == "reserve":
                need = hit.blocks_needed(request.max_kv_slots, self.kv.block_size)
                fits = need <= available - reserved
            else:
                need = hit.blocks_needed(cached + n, self.kv.block_size)
                fits = need <= available - watermark
            if not fits:
                if self.is_aged(request):
                    break
                continue
            try:
                self._admit(plan, request, hit, n)
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
