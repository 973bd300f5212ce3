"""A torch-free producer/consumer pair for prefill/decode disaggregation, for fast fault sweeps.

The "KV" of this toy engine is, per slot, the token id whose key/value it would hold
(:class:`TokenKV`). :class:`TokenKVExecutor` writes each chunk's tokens into their slots and
samples from what the slots *hold* (a hash of the context read back through the block table),
so a wrong install changes the tokens, exactly as wrong KV would in the real model; it also
records every position whose slot holds the wrong token (``violations``).
:class:`TokenKVCodec` is the payload codec (producer's reader, consumer's writer): a payload is
the token ids of the exported slots as little-endian int64.

:func:`run_pair` drives a producer :class:`~kvlab.core.engine_core.EngineCore` and a consumer
one (both :class:`~kvlab.disagg.remote_kv_scheduler.RemoteKVScheduler` over a
:class:`~kvlab.core.baseline_scheduler.BaselineScheduler`) through the in-process channel, with a
:class:`~kvlab.disagg.transfer_faults.FaultSchedule`, and compares with a single engine.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.engine_core import EngineCore
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.core.step_records import ModelOutput, SchedulerOutput
from kvlab.disagg.channel import EntryExporter, InProcessChannel
from kvlab.disagg.entry import LAYOUT, Delivery
from kvlab.disagg.install_journal import InstallCrash, recover_installs
from kvlab.disagg.remote_kv_scheduler import RemoteKVPolicy, RemoteKVScheduler
from kvlab.disagg.transfer_faults import FaultSchedule, TransferFaultInjector
from kvlab.labs.invariants import check_scheduler
from kvlab.sim.tokens import hash_token

__all__ = ["TOY_FIELDS", "PairResult", "TokenKV", "TokenKVCodec", "TokenKVExecutor", "run_pair"]

TOY_FIELDS = {"model_version": "toy-v1", "layers": 1, "kv_heads": 1, "head_dim": 1,
              "dtype": "int64", "layout": LAYOUT, "rope": "none"}


class TokenKV:
    """Slot ``s`` holds the token id whose KV it stores (None: never written)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)

    def slot(self, table: Sequence[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


class TokenKVExecutor:
    """Executor over :class:`TokenKV`; tokens come from the KV it reads (module docstring)."""

    def __init__(self, requests: Any, memory: TokenKV, vocab: int = 1000) -> None:
        self.requests, self.memory, self.vocab = requests, memory, vocab
        self.violations: list[tuple[str, int]] = []
        self.tables: dict[str, list[int]] = {}   # kept from the chunks' deltas, as a runner

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        mem = self.memory
        bs = mem.block_size
        for src, dst in output.copies:
            mem.slots[dst * bs:(dst + 1) * bs] = mem.slots[src * bs:(src + 1) * bs]
        sampled = {}
        for rid in output.preempted:
            self.tables.pop(rid, None)
        for chunk in output.chunks:
            request = self.requests(chunk.request_id)
            kept = self.tables.get(chunk.request_id, [])[:chunk.num_kept_blocks]
            table = self.tables[chunk.request_id] = kept + list(chunk.new_block_ids)
            for i, tok in enumerate(chunk.token_ids):
                mem.slots[mem.slot(table, chunk.start_pos + i)] = tok
            end = chunk.start_pos + chunk.num_tokens
            context = [mem.slots[mem.slot(table, p)] for p in range(end)]
            truth = request.all_token_ids[:end]
            self.violations += [(chunk.request_id, p) for p in range(end)
                                if context[p] != truth[p]]
            if chunk.sample:
                sampled[chunk.request_id] = hash_token([t if t is not None else -1
                                                        for t in context], self.vocab)
        return ModelOutput(sampled)


class TokenKVCodec:
    """Payload codec of the toy engine (reader for the producer, writer for the consumer)."""

    def __init__(self, memory: TokenKV) -> None:
        self.memory = memory

    def export(self, blocks: Sequence[int], num_tokens: int) -> bytes:
        mem = self.memory
        ids = [mem.slots[mem.slot(blocks, p)] for p in range(num_tokens)]
        return struct.pack(f"<{num_tokens}q", *[-1 if t is None else t for t in ids])

    def decode(self, delivery: Delivery, num_tokens: int) -> list[int]:
        if len(delivery.payload) != 8 * delivery.num_tokens or num_tokens > delivery.num_tokens:
            raise ValueError(f"payload of {len(delivery.payload)} bytes does not hold "
                             f"{delivery.num_tokens} int64 tokens")
        return list(struct.unpack(f"<{delivery.num_tokens}q", delivery.payload))[:num_tokens]

    def write(self, decoded: list[int], blocks: Sequence[int], first_token: int) -> None:
        bs = self.memory.block_size
        for i, block in enumerate(blocks):
            base = first_token + i * bs
            self.memory.slots[block * bs:(block + 1) * bs] = decoded[base:base + bs]


def _core(num_blocks: int, block_size: int, remote: Any = None, kv: Any = None,
          mem: TokenKV | None = None) -> tuple[EngineCore, Any, TokenKV]:
    """An engine core over a baseline scheduler and the toy KV; ``remote(mem)`` gives the
    :class:`RemoteKVScheduler` keyword arguments (None: a plain single engine). ``kv`` and
    ``mem``: the surviving KV manager and memory of a restarted engine."""
    kv = kv if kv is not None else KVCacheManager(num_blocks, block_size)
    sched: Any = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=8,
                                                       max_num_batched_tokens=256))
    mem = mem if mem is not None else TokenKV(num_blocks, block_size)
    if remote is not None:
        sched = RemoteKVScheduler(sched, **remote(mem))
    core = EngineCore(sched, TokenKVExecutor(sched.get_request, mem), forget_ended=False)
    return core, sched, mem


