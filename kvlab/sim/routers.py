"""Router policies for :func:`~kvlab.sim.cluster.simulate_cluster`, each written from the rules
its real router documents (chapter 13 quotes the sources):

- :class:`RoundRobin`: replicas in turn (vllm-router ``round_robin``).
- :class:`LeastLoaded`: the fewest requests in flight, as the router counts them (the
  shortest-queue fallback of SGLang's and vllm-router's ``cache_aware``).
- :class:`ApproxTree`: ``cache_aware`` of SGLang's router and vllm-router
  (``src/policies/cache_aware.rs``): a prefix tree *per replica of what the router sent it*,
  never told what the replica evicted. Balanced load: the replica whose tree matches the most of
  the prompt if that share exceeds ``cache_threshold``, else the replica with the smallest
  tree; imbalanced load (``max - min > balance_abs`` and ``max > balance_rel * min``): the
  least loaded. The trees hold tokens here (the real ones hold characters), capped at
  ``max_tree_blocks`` by least-recent use.
- :class:`PreciseIndex`: routing on the replicas' KV events (vllm-router ``kv_aware``, llm-d's
  precise prefix-cache scorer): the replica whose cache holds the longest prefix of the
  prompt, the least loaded among equals; no load term beyond the tie.
- :class:`DynamoCost`: NVIDIA Dynamo's example KV router (``examples/llm/components/
  kv_router.py``): ``logit = 2 * overlap - kv_usage - waiting / max_waiting``, ``overlap`` the
  share of the prompt cached there; the highest logit, ties broken at random.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from kvlab.core.request import RuntimeRequest
from kvlab.sim.cluster import Replica

__all__ = ["POLICIES", "ApproxTree", "DynamoCost", "LeastLoaded", "PreciseIndex", "RoundRobin",
           "make_policy"]


def _least_loaded(candidates: Sequence[int], replicas: Sequence[Replica]) -> int:
    return min(candidates, key=lambda i: (replicas[i].in_flight, i))


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RuntimeRequest, keys: Sequence[int],
               replicas: Sequence[Replica]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i

    def finished(self, i: int, request: RuntimeRequest) -> None:
        pass


class LeastLoaded:
    name = "least_loaded"

    def choose(self, request: RuntimeRequest, keys: Sequence[int],
               replicas: Sequence[Replica]) -> int:
        return _least_loaded(range(len(replicas)), replicas)

    def finished(self, i: int, request: RuntimeRequest) -> None:
        pass


class ApproxTree:
    """``cache_aware`` with vllm-router 0.1.17's defaults (``--cache-threshold 0.3``,
    ``--balance-abs-threshold 64``, ``--balance-rel-threshold 1.5``)."""

    name = "approx_tree"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, max_tree_blocks: int | None = None) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_blocks = max_tree_blocks
        self.trees: list[OrderedDict[int, None]] = []

    def choose(self, request: RuntimeRequest, keys: Sequence[int],
               replicas: Sequence[Replica]) -> int:
        while len(self.trees) < len(replicas):
            self.trees.append(OrderedDict())
        loads = [r.in_flight for r in replicas]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(
                loads):
            i = _least_loaded(range(len(replicas)), replicas)
        else:
            matches = [_overlap(tree, keys) for tree in self.trees]
            best = max(range(len(replicas)), key=lambda j: (matches[j], -j))
            share = matches[best] / len(keys) if keys else 0.0
            if share > self.cache_threshold:
                i = best
            else:
                i = min(range(len(replicas)), key=lambda j: (len(self.trees[j]), j))
        tree = self.trees[i]
        for key in keys:   # the router records what it sent, most recent last
            tree[key] = None
            tree.move_to_end(key)
        if self.max_tree_blocks is not None:
            while len(tree) > self.max_tree_blocks:
                tree.popitem(last=False)
        return i

    def finished(self, i: int, request: RuntimeRequest) -> None:
        pass


def _overlap(tree: OrderedDict[int, None], keys: Sequence[int]) -> int:
    n = 0
    for key in keys:
        if key not in tree:
            break
        n += 1
    return n


class PreciseIndex:
    name = "precise_index"

    def choose(self, request: RuntimeRequest, keys: Sequence[int],
               replicas: Sequence[Replica]) -> int:
        overlaps = [r.index.overlap(keys) for r in replicas]
        best = max(overlaps)
        return _least_loaded([i for i, o in enumerate(overlaps) if o == best], replicas)

    def finished(self, i: int, request: RuntimeRequest) -> None:
        pass


class DynamoCost:
    """``overlap_weight`` is the 2 of Dynamo's example; 0 routes on load alone."""

    name = "dynamo_cost"

    def __init__(self, overlap_weight: float = 2.0, seed: int = 0) -> None:
        self.overlap_weight = overlap_weight
        self.rng = random.Random(seed)

    def choose(self, request: RuntimeRequest, keys: Sequence[int],
               replicas: Sequence[Replica]) -> int:
        block = replicas[0].kv.block_size
        n = len(request.prompt_token_ids)
        waiting = [r.waiting() for r in replicas]
        top = max(waiting)
        logits = [self.overlap_weight * r.index.overlap(keys) * block / n - r.usage()
                  - (w / top if top else 0.0) for r, w in zip(replicas, waiting, strict=True)]
        best = max(logits)
        return self.rng.choice([i for i, x in enumerate(logits) if x == best])

    def finished(self, i: int, request: RuntimeRequest) -> None:
        pass


POLICIES = ("round_robin", "least_loaded", "approx_tree", "precise_index", "dynamo_cost")


def make_policy(name: str, **kwargs):
    """A fresh policy by name (:data:`POLICIES`); ValueError naming the known ones."""
    classes = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "approx_tree": ApproxTree,
               "precise_index": PreciseIndex, "dynamo_cost": DynamoCost}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return classes[name](**kwargs)
