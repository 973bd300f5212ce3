"""A persistent input batch: block tables kept across steps and updated by per-step diffs.

Between two decode steps a running request's block table changes by at most a block appended
at the end (or, after copy-on-write or a preemption, a rewritten entry). Rebuilding every
table from the scheduler's tuples each step (what :func:`~kvlab.engine.attention.build_metadata`
does) is Python work proportional to the whole batch's tables; vLLM v1's model runner keeps
an ``InputBatch`` with one persistent block-table row per request instead, and writes only what
changed. :class:`InputBatch` does the same for kvlab's executor:

- each scheduled request owns a row of ``tables: [max_rows, max_blocks]`` (int64) while it
  keeps being scheduled; a row is released when its request is absent from a step;
- per step, a row is left alone when the request's table is the same tuple, gets only its new
  tail written when the old table is a prefix of the new one, and is rewritten otherwise;
- the decode rows' slot mapping and their buckets' block indices are then gathered from the
  persistent tensor in a few tensor ops, not per request in Python.

:meth:`InputBatch.build` returns exactly the :class:`~kvlab.engine.attention.AttentionMetadata`
``build_metadata`` would (tested field by field); multi-token chunks (prefills) still go
through ``build_metadata``, which they dominate with their own attention cost anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import (
    AttentionMetadata,
    ChunkSpec,
    DecodeBucket,
    Workspace,
    _split_buckets,
    build_metadata,
)

__all__ = ["InputBatch"]


class InputBatch:
    """Persistent block tables of the scheduled requests (CPU tensor; indices are copied to
    ``device`` per step). Grows its capacity on demand; one per executor."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu",
                 max_rows: int = 64, max_blocks: int = 64):
        self.block_size = block_size
        self.device = torch.device(device)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.long)
        self._row_of: dict[str, int] = {}
        self._table_of: dict[str, tuple[int, ...]] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        self.rows_written = 0     # counters: full rows written / tail entries written
        self.entries_written = 0

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def row_table(self, request_id: str) -> list[int]:
        """The stored table of ``request_id`` (for tests and debugging)."""
        n = len(self._table_of[request_id])
        return self.tables[self._row_of[request_id], :n].tolist()

    # ------------------------------------------------------------------ diffs
    def _grow(self, rows: int, blocks: int) -> None:
        old_rows, old_blocks = self.tables.shape
        new = torch.zeros(max(rows, old_rows), max(blocks, old_blocks), dtype=torch.long)
        new[:old_rows, :old_blocks] = self.tables
        self.tables = new
        self._free.extend(range(new.shape[0] - 1, old_rows - 1, -1))

    def update(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Make the stored tables equal ``(request_id, block_table)`` of this step's chunks;
        release the rows of requests not in the step."""
        present = {rid for rid, _ in chunks}
        for rid in [r for r in self._row_of if r not in present]:
            self._free.append(self._row_of.pop(rid))
            del self._table_of[rid]
        need_blocks = max((len(t) for _, t in chunks), default=0)
        new_rows = sum(rid not in self._row_of for rid, _ in chunks)
        if need_blocks > self.tables.shape[1] or new_rows > len(self._free):
            self._grow(self.num_rows + new_rows, max(need_blocks, 2 * self.tables.shape[1]
                                                     if need_blocks > self.tables.shape[1]
                                                     else 0))
        tables = self.tables
        for rid, table in chunks:
            table = tuple(table)
            old = self._table_of.get(rid)
            if old == table:
                continue
            row = self._row_of.get(rid)
            if row is None:
                row = self._free.pop()
                self._row_of[rid] = row
            n_old = len(old) if old is not None else 0
            if old is not None and len(table) >= n_old and table[:n_old] == old:
                tables[row, n_old:len(table)] = torch.tensor(table[n_old:], dtype=torch.long)
                self.entries_written += len(table) - n_old
            else:  # new row, or an entry rewritten (copy-on-write, re-admission)
                tables[row].zero_()
                tables[row, :len(table)] = torch.tensor(table, dtype=torch.long)
                self.rows_written += 1
            self._table_of[rid] = table

    # ------------------------------------------------------------------ metadata
    def build(self, request_ids: Sequence[str], chunks: Sequence[ChunkSpec],
              workspace: Workspace | None = None) -> AttentionMetadata:
        """The step's metadata (equal to ``build_metadata(chunks, ...)``); ``request_ids[i]``
        names ``chunks[i]``'s request. ValueError (nothing stored) on a malformed chunk."""
        bs = self.block_size
        for i, c in enumerate(chunks):
            end = c.start_pos + len(c.token_ids)
            if len(c.token_ids) == 0 or c.start_pos < 0 or len(c.block_table) * bs < end:
                # the general path raises the precise error
                return build_metadata(chunks, bs, self.device, workspace)
            if not isinstance(request_ids[i], str):
                raise ValueError(f"InputBatch.build: request id {request_ids[i]!r}")
        singles = sorted((i for i, c in enumerate(chunks) if len(c.token_ids) == 1),
                         key=lambda i: chunks[i].start_pos)
        self.update([(request_ids[i], chunks[i].block_table) for i in range(len(chunks))])
        if not singles:
            return build_metadata(chunks, bs, self.device, workspace)
        multis = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        rows = torch.tensor([self._row_of[request_ids[i]] for i in singles], dtype=torch.long)
        pos_list = [chunks[i].start_pos for i in singles]
        pos = torch.tensor(pos_list, dtype=torch.long)
        need = [p // bs + 1 for p in pos_list]
        width = need[-1]
        tab = self.tables.index_select(0, rows)[:, :width].contiguous()   # [S, width]
        slots = tab.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        span = torch.arange(width * bs)
        dtype = workspace.dtype if workspace is not None else torch.float32
        mask_all = torch.zeros(len(singles), width * bs, dtype=dtype).masked_fill_(
            span[None, :] > pos[:, None], float("-inf")).to(self.device)
        buckets = []
        for lo, hi in _split_buckets(need):
            nb = need[hi - 1]
            index = tab[lo:hi, :nb].reshape(-1).to(self.device)
            buckets.append(DecodeBucket(lo, hi - lo, nb, index,
                                        mask_all[lo:hi, None, :nb * bs]))
        ids = [chunks[i].token_ids[0] for i in singles]
        last_row = [0] * len(chunks)
        for row, i in enumerate(singles):
            last_row[i] = row
        positions, slot_mapping, prefills = pos, slots, []
        if multis:
            sub = build_metadata([chunks[i] for i in multis], bs, self.device, workspace)
            off = len(singles)
            ids.extend(sub.input_ids.tolist())
            positions = torch.cat([pos, sub.positions.cpu()])
            slot_mapping = torch.cat([slots, sub.slot_mapping.cpu()])
            prefills = [type(p)(p.offset + off, p.num_tokens, p.start_pos, p.slots)
                        for p in sub.prefills]
            for j, i in enumerate(multis):
                last_row[i] = sub.last_row[j] + off
        return AttentionMetadata(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=positions.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            num_single=len(singles), buckets=buckets, prefills=prefills, last_row=last_row,
            block_size=bs, workspace=workspace,
            max_position=max(c.start_pos + len(c.token_ids) for c in chunks) - 1,
            decode_tables=tab.to(self.device), decode_lens=(pos + 1).to(self.device))
