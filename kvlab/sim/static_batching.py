"""Request-level (static) batching: the baseline Orca's iteration-level scheduling replaced.

A static batch is formed from waiting requests only when the previous batch has completely
finished; its prompts are prefilled together in one step (padded to the longest), then the
batch decodes one token per member per step until its *longest* member is done. Members that
finish early leave their slot idle but still computed (padding), as in FasterTransformer-style
serving, and nobody joins a running batch. KV for prompt + max_tokens is reserved at admission.

It implements the same :class:`~kvlab.core.interfaces.Scheduler` protocol as the
iteration-level schedulers, so the simulator runs all of them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.core.request import RequestStatus
from kvlab.core.scheduler import SchedulerBase, StepPlan
from kvlab.core.step_records import SchedulerOutput

S = RequestStatus


class StaticBatchScheduler(SchedulerBase):
    """Request-level batching (see the module docstring).

    Config: ``max_num_seqs`` is the batch size. The token budget must hold a whole batch of
    prompts (``max_num_batched_tokens >= max_num_seqs * longest prompt``; a prompt that does not
    fit the budget is prefilled over several steps while the batch waits).
    """

    def __init__(self, kv, config=None, *, log=None) -> None:
        super().__init__(kv, config, log=log)
        self._batch: list[tuple[str, int]] = []   # members: (request id, final context length)
        self._padding: list[tuple[int, int]] = []

    def padding(self, output: SchedulerOutput) -> Sequence[tuple[int, int]]:
        """Dummy work of this step: idle slots of finished members, prompt padding."""
        return self._padding

    def _schedule_into(self, plan: StepPlan) -> None:
        self._padding = []
        if not self.running:
            self._form_batch(plan)
            return
        live = [self._requests[rid] for rid in self.running]
        prompt_pad = max((r.num_prompt_tokens for r in live), default=0)
        for request in live:
            if plan.tokens_left == 0:
                break
            n = (1 if request.is_decoding
                 else min(request.num_uncomputed_tokens, plan.tokens_left))
            start = request.num_computed_tokens
            plan.copies.extend(self._grow(request, n))   # reserved at admission: cannot fail
            plan.add_chunk(self._chunk(request, start, n))
        # members already done still occupy a slot: one dummy token at their final length
        running = set(self.running)
        self._padding = [(1, end) for rid, end in self._batch if rid not in running]
        if any(not r.is_decoding for r in live):
            self._padding += [(prompt_pad - r.num_prompt_tokens, r.num_prompt_tokens)
                              for r in live if r.num_prompt_tokens < prompt_pad]

    def _form_batch(self, plan: StepPlan) -> None:
        self._batch = []
        reserved = 0
        for rid in list(self.waiting):
            if plan.seqs_left == 0 or plan.tokens_left == 0:
                break
            request = self._requests[rid]
            hit = self.kv.find_prefix(request.scope, request.all_token_ids)   # one lookup
            need = hit.blocks_needed(request.max_kv_slots, self.kv.block_size)
            if need > self.kv.num_allocatable_blocks() - reserved:
                break                                   # FIFO: the batch is full of KV
            n = min(request.num_tokens - hit.cached, plan.tokens_left)
            self._admit(plan, request, hit, n)
            reserved += self.kv.blocks_needed(rid, request.max_kv_slots)
            self._batch.append((rid, request.max_kv_slots))
        if self._batch:
            longest = max(self._requests[rid].num_prompt_tokens for rid, _ in self._batch)
            self._padding = [(longest - self._requests[rid].num_prompt_tokens,
                              self._requests[rid].num_prompt_tokens) for rid, _ in self._batch]
