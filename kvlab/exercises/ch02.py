"""Chapter 2 exercises: debug a block-count shortcut, count block-tail waste, map a batch,
predict what a smaller arena changes, design a block size.

Each check computes the truth with :mod:`kvlab.core.paging` (or the fragmentation simulation)
and raises ``AssertionError`` saying what is wrong without printing the expected answer.
"""

from __future__ import annotations

import functools
import itertools
import operator

from kvlab.core.paging import slot_mapping
from kvlab.fragmentation import sharegpt_like_workload, simulate
from kvlab.reference import physical_slot

from ._common import require_answer

#: Request lengths (tokens) of :func:`check_tail_waste`.
TAIL_LENGTHS = (1, 15, 16, 17, 100, 1000, 2047)

#: The batch of :func:`check_slot_mapping`: block tables, block size, positions per request.
BATCH = {"block_tables": [[3, 7], [1], [0, 2, 5]], "block_size": 4,
         "positions": [[4, 5], [2], [9]]}


#: The workload and arenas of :func:`check_smaller_arena` (exercise 4; the chapter's own).
ARENA_PREDICT = {"requests": 1000, "seed": 0, "arena_tokens": 16384, "smaller_arena": 8192,
                 "block_size": 16}

#: The workload and arena of :func:`check_block_size_design` (exercise 5): the chapter's arena
#: and generator, with short chat turns (mean prompt 40, mean output 80 tokens) instead of the
#: chapter's ShareGPT-like lengths, so the chapter's block-size table does not answer it.
BLOCK_DESIGN = {"requests": 1000, "seed": 0, "arena_tokens": 16384, "prompt_mean": 40.0,
                "output_mean": 80.0, "min_token_states": 0.95,
                "block_sizes": (4, 8, 16, 32, 64, 128, 256, 512)}


def blocks_to_add(num_tokens: int, new_tokens: int, num_blocks: int,
                  block_size: int) -> int:
    """Exercise 1: a colleague's shortcut: how many blocks a table of ``num_blocks``
    blocks holding ``num_tokens`` tokens must take to append ``new_tokens`` more.
    It passes their tests (a 37-token prompt in blocks of 16, then 10 decodes)."""
    return (num_tokens + new_tokens) // block_size + 1 - num_blocks


