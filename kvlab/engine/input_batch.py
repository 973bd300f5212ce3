"""The runner's persistent input batch: one row per running request, its block table and its
sampling filter parameters, updated from each step's scheduler output alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from kvlab.core.sampling_params import SamplingParams
from kvlab.core.step_records import ScheduledChunk
from kvlab.engine.attention_metadata import AttentionMetadata, flat_metadata
from kvlab.engine.sampler import RowParams, SamplerState, row_top_k

__all__ = ["InputBatch"]


class InputBatch:
    """The runner's persistent rows, one per running request (vLLM's ``InputBatch``): its block
    table, kept from the chunks' deltas alone, and its filter parameters (temperature, top-k,
    top-p, min-p) as arrays the sampler indexes. A row is made by a request's first chunk (again
    after a preemption) and dropped on preemption or when the request ends; the arrays grow on
    demand."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu",
                 max_rows: int = 64, max_blocks: int = 64):
        self.block_size, self.device = block_size, torch.device(device)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.long)
        self.temperature = torch.ones(max_rows, dtype=torch.float64)
        self.top_k = torch.zeros(max_rows, dtype=torch.long)
        self.top_p = torch.ones(max_rows, dtype=torch.float64)
        self.min_p = torch.zeros(max_rows, dtype=torch.float64)
        self._filtered: set[int] = set()          # rows that use min-p, top-k or top-p
        self._row_of: dict[str, int] = {}
        self._len: dict[str, int] = {}            # table length of each row's request
        self._free = list(range(max_rows - 1, -1, -1))
        self.entries_written = 0                  # table entries written, over all steps

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def row_ids(self) -> set[str]:
        """The requests that have a row."""
        return set(self._row_of)

    def row(self, request_id: str) -> int:
        """The row of a request that has one."""
        return self._row_of[request_id]

    def table(self, request_id: str) -> list[int]:
        """The runner's copy of ``request_id``'s block table."""
        return self.tables[self._row_of[request_id], :self._len[request_id]].tolist()

    @torch.inference_mode()
    def remove(self, request_ids: Iterable[str]) -> None:
        """Drop the rows of ``request_ids`` (unknown ids are ignored)."""
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self.tables[row, :self._len.pop(rid)] = 0   # free rows are all padding
                self._filtered.discard(row)
                self._free.append(row)

    def row_params(self, request_ids: Sequence[str]) -> RowParams:
        """The filter parameters of ``request_ids``' rows, in that order."""
        rows = torch.tensor([self._row_of[rid] for rid in request_ids], dtype=torch.long)
        return RowParams(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                         self.min_p[rows],
                         any(self._row_of[rid] in self._filtered for rid in request_ids))

    @torch.inference_mode()
    def apply(self, chunks: Sequence[ScheduledChunk],
              states: Mapping[str, SamplerState] | None = None) -> None:
        """Apply each chunk's table delta; a chunk without a row gets one, with the filter
        parameters of its request's sampler state in ``states`` (defaults when not given)."""
        for c in chunks:
            assert c.num_kept_blocks <= self._len.get(c.request_id, 0), \
                f"{c.request_id!r}: the delta keeps more table entries than the runner has"
        need = max((c.num_kept_blocks + len(c.new_block_ids) for c in chunks), default=0)
        rows = sum(c.request_id not in self._row_of for c in chunks)
        width = self.tables.shape[1]
        if need > width or rows > len(self._free):
            old_rows, old_width = self.tables.shape
            grown = torch.zeros(max(old_rows, self.num_rows + rows),
                                max(old_width, 2 * old_width if need > old_width else 0, need),
                                dtype=torch.long)
            grown[:old_rows, :old_width] = self.tables
            self.tables = grown
            extra = grown.shape[0] - old_rows
            self.temperature = torch.cat((self.temperature, torch.ones(extra).double()))
            self.top_k = torch.cat((self.top_k, torch.zeros(extra, dtype=torch.long)))
            self.top_p = torch.cat((self.top_p, torch.ones(extra).double()))
            self.min_p = torch.cat((self.min_p, torch.zeros(extra).double()))
            self._free.extend(range(grown.shape[0] - 1, old_rows - 1, -1))
        for c in chunks:
            row = self._row_of.get(c.request_id)
            if row is None:
                row = self._row_of[c.request_id] = self._free.pop()
                if states is not None:
                    self._set_params(row, states[c.request_id].params)
            kept, new = c.num_kept_blocks, c.new_block_ids
            if new:
                self.tables[row, kept:kept + len(new)] = torch.tensor(new, dtype=torch.long)
                self.entries_written += len(new)
            n, before = kept + len(new), self._len.get(c.request_id, 0)
            if n < before:                      # a rollback cut the tail: pad with 0 again
                self.tables[row, n:before] = 0
            self._len[c.request_id] = n

    def _set_params(self, row: int, p: SamplingParams) -> None:
        self.temperature[row] = p.temperature
        self.top_k[row] = row_top_k(p)
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        if p.filtered:
            self._filtered.add(row)

    def build(self, chunks: Sequence[ScheduledChunk], paged_max_tokens: int = 0
              ) -> AttentionMetadata:
        """The step's metadata from the rows, with tensor operations (:meth:`apply` the
        step's deltas first; each chunk's table covers it, as the scheduler guarantees)."""
        for c in chunks:
            assert c.token_ids and c.start_pos >= 0 and (
                self._len[c.request_id] * self.block_size >= c.start_pos + len(c.token_ids)), \
                f"{c.request_id!r}: its table does not cover its chunk"
        rows = torch.tensor([self._row_of[c.request_id] for c in chunks], dtype=torch.long)
        return flat_metadata([c.token_ids for c in chunks], [c.start_pos for c in chunks],
                             self.tables.index_select(0, rows), self.block_size, self.device,
                             paged_max_tokens)
