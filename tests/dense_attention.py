"""The dense reference the paged attention paths are tested against (a test oracle)."""

from __future__ import annotations

import torch


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float, window: int = 0) -> torch.Tensor:
    """One sequence, ``q: [T, H, D]``, ``k, v: [T, KV, D]``, plain causal softmax (query ``i``
    over keys ``0 .. i``, or ``i - window + 1 .. i`` with a sliding ``window > 0``).

    Written out with explicit matmuls and a float64 softmax (no SDPA, no paging) so that tests
    compare the paged path against an independent computation.
    """
    t, heads, _ = q.shape
    group = heads // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1).double()  # [H, T, D]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1).double()
    scores = q.transpose(0, 1).double() @ kk.transpose(1, 2) * scale  # [H, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if window:
        causal = causal.triu(-(window - 1))
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1).to(q.dtype)
