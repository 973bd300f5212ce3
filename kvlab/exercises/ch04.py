"""Chapter 4 exercises: a conversation's second turn, the prefill a shared prefix saves, a
cache-aware request order, and a block-hash prefix index to debug.

A check never holds the answer it grades: the prediction is compared with sealed truths
(``_common.sealed``; the instructor edition computes them with :mod:`kvlab.core`) and graded
once per session (``_common.earlier_prediction``), a reader's function is run on workloads
drawn afresh at each call (``_common.hidden_rng``) and compared with a real
``KVCacheManager``, and the design and debug checks run the reader's order or class on a real
``KVCacheManager``. Each raises ``AssertionError`` naming the concept to revisit, never the
answer, the direction of an error, or which case failed, so an answer cannot be found by
trying values against the check.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.exercises._common import (
    earlier_prediction,
    graded_once,
    hidden_rng,
    require_answer,
    sealed,
)

#: Exercise 1: a conversation's first turn, then its second turn sent as one prompt.
CONVERSATION = {"prompt_tokens": 40, "output_tokens": 24, "new_tokens": 10, "block_size": 16}


def _whole(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AssertionError(f"give {what} as a whole number (an int >= 0), got {value!r}")
    return value


def check_conversation_hit(tokens_with_kv, cached_tokens, reason) -> str:
    """Exercise 1: for :data:`CONVERSATION`, how many of turn one's tokens have KV when it
    finishes, how many tokens ``lookup`` reports for turn two, and a letter for why that is
    fewer than the whole first turn (options in the chapter). A prediction, graded once: the
    first wrong answer (numbers and letter together) is recorded, and a different answer after
    it is not graded, so neither the numbers nor the letter can be found by trying. The two
    numbers are judged together; the letter once they are right."""
    require_answer(tokens_with_kv, "tokens of turn one with KV")
    require_answer(cached_tokens, "cached tokens")
    require_answer(reason, "your letter")
    pair = [_whole(tokens_with_kv, "the tokens with KV"), _whole(cached_tokens,
                                                                  "the cached tokens")]
    letter = str(reason).strip().lower()
    if letter not in ("a", "b", "c", "d"):
        raise AssertionError(f"{reason!r} is not one of the letters a-d")
    truth = sealed("ch04.conversation_hit.reason")   # each letter's verdict is sealed under it
    right = sealed("ch04.conversation_hit.tokens").is_answer(pair) and truth.is_answer(letter)
    earlier = earlier_prediction("ch04.conversation_hit", [*pair, letter], right)
    if earlier is not None:
        return graded_once(earlier)
    if not sealed("ch04.conversation_hit.tokens").is_answer(pair):
        # one verdict for the pair: naming which number is off would let each be tried alone
        raise AssertionError("the two numbers are not both what the KV manager does: revisit "
                             "which tokens a decode step feeds through the model (and so "
                             "writes KV for), and which blocks the prefix cache takes. Your "
                             "prediction is recorded: it is graded once.")
    if not truth.is_answer(letter):
        raise AssertionError(f"the numbers are right, but ({letter}) is not why: "
                             f"{truth.note(letter)}.")
    return f"Correct: {cached_tokens} {truth.note(letter)}"


#: Exercise 2: requests sharing a few-shot prefix, run one after another.
FEW_SHOT = {"shared_tokens": 600, "question_tokens": 40, "requests": 20, "block_size": 16}

def _measured_prefill(shared_tokens: int, question_tokens: int, requests: int,
                      block_size: int) -> tuple[int, int]:
    """Prefill tokens computed without and with the prefix cache when ``requests`` requests,
    each the shared prefix and its own question, run one after another on a real
    ``KVCacheManager`` large enough for all of them."""
    off = requests * (shared_tokens + question_tokens)
    kv = KVCacheManager(4 * (-(-(shared_tokens + question_tokens) // block_size)) + 4,
                        block_size)
    shared = list(range(shared_tokens))
    on = 0
    for i in range(requests):
        prompt = shared + [100_000 + i * question_tokens + j for j in range(question_tokens)]
        cached = kv.admit(f"r{i}", ("s",), prompt, len(prompt))
        kv.commit(f"r{i}", prompt)
        kv.free(f"r{i}")
        on += len(prompt) - cached
    return off, on


def _draw_prefill_case(rng) -> dict:
    """A workload for :func:`check_prefill_tokens`: prefixes on and off the block size, short
    and long questions, one request or many."""
    block_size = rng.choice((1, 4, 16, 32))
    blocks = rng.randint(0, 40)
    shared = max(1, blocks * block_size + (0 if rng.random() < 0.3
                                           else rng.randint(0, block_size - 1)))
    return {"shared_tokens": shared, "question_tokens": rng.randint(1, 64),
            "requests": rng.randint(1, 20), "block_size": block_size}


def check_prefill_tokens(prefill_tokens) -> str:
    """Exercise 2: ``prefill_tokens(shared_tokens, question_tokens, requests, block_size)``
    returns ``(tokens computed without the prefix cache, tokens computed with it)`` for
    requests that share a prefix and each add their own question, run one after another on a
    cache large enough for all of them. The check runs it on :data:`FEW_SHOT` and on workloads
    drawn at each call, compared with a real ``KVCacheManager``: one verdict, naming no
    workload."""
    require_answer(prefill_tokens, "your prefill_tokens function")
    if not callable(prefill_tokens):
        raise AssertionError("pass a function (shared_tokens, question_tokens, requests, "
                             "block_size) -> (without, with)")
    rng = hidden_rng()
    for case in [FEW_SHOT] + [_draw_prefill_case(rng) for _ in range(16)]:
        got = prefill_tokens(**case)
        if not (isinstance(got, (tuple, list)) and list(got) == list(_measured_prefill(**case))):
            raise AssertionError("your function does not agree with the KV manager on every "
                                 "workload: revisit what a later request can find in the cache "
                                 "(whole blocks only, and never its last token) and what the "
                                 "first request must compute.")
    return ("Correct on every workload: only whole blocks of the shared prefix are reused, so a "
            "prefix that ends inside a block leaves that block to be recomputed by every "
            "request.")


#: Exercise 3: requests waiting at once, a small cache, you choose the order they run in.
ORDERING = {"groups": 3, "per_group": 4, "prefix_tokens": 128, "question_tokens": 32,
            "num_blocks": 24, "block_size": 16}


def ordering_requests() -> dict[str, list[int]]:
    """The waiting requests of exercise 3, by id, in arrival order (groups interleaved):
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


