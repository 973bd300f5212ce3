"""Continuous-batching schedulers over a paged KV cache (spec rules 5, 6 and 11).

Two schedulers implement the :class:`~kvlab.core.scheduler_api.Scheduler` protocol:

* :class:`BaselineScheduler` is the spec's reference :func:`kvlab.core.sched.build_batch`
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

Common rules (the base class):

* ``add_request`` validates its input (``ValueError``, scheduler unchanged) and then *rejects*
  (status REJECTED, reason in ``status_message``) a request that can never fit: its prompt does
  not fit ``max_model_len``, or prompt + max_tokens needs more KV blocks than the pool has.
  Rejected requests appear in the next output's ``rejected`` and in the list returned by the
  next ``update_from_output``.
* ``num_computed_tokens`` advances in ``update_from_output`` (KV is written when the step ran),
  so ``schedule()`` may not be called again before the previous output was consumed.
* Every non-terminal request is in exactly one queue: ``waiting`` (WAITING or PREEMPTED, holds
  no KV) or ``running`` (PREFILL or DECODE, holds a block table). ``check_invariants`` checks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .lifecycle import (
    RUNNING_STATUSES,
    WAITING_STATUSES,
    EventLog,
    Lifecycle,
)
from .request import Phase
from .request import Request as ReferenceRequest
from .scheduler_api import (
    FinishReason,
    RequestStatus,
    RuntimeRequest,
    ScheduledChunk,
    SchedulerOutput,
)

S = RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policy knobs. Token counts are tokens; steps are scheduler steps.

    Attributes:
        max_num_seqs: requests in one step's batch (and, for the production scheduler, running).
        max_num_batched_tokens: the token budget of one step, decodes and prefill chunks together.
        prefill_chunk: the longest prefill chunk one request gets in a step.
        admission: production only. ``"reserve"`` admits a request only if KV for its whole
            prompt + max_tokens fits beside what running requests may still need (no preemption
            is ever needed without forks); ``"watermark"`` admits when the first chunk fits and
            ``watermark`` of the pool stays free, preempting when KV runs out (more concurrency,
            recompute risk).
        watermark: fraction of the pool kept free by ``"watermark"`` admission.
        max_waiting: production only. Overload policy: a request arriving when this many wait is
            rejected with reason "queue full". ``None`` = unbounded queue.
        max_wait_steps: production only. Ageing: a request waiting this many steps since its
            arrival outranks every class, deadline and cache hit, FIFO among the aged, and blocks
            admissions behind it while it does not fit. ``None`` disables ageing (then
            starvation is possible, see chapter 6).
        cache_affinity: production only. Order equal-class, equal-deadline candidates by longest
            prefix-cache hit first (within ``affinity_window`` candidates, to bound lookup cost).
        affinity_window: how many leading candidates get a prefix lookup per step.
        admission_scan_limit: production only. At most this many waiting candidates are tried
            per step (in order); the rest wait for a later step. Bounds the per-step cost when a
            long queue does not fit. ``None``: try them all.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk: int = 256
    admission: str = "reserve"
    watermark: float = 0.0
    max_waiting: int | None = None
    max_wait_steps: int | None = 64
    cache_affinity: bool = True
    affinity_window: int = 256
    admission_scan_limit: int | None = 128

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk",
                     "affinity_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.admission not in ("reserve", "watermark"):
            raise ValueError("SchedulerConfig.admission must be 'reserve' or 'watermark', "
                             f"got {self.admission!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"SchedulerConfig.watermark must be in [0, 1), got {self.watermark!r}")
        for name, low in (("max_waiting", 0), ("max_wait_steps", 0), ("admission_scan_limit", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"SchedulerConfig.{name} must be None or an int >= {low}")


class SchedulerBase:
    """Request registry, queues, KV bookkeeping and output handling shared by both policies."""

    #: The event log is compacted (ended, released requests dropped) when it reaches this many
    #: events, then whenever it doubles in size since the last compaction.
    compact_min_events: int = 4096

    def __init__(self, kv: Any, config: SchedulerConfig | None = None, *,
                 log: EventLog | None = None) -> None:
        self.kv = kv
        self.config = config if config is not None else SchedulerConfig()
        self.lifecycle = Lifecycle(log, step=lambda: self._step)
        self._requests: dict[str, RuntimeRequest] = {}
        self._seq: dict[str, int] = {}          # arrival order (stable tie-breaker)
        self._admit_seq: dict[str, int] = {}    # order of the latest admission
        self._counter = 0
        self.waiting: list[str] = []
        self.running: list[str] = []
        self._step = 0
        self._inflight: SchedulerOutput | None = None
        self._inflight_ids: set[str] = set()
        self._forked: dict[str, str] = {}       # child -> parent, forked during the in-flight step
        self._deferred_release: list[str] = []  # aborted while in flight: free after the step
        self._ended: list[RuntimeRequest] = []  # rejected/failed, reported by update_from_output
        self._rejected_pending: list[str] = []  # rejected since the last schedule()
        self._compact_at = self.compact_min_events  # log size that triggers the next compaction

    # -- protocol: queries --------------------------------------------------------------------

    @property
    def log(self) -> EventLog:
        return self.lifecycle.log

    @property
    def step_count(self) -> int:
        """Steps scheduled so far (the ``step`` of the latest output)."""
        return self._step

    def get_request(self, request_id: str) -> RuntimeRequest:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def requests(self) -> Sequence[RuntimeRequest]:
        """Every request ever added, in arrival order (terminal ones included)."""
        return list(self._requests.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._ended or self._inflight_ids)

    # -- protocol: request arrival and abort --------------------------------------------------

    def add_request(self, request: RuntimeRequest) -> None:
        """Queue ``request``; reject it (REJECTED + reason) if it can never fit or on overload."""
        self._validate_new(request)
        self.lifecycle.add(request)
        rid = request.request_id
        self._requests[rid] = request
        self._seq[rid] = self._counter
        self._counter += 1
        request.arrival_step = self._step
        why = self._never_fits(request) or self._overloaded(request)
        if why is not None:
            self.lifecycle.reject(request, why)
            self._ended.append(request)
            self._rejected_pending.append(rid)
            return
        self.waiting.append(rid)

    def abort_request(self, request_id: str) -> RuntimeRequest | None:
        """Cancel a request (client abort). Idempotent: an ended request is returned unchanged,
        an unknown id returns None. A request in the step now executing is cancelled at once but
        its KV is freed after ``update_from_output`` (the executor may still be using it)."""
        request = self._requests.get(request_id)
        if request is None or request.status.is_terminal:
            return request
        in_queue = self.waiting if request.status in WAITING_STATUSES else self.running
        self.lifecycle.cancel(request)
        in_queue.remove(request_id)
        if request_id in self._inflight_ids:
            self._deferred_release.append(request_id)
        else:
            self.lifecycle.release(request, self.kv)
        return request

    # -- protocol: one step -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's chunks; allocates their KV. See the policy class for the rules."""
        if self._inflight is not None:
            if not self._inflight.is_empty:
                raise RuntimeError(
                    f"schedule() called before update_from_output() of step {self._inflight.step}")
            self._inflight = None
        self._step += 1
        plan = _StepPlan(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_into(plan)
        chunks = tuple(plan.chunks)
        output = SchedulerOutput(
            step=self._step,
            chunks=chunks,
            copies=tuple(plan.copies),
            preempted=tuple(plan.preempted),
            admitted=tuple(plan.admitted),
            rejected=tuple(self._rejected_pending),
            num_batched_tokens=sum(c.num_tokens for c in chunks),
        )
        self._rejected_pending = []
        self._inflight = output
        self._inflight_ids = {c.request_id for c in chunks}
        return output

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[RuntimeRequest]:
        """Apply a step's results; returns requests that ended (finished, rejected, failed).

        ``sampled`` maps every request whose chunk had ``sample=True`` (and every child forked
        this step) to its new token. Validated before anything changes. Aborted requests'
        tokens are ignored.
        """
        inflight = self._inflight
        if inflight is None or output is not inflight:
            if output.is_empty and not sampled:
                ended, self._ended = self._ended, []
                return ended
            raise ValueError(f"output of step {output.step} is not the step in flight")
        live = [c for c in output.chunks if not self._requests[c.request_id].status.is_terminal]
        expected = {c.request_id for c in live if c.sample}
        expected |= {child for child in self._forked
                     if not self._requests[child].status.is_terminal}
        aborted = {c.request_id for c in output.chunks} | set(self._forked)
        missing = expected - set(sampled)
        extra = set(sampled) - expected - aborted
        if missing:
            raise ValueError(f"no sampled token for {sorted(missing)}")
        if extra:
            raise ValueError(f"sampled tokens for requests that did not sample: {sorted(extra)}")
        for rid in expected:
            token = sampled[rid]
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"sampled token for {rid!r} must be an int >= 0, got {token!r}")

        ended: list[RuntimeRequest] = []
        touched: list[RuntimeRequest] = []
        for chunk in live:
            request = self._requests[chunk.request_id]
            request.num_computed_tokens = chunk.start_pos + chunk.num_tokens
            token = sampled[chunk.request_id] if chunk.sample else None
            self._apply_token(request, token)
            touched.append(request)
        for child_id in self._forked:
            child = self._requests[child_id]
            if child.status.is_terminal:
                continue
            self._apply_token(child, sampled[child_id])
            touched.append(child)
        for request in touched:
            if self.kv.prefix_cache is not None:
                self.kv.commit(request.request_id,
                               request.all_token_ids[:request.num_computed_tokens])
            reason = self._stop_reason(request)
            if reason is not None:
                self.lifecycle.finish(request, reason)
                self.running.remove(request.request_id)
                self.lifecycle.release(request, self.kv)
                ended.append(request)
        for rid in self._deferred_release:
            self.lifecycle.release(self._requests[rid], self.kv)
        self._deferred_release = []
        self._forked = {}
        self._inflight = None
        self._inflight_ids = set()
        early, self._ended = self._ended, []
        if len(self.log) >= self._compact_at:
            self._compact_log()
        return early + ended

    def _compact_log(self) -> None:
        """Checkpoint: drop the log events of requests that ended and hold no KV (amortised
        O(1) per event: the next compaction waits until the log doubles)."""
        done = {rid for rid, r in self._requests.items()
                if r.status.is_terminal and not self.kv.has(rid)}
        self.log.compact(done)
        self._compact_at = max(self.compact_min_events, 2 * len(self.log))

    def fork(self, parent_id: str, child: RuntimeRequest) -> None:
        """Add ``child`` as an extra sample of ``parent_id`` (n > 1), sharing the parent's KV.

        Call between ``schedule()`` and ``update_from_output()`` of the step in which the
        parent's chunk has ``sample=True``; the child's first token is then passed in
        ``sampled``. The child must carry the parent's prompt and be fresh (WAITING, no output).
        """
        parent = self.get_request(parent_id)
        chunk = self._inflight_chunk(parent_id)
        if chunk is None or not chunk.sample:
            raise ValueError(f"fork({parent_id!r}): the parent has no sampling chunk in flight")
        if parent.status.is_terminal:
            raise ValueError(f"fork({parent_id!r}): the parent already ended")
        self._validate_new(child)
        if child.prompt_token_ids != parent.prompt_token_ids:
            raise ValueError("fork: the child must have the parent's prompt_token_ids")
        cid = child.request_id
        child.parent_id = parent_id
        self.lifecycle.add(child)
        self._requests[cid] = child
        self._seq[cid] = self._counter
        self._counter += 1
        child.arrival_step = self._step
        computed = chunk.start_pos + chunk.num_tokens

        def do_fork() -> int:
            self.kv.fork(parent_id, cid)
            return computed

        self.lifecycle.acquire(child, "fork", do_fork)
        child.num_computed_tokens = computed
        child.num_cached_tokens = parent.num_cached_tokens
        self.lifecycle.transition(child, S.PREFILL)
        child.admitted_step = self._step
        self._admit_seq[cid] = self._counter
        self.running.insert(self.running.index(parent_id) + 1, cid)
        self._forked[cid] = parent_id

    def _restore(self, requests: Sequence[RuntimeRequest], running_order: Sequence[str],
                 step: int) -> None:
        """Install recovered requests into this empty scheduler (kvlab.core.recovery only).

        Waiting requests are queued preempted-first, each group in arrival order; running
        requests in ``running_order`` (their admission order before the crash).
        """
        if self._requests or self._step:
            raise RuntimeError("_restore needs a fresh scheduler")
        for request in requests:
            rid = request.request_id
            self._requests[rid] = request
            self._seq[rid] = self._counter
            self._counter += 1
        self.waiting = (
            [r.request_id for r in requests if r.status == S.PREEMPTED]
            + [r.request_id for r in requests if r.status == S.WAITING])
        for rid in running_order:
            self.running.append(rid)
            self._admit_seq[rid] = self._counter
            self._counter += 1
        self._step = step

    # -- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """AssertionError naming the first broken invariant (queues, KV ownership, counters)."""
        waiting, running = set(self.waiting), set(self.running)
        assert len(waiting) == len(self.waiting), "a request is twice in the waiting queue"
        assert len(running) == len(self.running), "a request is twice in the running queue"
        assert not waiting & running, f"in both queues: {sorted(waiting & running)}"
        deferred = set(self._deferred_release)
        for rid, request in self._requests.items():
            status = request.status
            if status in WAITING_STATUSES:
                assert rid in waiting, f"{rid} is {status.value} but not in the waiting queue"
            elif status in RUNNING_STATUSES:
                assert rid in running, f"{rid} is {status.value} but not in the running queue"
            else:
                assert rid not in waiting and rid not in running, f"{rid} ended but is queued"
                assert request.finish_reason is not None, f"{rid} ended without a reason"
            holds = self.kv.has(rid)
            if status in RUNNING_STATUSES:
                assert holds, f"running request {rid} holds no KV"
            elif rid not in deferred:
                assert not holds, f"{rid} is {status.value} but still holds KV"
            assert 0 <= request.num_computed_tokens <= request.num_tokens, \
                f"{rid}: num_computed_tokens out of range"
            assert len(request.output_token_ids) <= request.max_tokens, \
                f"{rid}: more outputs than max_tokens"
            if status == S.DECODE and rid not in self._inflight_ids:
                assert request.num_uncomputed_tokens == 1, f"{rid}: decoding but not 1 token behind"
        self.kv.check_invariants()

    # -- helpers for policies -----------------------------------------------------------------

    def _schedule_into(self, plan: _StepPlan) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def max_slots(self, request: RuntimeRequest) -> int:
        """KV slots the request can ever occupy: every token but the last one sampled."""
        final = request.num_prompt_tokens + request.max_tokens
        if request.max_model_len is not None:
            final = min(final, request.max_model_len)
        return final - 1

    def _validate_new(self, request: RuntimeRequest) -> None:
        if not isinstance(request, RuntimeRequest):
            raise TypeError(f"expected a RuntimeRequest, got {type(request).__name__}")
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
        if rid in self._requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be an int >= 1")
        if request.status != S.WAITING or request.output_token_ids or request.num_computed_tokens:
            raise ValueError(
                f"request {rid!r} must be fresh (WAITING, no outputs, nothing computed)")
        if request.max_model_len is not None and request.max_model_len < 1:
            raise ValueError(f"request {rid!r}: max_model_len must be >= 1")

    def _never_fits(self, request: RuntimeRequest) -> str | None:
        n = request.num_prompt_tokens
        if request.max_model_len is not None and n >= request.max_model_len:
            return f"prompt of {n} tokens leaves no room in max_model_len={request.max_model_len}"
        need = self.kv.blocks_for(self.max_slots(request))
        if need > self.kv.num_blocks:
            return (f"prompt + max_tokens needs {need} KV blocks; the pool has "
                    f"{self.kv.num_blocks}: it can never fit")
        return None

    def _overloaded(self, request: RuntimeRequest) -> str | None:
        return None

    def _inflight_chunk(self, rid: str) -> ScheduledChunk | None:
        if self._inflight is None:
            return None
        for chunk in self._inflight.chunks:
            if chunk.request_id == rid:
                return chunk
        return None

    def _apply_token(self, request: RuntimeRequest, token: int | None) -> None:
        # Log the progress before the status change: a crash in between leaves a PREFILL
        # request one token behind, which recovery (and the next step) handle as a decode.
        if token is not None:
            request.output_token_ids.append(token)
            if request.first_token_step is None:
                request.first_token_step = self._step
        self.lifecycle.progress(request, token)
        if token is not None and request.status == S.PREFILL:
            self.lifecycle.transition(request, S.DECODE)

    @staticmethod
    def _stop_reason(request: RuntimeRequest) -> FinishReason | None:
        """Stop conditions of CONTRACTS §2, applied after each sampled token."""
        if request.status != S.DECODE or not request.output_token_ids:
            return None
        token = request.output_token_ids[-1]
        if token in request.stop_token_ids or (
            request.eos_token_id is not None and token == request.eos_token_id
            and not request.ignore_eos
        ):
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.max_tokens:
            return FinishReason.LENGTH
        if request.max_model_len is not None and request.num_tokens >= request.max_model_len:
            return FinishReason.LENGTH
        return None

    def _admit(self, plan: _StepPlan, request: RuntimeRequest, cached: int, n: int) -> None:
        """Give a waiting request its table (reusing ``cached`` prefix tokens) and a chunk."""
        rid = request.request_id
        tokens = request.all_token_ids
        got = self.lifecycle.acquire(
            request, "admit", lambda: self.kv.admit(rid, request.scope, tokens, cached + n))
        if got != cached:  # the manager's lookup() and admit() disagree: a bug, not a policy
            raise AssertionError(f"{rid}: admit reused {got} tokens, lookup said {cached}")
        first = request.admitted_step is None
        self.lifecycle.transition(request, S.PREFILL)
        request.num_computed_tokens = cached
        if first:
            request.num_cached_tokens = cached
            request.admitted_step = self._step
        self.waiting.remove(rid)
        self._admit_seq[rid] = self._counter
        self._counter += 1
        self._place_running(rid)
        plan.admitted.append(rid)
        plan.add_chunk(self._chunk(request, cached, n))

    def _place_running(self, rid: str) -> None:
        self.running.append(rid)

    def _grow(self, request: RuntimeRequest, n: int) -> list[tuple[int, int]]:
        """Extend a running request's table for ``n`` more tokens (MemoryError: unchanged)."""
        start = request.num_computed_tokens
        return list(self.kv.grow(request.request_id, start + n, write_from=start))

    def _chunk(self, request: RuntimeRequest, start: int, n: int) -> ScheduledChunk:
        end = start + n
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_pos=start,
            block_table=tuple(self.kv.block_table(request.request_id)),
            sample=end == request.num_tokens,
            is_prefill=request.status == S.PREFILL,
        )

    def _preempt(self, plan: _StepPlan, request: RuntimeRequest) -> None:
        """Recompute preemption: free the KV, back to waiting with its tokens kept."""
        rid = request.request_id
        self.lifecycle.transition(request, S.PREEMPTED)
        self.lifecycle.release(request, self.kv)
        request.num_computed_tokens = 0
        self.running.remove(rid)
        self._requeue_preempted(rid)
        plan.preempted.append(rid)

    def _requeue_preempted(self, rid: str) -> None:
        self.waiting.insert(0, rid)

    def _uncomputed_prefix_hit(self, request: RuntimeRequest) -> int:
        """Tokens of the request served by the prefix cache now (0 without a cache)."""
        if self.kv.prefix_cache is None:
            return 0
        return self.kv.lookup(request.scope, request.all_token_ids)

    def _ensure_kv(self, plan: _StepPlan, request: RuntimeRequest, n: int,
                   victims: Callable[[], list[RuntimeRequest]]) -> bool:
        """Grow ``request`` by ``n`` tokens, preempting from ``victims()`` (best victim first)
        while KV is short. False if ``request`` itself had to be preempted or failed."""
        while True:
            try:
                plan.copies.extend(self._grow(request, n))
                return True
            except MemoryError:
                pool = [v for v in victims() if v is not request]
                if pool:
                    self._preempt(plan, pool[0])
                    continue
                # Nobody else to preempt (the rest is scheduled already, or it runs alone: then
                # its table holds private duplicates of blocks another request cached first).
                # Recomputing it later reuses the cache; a lone request always fits then,
                # because add_request rejected any request whose max_slots exceed the pool.
                self._preempt(plan, request)
                return False


