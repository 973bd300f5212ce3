"""Chapter 2 exercises: debug and repair a block-count shortcut, count block-tail waste, map a
batch, predict what a smaller arena changes, design a block size.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with :mod:`kvlab.labs.paging` or the fragmentation simulation);
the debug check runs the reader's case and repair against a real ``BlockTable``. The ★★ and
★★★ checks cannot be passed by trying: they take the run's own numbers together with the
choice, or a function run on cases the chapter does not print. Each raises ``AssertionError``
saying which quantity is wrong and what to revisit, never the answer nor which way it is off.
"""

from __future__ import annotations

import itertools
import operator

from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed
from kvlab.labs.paging import BlockTable
from kvlab.reference import BlockAllocator, physical_slot

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


#: The inputs ``(num_tokens, new_tokens, block_size)`` exercise 1's check runs the reader's
#: repaired function on, besides the reader's own case (the chapter does not print them).
BLOCKS_TO_ADD_CASES = ((0, 1, 16), (0, 16, 16), (0, 17, 16), (37, 1, 16), (37, 11, 16),
                       (48, 1, 16), (47, 1, 16), (5, 3, 8), (7, 1, 8), (8, 8, 8),
                       (1, 1, 1), (100, 156, 256), (255, 1, 256), (3, 30, 4))


def _blocks_taken(num_tokens: int, new_tokens: int, block_size: int) -> tuple[int, int]:
    """``(blocks held, blocks taken)``: a real :class:`~kvlab.labs.paging.BlockTable` holding
    ``num_tokens`` tokens, then appending ``new_tokens`` more."""
    need = -(-(num_tokens + new_tokens) // block_size) + 1
    table = BlockTable(block_size, BlockAllocator(need))
    table.append_tokens(num_tokens)
    held = len(table.blocks)
    table.append_tokens(new_tokens)
    return held, len(table.blocks) - held


def _case(case, what: str) -> tuple[int, int, int]:
    if not isinstance(case, (tuple, list)) or len(case) != 3 or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in case):
        raise AssertionError(f"{what}: give a tuple of three whole numbers "
                             "(num_tokens, new_tokens, block_size)")
    num_tokens, new_tokens, block_size = case
    if num_tokens < 0 or new_tokens < 1 or block_size < 1:
        raise AssertionError(f"{what}: need num_tokens >= 0, new_tokens >= 1 and "
                             "block_size >= 1")
    if (num_tokens + new_tokens) // block_size > 1_000_000:
        raise AssertionError(f"{what}: keep it under a million blocks")
    return num_tokens, new_tokens, block_size


def check_blocks_to_add_counterexample(case, fixed_blocks_to_add) -> str:
    """Exercise 1: ``(num_tokens, new_tokens, block_size)`` on which :func:`blocks_to_add`
    (given the table a real ``BlockTable`` would hold) differs from what that table takes,
    and ``fixed_blocks_to_add``, the shortcut repaired (same signature), which must agree
    with a real ``BlockTable`` on that case and on :data:`BLOCKS_TO_ADD_CASES`."""
    require_answer(case, "counterexample")
    require_answer(fixed_blocks_to_add, "fixed_blocks_to_add")
    num_tokens, new_tokens, block_size = _case(case, "counterexample")
    held, want = _blocks_taken(num_tokens, new_tokens, block_size)
    got = blocks_to_add(num_tokens, new_tokens, held, block_size)
    if got == want:
        raise AssertionError("both take the same number of blocks here: the bug does not "
                             "show on this input.")
    if not callable(fixed_blocks_to_add):
        raise AssertionError("the counterexample is right; pass your repaired function, with "
                             "the shortcut's signature")
    for other in (tuple(case), *BLOCKS_TO_ADD_CASES):
        held_other, truth = _blocks_taken(*other)
        repaired = fixed_blocks_to_add(other[0], other[1], held_other, other[2])
        if isinstance(repaired, bool) or not isinstance(repaired, int) or repaired != truth:
            shown = "your counterexample" if other == tuple(case) else f"the input {other}"
            raise AssertionError("the counterexample is right; your repaired function "
                                 f"disagrees with a real BlockTable on {shown}: revisit how "
                                 "many whole blocks a table of n tokens holds, at and off a "
                                 "multiple of the block size.")
    return (f"Correct: the shortcut takes {got} where "
            f"{want} {'suffices' if want == 1 else 'suffice'}, and your repair agrees with a "
            f"real BlockTable on {len(BLOCKS_TO_ADD_CASES) + 1} inputs. Say what the "
            "shortcut costs a server that runs many requests at once.")


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
    wrong = [f"block size {q}" for q, got in ((16, answer16), (256, answer256))
             if not sealed(f"ch02.tail_waste.{q}").is_answer(got)]
    if wrong:
        raise AssertionError(" and ".join(wrong) + " not right: revisit how many whole blocks "
                             "each length takes, and how many of their slots stay empty.")
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
             if not sealed(f"ch02.slot_mapping.{i}").is_answer(g)]
    if wrong:
        raise AssertionError("wrong slot for " + ", ".join(wrong) + ": revisit the logical "
                             "block of a position, the physical block the table maps it to, "
                             "and the offset inside it.")
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


