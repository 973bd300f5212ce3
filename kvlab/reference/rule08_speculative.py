"""Spec rule 8 — exact speculative decoding: the reference single-token ``speculative_step``.

The draft distribution ``q`` proposed token ``x``; accept it with probability
``min(1, p(x)/q(x))``, otherwise sample from the normalised positive residual ``[p - q]+``.
The token that results is distributed exactly as ``p``. This module imports torch; the package
:mod:`kvlab.reference` loads it only when ``speculative_step`` is first used.
"""

from __future__ import annotations

import torch

__all__ = ["speculative_step"]


def speculative_step(p, q, proposal, generator=None):
    """p/q:[V] normalized distributions -> token, accepted."""
    if p.shape != q.shape or p.ndim != 1 or p.numel() == 0:
        raise ValueError("p and q must share one token space")
    if not isinstance(proposal, int) or not 0 <= proposal < p.numel():
        raise ValueError("proposal must index the shared vocabulary")
    p, q = p.double(), q.double()
    if not torch.all(torch.isfinite(p) & (p >= 0)) or not torch.all(
            torch.isfinite(q) & (q >= 0)):
        raise ValueError("probabilities must be finite and non-negative")
    if not torch.allclose(
            torch.stack((p.sum(), q.sum())), p.new_ones(2)):
        raise ValueError("p and q must be normalized")
    qx = q[proposal]
    if qx <= 0:
        raise ValueError("draft could not have sampled this proposal")
    accept = min(1.0, (p[proposal] / qx).item())
    if torch.rand((), generator=generator).item() < accept:
        return int(proposal), True
    residual = (p - q).clamp_min(0)
    if residual.sum() <= 0:
        raise ValueError("rejection has no residual mass")
    residual = residual / residual.sum()
    return int(torch.multinomial(residual, 1, generator=generator)), False
