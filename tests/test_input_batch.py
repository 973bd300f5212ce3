"""The persistent input batch builds exactly the metadata of ``build_metadata``, step after step,
while writing only table diffs."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.engine.attention import ChunkSpec, build_metadata
from kvlab.engine.model_runner import InputBatch


def _same(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.positions, b.positions)
    assert torch.equal(a.slot_mapping, b.slot_mapping)
    assert a.num_single == b.num_single and a.last_row == b.last_row
    assert a.max_position == b.max_position and a.block_size == b.block_size
    assert len(a.buckets) == len(b.buckets)
    for x, y in zip(a.buckets, b.buckets, strict=True):
        assert (x.row0, x.size, x.max_blocks) == (y.row0, y.size, y.max_blocks)
        assert torch.equal(x.block_index, y.block_index)
        assert torch.equal(x.mask, y.mask)
    assert len(a.prefills) == len(b.prefills)
    for x, y in zip(a.prefills, b.prefills, strict=True):
        assert (x.offset, x.num_tokens, x.start_pos) == (y.offset, y.num_tokens, y.start_pos)
        assert torch.equal(x.slots, y.slots)


@pytest.mark.parametrize("seed", range(6))
def test_input_batch_equals_build_metadata_over_random_steps(seed):
    """Requests arrive (prefill chunks), decode, grow tables, get a block rewritten (as after
    copy-on-write), skip steps, finish and are replaced; tables exceed the initial capacity."""
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    batch = InputBatch(bs, max_rows=2, max_blocks=2)   # forces growth of both dimensions
    next_block = iter(range(10**6))
    live: dict[str, dict] = {}
    made = 0
    for _ in range(40):
        while len(live) < 12 and rng.random() < 0.5:
            live[f"r{made}"] = {"pos": 0, "len": rng.randint(1, 40), "table": []}
            made += 1
        chunks, ids = [], []
        for rid, r in list(live.items()):
            if rng.random() < 0.15:     # not scheduled this step (its row is released)
                continue
            n = 1 if r["pos"] >= r["len"] else rng.randint(1, r["len"] - r["pos"])
            end = r["pos"] + n
            while len(r["table"]) * bs < end:
                r["table"].append(next(next_block))
            if r["table"] and rng.random() < 0.1:   # copy-on-write: an entry is replaced
                r["table"][rng.randrange(len(r["table"]))] = next(next_block)
            chunks.append(ChunkSpec([rng.randrange(100) for _ in range(n)], r["pos"],
                                    tuple(r["table"])))
            ids.append(rid)
            r["pos"] = end
            if r["pos"] > r["len"] + rng.randint(0, 30):
                del live[rid]
        if not chunks:
            continue
        _same(batch.build(ids, chunks), build_metadata(chunks, bs))
        for rid, c in zip(ids, chunks, strict=True):
            assert batch.row_table(rid) == list(c.block_table)
    assert batch.entries_written > 0 and batch.rows_written > 0


def test_input_batch_writes_only_appended_blocks():
    batch = InputBatch(4)
    tables = {f"r{i}": [10 * i] for i in range(8)}
    for step in range(12):
        chunks = []
        for t in tables.values():
            if step % 4 == 0 and step:
                t.append(t[-1] + 1)
            chunks.append(ChunkSpec([1], 4 * len(t) - 1 - (step % 4 != 0), tuple(t)))
        batch.build(list(tables), chunks)
    assert batch.rows_written == 8          # one full write per request, at its first step
    assert batch.entries_written == 8 * 2   # then one entry per appended block


def test_input_batch_rejects_bad_chunks_without_storing():
    batch = InputBatch(8)
    with pytest.raises(ValueError, match="does not cover"):
        batch.build(["a"], [ChunkSpec([1], 20, (0, 1))])
    with pytest.raises(ValueError, match="no tokens"):
        batch.build(["a"], [ChunkSpec([], 0, (0,))])
    assert batch.num_rows == 0
