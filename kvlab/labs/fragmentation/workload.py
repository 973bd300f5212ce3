"""Workloads for the fragmentation measurement: requests with true prompt and output lengths.

:func:`sharegpt_like_workload` draws a seeded, heavy-tailed synthetic chat workload whose
length statistics are close to the ShareGPT means the PagedAttention paper reports. Same
arguments, same workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["WorkloadRequest", "sharegpt_like_workload"]


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: arrival step and its true prompt and output lengths."""

    request_id: int
    arrival: int
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        for name in ("arrival", "prompt_len", "output_len"):
            value = getattr(self, name)
            low = 0 if name == "arrival" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"WorkloadRequest.{name} must be an int >= {low}, got {value!r}")

    @property
    def total_len(self) -> int:
        """Tokens whose K/V the request stores by the time it finishes."""
        return self.prompt_len + self.output_len


def sharegpt_like_workload(
    num_requests: int,
    seed: int = 0,
    *,
    prompt_mean: float = 161.0,
    output_mean: float = 338.0,
    sigma: float = 1.0,
    max_seq_len: int = 2048,
    arrival_rate: float | None = None,
) -> list[WorkloadRequest]:
    """A seeded synthetic chat workload with ShareGPT-like, heavy-tailed lengths.

    Prompt and output lengths are drawn independently from log-normal distributions with
    shape ``sigma`` and means ``prompt_mean`` / ``output_mean`` before clipping (161 and 338
    tokens by default, close to the ShareGPT means reported in the PagedAttention paper).
    Prompts are clipped to ``[1, max_seq_len // 2]`` and outputs to
    ``[1, max_seq_len - prompt]`` so every request fits in ``max_seq_len``.
    Arrivals: all at step 0 when ``arrival_rate`` is None (an offline batch), else a Poisson
    process of ``arrival_rate`` requests per step. Same arguments, same workload.
    """
    if not isinstance(num_requests, int) or num_requests <= 0:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    for name, value in (("prompt_mean", prompt_mean), ("output_mean", output_mean),
                        ("sigma", sigma)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ValueError(f"arrival_rate must be positive or None, got {arrival_rate!r}")
    rng = np.random.default_rng(seed)

    def lognormal(mean: float) -> np.ndarray:
        return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, num_requests)

    prompts = np.clip(np.rint(lognormal(prompt_mean)), 1, max_seq_len // 2).astype(np.int64)
    outputs = np.clip(np.rint(lognormal(output_mean)), 1, max_seq_len - prompts)
    if arrival_rate is None:
        arrivals = np.zeros(num_requests, dtype=np.int64)
    else:
        gaps = rng.exponential(1.0 / arrival_rate, num_requests)
        arrivals = np.floor(np.cumsum(gaps)).astype(np.int64)
    return [
        WorkloadRequest(i, int(a), int(p), int(o))
        for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs.astype(np.int64), strict=True))
    ]
