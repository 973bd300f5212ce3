"""Prefill/decode disaggregation on the real model: the shared-storage and TCP connectors,
KV installed bit-for-bit, tokens and logprobs equal to a single engine, every fault on the real
transports, and a producer and a consumer in two OS processes over loopback TCP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvlab.core.sampling_params import SamplingParams
from kvlab.disagg.transfer_faults import FAULT_KINDS, Fault, FaultSchedule
from kvlab.engine.checkpoint import load_checkpoint
from kvlab.engine.kv_transfer import InProcessChannel, KVTransferConfig
from kvlab.engine.kv_transfer.connectors import HEADER_FILE, PAYLOAD_FILE
from kvlab.engine.llm import LLM
from kvlab.labs.invariants import check_engine

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((37, 20, 53))]


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint("kvlab-tiny")


@pytest.fixture(scope="module")
def single(ckpt):
    llm = LLM(ckpt, block_size=8, num_blocks=64)
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _llm(ckpt, connector, role, **extra):
    return LLM(ckpt, block_size=8, num_blocks=64, kv_transfer_config={
        "kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra})


def _produce(ckpt, connector, **extra):
    prod = _llm(ckpt, connector, "kv_producer", **extra)
    prod.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    prod.engine.kv_transfer.flush()
    return prod


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[k] - ly[k]) <= 1e-5 for k in lx)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("config,match", [
    ([], "must be a dict"),
    ({"kv_connector": "nixl", "kv_role": "kv_producer"}, "kv_connector must be one of"),
    ({"kv_connector": "tcp", "kv_role": "prefill"}, "kv_role must be one of"),
    ({"kv_connector": "tcp", "kv_role": "kv_producer", "extra": 1}, "unknown keys"),
    ({"kv_connector": "shared_storage", "kv_role": "kv_producer"}, "shared_storage_path"),
    ({"kv_connector": "tcp", "kv_role": "kv_producer"}, "port"),
    ({"kv_connector": "tcp", "kv_role": "kv_consumer",
      "kv_connector_extra_config": {"host": "10.0.0.1"}}, "loopback"),
    ({"kv_connector": "tcp", "kv_role": "kv_both",
      "kv_connector_extra_config": {"port": 5}}, "kv_both"),
    ({"kv_connector": "inprocess", "kv_role": "kv_consumer"}, "channel"),
    ({"kv_connector": "shared_storage", "kv_role": "kv_consumer", "kv_connector_extra_config":
      {"shared_storage_path": "kv-store", "on_failure": "retry"}}, "on_failure"),
    ({"kv_connector": "shared_storage", "kv_role": "kv_consumer", "kv_connector_extra_config":
      {"shared_storage_path": "kv-store", "timeout_s": -1}}, "timeout_s"),
    ({"kv_connector": "shared_storage", "kv_role": "kv_consumer", "kv_connector_extra_config":
      {"shared_storage_path": "kv-store", "colour": 1}}, "unknown keys"),
])
def test_bad_kv_transfer_config_is_refused_by_name(ckpt, config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(ckpt, block_size=8, num_blocks=16, kv_transfer_config=config)


def test_consumer_needs_prefix_caching(ckpt, tmp_path):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(ckpt, block_size=8, num_blocks=16, enable_prefix_caching=False,
            kv_transfer_config={"kv_connector": "shared_storage", "kv_role": "kv_consumer",
                                "kv_connector_extra_config": {"shared_storage_path": tmp_path}})
    assert KVTransferConfig.parse({"kv_connector": "inprocess", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"channel": 1}}).timeout_s == 0


# ----------------------------------------------------------------------------- storage
def test_shared_storage_round_trip_is_exact(ckpt, single, tmp_path):
    prod = _produce(ckpt, "shared_storage", shared_storage_path=str(tmp_path))
    entries = sorted(p for p in tmp_path.iterdir())
    assert len(entries) == 3 and not any(p.name.startswith(".tmp-") for p in entries)
    for d in entries:
        assert sorted(x.name for x in d.iterdir()) == [HEADER_FILE, PAYLOAD_FILE]
        header = json.loads((d / HEADER_FILE).read_text())
        assert header["key"] == d.name and header["payload_bytes"] == (
            d / PAYLOAD_FILE).stat().st_size
    assert prod.engine.kv_transfer.stats == {"exported": 3}

    cons = _llm(ckpt, "shared_storage", "kv_consumer", shared_storage_path=str(tmp_path))
    out = cons.generate(PROMPTS, GREEDY, use_tqdm=False)
    _same(single, out)
    sched = cons.engine.scheduler
    assert cons.engine.kv_transfer.stats == {"installed": 3}
    check_engine(cons.engine)
    assert cons.engine.kv.requests() == []                   # nothing leaked
    # the consumer's blocks hold exactly the producer's bytes
    codec = cons.engine.kv_transfer.codec
    src = {json.loads((d / HEADER_FILE).read_text())["entry_id"]: d for d in entries}
    for rec in sched.journal.records:
        if rec.kind != "allocated":
            continue
        table, _cached = rec.data
        entry = src[rec.op_id.split("@")[1]]
        delivery = cons.engine.kv_transfer.connector.fetch([entry.name])[0]
        payload = codec.decode(delivery, len(table) * 8)
        assert torch.equal(codec.gather(table, len(table) * 8), payload)


def test_producer_crash_mid_write_leaves_no_visible_entry(ckpt, single, tmp_path):
    sched = FaultSchedule((Fault("producer_crash", 1),), seed=2)
    _produce(ckpt, "shared_storage", shared_storage_path=str(tmp_path), fault_schedule=sched)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len([n for n in names if n.startswith(".tmp-")]) == 1 and len(names) == 3
    cons = _llm(ckpt, "shared_storage", "kv_consumer", shared_storage_path=str(tmp_path),
                timeout_s=0.05)
    _same(single, cons.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert cons.engine.kv_transfer.stats == {"installed": 2, "missing": 1, "recomputed": 1}


FRAME_FAULTS = [k for k in FAULT_KINDS if k not in ("consumer_crash", "after_abort")]
MANY = [[(11 * i + 5 * j) % 700 + 2 for j in range(17 + 3 * i)]
        for i in range(len(FRAME_FAULTS) + 2)]
EXPECT = {"drop": "missing", "truncate": "truncated", "corrupt_payload": "corrupt_payload",
          "corrupt_descriptor": "corrupt_descriptor", "layers": "incompatible",
          "kv_heads": "incompatible", "dtype": "incompatible", "rope": "incompatible",
          "stale_model_version": "stale_model_version", "security_domain": "security_domain",
          "duplicate": "duplicate", "out_of_order": "installed", "producer_crash": "missing"}


@pytest.mark.parametrize("connector", ["shared_storage", "tcp"])
def test_every_fault_on_the_real_transports(ckpt, tmp_path, connector):
    """Entry i gets fault i (two entries stay clean): 0 wrong installs (tokens and logprobs
    equal the single engine), 0 leaked blocks, each fault counted under its own kind."""
    truth = LLM(ckpt, block_size=8, num_blocks=96).generate(MANY, GREEDY, use_tqdm=False)
    sched = FaultSchedule(tuple(Fault(k, i) for i, k in enumerate(FRAME_FAULTS)), seed=11)
    extra = ({"shared_storage_path": str(tmp_path)} if connector == "shared_storage"
             else {"port": 0})
    cons = LLM(ckpt, block_size=8, num_blocks=96, kv_transfer_config={
        "kv_connector": connector, "kv_role": "kv_consumer", "kv_connector_extra_config":
        {**extra, "timeout_s": 1.0, "fault_schedule": sched}})
    if connector == "tcp":
        extra = {"port": cons.engine.kv_transfer.connector.port}
    prod = LLM(ckpt, block_size=8, num_blocks=96, kv_transfer_config={
        "kv_connector": connector, "kv_role": "kv_producer", "kv_connector_extra_config":
        {**extra, "fault_schedule": sched}})
    prod.generate(MANY, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    prod.engine.kv_transfer.flush()
    try:
        out = cons.generate(MANY, GREEDY, use_tqdm=False)
    finally:
        cons.engine.kv_transfer.close()
    _same(truth, out)
    stats = cons.engine.kv_transfer.stats
    check_engine(cons.engine)
    assert cons.engine.kv.requests() == []
    for kind in FRAME_FAULTS:
        if kind == "producer_crash" and connector == "tcp":   # cut mid-header or mid-payload
            assert stats.get("missing", 0) + stats.get("truncated", 0) >= 2, stats
        else:
            assert stats.get(EXPECT[kind], 0) >= 1, (kind, stats)
    refused = len(FRAME_FAULTS) - 2            # all but duplicate and out_of_order
    assert stats["recomputed"] == refused
    assert stats["installed"] == len(MANY) - refused


def test_fail_policy_and_delivery_after_abort(ckpt, tmp_path):
    extra = {"shared_storage_path": str(tmp_path)}
    _produce(ckpt, "shared_storage", fault_schedule=FaultSchedule((Fault("rope", 0),)),
             **extra)
    cons = _llm(ckpt, "shared_storage", "kv_consumer", on_failure="fail", **extra)
    out = cons.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "error" and out[0].outputs[0].token_ids == []
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in out[1:])
    assert cons.engine.kv_transfer.stats["incompatible"] == 1
    assert cons.engine.kv.requests() == []

    ch = InProcessChannel()
    cons = _llm(ckpt, "inprocess", "kv_consumer", channel=ch, timeout_s=60)
    eng = cons.engine
    eng.add_request("a", PROMPTS[2], GREEDY)
    eng.step()
    assert eng.scheduler.find_request("a").status.value == "waiting_for_remote_kv"
    eng.abort_request("a")
    _produce(ckpt, "inprocess", channel=ch)       # the entries arrive after the abort
    eng.add_request("b", PROMPTS[1], GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv_transfer.stats["after_abort"] == 1
    assert eng.kv_transfer.stats["installed"] == 1
    check_engine(eng)
    assert eng.kv.requests() == []


# ----------------------------------------------------------------------------- 2 processes
PRODUCER = textwrap.dedent("""
    import json, sys
    from kvlab.engine.llm import LLM
    from kvlab.core.sampling_params import SamplingParams
    port, prompts, faults = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM("kvlab-tiny", block_size=8, num_blocks=64, kv_transfer_config={
        "kv_connector": "tcp", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"port": port, "fault_schedule": faults}})
    out = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    llm.engine.kv_transfer.flush()
    print(json.dumps({"pid": __import__("os").getpid(), "stats": llm.engine.kv_transfer.stats}))
