"""The runner's persistent input batch keeps block tables from the scheduler's deltas alone and
builds exactly the metadata of ``build_metadata`` over the full tables, step after step."""

from __future__ import annotations

import random

import pytest
import torch

from kvlab.core.step_records import ScheduledChunk
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.input_batch import InputBatch


def _same(a, b) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "paged_rows",
                 "paged_tables", "paged_lens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.query_start, a.start_pos, a.dense) == (b.query_start, b.start_pos, b.dense)


def _chunk(rid, tokens, start, table, kept):
    return ScheduledChunk(rid, tuple(tokens), start, tuple(table[kept:]), True, len(tokens) > 1,
                          num_kept_blocks=kept)


@pytest.mark.parametrize("seed", range(6))
def test_input_batch_follows_table_deltas_and_equals_build_metadata(seed):
    """Requests arrive (prefill chunks), decode, grow tables, get an entry rewritten (as after
    copy-on-write) or the tail cut (a speculative rollback), skip steps (their rows stay),
    are preempted (resent whole) and finish; tables exceed the initial capacity. The runner
    sees only the deltas, as the KV manager's ``table_delta`` makes them."""
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    batch = InputBatch(bs, max_rows=2, max_blocks=2)   # forces growth of both dimensions
    next_block = iter(range(10**6))
    live: dict[str, dict] = {}
    made = 0
    for _ in range(40):
        while len(live) < 12 and rng.random() < 0.5:
            live[f"r{made}"] = {"pos": 0, "len": rng.randint(1, 40), "table": [], "sent": 0}
            made += 1
        chunks, ended, truth = [], [], {}
        for rid, r in list(live.items()):
            if rng.random() < 0.15:     # not scheduled this step: its row is kept
                continue
            if r["table"] and rng.random() < 0.05:   # preempted: table gone, resent whole
                batch.remove([rid])
                r.update(pos=0, table=[], sent=0)
            n = 1 if r["pos"] >= r["len"] else rng.randint(1, r["len"] - r["pos"])
            end = r["pos"] + n
            if r["table"] and rng.random() < 0.1:   # a rollback cut the tail
                keep = max(1, len(r["table"]) - rng.randint(0, 2))
                del r["table"][keep:]
                r["sent"] = min(r["sent"], keep)
            while len(r["table"]) * bs < end:
                r["table"].append(next(next_block))
            if r["table"] and rng.random() < 0.1:   # copy-on-write: an entry is replaced
                at = rng.randrange(len(r["table"]))
                r["table"][at] = next(next_block)
                r["sent"] = min(r["sent"], at)
            chunks.append(_chunk(rid, [rng.randrange(100) for _ in range(n)], r["pos"],
                                 r["table"], r["sent"]))
            r["sent"] = len(r["table"])
            truth[rid] = tuple(r["table"])
            r["pos"] = end
            if r["pos"] > r["len"] + rng.randint(0, 30):
                del live[rid]
                ended.append(rid)
        if not chunks:
            continue
        batch.apply(chunks)
        expected = [ChunkSpec(c.token_ids, c.start_pos, truth[c.request_id]) for c in chunks]
        for c in chunks:                # the runner's row is the whole table, from the delta
            assert batch.table(c.request_id) == list(truth[c.request_id])
        _same(batch.build(chunks), build_metadata(expected, bs))
        batch.remove(ended)             # finished after the step ran
    for rid, r in live.items():
        if rid in batch.row_ids():
            assert batch.table(rid)[:r["sent"]] == r["table"][:r["sent"]]
    assert batch.entries_written > 0


def test_input_batch_writes_only_the_delta():
    batch = InputBatch(4)
    tables = {f"r{i}": [10 * i] for i in range(8)}
    sent = dict.fromkeys(tables, 0)
    for step in range(12):
        chunks = []
        for rid, t in tables.items():
            if step % 4 == 0 and step:
                t.append(t[-1] + 1)
            chunks.append(_chunk(rid, [1], 4 * len(t) - 1 - (step % 4 != 0), t, sent[rid]))
            sent[rid] = len(t)
        batch.apply(chunks)
        batch.build(chunks)
    assert batch.entries_written == 8 + 8 * 2   # each table once, then each appended block
    assert all(batch.table(rid) == t for rid, t in tables.items())


def test_input_batch_asserts_the_schedulers_guarantees():
    """The scheduler never sends a delta that keeps more than the runner has, an empty chunk or
    a table that does not cover its chunk; the batch asserts it (inside the engine: asserts,
    not validation)."""
    batch = InputBatch(8)
    with pytest.raises(AssertionError, match="keeps more table entries"):
        batch.apply([_chunk("a", [1], 0, [0, 1], 1)])
    assert batch.num_rows == 0
    batch.apply([_chunk("a", [1], 20, [0, 1], 0)])
    with pytest.raises(AssertionError, match="does not cover"):
        batch.build([_chunk("a", [1], 20, [0, 1], 2)])
    batch.apply([_chunk("b", [], 0, [3], 0)])
    with pytest.raises(AssertionError, match="does not cover"):
        batch.build([_chunk("b", [], 0, [3], 1)])
