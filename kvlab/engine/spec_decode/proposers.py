"""Proposers: where draft tokens come from.

:class:`NgramProposer` (prompt lookup, no model) and :class:`DraftModelProposer` (a small model
with its own paged KV cache). Both answer :meth:`propose` for one step: per speculating request
(a chunk with ``num_lookahead > 0``) up to ``num_lookahead`` draft tokens and, for the draft
model, the processed draft distributions ``q`` they were sampled from.

The draft model's KV lives in a second :class:`~kvlab.engine.kv_cache.PagedKVCache` with the
same number of blocks and the same block tables as the target's, so every decision of the
scheduler (allocation, copy-on-write, prefix-cache hits, truncation after a rejection) holds
for both caches at once. To keep it complete, the draft runs every step over *every* chunk the
target runs (prefills too), then ``k`` single-token steps for the speculating requests, the
last of which only writes the KV of the final draft: after any verification outcome the draft
cache holds valid KV for every position the target has computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvlab.core.step_records import ScheduledChunk
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.model import LlamaModel
from kvlab.engine.ops import Kernels
from kvlab.engine.spec_decode.rng import DRAFT, position_generator
from kvlab.engine.spec_decode.verifier import processed_probs

__all__ = ["DraftModelProposer", "NgramProposer", "Proposal", "RowContext", "ngram_lookup"]


@dataclass
class RowContext:
    """What a proposer needs about one speculating request: its tokens so far, sampling
    parameters, stream seed (None: greedy) and optional grammar constraint."""

    token_ids: tuple[int, ...]
    params: object
    seed: int | None
    constraint: object | None = None


@dataclass
class Proposal:
    """Draft tokens and (draft model only) their processed distributions ``q: [len, V]``."""

    tokens: tuple[int, ...]
    q: torch.Tensor | None


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """Prompt lookup: for ``n`` from ``n_max`` down to ``n_min``, find the latest earlier
    occurrence of the last ``n`` tokens and return (up to ``k`` of) the tokens that followed
    it; ``()`` when no suffix recurs."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(tokens[size - n:])
        for start in range(size - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                return tuple(tokens[start + n:start + n + k])
    return ()


class NgramProposer:
    """Prompt-lookup proposals: deterministic, so ``q`` is a point mass on each draft."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """No KV of its own."""

    def propose(self, chunks: Sequence[ScheduledChunk], rows: dict[str, RowContext],
                tables: Mapping[str, Sequence[int]]) -> dict[str, Proposal]:
        out = {}
        for c in chunks:
            if not c.num_lookahead:
                continue
            ctx = rows[c.request_id]
            drafts = ngram_lookup(ctx.token_ids, c.num_lookahead, self.n_min, self.n_max)
            if ctx.constraint is not None:   # keep the drafts the grammar allows
                kept = []
                for t in drafts:
                    if not ctx.constraint.push(t):
                        break
                    kept.append(t)
                ctx.constraint.pop_all()
                drafts = tuple(kept)
            out[c.request_id] = Proposal(drafts, None)
        return out


class DraftModelProposer:
    """A draft model over its own paged KV (same block tables as the target's)."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 kernels: Kernels) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                  cfg.head_dim, dtype=model.dtype, device=model.device)
        self.kernels = kernels

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write copies of the step, applied to the draft cache too."""
        self.cache.copy_blocks(copies)

    def _run(self, specs: list[ChunkSpec], rows: list[int]) -> torch.Tensor:
        meta = build_metadata(specs, self.block_size, self.model.device,
                              self.kernels.attention.paged_max_tokens)
        picked = torch.tensor([meta.last_row[i] for i in rows], dtype=torch.long,
                              device=self.model.device)
        return self.model.logits(self.model(meta, self.cache.layers, self.kernels,
                                            rows=picked))

    def _draw(self, logits: torch.Tensor, ctxs: list[RowContext], positions: list[int]
              ) -> list[tuple[int, torch.Tensor]]:
        """Sample one draft per row (the rows' processed distributions, per-position draft
        streams; argmax for greedy rows)."""
        allowed = None
        if any(c.constraint is not None for c in ctxs):
            allowed = torch.stack([c.constraint.allowed() if c.constraint is not None else
                                   torch.ones(logits.shape[-1], dtype=torch.bool)
                                   for c in ctxs]).to(logits.device)
        q = processed_probs(logits, [c.params for c in ctxs], allowed).cpu()
        out = []
        for row, (ctx, pos) in enumerate(zip(ctxs, positions, strict=True)):
            if ctx.seed is None:
                out.append((int(q[row].argmax()), q[row]))
            else:
                gen = position_generator(ctx.seed, pos, DRAFT, "cpu")
                out.append((int(torch.multinomial(q[row], 1, generator=gen)), q[row]))
        return out

    @torch.inference_mode()
    def propose(self, chunks: Sequence[ScheduledChunk], rows: dict[str, RowContext],
                tables: Mapping[str, Sequence[int]]) -> dict[str, Proposal]:
        """Drafts for the chunks with lookahead; ``tables``: each chunk's block table (the
        draft cache has the target's geometry, so the same tables address it). The draft runs
        over every chunk the target runs, prefills too, so its cache holds what later drafts
        read; a step without lookahead runs that forward alone."""
        if not chunks:
            return {}
        spec = [i for i, c in enumerate(chunks) if c.num_lookahead]
        logits = self._run([ChunkSpec(c.token_ids, c.start_pos, tables[c.request_id])
                            for c in chunks], spec)
        if not spec:
            return {}
        drafts: dict[str, list[int]] = {chunks[i].request_id: [] for i in spec}
        qs: dict[str, list[torch.Tensor]] = {chunks[i].request_id: [] for i in spec}

        def draw(j: int, logits: torch.Tensor, which: list[int]) -> None:
            ctxs = [rows[chunks[i].request_id] for i in which]
            got = self._draw(logits, ctxs, [chunks[i].start_pos + 1 + j for i in which])
            for i, ctx, (token, q) in zip(which, ctxs, got, strict=True):
                if ctx.constraint is not None:
                    ctx.constraint.push(token)
                drafts[chunks[i].request_id].append(token)
                qs[chunks[i].request_id].append(q)

        draw(0, logits, spec)
        for j in range(1, max((chunks[i].num_lookahead for i in spec), default=0) + 1):
            # step j feeds draft j (position start + j); the last step only writes its KV
            active = [i for i in spec if chunks[i].num_lookahead >= j]
            want = [r for r, i in enumerate(active) if chunks[i].num_lookahead > j]
            specs = [ChunkSpec((drafts[chunks[i].request_id][-1],), chunks[i].start_pos + j,
                               tables[chunks[i].request_id]) for i in active]
            logits = self._run(specs, want)
            if want:
                draw(j, logits, [active[r] for r in want])
        out = {}
        for i in spec:
            rid = chunks[i].request_id
            ctx = rows[rid]
            if ctx.constraint is not None:
                ctx.constraint.pop_all()
            out[rid] = Proposal(tuple(drafts[rid]), torch.stack(qs[rid]))
        return out
