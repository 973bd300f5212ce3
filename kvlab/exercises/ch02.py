"""Chapter 2 exercises: write ``physical_slot``, count block-tail waste, map a batch.

Each check computes the truth with :mod:`kvlab.core.paging` and raises ``AssertionError``
with a hint when the answer differs.
"""

from __future__ import annotations

import itertools

from kvlab.core.paging import slot_mapping
from kvlab.reference import physical_slot

from ._common import require_answer

#: Request lengths (tokens) of :func:`check_tail_waste`.
TAIL_LENGTHS = (1, 15, 16, 17, 100, 1000, 2047)

#: The batch of :func:`check_slot_mapping`: block tables, block size, positions per request.
BATCH = {"block_tables": [[3, 7], [1], [0, 2, 5]], "block_size": 4,
         "positions": [[4, 5], [2], [9]]}


def _outcome(fn, table, block_size, pos):
    try:
        return ("ok", fn(table, block_size, pos))
    except (ValueError, IndexError) as exc:
        return ("raises", type(exc).__name__)


def check_physical_slot(fn) -> str:
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
            raise AssertionError(f"physical_slot({table}, {block_size}, {pos}): expected "
                                 f"{want[1]!r}{' to be raised' if want[0] == 'raises' else ''},"
                                 f" got {got[1]!r}")
    return f"Correct on all {len(cases)} cases, the invalid ones included."


def tail_waste(lengths, block_size: int) -> int:
    """Slots allocated but never written when each length gets whole blocks."""
    return sum(-(-n // block_size) * block_size - n for n in lengths)


def check_tail_waste(answer16, answer256) -> str:
    """Unwritten slots in the last blocks of :data:`TAIL_LENGTHS` at block size 16 and 256."""
    for value, what in ((answer16, "block size 16"), (answer256, "block size 256")):
        require_answer(value, what)
    truth = (tail_waste(TAIL_LENGTHS, 16), tail_waste(TAIL_LENGTHS, 256))
    if (answer16, answer256) != truth:
        raise AssertionError(f"({answer16}, {answer256}) is not right. Each request wastes "
                             "ceil(n / q) * q - n slots; sum over the requests.")
    total = sum(TAIL_LENGTHS)
    return (f"Correct: {truth[0]} vs {truth[1]} wasted slots ({100 * truth[0] / total:.1f}% "
            f"vs {100 * truth[1] / total:.1f}% of {total} tokens). Small blocks waste less; "
            "very small blocks cost more table entries and less efficient kernels.")


def check_slot_mapping(answer) -> str:
    """The flat slot mapping of :data:`BATCH` (one slot per scheduled token, request order)."""
    require_answer(answer, "slot mapping")
    truth = slot_mapping(**BATCH).tolist()
    if [int(x) for x in answer] != truth:
        raise AssertionError(f"{list(answer)} is not right: slot = block_size * "
                             "table[pos // block_size] + pos % block_size, request by request.")
    return f"Correct: {truth}."
