"""Counter-based random streams: one generator per (request seed, token position, purpose).

A speculating request draws the randomness for the token at position ``t`` from streams keyed
by ``(seed, t)``, never from a running generator. So "rolling the RNG back" after a rejection
costs nothing and cannot go wrong: the positions past the accepted prefix are drawn again from
the same keys when they are next decided. Exactness is kept because the token finally kept at
``t`` is decided in exactly one step, from streams that nothing decided before it has read
(the decisions at earlier positions never look at later drafts). The output is a function of
the seed alone: independent of the batch, of preemption, and of the step boundaries.
"""

from __future__ import annotations

import torch

__all__ = ["DRAFT", "TARGET", "position_generator", "stream_seed"]

TARGET = 0   # accept test, then residual or bonus draw
DRAFT = 1    # the draft model's own sample at this position

_MASK = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def stream_seed(seed: int, position: int, purpose: int) -> int:
    """The 63-bit seed of stream ``(seed, position, purpose)``."""
    return _mix(_mix(_mix(seed & _MASK) ^ position) ^ purpose) >> 1


def position_generator(seed: int, position: int, purpose: int,
                       device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one token position and purpose (:data:`TARGET` / :data:`DRAFT`)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(stream_seed(seed, position, purpose))
    return gen
