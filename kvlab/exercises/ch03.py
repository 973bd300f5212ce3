"""Chapter 3 exercises: debug a copy-on-write, count the blocks parallel sampling needs,
predict the copies of a fork written in another order, and design the admission rule for
parallel sampling, graded on a real KV manager.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with :mod:`kvlab.core`: the reference ``BlockAllocator`` or a
real ``KVCacheManager``); the debug checks run the reader's code against the reference. The
★★ and ★★★ checks cannot be passed by trying: a reader's function runs on the printed case and
on cases drawn afresh at each call (``_common.hidden_rng``), compared with a real
``KVCacheManager``, with one verdict for all of them. Each raises ``AssertionError`` saying
what to revisit, never the answer, which way it is off, or which case failed.
"""

from __future__ import annotations

import random

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.exercises._common import hidden_rng, require_answer, sealed
from kvlab.reference import BlockAllocator

#: Parallel sampling of :func:`check_sampling_blocks` (exercise 2): one prompt, five samples
#: that stop after different numbers of tokens (one output length per sample).
SAMPLING = {"prompt_tokens": 730, "output_tokens": (90, 70, 6, 22, 90), "block_size": 16}

#: The fork of :func:`check_write_order` (exercise 3): the parent writes first.
WRITE_ORDER = {"n": 3, "prompt_tokens": 10, "block_size": 4, "order": ("p", "s1", "s2")}

#: The pool and request that :func:`check_sample_rule` (exercise 4) tries first.
SAMPLES_DESIGN = {"num_blocks": 64, "block_size": 16, "prompt_tokens": 300,
                  "output_tokens": 100}


def suspect_cow(allocator: BlockAllocator, table, logical_block):
    """Exercise 1's copy-on-write, with a bug: it passes the ordinary cases."""
    table = list(table)
    old = table[logical_block]
    if allocator.refcount[old] <= 0:
        raise ValueError("cannot copy a free block")
    if allocator.refcount[old] == 1:
        return table, None
    allocator.refcount[old] -= 1
    new = allocator.allocate()
    table[logical_block] = new
    return table, (old, new)


def _state(alloc: BlockAllocator) -> tuple:
    return (tuple(alloc.refcount), tuple(sorted(alloc.free)))


def _run(fn, alloc: BlockAllocator, table, logical):
    try:
        return ("ok", fn(alloc, list(table), logical))
    except (MemoryError, ValueError, IndexError) as exc:
        return ("raises", type(exc).__name__)


def check_cow(fn) -> str:
    """Compare the reader's ``fn(allocator, table, logical_block)`` with ``BlockAllocator.cow``.

    Random scenarios on twin allocators: the same result (``(table, None)`` or
    ``(new_table, (old, new))``), the same exception type for bad input or exhausted memory, and
    the same refcounts and free set afterwards (so a failed call must change nothing).
    """
    require_answer(fn, "your cow function")
    if not callable(fn):
        raise AssertionError("pass a function taking (allocator, table, logical_block)")
    rng = random.Random(3)
    cases = 0
    for trial in range(200):
        size = rng.randint(1, 6)
        ours, theirs = BlockAllocator(size), BlockAllocator(size)
        ours.free, theirs.free = set(range(size)), set(range(size))
        tables = []
        for _ in range(rng.randint(1, size)):
            if ours.free and rng.random() < 0.7:
                block = min(ours.free)
                ours.free.discard(block)
                theirs.free.discard(block)
                ours.refcount[block] = theirs.refcount[block] = 1
                tables.append([block])
            elif tables:
                t = rng.choice(tables)
                ours.share(t)
                theirs.share(t)
                tables.append(list(t))
        if not tables:
            continue
        table = rng.choice(tables)
        logical = rng.choice([0, 0, 0, 1, -1])
        want = _run(BlockAllocator.cow, theirs, table, logical)
        try:
            got = _run(fn, ours, table, logical)
        except Exception as exc:  # any other failure is reported to the reader
            got = ("raises", type(exc).__name__)
        cases += 1
        if got[0] == "ok" and want[0] == "ok":
            g_table, g_copy = got[1]
            w_table, w_copy = want[1]
            if (list(g_table), g_copy) != (list(w_table), w_copy):
                raise AssertionError(
                    f"trial {trial}: cow({table}, {logical}) returned {got[1]!r}, which is "
                    "wrong. Exclusive blocks are returned as they are; a shared block gets a "
                    "new block and the pair (old, new).")
        elif got != want:
            what = "raised " + got[1] if got[0] == "raises" else "returned normally"
            raise AssertionError(f"trial {trial}: cow({table}, {logical}) {what}, which the "
                                 "reference does not do on this input.")
        if _state(ours) != _state(theirs):
            raise AssertionError(
                f"trial {trial}: after cow({table}, {logical}) the refcounts or the free set "
                "differ from the reference's.")
    return f"Correct on {cases} random scenarios, exhausted memory and bad indices included."


