"""The fragmentation simulation: one KV arena, a workload, an allocation policy, time in steps.

It reproduces, at small scale, the measurement behind Figure 2 of the PagedAttention paper
(Kwon et al., SOSP 2023): in serving systems that reserve one contiguous chunk per request,
only about 20–38% of KV memory holds token states; with paged allocation 96% does.

**The simulation.** One KV arena of ``arena_tokens`` token slots serves a seeded workload
(:mod:`.workload`). Time advances in engine steps; in each step every running request writes
the K/V of one more token (decode), then waiting requests are admitted first come, first
served, and write their whole prompt (prefill). A request that has stored
``prompt + output`` tokens finishes at the end of that step and frees its memory. Policies:

* ``"max"``: reserve ``max_seq_len`` slots per request (Orca-Max style),
* ``"pow2"``: reserve ``prompt + next_pow2(output)`` (knows the output within 2×),
* ``"oracle"``: reserve exactly ``prompt + output`` (knows the output length),
* ``"paged"``: :class:`~kvlab.labs.paging.BlockTable` over the reference
  :class:`~kvlab.reference.BlockAllocator`, one block at a time; when a decode finds no free
  block, the most recently admitted request is preempted (blocks freed, recomputed later).

Contiguous policies allocate from an arena of :mod:`.arenas`; every step is accounted in the
categories of :mod:`.report`.

**What differs from the paper.** We simulate; no model runs, so the step is a unit of time
and throughput is measured in tokens per step, not per second. Lengths are synthetic
(log-normal, means chosen near the ShareGPT statistics the paper reports), not ShareGPT
itself. The arena is one pool of token slots with no per-layer layout, and paged admission
keeps a watermark of free blocks (1% by default, as vLLM). The step clock charges one step
whatever a step holds: prefills and the recomputation after a preemption are free
(``WasteReport.recomputed_tokens`` counts the latter), so a ratio of steps is a ratio of batch
sizes, not of wall-clock times. The paper's Orca baselines are its own re-implementation; ours are
simpler still. The *shape* of the result (contiguous 60–80% waste, paged a few percent) is
what we reproduce; exact percentages depend on the workload and arena size.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvlab.core.block_pool import OutOfBlocks
from kvlab.labs.fragmentation.arenas import ARENAS
from kvlab.labs.fragmentation.report import CATEGORIES, WasteReport
from kvlab.labs.fragmentation.workload import WorkloadRequest
from kvlab.labs.paging import BlockTable
from kvlab.reference import BlockAllocator

__all__ = ["POLICIES", "compare_policies", "reservation", "simulate"]

POLICIES = ("max", "pow2", "oracle", "paged")


@dataclass(eq=False)
class _Live:
    req: WorkloadRequest
    stored: int = 0                       # tokens whose K/V is written (kept when preempted)
    start: int = -1                       # contiguous: chunk start
    asked: int = 0                        # contiguous: slots the policy reserved
    granted: int = 0                      # contiguous: slots the arena handed out
    table: BlockTable | None = None       # paged
    order: int = 0                        # admission counter (preemption picks the latest)
    running: bool = False

    def __post_init__(self) -> None:
        self.final = self.req.total_len


def reservation(policy: str, req: WorkloadRequest, max_seq_len: int) -> int:
    """Slots a contiguous ``policy`` reserves for ``req`` (see the module docstring)."""
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(max_seq_len, req.prompt_len + (1 << (req.output_len - 1).bit_length()))
    if policy == "oracle":
        return req.total_len
    raise ValueError(f"policy must be one of {POLICIES[:3]} for a reservation, got {policy!r}")


def simulate(
    workload: Sequence[WorkloadRequest],
    policy: str,
    arena_tokens: int,
    *,
    max_seq_len: int = 2048,
    block_size: int = 16,
    arena: str = "buddy",
    watermark: float = 0.01,
    max_steps: int = 1_000_000,
) -> WasteReport:
    """Serve ``workload`` under ``policy`` in an arena of ``arena_tokens`` slots; account waste.

    ``arena`` picks the contiguous allocator (``"buddy"`` or ``"first_fit"``; ignored for
    ``"paged"``); ``block_size`` is the page size for ``"paged"``, and paged admission keeps
    ``watermark`` of the blocks free (vLLM's default is 1%) so that running requests can
    grow without immediately preempting the newcomers. Deterministic. Raises
    ValueError for an unknown policy/arena, a non-positive size, or a request that could
    never be admitted (longer than ``max_seq_len`` or than the arena).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if arena not in ARENAS:
        raise ValueError(f"arena must be one of {sorted(ARENAS)}, got {arena!r}")
    for name, value in (("arena_tokens", arena_tokens), ("max_seq_len", max_seq_len),
                        ("block_size", block_size), ("max_steps", max_steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
    paged = policy == "paged"
    # A paged request must fit beside the watermark, or it could never be (re-)admitted.
    room = ((arena_tokens // block_size - math.ceil(watermark * (arena_tokens // block_size)))
            * block_size if paged else arena_tokens)
    for req in workload:
        if req.total_len > max_seq_len:
            raise ValueError(f"request {req.request_id} needs {req.total_len} tokens > "
                             f"max_seq_len {max_seq_len}")
        need = (-(-req.total_len // block_size) * block_size if paged
                else ARENAS[arena].granted_size(reservation(policy, req, max_seq_len)))
        if need > room:
            raise ValueError(f"request {req.request_id} can never fit: needs {need} slots, "
                             f"arena has room for {room}")

    pending = deque(sorted(workload, key=lambda r: (r.arrival, r.request_id)))
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    if paged:
        allocator = BlockAllocator(arena_tokens // block_size)
        watermark_blocks = math.ceil(watermark * (arena_tokens // block_size))
        pool = None
    else:
        pool = ARENAS[arena](arena_tokens)
    rows: dict[str, list[int]] = {c: [] for c in (*CATEGORIES, "waiting", "running")}
    preemptions = finished = generated = admitted = recomputed = 0
    step = 0

    def preempt_latest() -> None:
        nonlocal preemptions
        victim = running.pop()              # ``running`` is kept in admission order
        victim.running = False
        victim.table.release()
        victim.table = None                 # progress (stored) is kept: it is recomputed
        waiting.appendleft(victim)
        preemptions += 1

    while pending or waiting or running:
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        while pending and pending[0].arrival <= step:
            waiting.append(_Live(pending.popleft()))
        # 1. decode: every running request stores one more token, oldest admission first.
        preempted_before = preemptions
        for live in list(running):
            if not live.running:            # preempted earlier in this loop
                continue
            if paged:
                while live.running:
                    try:
                        live.table.grow(1)
                        break
                    except OutOfBlocks:
                        preempt_latest()
                if not live.running:
                    continue
            live.stored += 1
            generated += 1
        # 2. admit first come, first served; prefill writes the prompt (plus any recompute).
        #    Paged: no admission in a step that preempted, and keep a watermark of free blocks.
        preempted_now = preemptions > preempted_before
        while waiting:
            live = waiting[0]
            prefill = live.stored or live.req.prompt_len   # a preempted request recomputes
            if paged:
                if preempted_now or (len(allocator.free) - -(-prefill // block_size)
                                     < watermark_blocks):
                    break
                table = BlockTable(block_size, allocator)
                table.grow(prefill)
                live.table = table
                recomputed += live.stored           # 0 unless the request was preempted
            else:
                asked = reservation(policy, live.req, max_seq_len)
                got = pool.allocate(asked)
                if got is None:
                    break
                live.start, live.granted = got
                live.asked = asked
            waiting.popleft()
            live.stored = prefill
            live.order = admitted
            admitted += 1
            live.running = True
            running.append(live)
        # 3. account.
        counts = dict.fromkeys(CATEGORIES, 0)
        for live in running:
            final = live.final
            counts["used"] += live.stored
            if paged:
                tail = live.table.capacity - live.stored
                future = min(tail, final - live.stored)
                counts["reserved"] += future
                counts["internal"] += tail - future
            else:
                counts["reserved"] += final - live.stored
                counts["over_reserved"] += live.asked - final
                counts["internal"] += live.granted - live.asked
        allocated = sum(counts.values())
        free = arena_tokens - allocated
        if waiting and not paged:
            head_need = pool.granted_size(reservation(policy, waiting[0].req, max_seq_len))
            counts["external"] = sum(h for h in pool.holes() if h < head_need)
        counts["free"] = free - counts["external"]
        for c in CATEGORIES:
            rows[c].append(counts[c])
        rows["waiting"].append(len(waiting))
        rows["running"].append(len(running))
        # 4. finish.
        done = [live for live in running if live.stored >= live.final]
        if done:
            running[:] = [live for live in running if live.stored < live.final]
        for live in done:
            live.running = False
            if paged:
                live.table.release()
            else:
                pool.free(live.start)
            finished += 1
        step += 1

    trace = {k: np.asarray(v, dtype=np.int64) for k, v in rows.items()}
    saturated = trace["waiting"] > 0
    if not saturated.any():                     # never memory-bound: average over all steps
        saturated = trace["running"] > 0
    measured = int(saturated.sum())
    fractions = {c: float(trace[c][saturated].mean() / arena_tokens) for c in CATEGORIES}
    return WasteReport(
        policy=policy, arena="paged" if paged else arena, arena_tokens=arena_tokens,
        block_size=block_size if paged else None, steps=step, measured_steps=measured,
        fractions=fractions, preemptions=preemptions, finished=finished,
        generated_tokens=generated, recomputed_tokens=recomputed,
        mean_running=float(trace["running"][saturated].mean()),
        trace=trace,
    )


def compare_policies(
    workload: Sequence[WorkloadRequest],
    arena_tokens: int,
    *,
    policies: Sequence[str] = POLICIES,
    **kwargs,
) -> dict[str, WasteReport]:
    """:func:`simulate` each policy on the same workload and arena; policy -> report."""
    return {p: simulate(workload, p, arena_tokens, **kwargs) for p in policies}
