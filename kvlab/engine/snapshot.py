"""Plain-data snapshots of an :class:`~kvlab.engine.llm_engine.LLMEngine` (widgets draw these).

Everything here is built from ints, strings, tuples and dicts only, so a figure function can
take a snapshot without importing torch or reaching into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.core.step_records import SchedulerOutput
    from kvlab.engine.attention_metadata import AttentionMetadata

__all__ = ["BatchEntry", "EngineSnapshot", "RequestView", "StepTrace", "take_snapshot"]


@dataclass
class StepTrace:
    """What the last :meth:`LLMEngine.step` did (``engine.last_trace``), for snapshots, teaching
    and debugging (references only).

    ``scheduler_output``: the scheduler's decisions (chunks, copies, admissions, preemptions);
    ``metadata``: the executor's flat-batch layout (``input_ids``, ``positions``,
    ``slot_mapping``, the paged rows and dense chunks); ``sampled_from``: request ids whose
    logits rows were sampled, in row order; ``logits_shape``: ``(rows, vocab)``;
    ``sampled``: the new tokens per sequence; ``finished``: sequence ids that ended.
    """

    scheduler_output: SchedulerOutput
    metadata: AttentionMetadata | None
    sampled_from: list[str]
    logits_shape: tuple[int, ...]
    sampled: dict[str, tuple[int, ...]]
    finished: list[str]



@dataclass(frozen=True)
class RequestView:
    """One sequence as the scheduler sees it."""

    request_id: str
    status: str              # RequestStatus value: waiting, running, preempted, finished...
    phase: str               # "prefill" | "decode" | "idle" (waiting/preempted/ended)
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    block_table: tuple[int, ...]
    finish_reason: str | None


@dataclass(frozen=True)
class BatchEntry:
    """One chunk of the last step: which tokens ran where."""

    request_id: str
    start_pos: int
    num_tokens: int
    is_prefill: bool
    sample: bool
    slots: tuple[int, ...]          # flat KV slots written: block * block_size + offset
    sampled_token: int | None


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine after a step: requests, the last batch, and the KV pool."""

    step: int
    block_size: int
    num_blocks: int
    requests: tuple[RequestView, ...]
    last_batch: tuple[BatchEntry, ...]
    last_copies: tuple[tuple[int, int], ...]
    block_states: tuple[str, ...]
    refcounts: tuple[int, ...]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def running(self) -> tuple[RequestView, ...]:
        return tuple(r for r in self.requests if r.phase != "idle")


def take_snapshot(engine: Any, *, include_finished: bool = False) -> EngineSnapshot:
    """Snapshot ``engine`` (an LLMEngine). Finished requests are left out unless asked for."""
    sched, kv = engine.scheduler, engine.kv
    bs = engine.block_size
    views = []
    for req in sched.requests():
        status = req.status.value
        if req.status.is_terminal and not include_finished:
            continue
        phase = req.phase if status == "running" else "idle"
        table = tuple(kv.block_table(req.request_id)) if kv.has(req.request_id) else ()
        views.append(RequestView(
            request_id=req.request_id, status=status, phase=phase,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_token_ids),
            num_computed_tokens=req.num_computed_tokens, num_cached_tokens=req.num_cached_tokens,
            block_table=table,
            finish_reason=None if req.finish_reason is None else req.finish_reason.value))
    batch = []
    trace = engine.last_trace
    out = trace.scheduler_output if trace is not None else None
    meta = trace.metadata if trace is not None else None
    if out is not None and meta is not None:
        slot_mapping = meta.slot_mapping.tolist()
        for i, c in enumerate(out.chunks):
            first = meta.query_start[i]    # the chunk's rows (then any drafts)
            slots = tuple(slot_mapping[first:first + c.num_tokens])
            tokens = trace.sampled.get(c.request_id, ())
            batch.append(BatchEntry(c.request_id, c.start_pos, c.num_tokens, c.is_prefill,
                                    c.sample, slots, tokens[0] if tokens else None))
    pool, cache = kv.pool, kv.prefix_cache
    st = engine.stats
    stats = {
        "steps": st.steps, "prompt_tokens": st.prompt_tokens,
        "cached_prompt_tokens": st.cached_prompt_tokens, "generated_tokens": st.generated_tokens,
        "finished_requests": st.finished_requests, "prefix_hit_rate": st.prefix_hit_rate,
        "free_blocks": pool.num_free(),
        "cached_blocks": cache.num_cached_blocks() if cache is not None else 0,
    }
    return EngineSnapshot(
        step=0 if out is None else out.step, block_size=bs, num_blocks=engine.num_blocks,
        requests=tuple(views), last_batch=tuple(batch),
        last_copies=() if out is None else tuple(out.copies),
        block_states=tuple(pool.state(b) for b in range(pool.num_blocks)),
        refcounts=tuple(pool.refcount(b) for b in range(pool.num_blocks)), stats=stats)
