"""Chapter 4 exercises: the recomputed last token, scope isolation, saved prefill, and a
cache-aware request order.

Each check computes the truth with :mod:`kvlab.core` and raises ``AssertionError`` saying what
is wrong (too high, too low, which rule), never the expected answer.
"""

from __future__ import annotations

import dataclasses

from kvlab.core.kv_manager import KVCacheManager
from kvlab.core.scope import SCOPE_FIELDS, CacheScope

from ._common import require_answer

#: The lookup of :func:`check_last_token`: a fully cached prompt of this many tokens.
LAST_TOKEN = {"prompt_tokens": 48, "block_size": 16}

#: The workload of :func:`check_saved_prefill`.
FEW_SHOT = {"shared_tokens": 600, "question_tokens": 40, "requests": 20, "block_size": 16}


def _cached_tokens_for_full_hit(prompt_tokens: int, block_size: int) -> int:
    kv = KVCacheManager(2 * (-(-prompt_tokens // block_size)) + 2, block_size)
    prompt = list(range(prompt_tokens))
    kv.admit("first", ("s",), prompt, prompt_tokens)
    kv.commit("first", prompt)
    kv.free("first")
    return kv.lookup(("s",), prompt)


def check_last_token(cached_tokens, reason) -> str:
    """How many tokens of a fully cached :data:`LAST_TOKEN` prompt ``lookup`` reports, and why.

    ``reason`` is a letter: (a) the last block is never cached, (b) the first output token is
    sampled from the logits at the last prompt position, which only a forward pass over that
    token produces, (c) to keep the hit rate below 100%, (d) the last token's KV is invalid.
    """
    require_answer(cached_tokens, "cached tokens")
    require_answer(reason, "your letter")
    truth = _cached_tokens_for_full_hit(**LAST_TOKEN)
    if cached_tokens != truth:
        raise AssertionError(
            f"{cached_tokens} is {'too high' if cached_tokens > truth else 'too low'}. "
            "The match is capped at len(prompt) - 1 tokens and "
            "then rounded down to whole blocks.")
    if str(reason).strip().lower() != "b":
        raise AssertionError(
            f"{reason!r} is not the reason. The cache stores K and V, not logits: to sample the "
            "first output token the model must run a forward pass at the last prompt position.")
    return (f"Correct: {truth} of {LAST_TOKEN['prompt_tokens']} tokens. With whole-block "
            "matching the capped token drags its whole block along: up to block_size tokens are "
            "recomputed for one logit row (engines that match token-granular avoid that).")


def check_tenant_scopes(scope_a, scope_b) -> str:
    """Two :class:`CacheScope` objects for tenants ``acme`` and ``globex`` on one deployment.

    They must differ in ``security_domain`` only, and a prompt cached for one must not hit for
    the other.
    """
    require_answer(scope_a, "scope for acme")
    require_answer(scope_b, "scope for globex")
    for scope, tenant in ((scope_a, "acme"), (scope_b, "globex")):
        if not isinstance(scope, CacheScope):
            raise AssertionError("build kvlab.core.scope.CacheScope objects")
        if scope.security_domain != tenant:
            raise AssertionError(f"the security_domain of {tenant}'s scope must be {tenant!r}")
    differing = [f for f in SCOPE_FIELDS if getattr(scope_a, f) != getattr(scope_b, f)]
    if differing != ["security_domain"]:
        raise AssertionError(f"the scopes differ in {differing}; same deployment means every "
                             "other field is equal")
    kv = KVCacheManager(8, 4)
    prompt = list(range(13))
    kv.admit("a", scope_a, prompt, 13)
    kv.commit("a", prompt)
    assert kv.lookup(scope_a, prompt) == 12
    if kv.lookup(scope_b, prompt) != 0:  # pragma: no cover - guarded by the radix cache
        raise AssertionError("a hit across security domains")
    same = dataclasses.replace(scope_b, security_domain="acme")
    assert kv.lookup(same, prompt) == 12
    return ("Correct: the same prompt hits for acme again but never for globex. Without the "
            "domain in the key, globex could learn from its time to first token whether acme "
            "recently sent a given prefix: a timing side channel on other tenants' prompts.")


def saved_prefill(shared_tokens: int, question_tokens: int, requests: int,
                  block_size: int) -> tuple[int, int]:
    """Prefill tokens computed without and with the prefix cache (sequential requests)."""
    off = requests * (shared_tokens + question_tokens)
    kv = KVCacheManager(4 * (-(-(shared_tokens + question_tokens) // block_size)) + 4, block_size)
    shared = list(range(shared_tokens))
    on = 0
    for i in range(requests):
        prompt = shared + [100_000 + i * question_tokens + j for j in range(question_tokens)]
        cached = kv.admit(f"r{i}", ("s",), prompt, len(prompt))
        kv.commit(f"r{i}", prompt)
        kv.free(f"r{i}")
        on += len(prompt) - cached
    return off, on


def check_saved_prefill(tokens_without, tokens_with) -> str:
    """Prefill tokens for :data:`FEW_SHOT`: requests sharing a few-shot prefix, one at a time."""
    require_answer(tokens_without, "tokens without the cache")
    require_answer(tokens_with, "tokens with the cache")
    truth = saved_prefill(**FEW_SHOT)
    if (tokens_without, tokens_with) != truth:
        wrong = "; ".join(f"{what}: {got} is {'too high' if got > want else 'too low'}"
                          for what, got, want in (("without", tokens_without, truth[0]),
                                                  ("with", tokens_with, truth[1])) if got != want)
        raise AssertionError(
            f"{wrong}. The first request computes "
            "everything; later ones reuse the shared prefix rounded down to whole blocks, and "
            "recompute the partial block that straddles the prefix and the question.")
    return f"Correct: {truth[0]} vs {truth[1]} tokens ({truth[0] / truth[1]:.1f}x less prefill)."


#: Exercise 4: requests waiting at once, a small cache, you choose the order they run in.
ORDERING = {"groups": 3, "per_group": 4, "prefix_tokens": 128, "question_tokens": 32,
            "num_blocks": 24, "block_size": 16}


def ordering_requests() -> dict[str, list[int]]:
    """The waiting requests of exercise 4, by id, in arrival order (groups interleaved):
    request ``g{k}q{i}`` is group ``k``'s shared prefix followed by its own question."""
    d = ORDERING
    requests = {}
    for i in range(d["per_group"]):
        for k in range(d["groups"]):
            prefix = [1000 * (k + 1) + t for t in range(d["prefix_tokens"])]
            question = [50_000 + 1000 * k + 100 * i + t for t in range(d["question_tokens"])]
            requests[f"g{k}q{i}"] = prefix + question
    return requests


def prefill_for_order(order) -> int:
    """Prefill tokens computed when :func:`ordering_requests` run one at a time in ``order``
    on a real ``KVCacheManager`` of ``ORDERING['num_blocks']`` blocks with prefix caching."""
    requests = ordering_requests()
    kv = KVCacheManager(ORDERING["num_blocks"], ORDERING["block_size"])
    computed = 0
    for rid in order:
        prompt = requests[rid]
        cached = kv.admit(rid, ("s",), prompt, len(prompt))
        kv.commit(rid, prompt)
        kv.free(rid)
        computed += len(prompt) - cached
    return computed


def longest_prefix_first_order() -> list[str]:
    """SGLang's policy, greedily: always run the waiting request with the longest cached
    prefix next (ties in arrival order)."""
    requests = ordering_requests()
    kv = KVCacheManager(ORDERING["num_blocks"], ORDERING["block_size"])
    waiting, order = list(requests), []
    while waiting:
        rid = max(waiting, key=lambda r: (kv.lookup(("s",), requests[r]), -waiting.index(r)))
        waiting.remove(rid)
        kv.admit(rid, ("s",), requests[rid], len(requests[rid]))
        kv.commit(rid, requests[rid])
        kv.free(rid)
        order.append(rid)
    return order


def check_request_order(order) -> str:
    """Exercise 4: an order of all the waiting requests that computes no more prefill than
    longest-prefix-first scheduling does on the same small cache."""
    require_answer(order, "your order")
    requests = ordering_requests()
    order = list(order)
    if sorted(order) != sorted(requests):
        missing = sorted(set(requests) - set(order))
        raise AssertionError("the order must run every waiting request exactly once"
                             + (f"; missing {missing}" if missing else "; some run twice or "
                                "are unknown"))
    yours = prefill_for_order(order)
    target = prefill_for_order(longest_prefix_first_order())
    arrival = prefill_for_order(list(requests))
    if yours > target:
        better = " It does no better than arrival order." if yours >= arrival else ""
        raise AssertionError(f"your order computes {yours:,} prefill tokens: too many; a "
                             f"cache-aware order computes fewer.{better}")
    return (f"Correct: {yours:,} prefill tokens against {arrival:,} in arrival order. Running "
            "requests that share a prefix back to back keeps that prefix from being evicted "
            "between them: SGLang's longest-prefix-match scheduling does it automatically.")