@dataclass
class PairResult:
    """What a disaggregated run did, beside the single-engine truth."""

    tokens: dict[str, list[int]]          # consumer outputs of requests that completed
    truth: dict[str, list[int]]           # single-engine outputs
    status: dict[str, str]                # consumer final status per request
    stats: dict[str, int]
    violations: list[tuple[str, int]]     # consumer positions that read wrong KV
    leaked_blocks: int                    # blocks still held by anyone after the run
    crashed: bool = False
    recovery: dict[str, Any] = field(default_factory=dict)
    recovery_cached: dict[str, int] = field(default_factory=dict)   # op -> cached prompt tokens
    decisions: list[Any] = field(default_factory=list)
    applied: list[tuple[str, int, str]] = field(default_factory=list)


def _requests(prompts: Sequence[Sequence[int]], max_tokens: int, prefix: str):
    return [RuntimeRequest(f"{prefix}{i}", tuple(p), max_tokens) for i, p in enumerate(prompts)]


def _drain(core: EngineCore, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not core.has_unfinished_requests():
            return
        core.step()
    raise RuntimeError("run did not finish")


def run_pair(prompts: Sequence[Sequence[int]], schedule: FaultSchedule | None = None, *,
             max_tokens: int = 6, block_size: int = 4, num_blocks: int = 96,
             on_failure: str = "recompute") -> PairResult:
    """Producer prefills every prompt (max_tokens=1) and exports; the consumer generates
    ``max_tokens`` for each, fetching KV through the in-process channel; ``schedule`` injects
    faults. Steps of the consumer stand in for time (``timeout_s`` = 3 steps)."""
    schedule = schedule if schedule is not None else FaultSchedule()
    injector = TransferFaultInjector(schedule)
    channel = InProcessChannel()
    # the single engine: the truth
    single, _, _ = _core(num_blocks, block_size)
    for r in _requests(prompts, max_tokens, "r"):
        single.add_request(r)
    _drain(single)
    truth = {r.request_id: list(r.output_token_ids) for r in single.scheduler.requests()}
    # the producer
    holder: dict[str, Any] = {}

    def producer_remote(mem: TokenKV) -> dict:
        exporter = EntryExporter(TokenKVCodec(mem).export, TOY_FIELDS, channel, injector)
        holder["exporter"] = exporter
        return {"policy": RemoteKVPolicy(TOY_FIELDS, produce=True), "exporter": exporter}

    producer, _, _ = _core(num_blocks, block_size, producer_remote)
    for r in _requests(prompts, 1, "r"):
        producer.add_request(r)
    # the consumer: its clock is its step count
    live: list[Any] = []

    def consumer_remote(mem: TokenKV) -> dict:
        return {"policy": RemoteKVPolicy(TOY_FIELDS, consume=True, on_failure=on_failure,
                                         timeout_s=3),
                "source": _FaultySource(channel, injector), "writer": TokenKVCodec(mem),
                "clock": lambda: float(live[-1].step_count) if live else 0.0}

    consumer, csched, _ = _core(num_blocks, block_size, consumer_remote)
    live.append(csched)
    csched.journal.crash_at = injector.crash_record()
    for r in _requests(prompts, max_tokens, "r"):
        consumer.add_request(r)
    for i, r in enumerate(list(csched.parked)):
        if injector.abort_before_delivery(i):
            consumer.abort_request(r)
    _drain(producer)
    holder["exporter"].flush()
    crashed, recovery, cached = False, {}, {}
    carried: list[RuntimeRequest] = []      # requests that ended before a consumer crash
    try:
        _drain(consumer)
    except InstallCrash:
        # The consumer died. Its KV manager and memory survive; the journal says which
        # installs completed. Restart: recover the installs, drop the dead process's request
        # tables, resubmit every request that had not finished, and let entries be fetched
        # again (the channel keeps what it received, as shared storage would).
        crashed = True
        injector.applied.append(("install", len(csched.journal), "consumer_crash"))
        recovery = recover_installs(csched.journal, csched.kv)
        # what the surviving prefix cache holds of each operation's prompt, right after
        for op in recovery:
            rid = op.split("@")[0]
            cached[op] = csched.kv.lookup((), prompts[int(rid[1:])])
        carried = [r for r in csched.requests() if r.status.is_terminal]
        done = {r.request_id for r in carried}
        violations = list(consumer.executor.violations)
        for rid in csched.kv.requests():
            csched.kv.free(rid)
        kv, mem = csched.kv, consumer.executor.memory
        channel.replay()
        consumer, csched, _ = _core(num_blocks, block_size, consumer_remote, kv, mem)
        live.append(csched)
        consumer.executor.violations = violations
        for r in _requests(prompts, max_tokens, "r"):
            if r.request_id not in done:
                consumer.add_request(r)
        _drain(consumer)
    violations = list(consumer.executor.violations)
    everyone = carried + list(csched.requests())
    status = {r.request_id: r.status.value for r in everyone}
    tokens = {r.request_id: list(r.output_token_ids) for r in everyone
              if r.status is RequestStatus.FINISHED}
    check_scheduler(csched)
    leaked = sum(len(csched.kv.block_table(rid)) for rid in csched.kv.requests())
    return PairResult(tokens, truth, status, dict(csched.stats), violations, leaked, crashed,
                      recovery, cached, list(csched.decisions), list(injector.applied))


class _FaultySource:
    """The in-process channel seen through the deliver-point faults."""

    def __init__(self, channel: InProcessChannel, injector: TransferFaultInjector) -> None:
        self.channel, self.injector = channel, injector

    def fetch(self, keys: Sequence[str]) -> list[Delivery]:
        return self.injector.on_deliver(self.channel.fetch(keys))

    def wait(self, timeout: float) -> None:
        pass

