"""Shared machinery of kvlab's schedulers: configuration, request registry and queues, KV
bookkeeping, output handling, invariants. The policies live in :mod:`.scheduler_baseline` and
:mod:`.scheduler_production`; :mod:`.scheduler` re-exports everything (see its docstring for
the rules common to both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .block_pool import OutOfBlocks
from .lifecycle import (
    RUNNING_STATUSES,
    WAITING_STATUSES,
    EventLog,
    Lifecycle,
)
from .scheduler_api import (
    RequestStatus,
    RuntimeRequest,
    ScheduledChunk,
    SchedulerOutput,
    stop_reason,
)
from .scope import scope_key

S = RequestStatus


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never a token id or count)."""
    return isinstance(value, int) and not isinstance(value, bool)


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
        config = config if config is not None else SchedulerConfig()
        if config.max_num_seqs > config.max_num_batched_tokens:
            raise ValueError(
                f"{type(self).__name__} needs max_num_seqs <= max_num_batched_tokens (got "
                f"{config.max_num_seqs} > {config.max_num_batched_tokens}) so that a full batch "
                "still gives every request at least one token")
        self.kv = kv
        self.config = config
        self.lifecycle = Lifecycle(log, step=lambda: self._step)
        self._requests: dict[str, RuntimeRequest] = {}
        self._counter = 0                       # source of arrival_seq / admit_seq
        self.waiting: list[str] = []
        self.running: list[str] = []
        self._step = 0
        self._inflight: SchedulerOutput | None = None
        self._inflight_ids: set[str] = set()
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
        """Every request added and not forgotten, in arrival order (terminal ones included)."""
        return list(self._requests.values())

    def forget(self, request_id: str) -> RuntimeRequest:
        """Drop an ended request from the registry (a long-running engine calls this once it
        has reported the request, so memory stays proportional to live requests).

        KeyError for an unknown id; ValueError (nothing changed) if the request has not ended,
        still owes a report (``update_from_output`` has not returned it yet) or is part of the
        step in flight.
        """
        request = self.get_request(request_id)
        if not request.status.is_terminal:
            raise ValueError(f"request {request_id!r} is {request.status.value}: not ended")
        if not self.can_forget(request_id):
            raise ValueError(f"request {request_id!r} is still being reported or executed")
        del self._requests[request_id]
        return request

    def can_forget(self, request_id: str) -> bool:
        """Whether :meth:`forget` would succeed: known, ended, reported, not in flight."""
        request = self._requests.get(request_id)
        return (request is not None and request.status.is_terminal
                and not any(r is request for r in self._ended)
                and request_id not in self._inflight_ids
                and request_id not in self._deferred_release)

    def _next_seq(self) -> int:
        """The next value of the counter that orders arrivals and admissions."""
        self._counter += 1
        return self._counter

    def find_request(self, request_id: str) -> RuntimeRequest | None:
        """The request with this id, or None if unknown (or forgotten)."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._ended or self._inflight_ids)

    # -- protocol: request arrival and abort --------------------------------------------------

    def add_request(self, request: RuntimeRequest) -> None:
        """Queue ``request``; reject it (REJECTED + reason) if it can never fit or on overload."""
        self._validate_new(request)
        self.lifecycle.add(request)
        rid = request.request_id
        self._requests[rid] = request
        request.arrival_seq = self._next_seq()
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

        ``sampled`` maps every request whose chunk had ``sample=True`` to its new token.
        Validated before anything changes. Tokens of requests aborted during the step are
        ignored.
        """
        inflight = self._inflight
        if inflight is None or output is not inflight:
            if output.is_empty and not sampled:
                ended, self._ended = self._ended, []
                return ended
            raise ValueError(f"output of step {output.step} is not the step in flight")
        live = [c for c in output.chunks if not self._requests[c.request_id].status.is_terminal]
        expected = {c.request_id for c in live if c.sample}
        aborted = {c.request_id for c in output.chunks}
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
        for request in touched:
            rid, computed = request.request_id, request.num_computed_tokens
            if self.kv.needs_commit(rid, computed):  # False: commit would change nothing
                self.kv.commit(rid, request.token_slice(0, computed))
            reason = stop_reason(request)
            if reason is not None:
                self.lifecycle.finish(request, reason)
                self.running.remove(request.request_id)
                self.lifecycle.release(request, self.kv)
                ended.append(request)
        self._close_step()
        early, self._ended = self._ended, []
        if len(self.log) >= self._compact_at:
            self._compact_log()
        return early + ended

    def _close_step(self) -> None:
        """End the step in flight: release the requests aborted during it."""
        for rid in self._deferred_release:
            self.lifecycle.release(self._requests[rid], self.kv)
        self._deferred_release = []
        self._inflight = None
        self._inflight_ids = set()

    def fail_step(self, output: SchedulerOutput, message: str) -> list[RuntimeRequest]:
        """The step in flight could not run (the executor or the sampler raised): end it.

        Every live request of the step becomes FAILED (finish reason ERROR, ``message`` in
        ``status_message``), leaves the running queue and releases its KV exactly once;
        requests aborted while it was in flight release theirs too. The step's copy-on-write
        copies still pending are completed first: their destination blocks belong only to
        requests of this step, which fail, so no KV that survives depends on them. Then the
        step is cleared: the next ``schedule()`` runs, and the next ``update_from_output()``
        reports the failed requests (like rejections). Requests outside the step are
        untouched. Returns the failed requests. ValueError (nothing changed) if ``output`` is
        not the step in flight.
        """
        if self._inflight is None or output is not self._inflight:
            raise ValueError(f"fail_step: output of step {output.step} is not the step in flight")
        if not isinstance(message, str):
            raise TypeError(f"fail_step: message must be a str, got {message!r}")
        if output.copies:
            still = Counter(self.kv.pending_copies()) & Counter(output.copies)
            if still:
                self.kv.complete_copies(list(still.elements()))
        failed: list[RuntimeRequest] = []
        for rid in [c.request_id for c in output.chunks]:
            request = self._requests[rid]
            if request.status.is_terminal:
                continue   # aborted while in flight: released with the deferred ones below
            self.lifecycle.fail(request, message)
            self.running.remove(rid)
            self.lifecycle.release(request, self.kv)
            failed.append(request)
        self._close_step()
        self._ended.extend(failed)
        return failed

    def _compact_log(self) -> None:
        """Checkpoint: drop the log events of requests that ended and hold no KV (amortised
        O(1) per event: the next compaction waits until the log doubles)."""
        live = {rid for rid, r in self._requests.items()
                if not r.status.is_terminal or self.kv.has(rid)}
        self.log.compact({e.request_id for e in self.log.events} - live)  # ended or forgotten
        self._compact_at = max(self.compact_min_events, 2 * len(self.log))

    def restore(self, requests: Sequence[RuntimeRequest], running_order: Sequence[str],
                 step: int) -> None:
        """Install recovered requests into this empty scheduler (the entry point of recovery).

        Waiting requests are queued preempted-first, each group in arrival order; running
        requests in ``running_order`` (their admission order before the crash).
        """
        if self._requests or self._step:
            raise RuntimeError("restore needs a fresh scheduler")
        for request in requests:
            rid = request.request_id
            self._requests[rid] = request
            request.arrival_seq = self._next_seq()
        self.waiting = (
            [r.request_id for r in requests if r.status == S.PREEMPTED]
            + [r.request_id for r in requests if r.status == S.WAITING])
        for rid in running_order:
            self.running.append(rid)
            self._requests[rid].admit_seq = self._next_seq()
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
        prompt = request.prompt_token_ids
        if not isinstance(prompt, tuple):
            raise ValueError(f"request {rid!r}: prompt_token_ids must be a tuple of ints, got "
                             f"{type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"request {rid!r} has an empty prompt")
        for i, token in enumerate(prompt):
            if not _is_int(token) or token < 0:
                raise ValueError(f"request {rid!r}: prompt_token_ids[{i}] must be an int >= 0, "
                                 f"got {token!r}")
        if not _is_int(request.max_tokens) or request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be an int >= 1, "
                             f"got {request.max_tokens!r}")
        if request.max_model_len is not None and (
                not _is_int(request.max_model_len) or request.max_model_len < 1):
            raise ValueError(f"request {rid!r}: max_model_len must be None or an int >= 1, "
                             f"got {request.max_model_len!r}")
        stops = request.stop_token_ids
        if not isinstance(stops, (set, frozenset)) or not all(
                _is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"request {rid!r}: stop_token_ids must be a frozenset of ints >= 0, "
                             f"got {stops!r}")
        eos = request.eos_token_id
        if eos is not None and (not _is_int(eos) or eos < 0):
            raise ValueError(f"request {rid!r}: eos_token_id must be None or an int >= 0, "
                             f"got {eos!r}")
        if not isinstance(request.ignore_eos, bool):
            raise ValueError(f"request {rid!r}: ignore_eos must be a bool, "
                             f"got {request.ignore_eos!r}")
        if not _is_int(request.priority):
            raise ValueError(f"request {rid!r}: priority must be an int, "
                             f"got {request.priority!r}")
        deadline = request.deadline
        if deadline is not None and (not isinstance(deadline, (int, float))
                                     or isinstance(deadline, bool) or deadline != deadline):
            raise ValueError(f"request {rid!r}: deadline must be None or a number, "
                             f"got {deadline!r}")
        try:
            scope_key(request.scope)
        except TypeError as error:
            raise ValueError(f"request {rid!r}: bad scope: {error}") from None
        if (request.status != S.WAITING or request.output_token_ids
                or request.num_computed_tokens or request.finish_reason is not None):
            raise ValueError(
                f"request {rid!r} must be fresh (WAITING, no outputs, nothing computed)")

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
        request.admit_seq = self._next_seq()
        self._place_running(rid)
        plan.admitted.append(rid)
        plan.add_chunk(self._chunk(request, cached, n))

    def _place_running(self, rid: str) -> None:
        self.running.append(rid)

    def _grow(self, request: RuntimeRequest, n: int) -> list[tuple[int, int]]:
        """Extend a running request's table for ``n`` more tokens (OutOfBlocks: unchanged)."""
        start = request.num_computed_tokens
        return list(self.kv.grow(request.request_id, start + n, write_from=start))

    def _chunk(self, request: RuntimeRequest, start: int, n: int) -> ScheduledChunk:
        end = start + n
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_slice(start, end),
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
            except OutOfBlocks:
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
        n = chunk.num_tokens
        if n <= 0 or n > self.tokens_left or self.seqs_left <= 0:
            raise AssertionError("a chunk would break the step's budgets")
        self.chunks.append(chunk)
        self.used += n
        self.scheduled.add(chunk.request_id)