def check_request_order(order) -> str:
    """Exercise 3: an order of all the waiting requests that computes no more prefill than
    longest-prefix-first scheduling does on the same small cache."""
    require_answer(order, "your order")
    requests = ordering_requests()
    if isinstance(order, str) or not isinstance(order, Sequence):
        raise AssertionError(f"give the order as a list of request ids, got {order!r}")
    order = list(order)
    if sorted(order) != sorted(requests):
        missing = sorted(set(requests) - set(order))
        raise AssertionError("the order must run every waiting request exactly once"
                             + (f"; missing {missing}" if missing else "; some run twice or "
                                "are unknown"))
    yours = prefill_for_order(order)
    arrival = prefill_for_order(list(requests))
    if yours > sealed("ch04.request_order.target").value():
        raise AssertionError(f"your order computes {yours:,} prefill tokens, and a cache-aware "
                             "order computes less on the same cache: revisit what LRU eviction "
                             "keeps between two requests that share a prefix.")
    return (f"Correct: {yours:,} prefill tokens against {arrival:,} in arrival order. Running "
            "requests that share a prefix back to back keeps that prefix from being evicted "
            "between them. Sorting the waiting queue by cached prefix length does it "
            "automatically (SGLang's 'lpm' policy, opt-in in current releases); nothing in "
            "that sort stops a "
            "request that matches nothing from being passed over while hits keep arriving.")


# -- exercise 4: a prefix index keyed by block hashes --------------------------------------------