def _blocks_to_add_truth(num_tokens: int, new_tokens: int, block_size: int) -> int:
    """What :class:`~kvlab.core.paging.BlockTable` takes: whole blocks for the new total."""
    return -(-(num_tokens + new_tokens) // block_size) - (-(-num_tokens // block_size))


def check_blocks_to_add_counterexample(case) -> str:
    """Exercise 1: ``(num_tokens, new_tokens, block_size)`` on which :func:`blocks_to_add`
    (given the table a real ``BlockTable`` would hold) differs from what it takes."""
    require_answer(case, "counterexample")
    if not isinstance(case, (tuple, list)) or len(case) != 3 or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in case):
        raise AssertionError("give a tuple of three whole numbers "
                             "(num_tokens, new_tokens, block_size)")
    num_tokens, new_tokens, block_size = case
    if num_tokens < 0 or new_tokens < 1 or block_size < 1:
        raise AssertionError("need num_tokens >= 0, new_tokens >= 1 and block_size >= 1")
    held = -(-num_tokens // block_size)
    want = _blocks_to_add_truth(num_tokens, new_tokens, block_size)
    got = blocks_to_add(num_tokens, new_tokens, held, block_size)
    if got == want:
        raise AssertionError(f"both take {want} block{'s' * (want != 1)} here: the bug does "
                             "not show on this input.")
    return (f"Correct: the shortcut takes {got} where {want} "
            f"{'suffices' if want == 1 else 'suffice'}"
            ". Say what that costs a server that runs many "
            "requests at once.")


def fast_slot(block_table, block_size, token_pos):
    """An unchecked slot function (deliberately without validation), kept with
    :func:`check_fast_slot_counterexample` for teachers' own exercises."""
    return block_table[token_pos // block_size] * block_size + token_pos % block_size


def _outcome(fn, table, block_size, pos):
    try:
        return ("ok", fn(table, block_size, pos))
    except (ValueError, IndexError) as exc:
        return ("raises", type(exc).__name__)


def check_physical_slot(fn) -> str:  # kept for teachers' own exercises
    """Compare the reader's ``fn(block_table, block_size, token_pos)`` with the reference.

    Runs every combination of a few tables, block sizes and positions, including the
    invalid ones: the function must return the same slot, or raise the same exception type
    (ValueError for a bad block size, position or negative block; IndexError for a position
    past the table).
    """
    require_answer(fn, "your physical_slot function")
    if not callable(fn):
        raise AssertionError("pass a function taking (block_table, block_size, token_pos)")
    tables = ([9, 2], [0], [5, 1, 7], [], [-1, 4], [3, -2])
    cases = list(itertools.product(tables, (1, 2, 4, 0, -3), (0, 1, 3, 4, 5, 7, 9, 11, -1)))
    for table, block_size, pos in cases:
        want = _outcome(physical_slot, table, block_size, pos)
        try:
            got = _outcome(fn, table, block_size, pos)
        except Exception as exc:  # any other failure is reported to the reader
            got = ("raises", type(exc).__name__)
        if got != want:
            kind = "should raise" if want[0] == "raises" else "should return a slot"
            raise AssertionError(f"physical_slot({table}, {block_size}, {pos}) {kind}; yours "
                                 f"{'raised ' + got[1] if got[0] == 'raises' else 'returned'}"
                                 f"{'' if got[0] == 'raises' else ' ' + repr(got[1])}.")
    return f"Correct on all {len(cases)} cases, the invalid ones included."


def tail_waste(lengths, block_size: int) -> int:
    """Slots allocated but never written when each length gets whole blocks."""
    return sum(-(-n // block_size) * block_size - n for n in lengths)


def check_tail_waste(answer16, answer256) -> str:
    """Exercise 2: unwritten slots in the last blocks of :data:`TAIL_LENGTHS` at block size 16
    and 256."""
    for value, what in ((answer16, "block size 16"), (answer256, "block size 256")):
        require_answer(value, what)
        if isinstance(value, bool) or not isinstance(value, int):
            raise AssertionError(f"{what}: expected a whole number of slots, got {value!r}")
    truth = (tail_waste(TAIL_LENGTHS, 16), tail_waste(TAIL_LENGTHS, 256))
    wrong = [f"block size {q}: {got} is {'too high' if got > want else 'too low'}"
             for q, got, want in ((16, answer16, truth[0]), (256, answer256, truth[1]))
             if got != want]
    if wrong:
        raise AssertionError("; ".join(wrong) + ".")
    total = sum(TAIL_LENGTHS)
    return (f"Correct: {truth[0]} vs {truth[1]} wasted slots ({100 * truth[0] / total:.1f}% "
            f"vs {100 * truth[1] / total:.1f}% of {total} tokens). Small blocks waste less; "
            "very small blocks cost more table entries and less efficient kernels.")


def check_slot_mapping(answer) -> str:
    """Exercise 3: the flat slot mapping of :data:`BATCH` (one slot per scheduled token, in
    request order)."""
    require_answer(answer, "slot mapping")
    try:
        got = [operator.index(x) for x in answer]
    except TypeError:
        raise AssertionError(f"give a list of whole numbers (slots), got {answer!r}") from None
    truth = slot_mapping(**BATCH).tolist()
    if len(got) != len(truth):
        raise AssertionError(f"the step schedules {len(truth)} tokens; your mapping has "
                             f"{len(got)} entries (one slot per scheduled token).")
    tokens = [(r, p) for r, ps in enumerate(BATCH["positions"]) for p in ps]
    wrong = [f"request {r} position {p}" for (r, p), g, t in zip(tokens, got, truth,
                                                                 strict=True) if g != t]
    if wrong:
        raise AssertionError("wrong slot for " + ", ".join(wrong) + ".")
    return f"Correct: {truth}."


def check_fast_slot_counterexample(case) -> str:  # kept for teachers' own exercises
    """An input on which :func:`fast_slot` returns a slot where the reference
    :func:`~kvlab.reference.physical_slot` raises."""
    require_answer(case, "counterexample")
    if not isinstance(case, (tuple, list)) or len(case) != 3:
        raise AssertionError("give a tuple (block_table, block_size, token_pos)")
    table, block_size, pos = case
    want = _outcome(physical_slot, list(table), block_size, pos)
    try:
        got = ("ok", fast_slot(list(table), block_size, pos))
    except Exception as exc:
        got = ("raises", type(exc).__name__)
    if want[0] == "ok":
        raise AssertionError("the reference accepts this input, so it reveals no bug: look "
                             "for inputs the reference rejects.")
    if got[0] == "raises":
        raise AssertionError(f"fast_slot also fails here ({got[1]}), so the bug stays "
                             "visible. Find an input where it silently returns a slot.")
    return (f"Correct: fast_slot returns {got[1]} where physical_slot raises {want[1]}. The "
            "engine would write that token's K/V into a slot it does not own.")


@functools.lru_cache(maxsize=16)
def _paged_run(requests: int, seed: int, arena_tokens: int, block_size: int,
               prompt_mean: float = 161.0, output_mean: float = 338.0):
    """The paged simulation of a ShareGPT-like workload (the chapter's by default; cached: the
    checks reuse runs)."""
    workload = sharegpt_like_workload(requests, seed=seed, prompt_mean=prompt_mean,
                                      output_mean=output_mean)
    return simulate(workload, "paged", arena_tokens, block_size=block_size)


#: Exercise 4's options, each a claim about (mean batch, share of token states) when the arena
#: halves: "half" or "same" for each.
ARENA_OPTIONS = {"a": ("half", "half"), "b": ("half", "same"), "c": ("same", "half"),
                 "d": ("same", "same")}


def _how(ratio: float) -> str:
    return "half" if 0.35 <= ratio <= 0.65 else "same" if ratio >= 0.9 else "other"


def check_smaller_arena(answer) -> str:
    """Exercise 4: what halving :data:`ARENA_PREDICT`'s arena does to the paged run's mean batch
    and to the share of the arena holding token states (a letter of :data:`ARENA_OPTIONS`)."""
    require_answer(answer, "your letter")
    letter = str(answer).strip().lower()
    if letter not in ARENA_OPTIONS:
        raise AssertionError(f"answer with one of {sorted(ARENA_OPTIONS)}, got {answer!r}")
    d = ARENA_PREDICT
    big = _paged_run(d["requests"], d["seed"], d["arena_tokens"], d["block_size"])
    small = _paged_run(d["requests"], d["seed"], d["smaller_arena"], d["block_size"])
    seen = (_how(small.mean_running / big.mean_running),
            _how(small.token_states / big.token_states))
    claim = ARENA_OPTIONS[letter]
    if claim != seen:
        # one reason only, about one part of the option: naming every part that fails (and so,
        # by omission, the parts that hold) would point to the right option by elimination
        what, said = next((w, c) for w, c, s in zip(("the mean batch",
                                                     "the share of token states"),
                                                    claim, seen, strict=True) if c != s)
        change = "fall to about half" if said == "half" else "stay about the same"
        raise AssertionError(f"({letter}) fails; one reason: in the run {what} does not "
                             f"{change} when the arena halves.")
    return (f"Correct: the mean batch goes from {big.mean_running:.1f} to "
            f"{small.mean_running:.1f}, the token states from {big.token_states:.1%} to "
            f"{small.token_states:.1%}. Paging's waste is a few slots per running request, so "
            "it shrinks with the batch: the share is a property of the block size, not of the "
            "arena.")


def check_block_size_design(block_size) -> str:
    """Exercise 5: the largest block size in :data:`BLOCK_DESIGN` whose paged run of its
    workload keeps at least ``min_token_states`` of the arena holding token states."""
    require_answer(block_size, "block size")
    d = BLOCK_DESIGN
    if block_size not in d["block_sizes"]:
        raise AssertionError(f"choose one of {d['block_sizes']}, got {block_size!r}")

    def good(q: int) -> bool:
        run = _paged_run(d["requests"], d["seed"], d["arena_tokens"], q, d["prompt_mean"],
                         d["output_mean"])
        return run.token_states >= d["min_token_states"]

    if not good(block_size):
        raise AssertionError(f"at block size {block_size} less than "
                             f"{d['min_token_states']:.0%} of the arena holds token states: "
                             "too large.")
    # the share falls as the block grows (the tests check it over every size), so the next
    # size up decides whether a larger one also meets the target
    larger = [q for q in d["block_sizes"] if q > block_size][:1]
    if larger and good(larger[0]):
        raise AssertionError(f"block size {block_size} meets the target, but a larger one "
                             "does too: too small.")
    return (f"Correct: {block_size} is the largest block size that keeps "
            f"{d['min_token_states']:.0%} of the arena holding token states here.")
