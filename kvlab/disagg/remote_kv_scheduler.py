"""RemoteKVScheduler: prefill/decode disaggregation inside the one step loop.

It wraps any kvlab scheduler (it *is* the :class:`~kvlab.core.interfaces.Scheduler` that
:class:`~kvlab.core.engine_core.EngineCore` steps) and adds the two roles of a KV-transfer
engine, in the shape of vLLM's KV connector:

**Producer** (``produce``). When a chunk completes a request's prompt, before the step's
update can release anything, the request's full blocks (``floor(P / block_size)`` of them) are
handed to the :class:`KVExporter`, which reads the tensors and writes an entry.

**Consumer** (``consume``). A new request whose prompt has at least one full block beyond the
last token is **parked** in status ``WAITING_FOR_REMOTE_KV``: the wrapped scheduler does not see
it, and it holds no KV. At the start of every ``schedule()`` the wrapper fetches the entries of
parked requests from the :class:`KVSource` and, for each delivery:

1. checks it (:func:`~kvlab.disagg.entry.check_delivery`: header seal, the reference
   ``validate_kv_descriptor`` against this engine's own expectation, length, SHA-256) and
   decodes it (:meth:`KVWriter.decode`) before touching any state;
2. journals ``begin``, allocates a table for the **operation** ``"<request>@<entry>"``
   (``kv.admit``; blocks already in the prefix cache are reused, not rewritten), journals
   ``allocated``; writes the payload into the fresh blocks (:meth:`KVWriter.write`), journals
   ``written``; commits the table to the prefix cache, journals ``committed``;
3. only then moves the request to WAITING and hands it to the wrapped scheduler, whose normal
   admission finds the installed prefix (a prefix-cache hit) and computes the rest of the
   prompt (< one block, at least the last token) before decoding.

The operation keeps its hold on the blocks until the wrapped scheduler has admitted the request
(so nothing can evict them in between), then releases it (journal ``released``). An operation
id is installed at most once: a duplicate delivery finds the request no longer parked, or the
id done, and installs nothing. A delivery that fails a check is never installed: the request
recomputes its prompt locally (``on_failure="recompute"``) or fails with the reason
(``"fail"``); no entry within ``timeout_s`` counts as ``missing``. Every decision is counted by
kind in :attr:`RemoteKVScheduler.stats` and kept in :attr:`RemoteKVScheduler.decisions`.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.request import Lifecycle, RequestStatus, RuntimeRequest
from kvlab.core.step_records import SchedulerOutput
from kvlab.disagg.entry import Delivery, check_delivery, entry_key, make_descriptor, token_ids_hash
from kvlab.disagg.install_journal import InstallJournal
from kvlab.disagg.interfaces import (
    KVExporter,
    KVSource,
    KVWriter,
    RemoteKVPolicy,
    TransferDecision,
    scope_domain,
)

__all__ = ["KVExporter", "KVSource", "KVWriter", "RemoteKVPolicy", "RemoteKVScheduler",
           "TransferDecision", "scope_domain"]

S = RequestStatus
_MEMORY = 4096          # bounded memories: aborted keys, installed keys, decisions


@dataclass
class _Parked:
    request: RuntimeRequest
    key: str
    target: int                    # tokens to install: floor((P - 1) / block_size) full blocks
    since: float
    expected: dict[str, Any]
    pending: list[Delivery] = field(default_factory=list)   # valid, waiting for free blocks


class RemoteKVScheduler:
    """Adds the producer and consumer roles to ``inner`` (see the module docstring)."""

    def __init__(self, inner: Any, policy: RemoteKVPolicy, *, source: KVSource | None = None,
                 writer: KVWriter | None = None, exporter: KVExporter | None = None,
                 journal: InstallJournal | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy.consume and (source is None or writer is None):
            raise ValueError("a consumer needs a KV source and a KV writer")
        if policy.produce and exporter is None:
            raise ValueError("a producer needs a KV exporter")
        self.inner, self.policy = inner, policy
        self.kv = inner.kv
        self.source, self.writer, self.exporter = source, writer, exporter
        self.journal = journal if journal is not None else InstallJournal()
        self.clock = clock
        # parked requests' changes go to the wrapped scheduler's log, if it keeps one
        self.lifecycle = Lifecycle(inner.log, step=lambda: self.inner.step_count)
        self.stats: Counter[str] = Counter()
        self.decisions: deque[TransferDecision] = deque(maxlen=_MEMORY)
        self._parked: dict[str, _Parked] = {}
        self._own: dict[str, RuntimeRequest] = {}      # parked, or ended while parked
        self._ended: list[RuntimeRequest] = []          # ended while parked, not yet reported
        self._held: dict[str, str] = {}                 # op id -> request id (op holds blocks)
        self._done_ops: set[str] = set()
        self._aborted_keys: dict[str, str] = {}         # key -> request id, oldest first
        self._aborted_at: dict[str, float] = {}         # key -> when (watched for timeout_s)
        self._installed_keys: dict[str, str] = {}
        self._exported: dict[str, None] = {}

    # ------------------------------------------------------------------ delegation
    def __getattr__(self, name: str) -> Any:   # public attributes of the wrapped scheduler
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def parked(self) -> tuple[str, ...]:
        """Ids of the requests in WAITING_FOR_REMOTE_KV, in arrival order."""
        return tuple(self._parked)

    @property
    def held_ops(self) -> dict[str, str]:
        """Install operations still holding their blocks: op id -> request id."""
        return dict(self._held)

    def _decide(self, rid: str, kind: str, action: str, **kw: Any) -> None:
        self.stats[kind] += 1
        self.decisions.append(TransferDecision(self.inner.step_count, rid, kind, action, **kw))

    # ------------------------------------------------------------------ requests
    def add_request(self, request: RuntimeRequest) -> None:
        if not self.policy.consume:
            return self.inner.add_request(request)
        if not isinstance(request, RuntimeRequest):
            raise TypeError(f"expected a RuntimeRequest, got {type(request).__name__}")
        request.check_new()
        rid = request.request_id
        if rid in self._own or self.inner.find_request(rid) is not None:
            raise ValueError(f"duplicate request id {rid!r}")
        bs = self.kv.block_size
        target = (request.num_prompt_tokens - 1) // bs * bs
        prompt = request.prompt_token_ids
        if target == 0 or self.kv.blocks_for(request.max_kv_slots) > self.kv.num_blocks:
            return self.inner.add_request(request)   # nothing worth fetching, or never fits
        if self.kv.lookup(request.scope, prompt) >= target:
            self._decide(rid, "local_hit", "recompute", detail="prefix cache covers it")
            return self.inner.add_request(request)
        domain = scope_domain(request.scope)
        expected = make_descriptor(rid, prompt, domain, self.policy.model_fields)
        expected.pop("request_id")                   # entries are found by content, not id
        key = entry_key(token_ids_hash(prompt), domain)
        self.lifecycle.add(request)
        self.lifecycle.transition(request, S.WAITING_FOR_REMOTE_KV)
        self._own[rid] = request
        self._parked[rid] = _Parked(request, key, target, self.clock(), expected)
        self.decisions.append(TransferDecision(self.inner.step_count, rid, "parked", "park"))
        return None

    def abort_request(self, request_id: str) -> RuntimeRequest | None:
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            self.lifecycle.cancel(parked.request)
            self._remember(self._aborted_keys, parked.key, request_id)
            self._aborted_at[parked.key] = self.clock()
            return parked.request
        if request_id in self._own:
            return self._own[request_id]
        request = self.inner.abort_request(request_id)
        self._release_ops()
        return request

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        if self._parked or self._aborted_keys:
            self._poll()
        output = self.inner.schedule()
        self._release_ops()
        return output

    def update_from_output(self, output: SchedulerOutput,
                           sampled: Mapping[str, int]) -> list[RuntimeRequest]:
        if self.policy.produce:
            self._export(output)
        ended = self.inner.update_from_output(output, sampled)
        mine, self._ended = self._ended, []
        return mine + ended

    def fail_step(self, output: SchedulerOutput, message: str) -> list[RuntimeRequest]:
        return self.inner.fail_step(output, message)

    # ------------------------------------------------------------------ consumer
    def _poll(self) -> None:
        keys = list(dict.fromkeys([p.key for p in self._parked.values()]
                                  + list(self._aborted_keys)))
        retry = [(p, d) for p in self._parked.values() for d in p.pending]
        for p, _ in retry:
            p.pending = []
        for p, d in retry:
            if p.request.request_id in self._parked:
                self._try_install(p, d)
        deliveries = self.source.fetch(keys)  # type: ignore[union-attr]
        if (not deliveries and self._parked and not retry
                and not self.inner.has_unfinished_requests()):
            self.source.wait(0.005)  # type: ignore[union-attr]  # idle: wait, do not spin
            deliveries = self.source.fetch(keys)  # type: ignore[union-attr]
        for d in deliveries:
            self._offer(d)
        now = self.clock()
        for key in [k for k in self._aborted_keys   # stop watching for late deliveries
                    if now - self._aborted_at.get(k, now) > self.policy.timeout_s]:
            del self._aborted_keys[key]
        self._aborted_at = {k: self._aborted_at[k] for k in self._aborted_keys
                            if k in self._aborted_at}
        for p in list(self._parked.values()):
            if not p.pending and now - p.since >= self.policy.timeout_s:
                self._refuse(p, "missing", f"no KV entry within {self.policy.timeout_s} s")

    def _offer(self, d: Delivery) -> None:
        key = d.key or d.meta.get("key")
        targets = [p for p in self._parked.values() if p.key == key]
        if not targets:
            if key in self._aborted_keys:
                self._decide(self._aborted_keys.pop(key), "after_abort", "discard",
                             entry_id=d.entry_id)
            elif key in self._installed_keys:
                self._decide(self._installed_keys[key], "duplicate", "discard",
                             entry_id=d.entry_id)
            else:
                self._decide("?", check_delivery(d, {}) or "unclaimed", "discard",
                             entry_id=d.entry_id)
            return
        for p in targets:
            self._try_install(p, d)

    def _try_install(self, p: _Parked, d: Delivery) -> None:
        request, rid = p.request, p.request.request_id
        op = f"{rid}@{d.entry_id}"
        if op in self._done_ops:
            return self._decide(rid, "duplicate", "discard", entry_id=d.entry_id)
        kind = check_delivery(d, p.expected)
        if kind is not None:
            return self._refuse(p, kind, f"entry {d.entry_id}: {kind}", d.entry_id)
        bs, prompt, scope = self.kv.block_size, request.prompt_token_ids, request.scope
        tokens = min(d.num_tokens, p.target) // bs * bs
        cached = self.kv.lookup(scope, prompt)
        if tokens == 0 or cached >= tokens:
            self._decide(rid, "local_hit" if tokens else "too_short", "recompute",
                         entry_id=d.entry_id)
            return self._unpark(p)
        try:
            decoded = self.writer.decode(d, tokens)  # type: ignore[union-attr]
        except ValueError as error:
            return self._refuse(p, "corrupt_payload", f"entry {d.entry_id}: {error}", d.entry_id)
        rest = self.kv.blocks_for(request.max_kv_slots) - tokens // bs
        need = self.kv.blocks_needed(None, tokens, scope, prompt) + max(0, rest)
        if need > self.kv.num_allocatable_blocks():
            p.pending.append(d)
            return self._decide(rid, "no_blocks", "wait", entry_id=d.entry_id)
        journal = self.journal
        journal.append("begin", op, (rid, tokens))
        try:
            got = self.kv.admit(op, scope, prompt, tokens)
        except OutOfBlocks:
            journal.append("released", op, ("out of blocks",))
            p.pending.append(d)
            return self._decide(rid, "no_blocks", "wait", entry_id=d.entry_id)
        table = self.kv.block_table(op)
        journal.append("allocated", op, (tuple(table), got))
        self.writer.write(decoded, table[got // bs:], got)  # type: ignore[union-attr]
        journal.append("written", op)
        self.kv.commit(op, prompt[:tokens])
        journal.append("committed", op)
        self._held[op] = rid
        self._done_ops.add(op)
        self._remember(self._installed_keys, p.key, rid)
        self._decide(rid, "installed", "install", entry_id=d.entry_id, tokens=tokens,
                     detail=f"{tokens - got} tokens written, {got} already cached")
        self._unpark(p)

    def _refuse(self, p: _Parked, kind: str, detail: str, entry_id: str = "") -> None:
        request = p.request
        if self.policy.on_failure == "fail":
            del self._parked[request.request_id]
            self.lifecycle.fail(request, f"remote KV refused: {detail}")
            self._ended.append(request)
            return self._decide(request.request_id, kind, "fail", entry_id=entry_id,
                                detail=detail)
        self._decide(request.request_id, kind, "recompute", entry_id=entry_id, detail=detail)
        self.stats["recomputed"] += 1
        self._unpark(p)

    def _unpark(self, p: _Parked) -> None:
        rid = p.request.request_id
        del self._parked[rid]
        del self._own[rid]
        self.lifecycle.transition(p.request, S.WAITING)
        self.inner.add_request(p.request)

    def _release_ops(self) -> None:
        """Drop the hold of every operation whose request left WAITING (admitted or ended)."""
        for op, rid in list(self._held.items()):
            request = self.inner.find_request(rid)
            if request is None or request.status is not S.WAITING:
                del self._held[op]
                self.kv.free(op)
                self.journal.append("released", op)

    @staticmethod
    def _remember(memory: dict[str, str], key: str, rid: str) -> None:
        memory.pop(key, None)
        memory[key] = rid
        while len(memory) > _MEMORY:
            del memory[next(iter(memory))]

    # ------------------------------------------------------------------ producer
    def _export(self, output: SchedulerOutput) -> None:
        bs = self.kv.block_size
        for chunk in output.chunks:
            rid = chunk.request_id
            request = self.inner.find_request(rid)
            if (request is None or request.output_token_ids or rid in self._exported
                    or chunk.start_pos + chunk.num_tokens != request.num_prompt_tokens):
                continue
            self._remember(self._exported, rid, None)  # type: ignore[arg-type]
            tokens = request.num_prompt_tokens // bs * bs
            if tokens == 0:
                self._decide(rid, "export_too_short", "discard")
                continue
            blocks = self.kv.block_table(rid)[:tokens // bs]
            self.exporter.export(request, blocks, tokens)  # type: ignore[union-attr]
            self._decide(rid, "exported", "export", tokens=tokens)

    # ------------------------------------------------------------------ registry
    def has_unfinished_requests(self) -> bool:
        return bool(self._parked or self._ended or self.inner.has_unfinished_requests())

    def get_request(self, request_id: str) -> RuntimeRequest:
        own = self._own.get(request_id)
        return own if own is not None else self.inner.get_request(request_id)

    def find_request(self, request_id: str) -> RuntimeRequest | None:
        own = self._own.get(request_id)
        return own if own is not None else self.inner.find_request(request_id)

    def requests(self) -> Sequence[RuntimeRequest]:
        return list(self.inner.requests()) + list(self._own.values())

    def can_forget(self, request_id: str) -> bool:
        own = self._own.get(request_id)
        if own is not None:
            return own.status.is_terminal and not any(r is own for r in self._ended)
        return self.inner.can_forget(request_id)

    def forget(self, request_id: str) -> RuntimeRequest:
        if request_id in self._own:
            if not self.can_forget(request_id):
                raise ValueError(f"request {request_id!r} is parked or not yet reported")
            return self._own.pop(request_id)
        return self.inner.forget(request_id)

    def check_parked(self) -> None:
        """AssertionError unless: a parked request is WAITING_FOR_REMOTE_KV, unknown to the
        wrapped scheduler and holds no KV; every KV table belongs to a request of the wrapped
        scheduler or to a held operation whose request waits for admission (the wrapped
        scheduler's own invariants: :func:`kvlab.labs.invariants.check_scheduler`)."""
        for rid, p in self._parked.items():
            assert self._own.get(rid) is p.request, f"parked {rid} not registered"
            assert p.request.status is S.WAITING_FOR_REMOTE_KV, \
                f"parked {rid} is {p.request.status}"
            assert self.inner.find_request(rid) is None, f"parked {rid} also in the scheduler"
            assert not self.kv.has(rid), f"parked {rid} holds KV"
        for rid, request in self._own.items():
            assert rid in self._parked or request.status.is_terminal, f"{rid} lost"
        owners = {r.request_id for r in self.inner.requests()} | set(self._held)
        stray = set(self.kv.requests()) - owners
        assert not stray, f"KV tables nobody owns: {sorted(stray)}"
        for op, rid in self._held.items():
            request = self.inner.find_request(rid)
            assert request is not None and request.status is S.WAITING, \
                f"operation {op} holds blocks for {rid}, which is not waiting"
