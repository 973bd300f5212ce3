"""Prefill/decode disaggregation, torch-free: entry format, descriptor checks, fault injector,
install journal and recovery, and the RemoteKVScheduler protocol under every fault.

The fault sweeps run the *in-process* connector and the toy token-KV engine of
:mod:`kvlab.labs.pd.pair` (hundreds of schedules in seconds; the toy samples from the KV it reads,
so
a wrong install changes tokens). The real model, storage and TCP between two OS processes are
tested in ``test_pd_engine.py``.
"""

from __future__ import annotations

import random

import pytest

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.request import (
    TRANSITIONS,
    IllegalTransition,
    Lifecycle,
    RequestStatus,
    RuntimeRequest,
)
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.disagg.entry import (
    REJECT_KINDS,
    check_delivery,
    decode_frame,
    encode_frame,
    make_descriptor,
    make_header,
    token_ids_hash,
)
from kvlab.disagg.install_journal import InstallJournal, InstallRecord, recover_installs
from kvlab.disagg.remote_kv_scheduler import RemoteKVPolicy, RemoteKVScheduler
from kvlab.disagg.transfer_faults import FAULT_KINDS, Fault, FaultSchedule, TransferFaultInjector
from kvlab.labs.invariants import check_scheduler
from kvlab.labs.pd.pair import TOY_FIELDS, run_pair
from kvlab.labs.recovery.event_log import EventLog
from kvlab.reference import REQUIRED_KV_FIELDS

S = RequestStatus


def _prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def _frame(prompt=(1, 2, 3, 4, 5), payload=b"\x01" * 64, domain="default"):
    desc = make_descriptor("req-0", prompt, domain, TOY_FIELDS)
    header = make_header(desc, 8, payload)
    expected = {k: v for k, v in desc.items() if k != "request_id"}
    return encode_frame(header, payload), expected


# ----------------------------------------------------------------------------- format
def test_token_ids_hash_is_exact():
    assert token_ids_hash([1, 2, 3]) == token_ids_hash((1, 2, 3))
    assert token_ids_hash([1, 2, 3]) != token_ids_hash([1, 2, 3, 0])
    assert token_ids_hash([1, 2, 3]) != token_ids_hash([3, 2, 1])
    assert token_ids_hash([256]) != token_ids_hash([1, 0])


def test_descriptor_has_every_required_field_and_good_entry_passes():
    frame, expected = _frame()
    d = decode_frame(frame)
    assert d.descriptor.keys() >= REQUIRED_KV_FIELDS
    assert check_delivery(d, expected) is None
    with pytest.raises(ValueError, match="lack"):
        make_descriptor("r", [1], "default", {"layers": 1})


@pytest.mark.parametrize("kind,reason", [
    ("truncate", "truncated"), ("corrupt_payload", "corrupt_payload"),
    ("corrupt_descriptor", "corrupt_descriptor"), ("stale_model_version", "stale_model_version"),
    ("security_domain", "security_domain"), ("layers", "incompatible"),
    ("kv_heads", "incompatible"), ("dtype", "incompatible"), ("rope", "incompatible")])
def test_every_damaged_frame_is_refused_with_its_kind(kind, reason):
    frame, expected = _frame()
    for seed in range(40):    # every byte position / cut the injector may choose
        plan = TransferFaultInjector(FaultSchedule((Fault(kind, 0),), seed)).on_send(frame)
        assert len(plan.frames) == 1
        assert check_delivery(decode_frame(plan.frames[0]), expected) == reason


def test_other_prompt_or_tenant_is_refused():
    frame, expected = _frame()
    assert check_delivery(decode_frame(frame), {**expected, "token_ids_hash":
                                                token_ids_hash([9])}) == "wrong_tokens"
    assert check_delivery(decode_frame(frame), {**expected, "security_domain": "b"}) \
        == "security_domain"
    assert check_delivery(decode_frame(b"garbage"), expected) == "corrupt_descriptor"
    assert set(REJECT_KINDS) >= {"truncated", "corrupt_payload", "incompatible"}


def test_fault_schedule_is_plain_data_and_validated():
    sched = FaultSchedule.random(7, 20, rate=1.0)
    assert FaultSchedule.from_data(sched.to_data()) == sched
    assert all(set(f) == {"kind", "point", "step"} for f in sched.to_data()["faults"])
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault("meteor")
    with pytest.raises(ValueError, match="cannot strike"):
        Fault("corrupt_payload", 0, "install")
    with pytest.raises(ValueError, match="step"):
        Fault("drop", -1)