""")


def test_two_processes_over_loopback_tcp(ckpt, single):
    sched = FaultSchedule((Fault("corrupt_payload", 0), Fault("duplicate", 1, "send")), seed=3)
    cons = _llm(ckpt, "tcp", "kv_consumer", port=0, timeout_s=60)
    port = cons.engine.kv_transfer.connector.port
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PRODUCER, str(port), json.dumps(PROMPTS),
                           json.dumps(sched.to_data())], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["pid"] != os.getpid() and report["stats"] == {"exported": 3}
    try:
        out = cons.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        cons.engine.kv_transfer.close()
    _same(single, out)
    stats = cons.engine.kv_transfer.stats
    assert stats["corrupt_payload"] == 1 and stats["recomputed"] == 1
    assert stats["installed"] == 2 and stats["duplicate"] == 1
    assert cons.engine.kv.requests() == []


# ----------------------------------------------------------------------------- crash, kv_both
@pytest.mark.parametrize("crash_at,installed", [(1, False), (2, False), (3, True)])
def test_consumer_crash_mid_install_on_the_real_engine(ckpt, tmp_path, crash_at, installed):
    """The consumer dies before install-journal record ``crash_at`` (1: allocated, 2: written,
    3: committed — after the prefix-cache commit). Recovery says whether the blocks were
    installed; installed blocks hold exactly the producer's bytes, and no table survives."""
    from kvlab.disagg.install_journal import InstallCrash, recover_installs

    extra = {"shared_storage_path": str(tmp_path)}
    _produce(ckpt, "shared_storage", **extra)
    cons = _llm(ckpt, "shared_storage", "kv_consumer", **extra)
    eng = cons.engine
    sched = eng.kv_transfer.scheduler
    sched.journal.crash_at = crash_at
    eng.add_request("a", PROMPTS[0], GREEDY)
    assert eng.snapshot().requests[0].status == "waiting_for_remote_kv"
    with pytest.raises(InstallCrash):
        eng.step()
    report = recover_installs(sched.journal, eng.kv)
    (op, rec), = report.items()
    assert rec.installed is installed and rec.freed    # admit ran before record 1 each time
    assert eng.kv.requests() == []                       # nothing leaked
    target = (len(PROMPTS[0]) - 1) // 8 * 8
    cached = eng.kv.lookup(eng.cache_scope(), PROMPTS[0])
    assert (cached >= target) is installed
    if installed:
        table = next(r.data[0] for r in sched.journal.records if r.kind == "allocated")
        codec = eng.kv_transfer.codec
        payloads = {d.entry_id: d for d in eng.kv_transfer.connector.fetch(
            [p.name for p in tmp_path.iterdir()])}
        mine = payloads[op.split("@")[1]]
        assert torch.equal(codec.gather(table, target), codec.decode(mine, target))


def test_kv_both_engines_share_a_store(ckpt, single, tmp_path):
    extra = {"shared_storage_path": str(tmp_path)}
    first = _llm(ckpt, "shared_storage", "kv_both", **extra)
    _same(single, first.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert first.engine.kv_transfer.stats == {"exported": 3, "missing": 3, "recomputed": 3}
    second = _llm(ckpt, "shared_storage", "kv_both", **extra)
    _same(single, second.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert second.engine.kv_transfer.stats["installed"] == 3
    assert second.engine.kv.requests() == []
