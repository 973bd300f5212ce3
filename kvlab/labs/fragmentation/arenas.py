"""Contiguous KV arenas: the allocators a pre-reserving server carves requests out of.

Both hand out one contiguous chunk per request and take it back whole, so external
fragmentation arises from real holes left by requests finishing at different times:

* :class:`BuddyArena` — power-of-two chunks, as the PagedAttention paper's Orca baselines;
  the round-up is internal fragmentation.
* :class:`FirstFitArena` — exact sizes; freed holes coalesce with their neighbours.

Common interface: ``allocate(n) -> (start, granted) | None``, ``free(start)``, ``holes()``
(free hole lengths) and the static ``granted_size(n)``.
"""

from __future__ import annotations

import bisect

__all__ = ["ARENAS", "BuddyArena", "FirstFitArena"]


class FirstFitArena:
    """Contiguous allocator over ``size`` slots: first hole large enough wins; frees coalesce.

    ``allocate(n)`` returns ``(start, granted)`` with ``granted == n`` or None when no hole
    of ``n`` slots exists; ``free(start)`` returns the chunk. Holes are kept sorted by start.
    """

    name = "first_fit"

    @staticmethod
    def granted_size(n: int) -> int:
        """Slots a request for ``n`` slots occupies (first fit grants exactly ``n``)."""
        return n

    def __init__(self, size: int):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"arena size must be a positive int, got {size!r}")
        self.size = size
        self._starts: list[int] = [0]        # hole starts, sorted
        self._lengths: dict[int, int] = {0: size}
        self._chunks: dict[int, int] = {}    # start -> granted length

    def allocate(self, n: int) -> tuple[int, int] | None:
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        for start in self._starts:
            length = self._lengths[start]
            if length >= n:
                self._starts.remove(start)
                del self._lengths[start]
                if length > n:
                    bisect.insort(self._starts, start + n)
                    self._lengths[start + n] = length - n
                self._chunks[start] = n
                return start, n
        return None

    def free(self, start: int) -> None:
        length = self._chunks.pop(start)
        i = bisect.bisect_left(self._starts, start)
        # merge with the following hole
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths.pop(self._starts.pop(i))
        # merge with the preceding hole
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            self._lengths[self._starts[i - 1]] += length
        else:
            self._starts.insert(i, start)
            self._lengths[start] = length

    def holes(self) -> list[int]:
        """Lengths of the free holes, in address order."""
        return [self._lengths[s] for s in self._starts]


class BuddyArena:
    """Binary buddy allocator over ``size`` slots: chunks are powers of two, aligned.

    A request for ``n`` slots is rounded up to ``2**ceil(log2 n)`` (the round-up is internal
    fragmentation); a freed chunk merges with its buddy whenever the buddy is free too. An
    arena that is not a power of two is covered by aligned power-of-two top chunks.
    """

    name = "buddy"

    def __init__(self, size: int):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"arena size must be a positive int, got {size!r}")
        self.size = size
        self._free: dict[int, set[int]] = {}   # order -> starts of free chunks
        self._chunks: dict[int, int] = {}      # start -> order
        start = 0
        while start < size:                     # greedy aligned power-of-two cover
            order = (size - start).bit_length() - 1
            while start % (1 << order):
                order -= 1
            self._free.setdefault(order, set()).add(start)
            start += 1 << order
        self._top_order = {s: o for o, starts in self._free.items() for s in starts}
        self._top_starts = sorted(self._top_order)

    @staticmethod
    def granted_size(n: int) -> int:
        """Slots a request for ``n`` slots occupies: ``n`` rounded up to a power of two."""
        return 1 << max(0, (n - 1).bit_length())

    def allocate(self, n: int) -> tuple[int, int] | None:
        if n <= 0:
            raise ValueError(f"allocation size must be positive, got {n}")
        want = max(0, (n - 1).bit_length())
        orders = sorted(o for o, s in self._free.items() if s and o >= want)
        if not orders:
            return None
        order = orders[0]
        start = min(self._free[order])
        self._free[order].discard(start)
        while order > want:                      # split, keep the upper half free
            order -= 1
            self._free.setdefault(order, set()).add(start + (1 << order))
        self._chunks[start] = order
        return start, 1 << order

    def free(self, start: int) -> None:
        order = self._chunks.pop(start)
        top_order = self._top_order[self._top_start(start)]
        while order < top_order:
            buddy = start ^ (1 << order)         # top chunks are aligned: XOR finds the buddy
            if buddy not in self._free.get(order, ()):
                break
            self._free[order].discard(buddy)
            start = min(start, buddy)
            order += 1
        self._free.setdefault(order, set()).add(start)

    def _top_start(self, start: int) -> int:
        """Start of the top-level chunk containing ``start``."""
        i = bisect.bisect_right(self._top_starts, start) - 1
        return self._top_starts[i]

    def holes(self) -> list[int]:
        """Lengths of the free chunks (buddies that cannot merge count separately)."""
        return [1 << o for o, starts in sorted(self._free.items()) for _ in starts]


ARENAS = {"buddy": BuddyArena, "first_fit": FirstFitArena}