class _StepPlan:
    """Mutable accumulator of one step's decisions (budgets are enforced by ``add_chunk``)."""

    def __init__(self, token_budget: int, max_seqs: int) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.chunks: list[ScheduledChunk] = []
        self.copies: list[tuple[int, int]] = []
        self.preempted: list[str] = []
        self.admitted: list[str] = []
        self.used = 0
        self.scheduled: set[str] = set()

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.used

    @property
    def seqs_left(self) -> int:
        return self.max_seqs - len(self.chunks)

    def add_chunk(self, chunk: ScheduledChunk) -> None:
        if chunk.request_id in self.scheduled:
            raise AssertionError(f"{chunk.request_id} scheduled twice in one step")
        if chunk.num_tokens <= 0 or chunk.num_tokens > self.tokens_left or self.seqs_left <= 0:
            raise AssertionError("a chunk would break the step's budgets")
        self.chunks.append(chunk)
        self.used += chunk.num_tokens
        self.scheduled.add(chunk.request_id)


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

    def _schedule_into(self, plan: _StepPlan) -> None:
        chunk_cap = self.config.prefill_chunk
        running = [self._requests[rid] for rid in self.running]
        decodes = [r for r in running if r.status == S.DECODE]
        prefills = [r for r in running if r.status == S.PREFILL]

        def victims() -> list[RuntimeRequest]:
            pool = [self._requests[rid] for rid in self.running if rid not in plan.scheduled]
            return sorted(pool, key=lambda r: -self._admit_seq[r.request_id])

        for request in decodes + prefills:
            if plan.seqs_left == 0 or plan.tokens_left == 0:
                return
            if request.status not in RUNNING_STATUSES:   # preempted earlier in this step
                continue
            n = 1 if request.status == S.DECODE else min(
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
            except MemoryError:
                return

    def reference_view(self) -> list[ReferenceRequest]:
        """This scheduler's state as the spec's reference ``Request`` list, in the order
        ``build_batch`` must see it (running, then waiting) for the two to agree."""
        view = []
        for rid in self.running + self.waiting:
            r = self._requests[rid]
            phase = {S.DECODE: Phase.DECODE, S.PREFILL: Phase.PREFILL}.get(r.status, Phase.WAITING)
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
       (prefix-cache hits make recomputation cheaper). With ``admission="reserve"`` and no forks
       this does not happen, with one exception: when two running requests compute the same new
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
    4. **Overload.** With ``max_waiting`` set, a request arriving to a full queue is rejected
       ("queue full"); a request that can never fit is always rejected at arrival.

    **Starvation bound** (ageing on, and no preemption: ``admission="reserve"``, no forks, see
    the exception in 2.): let ``T`` be the largest
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
        super().__init__(kv, config, log=log)
        if self.config.max_num_seqs > self.config.max_num_batched_tokens:
            raise ValueError("ProductionScheduler needs max_num_seqs <= max_num_batched_tokens "
                             "so that every running request advances every step")
        self.order_key: OrderKey = order_key if order_key is not None else default_order_key

    def _overloaded(self, request: RuntimeRequest) -> str | None:
        limit = self.config.max_waiting
        if limit is not None and len(self.waiting) >= limit:
            return f"queue full: {len(self.waiting)} requests already waiting (limit {limit})"
        return None

    def _running_order(self) -> list[RuntimeRequest]:
        reqs = [self._requests[rid] for rid in self.running]
        return sorted(reqs, key=lambda r: (r.priority, self._admit_seq[r.request_id]))

    def is_aged(self, request: RuntimeRequest) -> bool:
        limit = self.config.max_wait_steps
        return limit is not None and self._step - (request.arrival_step or 0) >= limit

    def reserved_blocks(self) -> int:
        """Blocks that running requests may still claim to reach prompt + max_tokens
        (missing blocks, plus copy-on-write of shared blocks they will write, e.g. after a fork)."""
        return sum(self._still_needs(self._requests[rid]) for rid in self.running)

    def _still_needs(self, request: RuntimeRequest) -> int:
        end = max(self.max_slots(request), request.num_computed_tokens)
        return self.kv.blocks_needed(request.request_id, end,
                                     write_from=request.num_computed_tokens)

    def waiting_order(self) -> list[tuple[RuntimeRequest, int]]:
        """Waiting candidates in admission order, each with its prefix-hit token count."""
        aged, rest = [], []
        for rid in self.waiting:
            request = self._requests[rid]
            (aged if self.is_aged(request) else rest).append(request)
        aged.sort(key=lambda r: self._seq[r.request_id])
        # Cheap order first (no lookups), then cache affinity inside a bounded window.
        rest.sort(key=lambda r: (*self.order_key(r, 0, self._step), self._seq[r.request_id]))
        use_hits = self.config.cache_affinity and self.kv.prefix_cache is not None
        window = self.config.affinity_window if use_hits else 0
        head = [(r, self._uncomputed_prefix_hit(r)) for r in rest[:window]]
        head.sort(key=lambda p: (*self.order_key(p[0], p[1], self._step),
                                 self._seq[p[0].request_id]))
        tail = [(r, -1) for r in rest[window:]]
        return [(r, -1) for r in aged] + head + tail

    def _schedule_into(self, plan: _StepPlan) -> None:
        cfg = self.config
        ordered = self._running_order()

        def victims() -> list[RuntimeRequest]:
            pool = [self._requests[rid] for rid in self.running if rid not in plan.scheduled]
            return sorted(pool, key=lambda r: (-r.priority, -self._admit_seq[r.request_id]))

        # 1. sizes: one token each, then extend prefills in order.
        sizes: dict[str, int] = {}
        budget = plan.token_budget
        for request in ordered[: min(plan.max_seqs, budget)]:
            sizes[request.request_id] = 1
        left = budget - len(sizes)
        for request in ordered:
            rid = request.request_id
            if rid in sizes and request.status == S.PREFILL and left > 0:
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
                need = self.kv.blocks_needed(None, self.max_slots(request), scope, tokens)
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
            except MemoryError:
                if self.is_aged(request):
                    break
                continue
            if cfg.admission == "reserve":
                reserved += self._still_needs(request)

    def _place_running(self, rid: str) -> None:
        self.running.append(rid)

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
