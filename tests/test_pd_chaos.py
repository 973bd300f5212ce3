"""P/D inside the chaos run (torch-free), and invariant 8 against a real, mutated installer.

The sweep: seeded producer/consumer runs (production scheduler, prefix cache, n > 1, random
and mid-step aborts, step faults, every P/D transfer fault at the send and deliver points),
the invariant set after every step with invariant 8 reading the independent install audit;
every finished request equals the single-engine truth, no position reads wrong KV, no block
leaks. Then the consumer's own check is mutated (it ignores one descriptor field) and the run
must stop at invariant 8, naming the request that got the bad install.
"""

from __future__ import annotations

from collections import Counter

import pytest

import kvlab.disagg.remote_kv_scheduler as remote_kv
from kvlab.disagg.entry import check_delivery
from kvlab.labs.chaos.pd_soak import PD_STEP_FAULTS, PD_TRANSFER_FAULTS, run_pd_chaos
from kvlab.labs.invariants.install_audit import InstallAudit
from kvlab.labs.invariants.spec_invariants import InvariantViolation


def test_pd_chaos_sweep_keeps_every_invariant():
    transfer, steps_faults, audited, checks, finished = Counter(), Counter(), 0, 0, 0
    for seed in range(60):
        r = run_pd_chaos(seed)                        # raises on a violation
        assert r.mismatches == [], (seed, r.mismatches)
        assert r.wrong_kv_reads == 0, seed
        assert r.leaked_blocks == 0, seed
        transfer.update(r.transfer)
        steps_faults.update(r.step_faults)
        audited += r.installs_audited
        checks += r.checks
        finished += r.finished
    assert audited >= 50 and transfer["installed"] == audited
    refused = {"stale_model_version", "security_domain", "incompatible", "truncated",
               "corrupt_payload", "corrupt_descriptor", "missing", "duplicate"}
    assert refused <= set(transfer), refused - set(transfer)
    assert set(PD_STEP_FAULTS) <= set(steps_faults)
    assert checks > 9 * 60 * 40 and finished > 300


def _lenient(field_name):
    """The mutated installer's check: it forgets to compare ``field_name``."""
    def check(delivery, expected):
        if delivery.header is None or field_name not in delivery.descriptor:
            return check_delivery(delivery, expected)
        return check_delivery(delivery, {**expected,
                                         field_name: delivery.descriptor[field_name]})
    return check


@pytest.mark.parametrize("kind,field_name", [("stale_model_version", "model_version"),
                                             ("security_domain", "security_domain"),
                                             ("layers", "layers")])
def test_invariant_8_catches_an_installer_that_accepts_a_bad_descriptor(monkeypatch, kind,
                                                                        field_name):
    kinds = (kind,)
    clean = run_pd_chaos(3, transfer_rate=1.0, transfer_kinds=kinds, step_fault_rate=0.0)
    assert clean.transfer["installed"] == 0 and clean.transfer[
        "incompatible" if kind == "layers" else kind] > 0     # the real check refuses them all
    monkeypatch.setattr(remote_kv, "check_delivery", _lenient(field_name))
    with pytest.raises(InvariantViolation) as info:
        run_pd_chaos(3, transfer_rate=1.0, transfer_kinds=kinds, step_fault_rate=0.0)
    v = info.value
    assert v.invariant.number == 8, str(v)
    assert v.subject.startswith("request q"), str(v)
    assert "the delivered entry is" in v.detail


def test_audit_flags_an_install_of_an_entry_it_never_saw():
    class Decision:
        kind, step, request_id, entry_id = "installed", 1, "r", "ghost"

    class Request:
        request_id, prompt_token_ids, scope = "r", (1, 2, 3, 4, 5), ()

    class Sched:
        def __init__(self):
            self.decisions = [Decision()]

        def find_request(self, rid):
            return Request()

    audit = InstallAudit({"model_version": "x"})
    assert audit.records(Sched()) == [("r", "ghost", "no such entry was ever delivered")]
    assert audit.records(Sched()) == []                  # each decision audited once
    assert PD_TRANSFER_FAULTS and "producer_crash" not in PD_TRANSFER_FAULTS
