"""Chapter 4 exercises: the recomputed last token, scope isolation, saved prefill.

Each check computes the truth with :mod:`kvlab.core` and raises ``AssertionError`` with a hint
when the answer differs.
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
            f"{cached_tokens} is not right. The match is capped at len(prompt) - 1 tokens and "
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
        raise AssertionError(
            f"({tokens_without}, {tokens_with}) is not right. The first request computes "
            "everything; later ones reuse the shared prefix rounded down to whole blocks, and "
            "recompute the partial block that straddles the prefix and the question.")
    return f"Correct: {truth[0]} vs {truth[1]} tokens ({truth[0] / truth[1]:.1f}x less prefill)."
