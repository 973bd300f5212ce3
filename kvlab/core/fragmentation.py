"""Where KV memory goes: contiguous pre-reservation vs paged allocation, measured over time.

This module reproduces, at small scale and in simulation, the measurement behind Figure 2 of
the PagedAttention paper (Kwon et al., SOSP 2023): in serving systems that reserve one
contiguous chunk per request, only about 20–38% of KV memory holds token states; with
paged allocation 96% does (a waste under 4%).

**The simulation.** One KV arena of ``arena_tokens`` token slots serves a seeded workload
(:func:`sharegpt_like_workload`). Time advances in engine steps; in each step every running
request writes the K/V of one more token (decode), then waiting requests are admitted first
come, first served, and write their whole prompt (prefill). A request that has stored
``prompt + output`` tokens finishes at the end of that step and frees its memory. Policies:

* ``"max"``: reserve ``max_seq_len`` slots per request (Orca-Max style),
* ``"pow2"``: reserve ``prompt + next_pow2(output)`` (knows the output within 2×),
* ``"oracle"``: reserve exactly ``prompt + output`` (knows the output length),
* ``"paged"``: :class:`~kvlab.core.paging.BlockTable` over the reference
  :class:`~kvlab.reference.BlockAllocator`, one block at a time; when a decode finds no free
  block, the most recently admitted request is preempted (blocks freed, recomputed later).

Contiguous reservations come from a :class:`BuddyArena` (power-of-two chunks, as the
paper's Orca baselines) or a :class:`FirstFitArena` (exact sizes, holes coalesce), so
external fragmentation arises from real holes left by requests finishing at different times.

**The accounting**, in token slots, at every step (they sum to ``arena_tokens``):

* ``used``: slots holding a token's K/V now (the paper's "token states");
* ``reserved``: allocated slots the owner will still write (the paper's "reservation");
* ``over_reserved``: reserved by the policy beyond the request's final length, never written;
* ``internal``: allocation-unit rounding never written: the buddy's power-of-two round-up, or
  the unused tail of a request's last block (``over_reserved + internal`` is the paper's
  "internal fragmentation");
* ``external``: free slots in holes too small for the request waiting at the head of the
  queue (0 when nothing waits, and always 0 for paging, where any free block serves);
* ``free``: every other free slot.

Averages are taken over the *saturated* steps, those where a request is left waiting after
admission, i.e. memory is the bottleneck, which is the regime the paper's Figure 2 describes.

**What differs from the paper.** We simulate; no model runs, so the step is a unit of time
and throughput is measured in tokens per step, not per second. Lengths are synthetic
(log-normal, means chosen near the ShareGPT statistics the paper reports), not ShareGPT
itself. The arena is one pool of token slots with no per-layer layout, and paged admission
has no watermark. The paper's Orca baselines are its own re-implementation; ours are
simpler still. The *shape* of the result (contiguous 60–80% waste, paged a few percent) is
what we reproduce; exact percentages depend on the workload and arena size.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlab.reference import BlockAllocator

from .paging import BlockTable

CATEGORIES = ("used", "reserved", "over_reserved", "internal", "external", "free")
POLICIES = ("max", "pow2", "oracle", "paged")


# ------------------------------------------------------------------------------------------
# Workload
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: arrival step and its true prompt and output lengths."""

    request_id: int
    arrival: int
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        for name in ("arrival", "prompt_len", "output_len"):
            value = getattr(self, name)
            low = 0 if name == "arrival" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"WorkloadRequest.{name} must be an int >= {low}, got {value!r}")

    @property
    def total_len(self) -> int:
        """Tokens whose K/V the request stores by the time it finishes."""
        return self.prompt_len + self.output_len