class BlockHashIndex:
    """A prefix index in the style of vLLM v1: a dictionary from block hashes to block ids.

    ``insert(scope, tokens, blocks)`` records ``blocks[i]`` as holding the KV of the ``i``-th
    full block of ``tokens``; ``match(scope, tokens)`` walks the full blocks of ``tokens``,
    stops at the first hash it does not know, never covers the last token, and returns
    ``(cached_tokens, blocks)``. Its contract is :class:`kvlab.PrefixCache`'s: a block may be
    served only for the exact tokens, at the exact position, that its KV was computed for.
    """

    def __init__(self, block_size: int):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.table: dict = {}

    def block_hash(self, parent, block_tokens: tuple, scope) -> int:
        """The key of one full block, given the key of the block before it (None first)."""
        return hash((scope, block_tokens))

    def _hashes(self, scope, tokens: Sequence[int], limit: int):
        parent = None
        bs = self.block_size
        for start in range(0, limit - limit % bs, bs):
            parent = self.block_hash(parent, tuple(tokens[start:start + bs]), scope)
            yield parent

    def insert(self, scope, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        for h, block in zip(self._hashes(scope, tokens, len(tokens)), blocks, strict=False):
            self.table.setdefault(h, block)

    def match(self, scope, tokens: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        found = []
        for h in self._hashes(scope, tokens, max(len(tokens) - 1, 0)):
            if h not in self.table:
                break
            found.append(self.table[h])
        return len(found) * self.block_size, tuple(found)


def _differential(index_cls, rounds: int = 400, seed: int = 0) -> str | None:
    """Drive ``index_cls`` and an exact oracle with random prompts; describe the first
    disagreement in words that name its kind only, or return None."""
    rng = random.Random(seed)
    bs = 2
    for _ in range(rounds // 20):
        index = index_cls(bs)
        truth: dict = {}                         # (scope, exact prefix) -> block id
        content: dict = {}                       # block id -> (scope, exact prefix)
        next_block = 0
        for _ in range(20):
            scope = rng.choice(("a", "b"))
            tokens = [rng.randrange(2) for _ in range(rng.randrange(1, 9))]
            if rng.random() < 0.5:
                n_full = len(tokens) // bs
                blocks = list(range(next_block, next_block + n_full))
                next_block += n_full
                index.insert(scope, tokens, blocks)
                for i, block in enumerate(blocks):
                    key = (scope, tuple(tokens[:(i + 1) * bs]))
                    truth.setdefault(key, block)
                    content[block] = key
                continue
            got_tokens, got_blocks = index.match(scope, tokens)
            want = 0
            limit = len(tokens) - 1
            while want + bs <= limit and (scope, tuple(tokens[:want + bs])) in truth:
                want += bs
            if got_tokens != len(got_blocks) * bs:
                return "match returned a token count that is not its blocks' worth of tokens"
            for i, block in enumerate(got_blocks):
                owner = content.get(block)
                if owner is not None and owner[0] != scope:
                    return "a lookup was served a block cached under another scope"
                if owner != (scope, tuple(tokens[:(i + 1) * bs])):
                    return "a lookup was served a block whose KV belongs to another prefix"
            if got_tokens < want:
                return "a lookup missed blocks that were cached for exactly its prefix"
    return None


def check_block_index(index_cls) -> str:
    """Exercise 4: ``index_cls`` (a :class:`BlockHashIndex` subclass, built with
    ``index_cls(block_size)``) must agree with an exact prefix cache on random workloads."""
    require_answer(index_cls, "your index class")
    if not (isinstance(index_cls, type) and issubclass(index_cls, BlockHashIndex)):
        raise AssertionError("pass a class derived from BlockHashIndex (the class, not an "
                             "instance)")
    problem = _differential(index_cls)
    if problem is not None:
        raise AssertionError(f"not yet: {problem}.")
    if index_cls is BlockHashIndex:  # pragma: no cover - the unfixed class always fails above
        raise AssertionError("that is the class as shipped")
    return ("Correct: your index serves a block only for the exact prefix its KV was computed "
            "for, on every random workload tried.")
