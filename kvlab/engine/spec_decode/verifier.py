"""The rejection sampler: exact multi-token verification of a request's drafts (float64).

For drafts ``x_1..x_k`` proposed from draft distributions ``q_i`` and the target's
distributions ``p_0..p_k`` (row ``i`` conditions on the drafts before it), keep ``x_i`` with
probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection emit a token drawn from the
normalised residual ``[p_i - q_i]+`` and stop; if every draft is kept emit a bonus token from
``p_k``. Each emitted token is distributed exactly as the target's (Leviathan et al. 2023,
Chen et al. 2023); chapter 9 derives it and :func:`kvlab.reference.speculative_step` is the
single-position reference this module is tested against, position by position.

Both distributions are *processed*: temperature, top-k, top-p and the grammar mask applied the
same way to draft and target (:func:`processed_probs`). A greedy request has one-hot
distributions: a draft is kept exactly when it is the target's argmax, so the output equals
non-speculative greedy decoding token for token. A proposer without probabilities (n-gram)
has ``q_i`` = a point mass on ``x_i``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.sampler import filter_logits

__all__ = ["Verdict", "processed_probs", "verify"]


def processed_probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[R, V]`` of float64 probabilities after the grammar mask (``allowed``: bool
    ``[R, V]``), temperature, top-k and top-p of each row's ``params`` (one for all rows, or
    one per row); greedy rows get the argmax one-hot. One batched call for the whole step."""
    rows = logits.shape[0]
    per_row = [params] * rows if isinstance(params, SamplingParams) else list(params)
    assert len(per_row) == rows, "one SamplingParams per row"
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    greedy = [i for i, p in enumerate(per_row) if p.greedy]
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        out[g] = out[g].scatter_(-1, logits[g].argmax(-1, keepdim=True), 1.0)
    rand = [i for i, p in enumerate(per_row) if not p.greedy]
    if rand:
        r = torch.tensor(rand, device=logits.device)
        out[r] = filter_logits(logits[r], [per_row[i] for i in rand]).double().softmax(-1)
    return out


@dataclass(frozen=True)
class Verdict:
    """One request's verification: the emitted ``tokens`` (accepted drafts, then one corrected
    or bonus token), ``num_accepted`` drafts, and at the first rejection the rejected draft
    with its target and draft probabilities ``(position index, token, p(x), q(x))``."""

    tokens: tuple[int, ...]
    num_accepted: int
    rejected: tuple[int, int, float, float] | None = None


def verify(p: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None,
           generators: Callable[[int], torch.Generator | None]) -> Verdict:
    """Verify ``drafts`` (``k`` tokens) against target rows ``p: [k + 1, V]`` (float64).

    ``q: [k, V]`` draft rows (float64), or None for point-mass proposals. ``generators(i)``
    gives row ``i``'s target stream (None: the rows are one-hot, nothing random is drawn).
    Row ``i``'s stream draws the accept uniform first and then, on rejection, the residual
    sample, exactly as :func:`~kvlab.reference.speculative_step` does with one generator.
    """
    k = len(drafts)
    assert p.shape[0] == k + 1 and (q is None or q.shape[0] == k), "rows do not match drafts"
    if k:
        idx = torch.tensor(list(drafts), device=p.device)
        ar = torch.arange(k, device=p.device)
        px = p[ar, idx]
        qx = q[ar, idx] if q is not None else torch.ones_like(px)
        ratio = (px / qx).clamp(max=1.0).tolist()
        gens = [generators(i) for i in range(k)]
        # the reference draws torch.rand((), generator) (float32) per position
        u = [torch.rand((), generator=g).item() if g is not None else 0.5 for g in gens]
        for i in range(k):
            if u[i] < ratio[i]:
                continue
            residual = p[i].clone()
            if q is not None:
                residual = (residual - q[i]).clamp_min(0)
            else:
                residual[drafts[i]] = 0.0
            if gens[i] is None:                       # one-hot target: its argmax
                token = int(residual.argmax())
            else:
                token = int(torch.multinomial(residual / residual.sum(), 1, generator=gens[i]))
            rej = (i, int(drafts[i]), float(px[i]), float(qx[i]))
            return Verdict((*(int(t) for t in drafts[:i]), token), i, rej)
    g = generators(k)
    bonus = int(p[k].argmax()) if g is None else int(torch.multinomial(p[k], 1, generator=g))
    return Verdict((*(int(t) for t in drafts), bonus), k)
