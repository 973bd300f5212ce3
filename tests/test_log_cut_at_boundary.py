"""A log cut cleanly at a record boundary (a valid prefix: the tail never reached the disk).

Unlike a torn or corrupted record (refused by recovery, see tests/test_chaos.py), a clean
prefix is indistinguishable from a crash at that record, so recovery must accept it. What it
then does, for every cut point of a seeded run with speculation and prefix sharing:

* accepts the prefix and rebuilds exactly the requests the prefix names (requests whose
  arrival was in the lost tail are unknown: their tables are freed, the client must resubmit);
* the invariant set holds on the recovered engine (invariant 7 tolerating only the blocks
  written past the durable progress);
* draining it, every request finishes with the tokens of the same request run alone, including
  requests that had already finished in the lost tail and are run again. The same tokens
  because the chaos executor computes each token from the request's own context, whatever the
  batch: a front end that deduplicates by request id and offset can rely on that here, and on a
  real engine only where its kernels are batch-invariant (chapter 12 measures kvlab's);
* no block is leaked.
"""

from __future__ import annotations

from kvlab.core.engine_core import EngineCore
from kvlab.labs.chaos.log_cut import build, make
from kvlab.labs.chaos.soak import ChaosExecutor, solo_tokens
from kvlab.labs.invariants.spec_invariants import EngineView, InvariantMonitor
from kvlab.labs.recovery import recover


def test_every_clean_prefix_of_the_log_recovers_to_a_correct_engine():
    _, sched, _, _ = build(1)
    n = len(sched.log.durable())
    assert n > 60
    refinished = lost = 0
    for k in range(n + 1):
        kv, sched, prompts, finished = build(1)
        prefix = sched.log.durable()[:k]
        recovered, _ = recover(prefix, kv, make)          # a clean prefix is never refused
        named = {e.request_id for e in prefix}
        ids = {r.request_id for r in recovered.requests()}
        assert ids == named & set(prompts), k
        assert set(kv.requests()) <= ids, k               # unexplained tables were freed
        lost += len(set(prompts) - ids)
        monitor = InvariantMonitor()
        monitor.reset({r.request_id: len(kv.block_table(r.request_id))
                       - kv.blocks_for(r.num_computed_tokens)
                       for r in recovered.requests() if kv.has(r.request_id)})
        monitor.check(EngineView(recovered, kv, recovered.step_count))
        core = EngineCore(recovered, ChaosExecutor(recovered.get_request, "draft"),
                          forget_ended=False)
        while core.has_unfinished_requests():
            core.step()
        for r in recovered.requests():
            assert r.status.value == "finished", (k, r.request_id, r.status)
            assert tuple(r.output_token_ids) == solo_tokens(*prompts[r.request_id]), k
            if r.request_id in finished:
                refinished += any(e.request_id == r.request_id and e.kind == "transition"
                                  and e.data[1] == "finished" for e in prefix) is False
        assert kv.num_allocatable_blocks() == kv.pool.num_blocks, k   # nothing leaked
    assert lost > 0 and refinished > 0     # both hazards of a lost tail did occur


def test_a_cut_inside_a_record_is_refused_but_a_cut_between_records_is_not():
    from dataclasses import replace

    import pytest

    from kvlab.labs.recovery.event_log import CorruptLog

    kv, sched, _, _ = build(2)
    events = sched.log.durable()
    torn = [*events[:-1], replace(events[-1], data=events[-1].data[:-1] or ("",))]
    before = kv.state_tuple()
    with pytest.raises(CorruptLog):
        recover(torn, kv, make)
    assert kv.state_tuple() == before                    # refused: nothing changed
    recover(events[:-1], kv, make)                       # the same log without that record
