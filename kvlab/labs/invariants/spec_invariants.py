"""The spec's nine engine invariants (rule 11) as one named, first-class set.

:data:`SPEC_INVARIANTS` lists nine :class:`Invariant` records, each with a number, a short
name, a one-line statement and a checker. A checker reads an :class:`EngineView` (the
scheduler, its KV manager, the step just run, optional probes for speculation, grammars and
P/D) through public accessors only, plus an :class:`InvariantMonitor`'s memory of earlier steps
(invariants 3 and 5 are about histories, not single states). A broken invariant raises
:class:`InvariantViolation`, which names the invariant and the offending request or block.

Use::

    monitor = InvariantMonitor()
    monitor.before_execute(view, output)   # invariant 2 (what the step will write)
    monitor.check(view)                    # all nine, after the step

:func:`kvlab.labs.invariants.check_every_step` and the chaos run (:mod:`kvlab.labs.chaos.soak`) do
this
on every step through :class:`~kvlab.core.engine_core.EngineCore`'s observers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvlab.core.request import RequestStatus
from kvlab.core.step_records import SchedulerOutput
from kvlab.labs.invariants.structural import live_owners, request_blocks
from kvlab.labs.invariants.view import Broken, EngineView, require

__all__ = ["SPEC_INVARIANTS", "EngineView", "Invariant", "InvariantMonitor",
           "InvariantViolation", "invariant"]

S = RequestStatus
_TERMINAL = {"finished", "cancelled", "failed", "rejected"}


@dataclass(frozen=True)
class Invariant:
    """One invariant: ``number`` 1..9 (the issue's order), ``name``, ``statement`` (one line),
    ``check(view, monitor)`` raising :class:`Broken`."""

    number: int
    name: str
    statement: str
    check: Callable[[EngineView, InvariantMonitor], None] = field(repr=False)


class InvariantViolation(AssertionError):
    """An engine invariant is broken. ``invariant`` (the :class:`Invariant`), ``subject``
    (``"request r"``, ``"block 7"``, ``"engine"``), ``detail`` and ``step`` say where."""

    def __init__(self, invariant: Invariant, subject: str, detail: str, step: int = -1) -> None:
        self.invariant, self.subject, self.detail, self.step = invariant, subject, detail, step
        super().__init__(f"invariant {invariant.number} ({invariant.name}) broken at step "
                         f"{step}, {subject}: {detail}")



SPEC_INVARIANTS: list[Invariant] = []


def invariant(number: int, name: str, statement: str):
    """Decorator registering a checker in :data:`SPEC_INVARIANTS`."""
    def register(fn: Callable[[EngineView, InvariantMonitor], None]):
        SPEC_INVARIANTS.append(Invariant(number, name, statement, fn))
        return fn
    return register


@dataclass
class InvariantMonitor:
    """Runs a set of invariants after every step and remembers what the history checks need.

    ``invariants`` defaults to :data:`SPEC_INVARIANTS`; ``checks`` counts checks performed.
    """

    invariants: Sequence[Invariant] = field(default_factory=lambda: list(SPEC_INVARIANTS))
    checks: int = 0
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    reported: dict[str, int] = field(default_factory=dict)   # id -> times reported ended
    log_seen: int = -1                                         # highest event index read
    terminal_events: dict[str, int] = field(default_factory=dict)
    freed_events: dict[str, int] = field(default_factory=dict)
    last_step: int = -1
    kv_slack: dict[str, int] = field(default_factory=dict)

    def by_number(self, number: int) -> Invariant:
        return next(i for i in self.invariants if i.number == number)

    def before_execute(self, view: EngineView, output: SchedulerOutput) -> None:
        """Invariant 2 at the moment it matters: before the executor writes ``output``."""
        inv = next((i for i in self.invariants if i.number == 2), None)
        if inv is None:
            return
        try:
            check_writes(view, output)
        except Broken as b:
            raise InvariantViolation(inv, b.subject, b.detail, output.step) from None
        self.checks += 1

    def check(self, view: EngineView, only: Iterable[int] | None = None) -> None:
        """Run every invariant (or those numbered in ``only``); the first broken one raises."""
        wanted = None if only is None else set(only)
        for inv in self.invariants:
            if wanted is not None and inv.number not in wanted:
                continue
            try:
                inv.check(view, self)
            except Broken as b:
                raise InvariantViolation(inv, b.subject, b.detail, view.step) from None
            self.checks += 1

    def reset(self, kv_slack: dict[str, int] | None = None) -> None:
        """Start a new history (after crash recovery: the recovered log is read afresh and the
        requests restart from what was durable); the count of checks is kept. ``kv_slack``:
        blocks a resumed request holds beyond its durable computed tokens (written before the
        crash, not yet logged as progress); invariant 7 tolerates exactly those."""
        checks = self.checks
        self.__init__(self.invariants)
        self.checks = checks
        self.kv_slack = dict(kv_slack or {})

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the history of requests whose ids may be reused (recovery rebuilds them)."""
        for rid in request_ids:
            for memory in (self.outputs, self.preemptions, self.reported):
                memory.pop(rid, None)


# ----------------------------------------------------------------------------- 1
@invariant(1, "refcount", "every block's refcount equals the number of its live owners "
           "(request tables, the prefix cache), its owner set is exactly those owners, and a "
           "block is on the free list exactly when it has no owner and no fence")
def _refcounts(view: EngineView, monitor: InvariantMonitor) -> None:
    pool = view.kv.pool
    expected = live_owners(view.kv)
    for b in range(pool.num_blocks):
        owners = set(pool.owners(b))
        require(pool.refcount(b) == len(expected[b]), f"block {b}",
                f"refcount {pool.refcount(b)} but {len(expected[b])} live owners "
                f"{sorted(map(str, expected[b]))}")
        require(owners == expected[b], f"block {b}",
                f"owner set {sorted(map(str, owners))} != live owners "
                f"{sorted(map(str, expected[b]))}")
    free = pool.free_blocks()
    for b in range(pool.num_blocks):
        require((b in free) == (not expected[b] and pool.fence_count(b) == 0), f"block {b}",
                "free-list membership disagrees with owners/fence")


# ----------------------------------------------------------------------------- 2
def check_writes(view: EngineView, output: SchedulerOutput) -> None:
    """Before execution: every block a chunk writes is private to its request (copy-on-write
    happened), and each copy of the step is pending with both ends fenced."""
    pool = view.kv.pool
    pending = set(pool.pending_copies())
    bs = view.kv.block_size
    for src, dst in output.copies:
        require((src, dst) in pending, f"block {dst}",
                f"copy {src}->{dst} of step {output.step} is not pending before execution")
        for b in (src, dst):
            require(pool.fence_count(b) > 0, f"block {b}",
                    f"copy {src}->{dst} not fenced while in flight")
    for chunk in output.chunks:
        if chunk.num_tokens == 0:
            continue
        first = chunk.start_pos // bs
        last = (chunk.start_pos + getattr(chunk, "num_query_tokens", chunk.num_tokens) - 1) // bs
        # the tables the executor writes through: the chunk's deltas over the ones it was sent
        # (a hybrid manager's groups after the first come in group_deltas)
        tables = [view.kv.block_table(chunk.request_id)[:chunk.num_kept_blocks]
                  + list(chunk.new_block_ids)]
        if chunk.group_deltas:
            tables += [list(t[:kept]) + list(new) for t, (kept, new) in zip(
                view.kv.block_tables(chunk.request_id)[1:], chunk.group_deltas, strict=True)]
        for table in tables:
            for i in range(first, last + 1):
                b = table[i]
                owners = pool.owners(b)
                require(owners == {chunk.request_id}, f"block {b}",
                        f"request {chunk.request_id} writes positions of block {b} shared with "
                        f"{sorted(map(str, owners - {chunk.request_id}))}: not copied before "
                        "the partial write")


@invariant(2, "copy-on-write", "a shared block is copied before any partial write: every "
           "block a step writes (its tokens and lookahead slots) belongs to the writing request "
           "alone; each copy is pending and fenced at both ends until it is done, and a block "
           "with a pending copy is never free")
def _fences(view: EngineView, monitor: InvariantMonitor) -> None:
    pool = view.kv.pool
    touching: dict[int, int] = {}
    for src, dst in pool.pending_copies():
        for b in (src, dst):
            touching[b] = touching.get(b, 0) + 1
    for b in range(pool.num_blocks):
        require(pool.fence_count(b) == touching.get(b, 0), f"block {b}",
                f"fence count {pool.fence_count(b)} != {touching.get(b, 0)} pending copies")
        if touching.get(b):
            require(not pool.is_free(b), f"block {b}", "free while a copy into it is pending")


# ----------------------------------------------------------------------------- 3
@invariant(3, "idempotent end", "finish, cancel and resource release are idempotent: one "
           "terminal transition (never left again), one release that frees, one final report "
           "per request, and a request that has ended holds no KV")
def _idempotent(view: EngineView, monitor: InvariantMonitor) -> None:
    log = getattr(view.scheduler, "log", None)
    if log is not None:
        for event in log.events:
            if event.index <= monitor.log_seen:
                continue
            monitor.log_seen = event.index
            rid = event.request_id
            if event.kind == "transition" and event.data[1] in _TERMINAL:
                n = monitor.terminal_events[rid] = monitor.terminal_events.get(rid, 0) + 1
                require(n == 1, f"request {rid}", f"ended {n} times (second: "
                        f"{event.data[0]} -> {event.data[1]} at event {event.index})")
            elif event.kind == "transition" and event.data[0] in _TERMINAL:
                raise Broken(f"request {rid}", f"left terminal status {event.data[0]} for "
                             f"{event.data[1]} at event {event.index}")
            elif event.kind == "released" and event.data and event.data[0]:
                n = monitor.freed_events[rid] = monitor.freed_events.get(rid, 0) + 1
                require(n == 1 or monitor.terminal_events.get(rid, 0) == 0, f"request {rid}",
                        f"its KV was freed {n} times after it ended")
            elif event.kind == "transition" and event.data[1] in ("preempted", "running"):
                monitor.freed_events[rid] = 0
    if view.last is not None:
        for r in [*view.last.ended, *view.last.aborted]:
            n = monitor.reported[r.request_id] = monitor.reported.get(r.request_id, 0) + 1
            require(n == 1, f"request {r.request_id}", f"reported ended {n} times")
    for r in view.requests():
        if r.status.is_terminal:
            require(not view.kv.has(r.request_id), f"request {r.request_id}",
                    f"{r.status.value} but still holds KV")


# ----------------------------------------------------------------------------- 4
@invariant(4, "one state", "every request is in exactly one queue or execution state, the "
           "one its status names; a running request holds KV, a waiting one holds none")
def _one_state(view: EngineView, monitor: InvariantMonitor) -> None:
    sched = view.scheduler
    waiting, running, parked = list(sched.waiting), list(sched.running), view.parked()
    for name, queue in (("waiting", waiting), ("running", running), ("parked", parked)):
        dup = {r for r in queue if queue.count(r) > 1}
        require(not dup, f"request {sorted(dup)[0] if dup else ''}", f"twice in {name}")
    where: dict[str, list[str]] = {}
    for name, queue in (("waiting", waiting), ("running", running), ("parked", parked)):
        for rid in queue:
            where.setdefault(rid, []).append(name)
    for r in view.requests():
        rid, st = r.request_id, r.status
        places = where.pop(rid, [])
        if st.is_terminal:
            places = [*places, "ended"]
        require(len(places) == 1, f"request {rid}",
                f"status {st.value} but in {places or 'no queue'}")
        expect = {S.WAITING: "waiting", S.PREEMPTED: "waiting", S.RUNNING: "running"}.get(st)
        if expect is not None:
            require(places == [expect], f"request {rid}", f"{st.value} but in {places}")
        if st is S.RUNNING:
            require(view.kv.has(rid), f"request {rid}", "running but holds no KV")
        elif places != ["parked"]:
            require(not view.kv.has(rid), f"request {rid}", f"{st.value} but still holds KV")
    require(not where, f"request {sorted(where)[0] if where else ''}",
            "queued but unknown to the scheduler")


# ----------------------------------------------------------------------------- 5
@invariant(5, "monotonic counters", "token counters are monotonic and bounded: outputs only "
           "grow (earlier tokens never change) and never exceed max_tokens, computed tokens "
           "stay within the request's tokens, preemption counts and the step counter never go "
           "back")
def _monotonic(view: EngineView, monitor: InvariantMonitor) -> None:
    require(view.step >= monitor.last_step, "engine",
            f"step counter went back from {monitor.last_step} to {view.step}")
    monitor.last_step = view.step
    for r in view.requests():   # (overlap: the outputs of steps in flight are not yet known)
        rid, out = r.request_id, tuple(r.known_output_token_ids)
        before = monitor.outputs.get(rid, ())
        if out[:len(before)] != before:
            pairs = enumerate(zip(before, out, strict=False))
            diff = next((i for i, (a, b) in pairs if a != b), len(out))
            raise Broken(f"request {rid}", f"output shrank or changed: had {len(before)} "
                         f"tokens, now {len(out)}; first difference at position {diff}")
        monitor.outputs[rid] = out
        require(r.num_preemptions >= monitor.preemptions.get(rid, 0), f"request {rid}",
                "preemption count went back")
        monitor.preemptions[rid] = r.num_preemptions
        require(0 <= r.num_computed_tokens <= r.num_tokens, f"request {rid}",
                f"computed {r.num_computed_tokens} of {r.num_tokens} tokens")
        n = len(r.output_token_ids)
        require(n <= r.max_tokens, f"request {rid}", f"{n} outputs > max_tokens {r.max_tokens}")


# ----------------------------------------------------------------------------- 6
@invariant(6, "scope isolation", "a cached block is only ever reused within its scope (model "
           "version, tokenizer, adapter, dtype, security domain, ...) and for the same tokens, "
           "and a request's table is registered under the request's own scope")
def _scopes(view: EngineView, monitor: InvariantMonitor) -> None:
    kv, cache = view.kv, view.kv.prefix_cache
    if cache is None:
        return
    bs = kv.block_size
    for r in view.requests():
        rid = r.request_id
        if not kv.has(rid):
            continue
        same = tuple(kv.scope_of(rid)) == tuple(r.scope)
        require(same, f"request {rid}",
                "KV table registered under another scope than the request's")
        tokens = r.all_token_ids
        tables = (kv.block_tables(rid) if isinstance(kv, HybridKVCacheManager)
                  else (kv.block_table(rid),))
        for i, b in ((i, b) for table in tables for i, b in enumerate(table) if b is not None):
            node = cache.node_of(b)
            if node is None:
                continue
            root_scope = node.scope
            require(root_scope == tuple(r.scope), f"block {b}",
                    f"request {rid} uses block {b} cached under another scope "
                    f"(domain {_domain(root_scope)!r} vs {_domain(r.scope)!r})")
            want = tuple(tokens[i * bs:(i + 1) * bs])
            if len(want) == bs:
                require(tuple(node.chunk) == want, f"block {b}",
                        f"request {rid} reuses block {b} cached for other tokens (a key "
                        "collision)")


def _domain(scope: Any) -> str:
    try:
        return str(dict(scope).get("security_domain", "?"))
    except (TypeError, ValueError):
        return "?"


# ----------------------------------------------------------------------------- 7
@invariant(7, "speculative rollback", "after a speculative rejection, KV and grammar state "
           "have rolled back to the accepted prefix (random draws are keyed by position, so "
           "none roll back): a running request holds no more blocks than its computed tokens "
           "need (plus its step's slack), and, where the engine adds its grammar probe, each "
           "grammar has accepted exactly its request's output tokens")
def _rollback(view: EngineView, monitor: InvariantMonitor) -> None:
    kv = view.kv
    for r in view.requests():
        rid = r.request_id
        if r.status is S.RUNNING and kv.has(rid):
            held, need = len(kv.block_table(rid)), -(-r.num_computed_tokens // kv.block_size)
            require(need <= held <= need + monitor.kv_slack.get(rid, 0), f"request {rid}",
                    f"holds {held} blocks for {r.num_computed_tokens} computed tokens "
                    f"(needs {need}): the rejected tail was not given back")
    for probe in view.rollback_probes:
        for subject, problem in probe():
            raise Broken(subject, problem)


# ----------------------------------------------------------------------------- 8
@invariant(8, "P/D install", "a P/D install never accepts a partial, stale or incompatible "
           "descriptor")
def _installs(view: EngineView, monitor: InvariantMonitor) -> None:
    for rid, entry, problem in view.installs:
        require(not problem, f"request {rid}", f"installed entry {entry!r} although {problem}")


# ----------------------------------------------------------------------------- 9
@invariant(9, "admission", "admission reserves KV for the output limit (production 'reserve'), "
           "and overload is explicit: a rejected or failed request has a reason, and no step "
           "schedules nothing while requests wait and nothing runs")
def _admission(view: EngineView, monitor: InvariantMonitor) -> None:
    sched, kv = view.scheduler, view.kv
    for r in view.requests():
        if r.status in (S.REJECTED, S.FAILED):
            require(bool(r.status_message), f"request {r.request_id}",
                    f"{r.status.value} without a reason")
    cfg = getattr(sched, "config", None)
    reserve = getattr(cfg, "admission", None) == "reserve" and hasattr(sched, "reserved_blocks")
    last = view.last
    if reserve and last is not None and last.output.admitted and not view.withheld:
        claims = sum(_claims(kv, r) for r in view.requests()
                     if r.status is S.RUNNING and kv.has(r.request_id))
        allocatable = kv.num_allocatable_blocks()
        shared = _shared_claims(view)
        require(claims <= allocatable + shared, "engine",
                f"running requests may still claim {claims} blocks but only {allocatable} are "
                f"allocatable after admitting {list(last.output.admitted)}")
    if last is not None and last.output.is_empty and not view.parked():
        live = [r for r in view.requests() if not r.status.is_terminal]
        stalled = live and not sched.running and not kv.pool.pending_copies()
        if stalled and not view.withheld:
            rid = live[0].request_id
            raise Broken(f"request {rid}", f"{len(live)} requests wait, nothing runs and the "
                         "step scheduled nothing: a silent stall")


def _claims(kv: Any, r: Any) -> int:
    """Blocks running request ``r`` may still claim to reach its output limit: the blocks its
    table lacks; with a hybrid manager, what growing every group's table there takes net of
    the blocks its windows release on the way (the manager's count)."""
    if isinstance(kv, HybridKVCacheManager):
        end = max(r.max_kv_slots, r.num_computed_tokens)
        return kv.blocks_needed(r.request_id, end, write_from=r.num_computed_tokens)
    return max(0, kv.blocks_for(r.max_kv_slots) - len(request_blocks(kv, r.request_id)))


def _shared_claims(view: EngineView) -> int:
    """Blocks a request may claim that another running request already computed (prefix-cache
    duplicates: the documented exception of 'reserve'), counted generously."""
    kv = view.kv
    if kv.prefix_cache is None:
        return 0
    return sum(1 for b in kv.prefix_cache.indexed_blocks() if kv.pool.refcount(b) > 2)