def sharegpt_like_workload(
    num_requests: int,
    seed: int = 0,
    *,
    prompt_mean: float = 161.0,
    output_mean: float = 338.0,
    sigma: float = 1.0,
    max_seq_len: int = 2048,
    arrival_rate: float | None = None,
) -> list[WorkloadRequest]:
    """A seeded synthetic chat workload with ShareGPT-like, heavy-tailed lengths.

    Prompt and output lengths are drawn independently from log-normal distributions with
    shape ``sigma`` and means ``prompt_mean`` / ``output_mean`` before clipping (161 and 338
    tokens by default, close to the ShareGPT means reported in the PagedAttention paper).
    Prompts are clipped to ``[1, max_seq_len // 2]`` and outputs to
    ``[1, max_seq_len - prompt]`` so every request fits in ``max_seq_len``.
    Arrivals: all at step 0 when ``arrival_rate`` is None (an offline batch), else a Poisson
    process of ``arrival_rate`` requests per step. Same arguments, same workload.
    """
    if not isinstance(num_requests, int) or num_requests <= 0:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    for name, value in (("prompt_mean", prompt_mean), ("output_mean", output_mean),
                        ("sigma", sigma)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ValueError(f"arrival_rate must be positive or None, got {arrival_rate!r}")
    rng = np.random.default_rng(seed)

    def lognormal(mean: float) -> np.ndarray:
        return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, num_requests)

    prompts = np.clip(np.rint(lognormal(prompt_mean)), 1, max_seq_len // 2).astype(np.int64)
    outputs = np.clip(np.rint(lognormal(output_mean)), 1, max_seq_len - prompts)
    if arrival_rate is None:
        arrivals = np.zeros(num_requests, dtype=np.int64)
    else:
        gaps = rng.exponential(1.0 / arrival_rate, num_requests)
        arrivals = np.floor(np.cumsum(gaps)).astype(np.int64)
    return [
        WorkloadRequest(i, int(a), int(p), int(o))
        for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs.astype(np.int64), strict=True))
    ]


# ------------------------------------------------------------------------------------------
# Contiguous arenas
# ------------------------------------------------------------------------------------------


class FirstFitArena:
    """Contiguous allocator over ``size`` slots: first hole large enough wins; frees coalesce.

    ``allocate(n)`` returns ``(start, granted)`` with ``granted == n`` or None when no hole
    of ``n`` slots exists; ``free(start)`` returns the chunk. Holes are kept sorted by start.
    """

    name = "first_fit"

    @staticmethod
    def granted_size(n: int) -> int:
        """Slots a request for ``n`` slots occupies (first fit grants exactly ``n``)."""
        return n

    def __init__(self, size: int):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"arena size must be a positive int, got {size!r}")
        self.size = size
        self._starts: list[int] = [0]        # hole starts, sorted
        self._lengths: dict[int, int] = {0: size}
        self._chunks: dict[int, int] = {}    # start -> granted length

    def allocate(self, n: int) -> tuple[int, int] | None:
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        for start in self._starts:
            length = self._lengths[start]
            if length >= n:
                self._starts.remove(start)
                del self._lengths[start]
                if length > n:
                    bisect.insort(self._starts, start + n)
                    self._lengths[start + n] = length - n
                self._chunks[start] = n
                return start, n
        return None

    def free(self, start: int) -> None:
        length = self._chunks.pop(start)
        i = bisect.bisect_left(self._starts, start)
        # merge with the following hole
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths.pop(self._starts.pop(i))
        # merge with the preceding hole
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            self._lengths[self._starts[i - 1]] += length
        else:
            self._starts.insert(i, start)
            self._lengths[start] = length

    def holes(self) -> list[int]:
        """Lengths of the free holes, in address order."""
        return [self._lengths[s] for s in self._starts]