def check_smaller_arena(answer, mean_batch, token_states_pct) -> str:
    """Exercise 4: what halving :data:`ARENA_PREDICT`'s arena does to the paged run's mean batch
    and to the share of the arena holding token states (a letter of :data:`ARENA_OPTIONS`),
    with the smaller arena's run: its mean batch (``mean_running``) and its share of token
    states in percent (``100 * token_states``), each rounded to one decimal. The letter is the
    prediction and is graded first, once (``_common.earlier_prediction``): after a wrong letter
    every other letter gets the same reply, so the options cannot be eliminated one by one.
    The numbers are graded with it."""
    require_answer(answer, "your letter")
    require_answer(mean_batch, "mean batch")
    require_answer(token_states_pct, "token states (percent)")
    letter = str(answer).strip().lower()
    if letter not in ARENA_OPTIONS:
        raise AssertionError(f"answer with one of {sorted(ARENA_OPTIONS)}, got {answer!r}")
    for value, what in ((mean_batch, "mean batch"), (token_states_pct, "token states")):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AssertionError(f"{what}: expected a number, got {value!r}")
    truth = sealed("ch02.smaller_arena")
    earlier = earlier_prediction("ch02.smaller_arena", letter, truth.is_answer(letter))
    numbers_right = sealed("ch02.smaller_arena.run").is_answer([mean_batch, token_states_pct])
    numbers_wrong = (
        "the numbers are not those of the 8,192-slot run: revisit what to run (the chapter's "
        "workload, paged, blocks of 16, 8,192 slots) and what to read from its report "
        "(mean_running, and 100 x token_states), each rounded to one decimal.")
    if earlier is not None:
        if not numbers_right:
            raise AssertionError(numbers_wrong)
        return graded_once(earlier) + " (The run's numbers you give are right.)"
    # each option's verdict is sealed under it: a wrong one gets one reason only, about one
    # part of the option (naming every part that fails would point to the right option)
    if not truth.is_answer(letter):
        raise AssertionError(truth.note(letter) + " Your prediction is recorded: it is graded "
                             "once; run the smaller arena and see why.")
    if not numbers_right:
        raise AssertionError("your prediction is right; " + numbers_wrong)
    return truth.note(letter)


def check_block_size_design(block_size, token_states_pct, next_token_states_pct) -> str:
    """Exercise 5: the largest block size in :data:`BLOCK_DESIGN` whose paged run of its
    workload keeps at least ``min_token_states`` of the arena holding token states, with the
    token-state shares (percent, one decimal) of the runs at that block size and at the next
    larger one. The shares are checked against the runs at the sizes given, then the size."""
    require_answer(block_size, "block size")
    require_answer(token_states_pct, "token states at that block size")
    require_answer(next_token_states_pct, "token states at the next block size")
    d = BLOCK_DESIGN
    if block_size not in d["block_sizes"][:-1]:
        raise AssertionError(f"choose one of {d['block_sizes'][:-1]} (one with a next larger "
                             f"size), got {block_size!r}")
    shares = [token_states_pct, next_token_states_pct]
    if not sealed(f"ch02.block_size_design.shares.{block_size}").is_answer(shares):
        raise AssertionError(
            f"the shares are not those of the runs at block sizes {block_size} and "
            f"{2 * block_size}: revisit what to run (BLOCK_DESIGN's workload and arena, paged) "
            "and what to read (100 x token_states, rounded to one decimal).")
    if not sealed("ch02.block_size_design").is_answer(block_size):
        raise AssertionError(
            f"your shares at {block_size} and {2 * block_size} are right, but {block_size} is "
            f"not the largest block size whose share meets {d['min_token_states']:.0%}: "
            "revisit the criterion and compare each of your two shares with it.")
    return (f"Correct: {block_size} is the largest block size that keeps "
            f"{d['min_token_states']:.0%} of the arena holding token states here "
            f"({token_states_pct}% at {block_size}, {next_token_states_pct}% at "
            f"{2 * block_size}).")