def _sampling_blocks(prompt_tokens: int, output_tokens: tuple, block_size: int) -> tuple:
    """Blocks held when every sample has generated its ``output_tokens[i]`` tokens, with forked
    sharing and without sharing, and the copies copy-on-write made (the check's truth; the
    chapter never calls it).

    Runs a real KVCacheManager: admit the prompt, fork one child per further sample, decode
    every unfinished sequence token by token (copy-on-write on the shared partial block), and
    count the distinct blocks held and the copies made.
    """
    n = len(output_tokens)
    if n < 1 or any(o < 1 for o in output_tokens):
        raise ValueError(f"need at least one sample and one token each, got {output_tokens!r}")
    private = sum(-(-(prompt_tokens + o) // block_size) for o in output_tokens)
    kv = KVCacheManager(private + 8, block_size, enable_prefix_caching=False)
    kv.admit("s0", (), list(range(prompt_tokens)), prompt_tokens)
    seqs = [f"s{i}" for i in range(n)]
    for child in seqs[1:]:
        kv.fork("s0", child)
    made = 0
    for length in range(prompt_tokens, prompt_tokens + max(output_tokens)):
        copies = []
        for rid, out in zip(seqs, output_tokens, strict=True):
            if length < prompt_tokens + out:
                copies += kv.grow(rid, length + 1, length)
        kv.complete_copies(copies)
        made += len(copies)
    shared = len({b for rid in seqs for b in kv.block_table(rid)})
    return shared, private, made


def _draw_sampling(rng) -> dict:
    """A request for :func:`check_sampling_blocks`: a third of the prompts fill their last
    block exactly (nothing to copy), the others end inside one."""
    block_size = rng.choice((4, 8, 16))
    partial = 0 if rng.random() < 0.3 else rng.randint(1, block_size - 1)
    return {"prompt_tokens": rng.randint(1, 40) * block_size + partial,
            "output_tokens": tuple(rng.randint(1, 6 * block_size)
                                   for _ in range(rng.randint(1, 6))),
            "block_size": block_size}


def check_sampling_blocks(held_blocks) -> str:
    """Exercise 2: ``held_blocks(prompt_tokens, output_tokens, block_size)`` returns
    ``(with_sharing, without_sharing, copies)``: the distinct blocks forked samples (one per
    entry of ``output_tokens``, each stopping after that many tokens) hold once the last one
    stops, what they would hold without sharing, and the block copies copy-on-write made. Run
    on :data:`SAMPLING` and on requests drawn at each call, compared with a real
    ``KVCacheManager``; one verdict, naming no case."""
    require_answer(held_blocks, "your held_blocks function")
    if not callable(held_blocks):
        raise AssertionError("pass a function held_blocks(prompt_tokens, output_tokens, "
                             "block_size) -> (with_sharing, without_sharing, copies)")
    rng = hidden_rng()
    for case in [SAMPLING] + [_draw_sampling(rng) for _ in range(16)]:
        got = held_blocks(**case)
        if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(
                isinstance(g, int) and not isinstance(g, bool) for g in got)):
            raise AssertionError(f"your function returned {got!r}: return three whole "
                                 "numbers (with_sharing, without_sharing, copies)")
        if tuple(got) != _sampling_blocks(**case):
            raise AssertionError(
                "your function is not right on every request: revisit which blocks all the "
                "samples hold once (the prompt's full blocks), which each holds of its own "
                "(its copy of the partial prompt block, its tail), which writers copy, and "
                "what each sample would hold without sharing.")
    with_sharing, without_sharing, copies = held_blocks(**SAMPLING)
    return (f"Correct on 17 requests. The printed one: {with_sharing} blocks instead of "
            f"{without_sharing} ({100 * (1 - with_sharing / without_sharing):.0f}% less KV "
            f"memory), for {copies} block copies.")


def check_double_release(answer) -> str:
    """What a second ``BlockPool.release(table, owner)`` by the same owner does (kept for
    teachers' own exercises; the chapter prints the answer in its demo).

    Answer with a letter: (a) raises ValueError, (b) decrements the refcounts again,
    (c) is a no-op and returns ``[]``, (d) frees the blocks. A wrong letter is told why it
    fails, from the pool's observed behaviour (each option's verdict is sealed under it).
    """
    require_answer(answer, "your letter")
    letter = str(answer).strip().lower()
    if letter not in ("a", "b", "c", "d"):
        raise AssertionError(f"answer with one of the letters a, b, c, d, got {answer!r}")
    truth = sealed("ch03.double_release")
    if not truth.is_answer(letter):
        raise AssertionError(truth.note(letter))
    return truth.note(letter)


def write_order_outcome(n: int, prompt_tokens: int, block_size: int,
                        order: tuple[str, ...]) -> tuple[int, str]:
    """Fork ``n`` sequences (``p``, ``s1``, ...) after a prefill of ``prompt_tokens`` on a real
    ``KVCacheManager`` and let each write its first token in ``order``: the number of copies
    made, and the sequence that writes into the shared partial block in place."""
    if prompt_tokens % block_size == 0:
        raise ValueError("the prompt must end in a partial block (else nothing is copied)")
    kv = KVCacheManager(4 * n * (-(-(prompt_tokens + 1) // block_size)), block_size,
                        enable_prefix_caching=False)
    kv.admit("p", (), list(range(prompt_tokens)), prompt_tokens)
    seqs = ["p"] + [f"s{i}" for i in range(1, n)]
    if sorted(order) != sorted(seqs):
        raise ValueError(f"order must name each of {seqs} once, got {order!r}")
    for child in seqs[1:]:
        kv.fork("p", child)
    partial = kv.block_table("p")[prompt_tokens // block_size]
    copies = []
    for rid in order:
        copies += kv.grow(rid, prompt_tokens + 1, prompt_tokens)
    kv.complete_copies(copies)
    in_place = [rid for rid in seqs if kv.block_table(rid)[prompt_tokens // block_size]
                == partial]
    assert len(in_place) == 1
    return len(copies), in_place[0]


def check_write_order(copies, in_place) -> str:
    """Exercise 3: the fork of :data:`WRITE_ORDER` written parent first: how many copies, and
    which sequence writes in place."""
    require_answer(copies, "number of copies")
    require_answer(in_place, "the sequence that writes in place")
    if isinstance(copies, bool) or not isinstance(copies, int):
        raise AssertionError(f"the number of copies is a whole number, got {copies!r}")
    problems = []
    if not sealed("ch03.write_order.copies").is_answer(copies):
        problems.append("the number of copies is not right: revisit which writers find the "
                        "partial block still shared when they write")
    seqs = WRITE_ORDER["order"]
    if in_place not in seqs:
        problems.append(f"{in_place!r} is not one of the sequences {seqs}")
    elif not sealed("ch03.write_order.in_place").is_answer(in_place):
        problems.append(f"{in_place!r} cannot write in place: when it writes, the partial "
                        "block still has another owner")
    if problems:
        raise AssertionError("; ".join(problems) + ".")
    return (f"Correct: {copies} copies, and {in_place} writes in place. Whatever "
            "the order, every writer but the last owner of the partial block copies it.")


def check_cow_counterexample(make_case) -> str:
    """Exercise 1: ``make_case()`` returns a fresh ``(allocator, table, logical_block)`` on which
    :func:`suspect_cow` leaves the allocator in a different state from the reference
    ``BlockAllocator.cow`` (same input, twin allocators)."""
    require_answer(make_case, "make_case")
    if not callable(make_case):
        raise AssertionError("pass a function returning (allocator, table, logical_block)")
    ours, table, logical = make_case()
    theirs, table2, logical2 = make_case()
    if ours is theirs or not isinstance(ours, BlockAllocator):
        raise AssertionError("make_case must build a new BlockAllocator on every call")
    if _state(ours) != _state(theirs) or list(table) != list(table2) or logical != logical2:
        raise AssertionError("make_case must build the same case every time")
    table = list(table)
    if not (isinstance(logical, int) and 0 <= logical < len(table)) or any(
            not (isinstance(b, int) and 0 <= b < len(ours.refcount) and ours.refcount[b] > 0)
            for b in table):
        raise AssertionError("make_case must return a valid case: a table of blocks that are "
                             "allocated, and a logical block index into that table")
    want = _run(BlockAllocator.cow, theirs, table, logical)
    try:
        got = _run(suspect_cow, ours, table, logical)
    except Exception as exc:
        got = ("raises", type(exc).__name__)
    if _state(ours) == _state(theirs) and got == want:
        return_kind = "raise" if want[0] == "raises" else "return"
        raise AssertionError(f"both versions {return_kind} the same and leave the same state "
                             "on this case: the bug does not show here.")
    same_state = _state(ours) == _state(theirs)
    return ("Correct: the suspect and the reference part ways here"
            + ("" if same_state else ", and the suspect leaves the refcounts changed after it"
               " failed: a block that still has sharers has lost a reference")
            + ". Validate and allocate first; mutate only when nothing can fail any more.")


def samples_fit(n: int, num_blocks: int, block_size: int, prompt_tokens: int,
                output_tokens: int) -> bool:
    """Whether ``n`` forked samples of one prompt run to ``output_tokens`` each on a real
    ``KVCacheManager`` of ``num_blocks`` blocks without running out (copies included)."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    try:
        kv.admit("s0", (), list(range(prompt_tokens)), prompt_tokens)
        seqs = ["s0"] + [f"s{i}" for i in range(1, n)]
        for child in seqs[1:]:
            kv.fork("s0", child)
        for length in range(prompt_tokens, prompt_tokens + output_tokens):
            copies = []
            for rid in reversed(seqs):
                copies += kv.grow(rid, length + 1, length)
            kv.complete_copies(copies)
    except OutOfBlocks:
        return False
    return True


def check_max_samples(n) -> str:
    """The largest ``n`` whose samples all fit :data:`SAMPLES_DESIGN`'s pool (kept for teachers'
    own exercises: a single number can be found by trying; the chapter's exercise 4 asks for the
    rule instead, :func:`check_sample_rule`)."""
    require_answer(n, "n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AssertionError(f"n must be a positive whole number, got {n!r}")
    if not sealed("ch03.max_samples").is_answer(n):
        raise AssertionError(f"n = {n} is not the largest n whose samples all fit: revisit "
                             "which blocks are held once and which each sample holds.")
    d = SAMPLES_DESIGN
    private = d["num_blocks"] // -(-(d["prompt_tokens"] + d["output_tokens"]) // d["block_size"])
    return (f"Correct: {n} samples fit and {n + 1} do not. Without sharing only {private} "
            "would: the prompt's full blocks are held once.")


def sample_rule_cases(count: int = 24, seed: int = 4) -> list[dict]:
    """The pools and requests :func:`check_sample_rule` tries, :data:`SAMPLES_DESIGN` first:
    prompts that end in a partial block and prompts that fill their last block, pools from
    too small for one sample to room for a dozen."""
    rng = random.Random(seed)
    cases = [dict(SAMPLES_DESIGN)]
    while len(cases) < count:
        block_size = rng.choice((4, 8, 16))
        prompt = rng.randint(1, 12) * block_size + (0 if rng.random() < 0.3
                                                     else rng.randint(1, block_size - 1))
        output = rng.randint(1, 6 * block_size)
        one = -(-(prompt + output) // block_size)
        num_blocks = rng.randint(max(1, one - 2), one + 12 * (one - prompt // block_size))
        cases.append({"num_blocks": num_blocks, "block_size": block_size,
                      "prompt_tokens": prompt, "output_tokens": output})
    return cases


def check_sample_rule(rule) -> str:
    """Exercise 4: ``rule(num_blocks, block_size, prompt_tokens, output_tokens)`` returns the
    largest ``n`` whose forked samples all run to the end on a pool of ``num_blocks`` blocks
    (0 when one sample does not fit). Graded on real ``KVCacheManager`` runs
    (:func:`samples_fit`) over :func:`sample_rule_cases` drawn with a seed chosen at each call;
    a failure names what to revisit, never the case, the right ``n`` nor which way the rule is
    off."""
    require_answer(rule, "your rule")
    if not callable(rule):
        raise AssertionError("pass a function rule(num_blocks, block_size, prompt_tokens, "
                             "output_tokens) -> int")
    cases = sample_rule_cases(seed=hidden_rng().randrange(2**32))
    for case in cases:
        n = rule(**case)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AssertionError(f"your rule returned {n!r}: it must return a whole number, "
                                 "0 or more")
        if (n > 0 and not samples_fit(n, **case)) or samples_fit(n + 1, **case):
            raise AssertionError("your rule's n is not the largest that runs to the end on "
                                 "every pool: revisit which blocks the samples hold once, "
                                 "which each holds of its own at the end, and whether a "
                                 "pending copy needs a block of its own.")
    d = SAMPLES_DESIGN
    private = d["num_blocks"] // -(-(d["prompt_tokens"] + d["output_tokens"]) // d["block_size"])
    return (f"Correct on {len(cases)} pools and requests. On the chapter's pool "
            f"your rule admits {rule(**d)} samples; without sharing only {private} would fit, "
            "because the prompt's full blocks are held once.")
