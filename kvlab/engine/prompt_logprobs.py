"""Prompt log-probabilities (vLLM's ``SamplingParams(prompt_logprobs=k)``), off the default path.

For a prompt ``t_0 .. t_{L-1}`` the entry of token ``j >= 1`` is a dict ``token id -> raw
log-probability`` at position ``j - 1``: the ``k`` most likely tokens, then ``t_j`` (always
present); entry 0 is None. The runner creates one :class:`PromptScorer` when the first request
asking for them is added; steps without such a request run exactly as before.

Rows come from the runner's own forward (every chunk of a chunked prefill gives its rows; the
forward keeps all hidden rows only in steps that carry such a chunk). vLLM skips *reading* the
prefix cache for these requests (``skip_reading_prefix_cache`` in v0.32's ``sampling_params.py``,
read by ``kv_cache_manager.py``); kvlab keeps the hit and scores the positions the hit skipped in
one extra forward over a scratch KV cache, which gives the same values. Only sample 0 of an
``n > 1`` request is scored (the prompt is the same for every sample): the engine gives the
other samples' runner requests ``prompt_logprobs=None``. Not with speculative
decoding (its executor runs its own forward): such requests get no prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kvlab.engine.attention_metadata import flat_metadata
from kvlab.engine.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from kvlab.core.step_records import ScheduledChunk
    from kvlab.engine.attention_metadata import AttentionMetadata
    from kvlab.engine.model import LlamaModel
    from kvlab.engine.ops import Kernels
    from kvlab.engine.sampler import SamplerState

__all__ = ["PromptScorer", "entries_from_logits"]

Entry = dict[int, float] | None


def entries_from_logits(logits: torch.Tensor, targets: list[int], k: int) -> list[dict]:
    """One entry per row of ``logits: [M, V]``: the ``k`` best raw log-probabilities, then
    ``targets[i]``'s (the sampler's dict layout)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])[:, 0]
    values, ids = logprobs.topk(max(k, 1), dim=-1)
    out = []
    for row_ids, row_values, t, v in zip(ids.tolist(), values.tolist(), targets,
                                         chosen.tolist(), strict=True):
        d = {int(i): float(x) for i, x in zip(row_ids[:k], row_values[:k], strict=True)}
        d[t] = float(v)
        out.append(d)
    return out


class PromptScorer:
    """The prompt entries of the runner's scored requests, filled chunk by chunk; a request's
    whole list is handed over once (:meth:`take`) in the step that completes it."""

    def __init__(self, requests: Mapping[str, SamplerState], model: LlamaModel,
                 block_size: int, kernels: Kernels) -> None:
        self.requests = requests      # the runner's sampler states (its dict, read as it changes)
        self.model, self.block_size, self.kernels = model, block_size, kernels
        self.pending: dict[str, list[Entry]] = {}   # seq id -> entries (None: not yet)
        self.complete: set[str] = set()
        self.done: dict[str, list[Entry]] = {}
        self._plan: list[tuple[int, ScheduledChunk]] = []

    def _wants(self, rid: str) -> bool:
        s = self.requests.get(rid)   # LLMEngine asks for sample 0's entries alone
        return s is not None and s.params.prompt_logprobs is not None and rid not in self.complete

    def plan(self, chunks: tuple[ScheduledChunk, ...]) -> bool:
        """Whether this step carries a chunk whose request still needs prompt entries."""
        live = self.requests
        for rid in [r for r in (*self.pending, *self.complete) if r not in live]:
            self.pending.pop(rid, None)
            self.complete.discard(rid)
        self._plan = [(i, c) for i, c in enumerate(chunks) if self._wants(c.request_id)
                      and c.start_pos < len(self.requests[c.request_id].prompt_ids)]
        return bool(self._plan)

    def score(self, meta: AttentionMetadata, hidden: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
        """Fill the planned chunks' entries from ``hidden`` (all rows of the step) and the
        scratch forward; return ``hidden[rows]``, what the sampler needs."""
        model = self.model
        for i, c in self._plan:
            rid = c.request_id
            prompt = list(self.requests[rid].prompt_ids)
            k = self.requests[rid].params.prompt_logprobs
            entries = self.pending.setdefault(rid, [None] * len(prompt))
            # position p predicts prompt token p + 1; positions L-1 on predict outputs
            want = [p for p in range(c.start_pos, min(c.start_pos + c.num_tokens,
                                                      len(prompt) - 1)) if entries[p + 1] is None]
            if want:
                index = torch.tensor([meta.query_start[i] + p - c.start_pos for p in want],
                                     dtype=torch.long, device=hidden.device)
                got = entries_from_logits(model.logits(hidden[index]),
                                          [prompt[p + 1] for p in want], k)
                for p, e in zip(want, got, strict=True):
                    entries[p + 1] = e
            missing = [p for p in range(min(c.start_pos, len(prompt) - 1))
                       if entries[p + 1] is None]
            if missing:       # a prefix hit skipped these positions: one scratch forward
                got = self._scratch(prompt[:missing[-1] + 1], prompt, missing, k)
                for p, e in zip(missing, got, strict=True):
                    entries[p + 1] = e
            if all(e is not None for e in entries[1:]):
                self.done[rid] = entries
                self.complete.add(rid)
                del self.pending[rid]
        return hidden[rows]

    def _scratch(self, tokens: list[int], prompt: list[int], positions: list[int],
                 k: int) -> list[dict]:
        """Entries at ``positions`` from a forward of ``tokens`` over a fresh KV cache."""
        model, cfg = self.model, self.model.cfg
        bs = self.block_size
        nb = -(-len(tokens) // bs)
        cache = PagedKVCache(cfg.num_layers, nb, bs, cfg.num_kv_heads, cfg.head_dim,
                             dtype=model.dtype, device=model.device)
        kernels = self.kernels
        meta = flat_metadata([tokens], [0], torch.arange(nb)[None, :], bs, model.device,
                             kernels.attention.paged_max_tokens)
        hidden = model(meta, cache.layers, kernels,
                       rows=torch.tensor(positions, dtype=torch.long, device=model.device))
        return entries_from_logits(model.logits(hidden), [prompt[p + 1] for p in positions], k)

    def take(self) -> dict[str, list[Entry]] | None:
        """The requests completed since the last call (None when none)."""
        done, self.done = self.done, {}
        return done or None