class BuddyArena:
    """Binary buddy allocator over ``size`` slots: chunks are powers of two, aligned.

    A request for ``n`` slots is rounded up to ``2**ceil(log2 n)`` (the round-up is internal
    fragmentation); a freed chunk merges with its buddy whenever the buddy is free too. An
    arena that is not a power of two is covered by aligned power-of-two top chunks.
    """

    name = "buddy"

    def __init__(self, size: int):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"arena size must be a positive int, got {size!r}")
        self.size = size
        self._free: dict[int, set[int]] = {}   # order -> starts of free chunks
        self._chunks: dict[int, int] = {}      # start -> order
        start = 0
        while start < size:                     # greedy aligned power-of-two cover
            order = (size - start).bit_length() - 1
            while start % (1 << order):
                order -= 1
            self._free.setdefault(order, set()).add(start)
            start += 1 << order
        self._top_order = {s: o for o, starts in self._free.items() for s in starts}
        self._top_starts = sorted(self._top_order)

    @staticmethod
    def granted_size(n: int) -> int:
        """Slots a request for ``n`` slots occupies: ``n`` rounded up to a power of two."""
        return 1 << max(0, (n - 1).bit_length())

    def allocate(self, n: int) -> tuple[int, int] | None:
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        want = max(0, (n - 1).bit_length())
        orders = sorted(o for o, s in self._free.items() if s and o >= want)
        if not orders:
            return None
        order = orders[0]
        start = min(self._free[order])
        self._free[order].discard(start)
        while order > want:                      # split, keep the upper half free
            order -= 1
            self._free.setdefault(order, set()).add(start + (1 << order))
        self._chunks[start] = order
        return start, 1 << order

    def free(self, start: int) -> None:
        order = self._chunks.pop(start)
        top_order = self._top_order[self._top_start(start)]
        while order < top_order:
            buddy = start ^ (1 << order)         # top chunks are aligned: XOR finds the buddy
            if buddy not in self._free.get(order, ()):
                break
            self._free[order].discard(buddy)
            start = min(start, buddy)
            order += 1
        self._free.setdefault(order, set()).add(start)

    def _top_start(self, start: int) -> int:
        """Start of the top-level chunk containing ``start``."""
        i = bisect.bisect_right(self._top_starts, start) - 1
        return self._top_starts[i]

    def holes(self) -> list[int]:
        """Lengths of the free chunks (buddies that cannot merge count separately)."""
        return [1 << o for o, starts in sorted(self._free.items()) for _ in starts]


ARENAS = {"buddy": BuddyArena, "first_fit": FirstFitArena}


# ------------------------------------------------------------------------------------------
# Simulation
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WasteReport:
    """Mean share of the arena in each category over the saturated steps, plus run facts.

    ``fractions[c]`` for ``c`` in :data:`CATEGORIES` sum to 1. ``trace`` holds per-step slot
    counts (``trace[c][t]``, int64) for every step of the run and ``trace["waiting"][t]``,
    the queue length after admission; the categories sum to ``arena_tokens`` at every step.
    """

    policy: str
    arena: str                  # "buddy", "first_fit" or "paged"
    arena_tokens: int
    block_size: int | None
    steps: int                  # steps until the last request finished (makespan)
    measured_steps: int         # saturated steps the fractions average over
    fractions: dict[str, float]
    preemptions: int
    finished: int
    generated_tokens: int
    mean_running: float         # mean number of running requests over the measured steps
    trace: dict[str, np.ndarray] = field(repr=False, compare=False)

    @property
    def token_states(self) -> float:
        """Share of the arena holding K/V of tokens (the paper's Figure 2 quantity)."""
        return self.fractions["used"]

    @property
    def waste(self) -> float:
        """Share wasted: reserved + over-reserved + internal + external (free excluded)."""
        f = self.fractions
        return f["reserved"] + f["over_reserved"] + f["internal"] + f["external"]

    @property
    def tokens_per_step(self) -> float:
        """Output tokens generated per step over the whole run (a throughput proxy)."""
        return self.generated_tokens / self.steps


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
    preemptions = finished = generated = admitted = 0
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
                    except MemoryError:
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
        generated_tokens=generated, mean_running=float(trace["running"][saturated].mean()),
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


def waste_table(reports: dict[str, WasteReport]) -> str:
    """A fixed-width table of the reports: percentages of the arena per category."""
    head = f"{'policy':<8}" + "".join(f"{c:>14}" for c in CATEGORIES) + f"{'waste':>9}"
    lines = [head]
    for name, rep in reports.items():
        cells = "".join(f"{100 * rep.fractions[c]:>13.1f}%" for c in CATEGORIES)
        lines.append(f"{name:<8}{cells}{100 * rep.waste:>8.1f}%")
    return "\n".join(lines)
