"""A cluster on a simulated clock: N replicas of the cost-model engine behind a router (no torch).

Each :class:`Replica` is the engine's own core (scheduler, KV cache manager with its radix
cache, :class:`~kvlab.core.engine_core.EngineCore`) over a
:class:`~kvlab.sim.executor.CostModelExecutor`, as :func:`~kvlab.sim.executor.simulate` runs
one. :func:`simulate_cluster` runs them side by side in one discrete-event loop: a request is
routed when it arrives (by a policy of :mod:`kvlab.sim.routers`), a replica steps whenever it
has work, each step lasting what its cost model says, and the tokens of a step appear when it
ends. The router sees what the real ones see: the requests it has in flight on each replica,
each replica's waiting queue and KV usage (the metrics vLLM and SGLang export), and, for the
precise policies, each replica's cached blocks, learned from its radix cache's events
(:class:`BlockIndex`, a :class:`~kvlab.core.radix_cache.CacheListener`, like a KV-event
subscriber with no delay). Chapter 13.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.engine_core import EngineCore
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.radix_cache import RadixNode
from kvlab.core.request import RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.sim.costmodel import RooflineCostModel, StepCost
from kvlab.sim.executor import CostModelExecutor
from kvlab.sim.workload import RequestSpec, to_request

__all__ = ["BlockIndex", "ClusterResult", "LinearStepCost", "Replica", "ReplicaStats",
           "RoutedRecord", "RoutingPolicy", "block_keys", "simulate_cluster"]


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """One key per full block of ``tokens``, each naming the whole prefix it ends (a hash
    chain, as vLLM's block hashes and the routers' own are)."""
    keys, parent = [], 0
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


class BlockIndex:
    """The blocks one replica's radix cache holds, kept from its events: a
    :class:`~kvlab.core.radix_cache.CacheListener` keyed like :func:`block_keys`."""

    def __init__(self) -> None:
        self._key: dict[RadixNode, int] = {}
        self.keys: set[int] = set()

    def stored(self, nodes: Sequence[RadixNode]) -> None:
        parent = nodes[0].parent
        key = self._key.get(parent, 0) if parent is not None and not parent.is_root else 0
        for node in nodes:
            key = hash((key, node.chunk))
            self._key[node] = key
            self.keys.add(key)

    def removed(self, node: RadixNode) -> None:
        self.keys.discard(self._key.pop(node))

    def cleared(self) -> None:
        self._key.clear()
        self.keys.clear()

    def overlap(self, keys: Sequence[int]) -> int:
        """Leading blocks of a request (its :func:`block_keys`) this replica holds."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n


@dataclass(frozen=True)
class LinearStepCost:
    """A step costs ``fixed_s + per_token_s * tokens``: a CPU-sized stand-in for the roofline
    (the live runs' engines), with the roofline's ``step_cost`` interface."""

    fixed_s: float = 5e-3
    per_token_s: float = 1e-4

    def step_cost(self, chunks, padding=()) -> StepCost:
        tokens = sum(c.num_query_tokens for c in chunks) + sum(n for n, _ in padding)
        return StepCost(0.0, 0.0, tokens * self.per_token_s, 0.0, self.fixed_s)


class Replica:
    """One engine replica: its KV cache manager (``num_blocks`` x ``block_size``), scheduler,
    core and cost model; ``index`` (its :class:`BlockIndex`) follows its radix cache."""

    def __init__(self, rid: int, num_blocks: int, block_size: int,
                 cost: RooflineCostModel | LinearStepCost, config: SchedulerConfig) -> None:
        self.id = rid
        self.kv = KVCacheManager(num_blocks, block_size)
        self.index = BlockIndex()
        self.kv.prefix_cache.listener = self.index
        self.scheduler = BaselineScheduler(self.kv, config)
        self.core = EngineCore(self.scheduler, CostModelExecutor(self.scheduler.get_request,
                                                                 cost=cost))
        self.in_flight = 0          # routed here and not finished (the router's own count)
        self.busy = False           # a step is running
        self.pending = None         # the running step's StepResult, applied when it ends
        self.routed = 0

    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def usage(self) -> float:
        """KV blocks held by requests / all blocks (cached-but-idle blocks count as free, as
        in vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.kv.num_allocatable_blocks() / self.kv.num_blocks


class RoutingPolicy(Protocol):
    """A router: ``choose(request, keys, replicas)`` -> replica index, where ``keys`` are the
    request's :func:`block_keys`; ``finished(i, request)`` hears each completion."""

    name: str

    def choose(self, request: RuntimeRequest, keys: Sequence[int],
               replicas: Sequence[Replica]) -> int: ...
    def finished(self, i: int, request: RuntimeRequest) -> None: ...


