"""The default policy: the spec's ``build_batch`` (rule 6) as a real scheduler. Decode first,
then FIFO prefill chunks into the rest of the budget (where KV is ample its batch *is*
``build_batch``'s); short of KV it admits only at the head of the line and preempts the
newest-admitted request. The opt-in :mod:`.production_scheduler` reserves KV (chapter 6).
"""

from __future__ import annotations

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.request import RUNNING_STATUSES, RequestStatus, RuntimeRequest
from kvlab.core.scheduler import SchedulerBase, StepPlan
from kvlab.reference import Phase
from kvlab.reference import Request as ReferenceRequest

S = RequestStatus


class BaselineScheduler(SchedulerBase):
    """Per step: each running decode gets one token, then running prefills and then waiting
    requests (FIFO, preempted ones first) get ``min(tokens left, prefill_chunk, budget left)``,
    until ``max_num_seqs`` entries or the budget run out."""

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
            if request.status not in RUNNING_STATUSES or not self._can_run(request):
                continue   # preempted earlier in this step, or its last token is in flight
            n = 1 if request.is_decoding else min(
                request.num_uncomputed_tokens, chunk_cap, plan.tokens_left)
            start = request.num_computed_tokens
            if self._ensure_kv(plan, request, n, victims):
                plan.add_chunk(self._chunk(request, start, n))
        for rid in list(self.waiting):
            if plan.seqs_left == 0 or plan.tokens_left == 0:
                return
            request = self._requests[rid]
            hit = self.kv.find_prefix(request.scope, request.all_token_ids)   # one lookup
            n = min(request.num_tokens - hit.cached, chunk_cap, plan.tokens_left)
            need = hit.blocks_needed(hit.cached + n, self.kv.block_size)
            if need > self.kv.num_allocatable_blocks():
                return   # head of line: wait for KV, never skip ahead
            try:
                self._admit(plan, request, hit, n)
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
