"""Chapter 2 exercises: debug a block-count shortcut, count block-tail waste, map a batch,
predict what a smaller arena changes, design a block size.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with :mod:`kvlab.labs.paging` or the fragmentation simulation);
the debug checks run the reader's case against the reference. Each raises ``AssertionError``
saying what is wrong without printing the expected answer.
"""

from __future__ import annotations

import itertools
import operator

from kvlab.exercises._common import require_answer, sealed
from kvlab.reference import physical_slot

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
    """What :class:`~kvlab.labs.paging.BlockTable` takes: whole blocks for the new total."""
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


def check_tail_waste(answer16, answer256) -> str:
    """Exercise 2: unwritten slots in the last blocks of :data:`TAIL_LENGTHS` at block size 16
    and 256."""
    for value, what in ((answer16, "block size 16"), (answer256, "block size 256")):
        require_answer(value, what)
        if isinstance(value, bool) or not isinstance(value, int):
            raise AssertionError(f"{what}: expected a whole number of slots, got {value!r}")
    wrong = [f"block size {q}: {got} is {way}" for q, got in ((16, answer16), (256, answer256))
             if (way := sealed(f"ch02.tail_waste.{q}").direction(got))]
    if wrong:
        raise AssertionError("; ".join(wrong) + ".")
    total = sum(TAIL_LENGTHS)
    return (f"Correct: {answer16} vs {answer256} wasted slots ({100 * answer16 / total:.1f}% "
            f"vs {100 * answer256 / total:.1f}% of {total} tokens). Small blocks waste less; "
            "very small blocks cost more table entries and less efficient kernels.")


def check_slot_mapping(answer) -> str:
    """Exercise 3: the flat slot mapping of :data:`BATCH` (one slot per scheduled token, in
    request order)."""
    require_answer(answer, "slot mapping")
    try:
        got = [operator.index(x) for x in answer]
    except TypeError:
        raise AssertionError(f"give a list of whole numbers (slots), got {answer!r}") from None
    tokens = [(r, p) for r, ps in enumerate(BATCH["positions"]) for p in ps]
    if len(got) != len(tokens):
        raise AssertionError(f"the step schedules {len(tokens)} tokens; your mapping has "
                             f"{len(got)} entries (one slot per scheduled token).")
    wrong = [f"request {r} position {p}" for i, ((r, p), g) in enumerate(zip(tokens, got,
                                                                             strict=True))
             if sealed(f"ch02.slot_mapping.{i}").direction(g)]
    if wrong:
        raise AssertionError("wrong slot for " + ", ".join(wrong) + ".")
    return f"Correct: {got}."


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


#: Exercise 4's options, each a claim about (mean batch, share of token states) when the arena
#: halves: "half" or "same" for each.
ARENA_OPTIONS = {"a": ("half", "half"), "b": ("half", "same"), "c": ("same", "half"),
                 "d": ("same", "same")}


def check_smaller_arena(answer) -> str:
    """Exercise 4: what halving :data:`ARENA_PREDICT`'s arena does to the paged run's mean batch
    and to the share of the arena holding token states (a letter of :data:`ARENA_OPTIONS`)."""
    require_answer(answer, "your letter")
    letter = str(answer).strip().lower()
    if letter not in ARENA_OPTIONS:
        raise AssertionError(f"answer with one of {sorted(ARENA_OPTIONS)}, got {answer!r}")
    # each option's verdict is sealed under it: a wrong one gets one reason only, about one
    # part of the option (naming every part that fails would point to the right option)
    truth = sealed("ch02.smaller_arena")
    if not truth.is_answer(letter):
        raise AssertionError(truth.note(letter))
    return truth.note(letter)


def check_block_size_design(block_size) -> str:
    """Exercise 5: the largest block size in :data:`BLOCK_DESIGN` whose paged run of its
    workload keeps at least ``min_token_states`` of the arena holding token states."""
    require_answer(block_size, "block size")
    d = BLOCK_DESIGN
    if block_size not in d["block_sizes"]:
        raise AssertionError(f"choose one of {d['block_sizes']}, got {block_size!r}")
    # the share falls as the block grows (the tests check it over every size), so the largest
    # size that meets the target splits the sizes into too small and too large
    way = sealed("ch02.block_size_design").direction(block_size)
    if way == "too high":
        raise AssertionError(f"at block size {block_size} less than "
                             f"{d['min_token_states']:.0%} of the arena holds token states: "
                             "too large.")
    if way:
        raise AssertionError(f"block size {block_size} meets the target, but a larger one "
                             "does too: too small.")
    return (f"Correct: {block_size} is the largest block size that keeps "
            f"{d['min_token_states']:.0%} of the arena holding token states here.")