def test_drop_duplicate_and_reorder_at_send():
    frame, _ = _frame()
    inj = TransferFaultInjector(FaultSchedule((Fault("drop", 0), Fault("duplicate", 1, "send"),
                                       Fault("out_of_order", 2, "send"))))
    assert inj.on_send(frame).frames == []
    assert inj.on_send(frame).frames == [frame, frame]
    assert inj.on_send(b"A" + frame[1:]).frames == []
    assert inj.on_send(frame).frames == [frame, b"A" + frame[1:]]   # arrives after the next
    crash = TransferFaultInjector(FaultSchedule((Fault("producer_crash", 0),), 1)).on_send(frame)
    assert crash.frames == [] and 0 < len(crash.partial) < len(frame)


# ----------------------------------------------------------------------------- lifecycle
def test_waiting_for_remote_kv_transitions():
    assert S.WAITING_FOR_REMOTE_KV in TRANSITIONS[S.WAITING]
    assert TRANSITIONS[S.WAITING_FOR_REMOTE_KV] == {S.WAITING, S.CANCELLED, S.FAILED}
    req = RuntimeRequest("a", (1, 2), 3)
    life = Lifecycle(EventLog())
    life.add(req)
    life.transition(req, S.WAITING_FOR_REMOTE_KV)
    with pytest.raises(IllegalTransition):
        life.transition(req, S.RUNNING)          # never decodes before its install
    assert req.status is S.WAITING_FOR_REMOTE_KV


# ----------------------------------------------------------------------------- protocol
def test_fault_free_pair_installs_everything_and_matches_single_engine():
    r = run_pair(_prompts(0))
    assert r.stats == {"installed": 5}
    assert r.tokens == r.truth
    assert r.violations == [] and r.leaked_blocks == 0


EXPECTED_COUNTER = {
    "drop": "missing", "truncate": "truncated", "corrupt_payload": "corrupt_payload",
    "corrupt_descriptor": "corrupt_descriptor", "stale_model_version": "stale_model_version",
    "security_domain": "security_domain", "layers": "incompatible", "kv_heads": "incompatible",
    "dtype": "incompatible", "rope": "incompatible",
    "producer_crash": ("missing", "truncated"),   # a stream cut mid-header / mid-payload
    "duplicate": "duplicate", "out_of_order": "installed", "after_abort": "after_abort",
}


@pytest.mark.parametrize("kind", [k for k in FAULT_KINDS if k != "consumer_crash"])
def test_each_fault_zero_wrong_installs_zero_leaks_tokens_equal(kind):
    r = run_pair(_prompts(1), FaultSchedule((Fault(kind, 2),), seed=5))
    assert r.violations == []                   # no position ever read wrong KV
    assert r.leaked_blocks == 0
    assert all(r.tokens[rid] == r.truth[rid] for rid in r.tokens)
    counters = EXPECTED_COUNTER[kind]
    counters = counters if isinstance(counters, tuple) else (counters,)
    assert sum(r.stats.get(c, 0) for c in counters) >= 1, r.stats
    if kind == "after_abort":
        assert r.status["r2"] == "cancelled" and len(r.tokens) == 4
    else:
        assert len(r.tokens) == 5
    if kind in ("duplicate", "out_of_order"):
        assert r.stats["installed"] == 5        # a duplicate installs nothing twice
    elif kind not in ("after_abort",):
        assert r.stats["installed"] == 4 and r.stats["recomputed"] == 1


def test_fail_policy_fails_the_request_with_the_reason():
    r = run_pair(_prompts(2), FaultSchedule((Fault("corrupt_payload", 0),), 1),
                 on_failure="fail")
    assert r.status["r0"] == "failed"
    assert all(r.status[f"r{i}"] == "finished" for i in range(1, 5))
    assert r.stats["corrupt_payload"] == 1 and "recomputed" not in r.stats
    assert r.leaked_blocks == 0


def test_consumer_crash_at_every_journal_record():
    prompts = _prompts(3)
    clean = run_pair(prompts)
    assert clean.stats["installed"] == 5
    for at in range(5 * 5 + 1):        # 5 records per install; +1: no crash at all
        r = run_pair(prompts, FaultSchedule((Fault("consumer_crash", at),)))
        assert r.violations == [] and r.leaked_blocks == 0
        assert r.tokens == r.truth        # everyone completes after the restart
        if at >= 25 or not r.crashed:
            continue
        # the journal tells whether each operation's blocks were installed: check it against
        # the surviving prefix cache (an installed op's prompt blocks are cached)
        for op, rec in r.recovery.items():
            prompt = prompts[int(op.split("@")[0][1:])]
            target = (len(prompt) - 1) // 4 * 4
            assert rec.installed == (r.recovery_cached[op] >= target), (at, op, rec)


