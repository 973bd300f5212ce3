"""The engine's bookkeeping invariants, checked from outside: :func:`check_engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.labs.invariants.structural import check_scheduler

if TYPE_CHECKING:
    from kvlab.engine.llm_engine import LLMEngine


def _check_group_tables(batch, kv: HybridKVCacheManager, rid: str) -> None:
    """Each group's runner table equals the manager's wherever the manager holds a block (an
    entry its window dropped keeps a stale id the attention never reads)."""
    for g, table in enumerate(kv.block_tables(rid)):
        runner = batch.group_table(rid, g) if g else batch.table(rid)
        assert len(runner) >= len(table), f"runner's group {g} table of {rid} is short"
        assert all(b is None or runner[i] == b for i, b in enumerate(table)), \
            f"runner's group {g} table of {rid}"


def check_engine(engine: LLMEngine) -> None:
    """AssertionError unless the scheduler's and KV manager's invariants hold and the engine's
    bookkeeping agrees with them: every sample has its request and a scheduler entry until it
    ends, the runner's block tables (kept from deltas alone) equal the KV manager's, the runner
    keeps sampler states of live requests only, and grammar states match the output tokens.
    With overlap scheduling it first waits until the runner has run the steps in flight: a
    placeholder output is then a token the runner has sampled and the scheduler not yet seen."""
    with engine.core.lock:
        engine.core.wait_executed()         # (overlap: the runner's state is then still)
        check_scheduler(engine.scheduler)   # the KV manager's too
        outputs, scheduler, kv = engine.outputs, engine.scheduler, engine.kv
        for rid, (state, sample) in outputs.samples.items():
            assert outputs.requests.get(state.request_id) is state, f"orphan {rid}"
            assert sample.ended is not None or scheduler.find_request(rid) is not None, \
                f"the scheduler lost {rid}"
        batch = engine.executor.input_batch
        rows = batch.row_ids()
        for rid in kv.requests():
            if rid in rows:   # (a rollback is sent with the next step)
                if isinstance(kv, HybridKVCacheManager):
                    _check_group_tables(batch, kv, rid)
                    continue
                table = kv.block_table(rid)
                assert batch.table(rid)[:len(table)] == table, f"runner's table of {rid}"
        samplers = engine.executor.requests
        leaving = set(scheduler.pending_finished_ids)    # dropped with the next step's output
        for rid in samplers:
            request = scheduler.find_request(rid)
            assert rid in leaving or (request is not None and not request.status.is_terminal), \
                f"the executor keeps the sampler of ended request {rid}"
        engine.structured_outputs.check_states(
            (r.request_id, samplers.get(r.request_id), r.output_token_ids)
            for r in scheduler.requests() if not r.status.is_terminal)
        for state in outputs.requests.values():
            assert state.samples, f"request {state.request_id} has no sample"
