"""The scheduler: request registry and queues, and one step's protocol (``schedule`` /
``update_from_output`` / ``fail_step``). The policies that fill a step subclass it:
:mod:`.baseline_scheduler` (the default) and :mod:`.production_scheduler`.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.request import (
    PLACEHOLDER,
    WAITING_STATUSES,
    Lifecycle,
    RequestLog,
    RequestStatus,
    RuntimeRequest,
    stop_reason,
)
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.spec_plan import plan_lookahead
from kvlab.core.step_records import NewRequest, ScheduledChunk, SchedulerOutput, check_sampled

if TYPE_CHECKING:
    from kvlab.core.kv_cache_manager import KVCacheManager, PrefixHit


class StepPlan:
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
        n = chunk.num_query_tokens
        if n <= 0 or n > self.tokens_left or self.seqs_left <= 0:
            raise AssertionError("a chunk would break the step's budgets")
        self.chunks.append(chunk)
        self.used += n
        self.scheduled.add(chunk.request_id)

    def replace_chunk(self, index: int, chunk: ScheduledChunk) -> None:
        """Swap chunk ``index`` for a larger version of itself (same request; lookahead added)."""
        old = self.chunks[index]
        extra = chunk.num_query_tokens - old.num_query_tokens
        if chunk.request_id != old.request_id or not 0 <= extra <= self.tokens_left:
            raise AssertionError("replace_chunk: another request, or beyond the token budget")
        self.chunks[index] = chunk
        self.used += extra


S = RequestStatus


def _drop_placeholders(request: RuntimeRequest) -> None:
    """Overlap mode, a request that ends: forget the outputs still in flight (their tokens
    are discarded) and the computed tokens planned on them (its last token has no KV, as in
    the synchronous engine)."""
    if request.num_output_placeholders:
        del request.output_token_ids[-request.num_output_placeholders:]
        request.num_output_placeholders = 0
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)


class SchedulerBase:
    """Request registry, queues, KV bookkeeping and output handling shared by both policies."""

    compact_min_events: int = 4096   # compact the event log at this size, then when it doubles

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig | None = None, *,
                 log: RequestLog | None = None) -> None:
        config = config if config is not None else SchedulerConfig()
        if config.max_num_seqs > config.max_num_batched_tokens:
            raise ValueError(f"{type(self).__name__} needs max_num_seqs <= max_num_batched_tokens "
                             f"(got {config.max_num_seqs} > {config.max_num_batched_tokens}): a "
                             "full batch must give every request at least one token")
        if config.async_scheduling and log is not None:
            raise ValueError("async scheduling advances a request's computed tokens when a step "
                             "is planned, before it ran: the write-ahead log (crash recovery) "
                             "needs the synchronous scheduler")
        self.kv = kv
        self.config = config
        self.lifecycle = Lifecycle(log, step=lambda: self._step)
        self._requests: dict[str, RuntimeRequest] = {}
        self._counter = 0                       # source of arrival_seq / admit_seq
        self.waiting: list[str] = []
        self.running: list[str] = []
        self._step = 0
        self._inflight: deque[SchedulerOutput] = deque()   # oldest first (two: overlap mode)
        self._inflight_ids: set[str] = set()
        self._ended: list[RuntimeRequest] = []  # rejected/failed, reported by update_from_output
        self._rejected_pending: list[str] = []  # rejected since the last schedule()
        self._known: set[str] = set()           # requests the executor holds state for
        self._finished_ids: list[str] = []      # ended since the last schedule(): to drop
        self._compact_at = self.compact_min_events  # log size that triggers the next compaction

    @property
    def log(self) -> RequestLog | None:   # the write-ahead log passed in; None: none kept
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
        """Drop an ended, reported request from the registry (ValueError unless
        :meth:`can_forget`; KeyError for an unknown id)."""
        request = self.get_request(request_id)
        if not self.can_forget(request_id):
            raise ValueError(f"request {request_id!r} is {request.status.value}: not ended, "
                             "or still being reported or executed")
        del self._requests[request_id]
        return request

    def can_forget(self, request_id: str) -> bool:
        """Whether :meth:`forget` would succeed: known, ended, reported, not in flight."""
        request = self._requests.get(request_id)
        return (request is not None and request.status.is_terminal
                and not any(r is request for r in self._ended)
                and request_id not in self._inflight_ids)

    def _next_seq(self) -> int:   # orders arrivals and admissions
        self._counter += 1
        return self._counter

    def find_request(self, request_id: str) -> RuntimeRequest | None:
        """The request with this id, or None if unknown (or forgotten)."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._ended or self._inflight_ids)

    def add_request(self, request: RuntimeRequest) -> None:
        """Queue ``request``; reject it (REJECTED + reason) if it can never fit or on overload."""
        if not isinstance(request, RuntimeRequest):
            raise TypeError(f"expected a RuntimeRequest, got {type(request).__name__}")
        request.check_new()
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
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
        """Cancel a request and free its KV (idempotent; None for an unknown id). RuntimeError
        for a request in the step in flight: the runner may still read its KV. With
        ``async_scheduling`` that is allowed: the executor runs steps one at a time in order,
        so a later step is the first that can reuse the blocks; the token in flight is
        dropped."""
        request = self._requests.get(request_id)
        if request is None or request.status.is_terminal:
            return request
        if request_id in self._inflight_ids and not self.config.async_scheduling:
            raise RuntimeError(f"abort_request({request_id!r}) during the step that runs it: "
                               "abort after update_from_output() or fail_step()")
        in_queue = self.waiting if request.status in WAITING_STATUSES else self.running
        self.lifecycle.cancel(request)
        in_queue.remove(request_id)
        self.lifecycle.release(request, self.kv)
        self._executor_drops(request_id)
        _drop_placeholders(request)
        return request

    def schedule(self) -> SchedulerOutput:
        """Decide this step's chunks; allocates their KV. See the policy class for the rules.

        With ``async_scheduling`` one step may still be executing (overlap): this one is
        planned as if it had run. Its chunks count as computed now, each token it will sample
        stands in the request's outputs as a :data:`~kvlab.core.request.PLACEHOLDER` (a decode
        planned on it feeds the placeholder, which the executor fills), and a request whose
        step is in flight is never preempted (short of KV, it sits this step out)."""
        while self._inflight and self._inflight[-1].is_empty:   # nothing to wait for
            self._inflight.pop()
        limit = 2 if self.config.async_scheduling else 1
        if len(self._inflight) >= limit:
            raise RuntimeError(f"schedule() called before update_from_output() of step "
                               f"{self._inflight[0].step}")
        self._step += 1
        plan = StepPlan(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_into(plan)
        if k := self.config.num_lookahead_tokens:   # speculative decoding's draft slots
            for i, chunk, copies in plan_lookahead(plan.chunks, plan.tokens_left, k, self.kv,
                                                   self.get_request):
                plan.copies.extend(copies)
                plan.replace_chunk(i, chunk)
        chunks = tuple(plan.chunks)
        new = tuple(self._new_request(c.request_id) for c in chunks
                    if c.request_id not in self._known)
        output = SchedulerOutput(self._step, chunks, tuple(plan.copies), tuple(plan.preempted),
                                 tuple(plan.admitted), tuple(self._rejected_pending),
                                 sum(c.num_query_tokens for c in chunks), new_requests=new,
                                 finished_ids=tuple(self._finished_ids))
        self._rejected_pending, self._finished_ids = [], []
        if self.config.async_scheduling:
            for c in chunks:      # planned as done: the next step builds on it
                request = self._requests[c.request_id]
                request.num_computed_tokens = c.start_pos + c.num_tokens
                if c.sample:
                    request.output_token_ids.append(PLACEHOLDER)
                    request.num_output_placeholders += 1
        self._inflight.append(output)
        self._inflight_ids |= {c.request_id for c in chunks}
        return output

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[RuntimeRequest]:
        """Apply a step's tokens (``request id -> token``, a tuple with lookahead); returns the
        requests that ended. Validated first (ValueError: nothing changed)."""
        if not self._inflight or output is not self._inflight[0]:
            if output.is_empty and not sampled:
                ended, self._ended = self._ended, []
                return ended
            raise ValueError(f"output of step {output.step} is not the step in flight (with "
                             "overlap: the oldest)")
        tokens = check_sampled(output, sampled)   # speculative chunks answer a tuple
        if self.config.async_scheduling:
            return self._update_overlapped(output, tokens)
        ended: list[RuntimeRequest] = []
        touched: list[RuntimeRequest] = []
        for chunk in output.chunks:
            request = self._requests[chunk.request_id]
            got = tokens.get(chunk.request_id, (None,))
            for i, token in enumerate(got):   # accepted drafts count as computed, one by one
                request.num_computed_tokens = chunk.start_pos + chunk.num_tokens + i
                self._apply_token(request, token)
                if stop_reason(request) is not None:
                    break
            if chunk.num_lookahead:   # give back the blocks past the accepted tokens
                self.kv.truncate(chunk.request_id, request.num_computed_tokens)
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
                self._executor_drops(rid)
                ended.append(request)
        self._close_step()
        early, self._ended = self._ended, []
        if self.log is not None and len(self.log) >= self._compact_at:
            self._compact_log()
        return early + ended

    def _update_overlapped(self, output: SchedulerOutput,
                           tokens: Mapping[str, tuple[int, ...]]) -> list[RuntimeRequest]:
        """:meth:`update_from_output` when steps overlap: each sampled token replaces its
        request's oldest placeholder; what this step computed is committed; a request that
        stops drops the placeholders of the step after (its token there is discarded)."""
        ended: list[RuntimeRequest] = []
        for chunk in output.chunks:
            request = self._requests[chunk.request_id]
            if request.status.is_terminal:         # aborted or failed while this step ran
                continue
            reason = None
            if chunk.sample:
                i = len(request.output_token_ids) - request.num_output_placeholders
                assert request.output_token_ids[i] == PLACEHOLDER
                request.output_token_ids[i] = tokens[chunk.request_id][0]
                request.num_output_placeholders -= 1
                if request.first_token_step is None:
                    request.first_token_step = output.step
                reason = stop_reason(request, i + 1)
            done = chunk.start_pos + chunk.num_tokens     # KV written, tokens known
            rid = request.request_id
            if request.status is S.RUNNING and self.kv.needs_commit(rid, done):
                self.kv.commit(rid, request.token_slice(0, done))
            if reason is not None:
                _drop_placeholders(request)        # the step after samples past the end
                self.lifecycle.finish(request, reason)
                self.running.remove(rid)
                self.lifecycle.release(request, self.kv)
                self._executor_drops(rid)
                ended.append(request)
        self._close_step()
        early, self._ended = self._ended, []
        return early + ended

    def _can_run(self, request: RuntimeRequest) -> bool:
        """False for a request whose tokens in flight already reach its length limit (overlap
        mode: nothing more to plan until they land)."""
        n = len(request.output_token_ids)
        return not request.num_output_placeholders or (
            n < request.max_tokens and (request.max_model_len is None
                                        or request.num_tokens < request.max_model_len))

    def _new_request(self, request_id: str) -> NewRequest:
        """The state of a request the executor has not seen, sent with its first chunk."""
        r = self._requests[request_id]
        self._known.add(request_id)
        return NewRequest(request_id, r.prompt_token_ids, tuple(r.output_token_ids),
                          r.max_tokens, r.max_model_len, r.stop_token_ids, r.eos_token_id,
                          r.ignore_eos, r.sampling_params, r.seed)

    def _executor_drops(self, request_id: str) -> None:
        """An ended request: the next output tells the executor to drop its state."""
        if request_id in self._known:
            self._known.remove(request_id)
            self._finished_ids.append(request_id)

    def complete_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        """The executor made these copy-on-write copies: their blocks' fences lift."""
        self.kv.complete_copies(copies)

    def _close_step(self) -> None:
        """End the oldest step in flight."""
        self._inflight.popleft()
        self._inflight_ids = {c.request_id for o in self._inflight for c in o.chunks}

    def fail_step(self, output: SchedulerOutput, message: str) -> list[RuntimeRequest]:
        """The step in flight could not run: its requests become FAILED (``message``) and
        release their KV once; the next ``update_from_output()`` reports them. The executor may
        not have seen the step, so the next output repeats its finished ids."""
        if not self._inflight or output is not self._inflight[0]:
            raise ValueError(f"fail_step: output of step {output.step} is not the step in "
                             "flight (with overlap: the oldest)")
        if not isinstance(message, str):
            raise TypeError(f"fail_step: message must be a str, got {message!r}")
        if output.copies:
            still = Counter(self.kv.pending_copies()) & Counter(output.copies)
            if still:
                self.kv.complete_copies(list(still.elements()))
        self._finished_ids[:0] = output.finished_ids   # dropping an unknown id is a no-op
        failed: list[RuntimeRequest] = []
        for rid in [c.request_id for c in output.chunks]:
            request = self._requests[rid]
            if request.status.is_terminal:      # ended in a step that overlapped this one
                continue
            _drop_placeholders(request)
            self.lifecycle.fail(request, message)
            self.running.remove(rid)
            self.lifecycle.release(request, self.kv)
            self._executor_drops(rid)
            failed.append(request)
        self._close_step()
        self._ended.extend(failed)
        return failed

    def _compact_log(self) -> None:
        """Drop the log events of requests that ended and hold no KV (amortised O(1))."""
        live = {rid for rid, r in self._requests.items()
                if not r.status.is_terminal or self.kv.has(rid)}
        self.log.compact(self.log.request_ids() - live)  # ended or forgotten
        self._compact_at = max(self.compact_min_events, 2 * len(self.log))

    def restore(self, requests: Sequence[RuntimeRequest], running_order: Sequence[str],
                 step: int) -> None:
        """Install recovered requests into this empty scheduler (crash recovery, chapter 5):
        preempted then waiting ones queued in arrival order, running ones in ``running_order``."""
        if self._requests or self._step:
            raise RuntimeError("restore needs a fresh scheduler")
        for request in requests:
            rid = request.request_id
            self._requests[rid] = request
            request.arrival_seq = self._next_seq()
        self.waiting = [r.request_id for s in (S.PREEMPTED, S.WAITING)
                        for r in requests if r.status == s]
        for rid in running_order:
            self.running.append(rid)
            self._requests[rid].admit_seq = self._next_seq()
        self._step = step

    @property
    def pending_finished_ids(self) -> tuple[str, ...]:
        """Requests that ended since the last output, which the next one tells the executor."""
        return tuple(self._finished_ids)

    @property
    def inflight_ids(self) -> frozenset[str]:
        """Ids of the requests whose chunks are in the step in flight."""
        return frozenset(self._inflight_ids)

    def _schedule_into(self, plan: StepPlan) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _never_fits(self, request: RuntimeRequest) -> str | None:
        n = request.num_prompt_tokens
        if request.max_model_len is not None and n >= request.max_model_len:
            return f"prompt of {n} tokens leaves no room in max_model_len={request.max_model_len}"
        need = self.kv.blocks_for(request.max_kv_slots)
        if need > self.kv.num_blocks:
            return (f"prompt + max_tokens needs {need} KV blocks; the pool has "
                    f"{self.kv.num_blocks}: it can never fit")
        return None

    def _overloaded(self, request: RuntimeRequest) -> str | None:
        return None

    def _apply_token(self, request: RuntimeRequest, token: int | None) -> None:
        if token is not None:
            request.output_token_ids.append(token)
            if request.first_token_step is None:
                request.first_token_step = self._step
        self.lifecycle.progress(request, token)

    def _admit(self, plan: StepPlan, request: RuntimeRequest, hit: PrefixHit, n: int) -> None:
        """Give a waiting request its table (reusing the prefix ``hit`` found for it this
        step) and a chunk of ``n`` tokens."""
        rid, cached = request.request_id, hit.cached
        tokens = request.all_token_ids
        got = self.lifecycle.acquire(
            request, "admit", lambda: self.kv.admit(rid, request.scope, tokens, cached + n, hit))
        assert got == cached, f"{rid}: admit reused {got} tokens, the hit said {cached}"
        first = request.admitted_step is None
        self.lifecycle.transition(request, S.RUNNING)
        request.num_computed_tokens = cached
        if first:
            request.num_cached_tokens = cached
            request.admitted_step = self._step
        self.waiting.remove(rid)
        request.admit_seq = self._next_seq()
        self.running.append(rid)
        plan.admitted.append(rid)
        plan.add_chunk(self._chunk(request, cached, n))

    def _grow(self, request: RuntimeRequest, n: int) -> list[tuple[int, int]]:
        """Extend a running request's table for ``n`` more tokens (OutOfBlocks: unchanged)."""
        start = request.num_computed_tokens
        return list(self.kv.grow(request.request_id, start + n, write_from=start))

    def _chunk(self, request: RuntimeRequest, start: int, n: int) -> ScheduledChunk:
        end = start + n
        kept, new = self.kv.table_delta(request.request_id)
        return ScheduledChunk(request.request_id, request.token_slice(start, end), start, new,
                              sample=end == request.num_tokens,
                              is_prefill=not request.is_decoding, num_kept_blocks=kept,
                              group_deltas=self.kv.group_deltas(request.request_id))

    def _preempt(self, plan: StepPlan, request: RuntimeRequest) -> None:
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
        return self.kv.lookup(request.scope, request.all_token_ids)

    def _ensure_kv(self, plan: StepPlan, request: RuntimeRequest, n: int,
                   victims: Callable[[], list[RuntimeRequest]]) -> bool:
        """Grow ``request`` by ``n`` tokens, preempting from ``victims()`` (best victim first)
        while KV is short. False if ``request`` itself had to be preempted or failed."""
        while True:
            try:
                plan.copies.extend(self._grow(request, n))
                return True
            except OutOfBlocks:
                busy = self._inflight_ids          # (overlap: never preempt a running step)
                pool = [v for v in victims() if v is not request and v.request_id not in busy]
                if pool:
                    self._preempt(plan, pool[0])
                    continue
                if request.request_id in busy:     # it sits this step out
                    return False
                # nobody else to preempt: recompute it later (it reuses the cache, and alone it
                # always fits: add_request rejected requests whose max_kv_slots exceed the pool)
                self._preempt(plan, request)
                return False