@dataclass
class RoutedRecord:
    """One request: where it went, its cached prefix there, its times (simulated seconds)."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    tenant: int | None
    replica: int = -1
    hit_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass
class ReplicaStats:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    busy_s: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class ClusterResult:
    """Per-request records, per-replica counters and the makespan of a cluster run."""

    policy: str
    records: list[RoutedRecord]
    replicas: list[ReplicaStats]
    makespan: float
    steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached / prompt tokens, over every replica."""
        hits = sum(r.hit_tokens for r in self.replicas)
        total = sum(r.prompt_tokens for r in self.replicas)
        return hits / total if total else 0.0

    def requests_per_replica(self) -> list[int]:
        return [r.requests for r in self.replicas]

    def hot_spot(self) -> float:
        """The busiest replica's requests over the mean (1 = even; N = all on one)."""
        counts = self.requests_per_replica()
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else math.nan

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.records if r.ttft is not None]


def simulate_cluster(workload: Sequence[RequestSpec], policy: RoutingPolicy, *, replicas: int,
                     num_blocks: int, block_size: int = 16,
                     cost: RooflineCostModel | LinearStepCost | None = None,
                     shared_prefix: int = 0, vocab_size: int = 32000,
                     config: SchedulerConfig | None = None, max_steps: int = 5_000_000,
                     observer: Callable[[RoutedRecord, Sequence[Replica]], None] | None = None
                     ) -> ClusterResult:
    """Route ``workload`` (requests of one ``prefix_group`` share their first
    ``shared_prefix`` tokens, :func:`~kvlab.sim.workload.to_request`) across ``replicas``
    engines with ``policy``; every request runs to completion. ``observer(record, replicas)``
    is called as each request is routed, before it is added (what the router saw; it must not
    change them). RuntimeError if a replica stalls with work (a request larger than its cache)
    or after ``max_steps`` steps in all."""
    if type(replicas) is not int or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    cost = LinearStepCost() if cost is None else cost
    config = config or SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                                       prefill_chunk=2048)
    nodes = [Replica(i, num_blocks, block_size, cost, config) for i in range(replicas)]
    specs = sorted(workload, key=lambda s: (s.arrival_time, s.request_id))
    records: dict[str, RoutedRecord] = {}
    placed: dict[str, int] = {}
    busy_s = [0.0] * replicas
    events: list[tuple[float, int, int, str]] = []   # (time, order, replica, kind)
    order = 0
    for spec in specs:
        heapq.heappush(events, (spec.arrival_time, order, -1, spec.request_id))
        order += 1
    by_id = {s.request_id: s for s in specs}
    steps = 0
    now = 0.0

    def start_step(node: Replica) -> None:
        nonlocal order, steps
        if node.busy or not node.core.has_unfinished_requests():
            return
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"cluster simulation not done after {max_steps} steps")
        result = node.core.step()
        for rid in result.output.admitted:   # the cached prefix each admission reused
            records[rid].hit_tokens = node.scheduler.get_request(rid).num_cached_tokens
        seconds = result.model.seconds
        if result.output.is_empty and not result.ended:
            if not node.scheduler.running:
                raise RuntimeError(f"replica {node.id} cannot admit its waiting requests "
                                   "(a request larger than its cache?)")
            return
        node.busy = True
        busy_s[node.id] += seconds
        node.pending = result
        heapq.heappush(events, (now + seconds, order, node.id, "step"))
        order += 1

    while events:
        now, _, who, what = heapq.heappop(events)
        if who < 0:   # an arrival: route it
            spec = by_id[what]
            request = to_request(spec, vocab_size=vocab_size, shared_prefix=shared_prefix)
            keys = block_keys(request.prompt_token_ids[:len(request.prompt_token_ids) - 1],
                              block_size)
            i = policy.choose(request, keys, nodes)
            node = nodes[i]
            node.in_flight += 1
            node.routed += 1
            placed[what] = i
            records[what] = RoutedRecord(what, spec.arrival_time, spec.prompt_len,
                                         spec.output_len, spec.prefix_group, i)
            if observer is not None:
                observer(records[what], nodes)
            node.core.add_request(request)
            start_step(node)
            continue
        node = nodes[who]
        node.busy = False
        result = node.pending
        for rid in result.model.sampled:
            rec = records[rid]
            if rec.first_token is None:
                rec.first_token = now
        for request in result.ended:
            records[request.request_id].finish = now
            node.in_flight -= 1
            policy.finished(who, request)
        start_step(node)
    stats = [ReplicaStats(n.routed, n.kv.query_tokens, n.kv.hit_tokens, busy_s[n.id])
             for n in nodes]
    makespan = max((r.finish for r in records.values() if r.finish is not None), default=0.0)
    return ClusterResult(policy.name, [records[s.request_id] for s in specs], stats, makespan,
                         steps)
