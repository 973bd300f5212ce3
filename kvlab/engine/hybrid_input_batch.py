"""The runner's persistent rows for a model with several KV cache groups: a block table per group
per request, kept from each chunk's deltas (group 0's as :class:`~kvlab.engine.input_batch.
InputBatch` keeps it, the others' from ``ScheduledChunk.group_deltas``), and a step's metadata
per group (:class:`HybridMetadata`), which each decoder layer picks by its group.

A window group's table keeps the ids of the blocks its window has dropped: the manager does
not send them again, and the attention of a layer with that window never reads them (nor the
block 0 sent for an entry dropped before it was first sent), as in vLLM, whose worker tables
keep them too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from kvlab.core.step_records import ScheduledChunk
from kvlab.engine.attention_metadata import AttentionMetadata, flat_metadata
from kvlab.engine.input_batch import InputBatch
from kvlab.engine.sampler import SamplerState

__all__ = ["HybridInputBatch", "HybridMetadata"]


@dataclass(frozen=True)
class HybridMetadata(AttentionMetadata):
    """A step's metadata for a model with several KV cache groups: group 0's (its own fields),
    every group's (``groups``: the same rows and positions, each its group's tables and slots)
    and the group of each decoder layer (``layer_group``)."""

    groups: tuple[AttentionMetadata, ...] = ()
    layer_group: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.layer_group[layer]]


class HybridInputBatch(InputBatch):
    """:class:`~kvlab.engine.input_batch.InputBatch` with one table per KV cache group;
    ``layer_group[l]``: the group of decoder layer ``l``."""

    def __init__(self, block_size: int, layer_group: Sequence[int],
                 device: torch.device | str = "cpu", max_rows: int = 64, max_blocks: int = 64):
        super().__init__(block_size, device, max_rows, max_blocks)
        self.layer_group = tuple(layer_group)
        others = max(self.layer_group)
        self.group_tables = [torch.zeros(max_rows, max_blocks, dtype=torch.long)
                             for _ in range(others)]
        self._group_len: list[dict[str, int]] = [{} for _ in range(others)]

    def group_table(self, request_id: str, group: int) -> list[int]:
        """The runner's copy of ``request_id``'s table in ``group``."""
        if group == 0:
            return self.table(request_id)
        length = self._group_len[group - 1][request_id]
        return self.group_tables[group - 1][self.row(request_id), :length].tolist()

    @torch.inference_mode()
    def remove(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        known = self.row_ids()
        for rid in request_ids:
            if rid in known:
                row = self.row(rid)
                for tables, lengths in zip(self.group_tables, self._group_len, strict=True):
                    tables[row, :lengths.pop(rid)] = 0
        super().remove(request_ids)

    @torch.inference_mode()
    def apply(self, chunks: Sequence[ScheduledChunk],
              states: Mapping[str, SamplerState] | None = None) -> None:
        super().apply(chunks, states)         # rows, sampling parameters, group 0's tables
        rows = self.tables.shape[0]
        for g, (tables, lengths) in enumerate(zip(self.group_tables, self._group_len,
                                                  strict=True)):
            deltas = [(c.request_id, *c.group_deltas[g]) for c in chunks]
            for rid, kept, _ in deltas:
                assert kept <= lengths.get(rid, 0), \
                    f"{rid!r}: group {g + 1}'s delta keeps more entries than the runner has"
            need = max((kept + len(new) for _, kept, new in deltas), default=0)
            if rows > tables.shape[0] or need > tables.shape[1]:
                grown = torch.zeros(max(rows, tables.shape[0]),
                                    max(tables.shape[1], 2 * tables.shape[1]
                                        if need > tables.shape[1] else 0, need),
                                    dtype=torch.long)
                grown[:tables.shape[0], :tables.shape[1]] = tables
                tables = self.group_tables[g] = grown
            for rid, kept, new in deltas:
                row = self.row(rid)
                if new:
                    tables[row, kept:kept + len(new)] = torch.tensor(new, dtype=torch.long)
                    self.entries_written += len(new)
                n, before = kept + len(new), lengths.get(rid, 0)
                if n < before:
                    tables[row, n:before] = 0
                lengths[rid] = n

    def build(self, chunks: Sequence[ScheduledChunk], paged_max_tokens: int = 0
              ) -> HybridMetadata:
        """Group 0's metadata (:meth:`InputBatch.build`) with every group's beside it."""
        first = super().build(chunks, paged_max_tokens)
        rows = torch.tensor([self.row(c.request_id) for c in chunks], dtype=torch.long)
        tokens, starts = [c.token_ids for c in chunks], [c.start_pos for c in chunks]
        groups = (first, *(flat_metadata(tokens, starts, tables.index_select(0, rows),
                                         self.block_size, self.device, paged_max_tokens)
                           for tables in self.group_tables))
        own = {f.name: getattr(first, f.name) for f in fields(AttentionMetadata)}
        return HybridMetadata(**own, groups=groups, layer_group=self.layer_group)