def test_property_hundreds_of_seeded_fault_schedules():
    """300 random schedules (every fault kind, 0-5 faults each) through the in-process
    connector and the toy engine: never a wrong install, never a leaked block, tokens equal
    to the single engine for every completed request, and every refusal counted."""
    kinds_seen = set()
    for seed in range(300):
        prompts = _prompts(seed, n=5)
        sched = FaultSchedule.random(seed, 5, rate=0.6)
        r = run_pair(prompts, sched)
        assert r.violations == [], (seed, sched)
        assert r.leaked_blocks == 0, (seed, sched)
        for rid, toks in r.tokens.items():
            assert toks == r.truth[rid], (seed, rid, sched)
        assert all(s in ("finished", "cancelled") for s in r.status.values())
        cancelled = sum(s == "cancelled" for s in r.status.values())
        assert cancelled == sum(f.kind == "after_abort" for f in sched.faults)
        refused = sum(r.stats.get(k, 0) for k in (*REJECT_KINDS, "missing"))
        assert r.stats.get("recomputed", 0) <= refused     # only a refusal recomputes
        if not r.crashed:    # (a restarted consumer counts afresh)
            assert r.stats.get("installed", 0) + r.stats.get("recomputed", 0) \
                + r.stats.get("local_hit", 0) == 5 - cancelled   # each request decided once
        kinds_seen |= {k for _, _, k in r.applied}
    assert kinds_seen == set(FAULT_KINDS)


# ----------------------------------------------------------------------------- journal
def test_journal_refuses_corruption_and_recovery_is_idempotent():
    kv = KVCacheManager(16, 4)
    j = InstallJournal()
    j.append("begin", "a@1", ("a", 8))
    kv.admit("a@1", (), list(range(9)), 8)
    j.append("allocated", "a@1", (tuple(kv.block_table("a@1")), 0))
    rep = recover_installs(j, kv)
    assert rep["a@1"].installed is False and rep["a@1"].freed is True
    assert kv.requests() == [] and kv.num_allocatable_blocks() == 16
    assert recover_installs(j, kv)["a@1"].freed is False        # nothing freed twice
    j.records[0] = InstallRecord(0, "begin", "a@1", ("b", 8), j.records[0].checksum)
    with pytest.raises(ValueError, match="corrupt"):
        j.check()
    bad = InstallJournal()
    bad.append("begin", "x")
    bad.records.append(InstallRecord(1, "committed", "x"))
    bad.records[1] = InstallRecord(1, "committed", "x", (), bad.records[1].expected_checksum())
    with pytest.raises(ValueError, match="after begin"):
        bad.check()


# ----------------------------------------------------------------------------- boundary
def test_remote_scheduler_boundary_errors_and_parked_abort():
    kv = KVCacheManager(32, 4)
    inner = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    with pytest.raises(ValueError, match="source"):
        RemoteKVScheduler(inner, RemoteKVPolicy(TOY_FIELDS, consume=True))
    with pytest.raises(ValueError, match="exporter"):
        RemoteKVScheduler(inner, RemoteKVPolicy(TOY_FIELDS, produce=True))
    with pytest.raises(ValueError, match="on_failure"):
        RemoteKVPolicy(TOY_FIELDS, on_failure="ignore")
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteKVPolicy(TOY_FIELDS, timeout_s=-1)

    class Nothing:
        def fetch(self, keys):
            return []

        def wait(self, timeout):
            pass

    sched = RemoteKVScheduler(inner, RemoteKVPolicy(TOY_FIELDS, consume=True, timeout_s=1e9),
                              source=Nothing(), writer=object())
    req = RuntimeRequest("a", tuple(range(10)), 2)
    sched.add_request(req)
    assert req.status is S.WAITING_FOR_REMOTE_KV and sched.parked == ("a",)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(RuntimeRequest("a", (1, 2), 2))
    short = RuntimeRequest("b", (1, 2, 3), 2)       # no full block before its last token
    sched.add_request(short)
    assert short.status is S.WAITING and sched.parked == ("a",)
    check_scheduler(sched)
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["b"]   # a waits; it never runs
    assert sched.abort_request("a").status is S.CANCELLED
    assert not kv.has("a") and sched.parked == ()
    assert sched.abort_request("a").status is S.CANCELLED   # idempotent
    check_scheduler(sched)


def test_book_transfer_arithmetic():
    from kvlab.labs.capacity.transfer_cost import (
        LINKS,
        kv_transfer_bytes,
        transfer_seconds,
        transfer_table,
    )
    from kvlab.sim.catalog import get_model

    m = get_model("Llama-3-8B")
    assert kv_transfer_bytes(m, 1024) == 2 * 32 * 1024 * 8 * 128 * 2 == 134_217_728
    nv = LINKS["NVLink 4 (H100)"]
    assert transfer_seconds(134_217_728, nv) == pytest.approx(5e-6 + 134_217_728 / 450e9)
    assert transfer_seconds(1e9, nv, 0.5) == pytest.approx(5e-6 + 2e9 / 450e9)
    with pytest.raises(ValueError, match="efficiency"):
        transfer_seconds(1, nv, 0)
    row = transfer_table([m], 8192)[0]
    assert row["bytes_per_token"] == 131_072                  # 128 KiB per token, bf16
    assert row["seconds"]["PCIe Gen5 x16"] < row["seconds"]["InfiniBand NDR 400G"]
