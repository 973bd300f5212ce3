"""kvlab.labs.slo: goodput, attainment, failures by kind, percentiles (differential vs the
reference goodput of spec rule 10 and vs NumPy)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvlab.labs.slo import (
    SLO,
    FailureKind,
    LatencyRecord,
    arrival_window,
    evaluate_slo,
    percentile,
)
from kvlab.reference import goodput as reference_goodput

KINDS = [k.value for k in FailureKind]


def random_records(rng: random.Random, n: int) -> list[LatencyRecord]:
    out = []
    for i in range(n):
        arrival = rng.uniform(0, 50)
        if rng.random() < 0.2:
            out.append(LatencyRecord(f"r{i}", arrival, status=rng.choice(KINDS)))
            continue
        ttft = rng.uniform(0.01, 2.0)
        tokens = rng.randint(1, 200)
        tpot = rng.uniform(0.005, 0.2) if tokens > 1 else None
        e2e = ttft + (tpot or 0.0) * (tokens - 1)
        out.append(LatencyRecord(f"r{i}", arrival, ttft=ttft, tpot=tpot, e2e=e2e,
                                 output_tokens=tokens, quality_ok=rng.random() > 0.1))
    return out


def as_reference(r: LatencyRecord) -> dict:
    return {"status": r.status, "quality_ok": r.quality_ok, "ttft": r.ttft or 0.0,
            "tpot": 0.0 if r.tpot is None else r.tpot, "e2e": r.e2e or 0.0}


@pytest.mark.parametrize("seed", range(30))
def test_goodput_agrees_with_reference(seed: int) -> None:
    rng = random.Random(seed)
    recs = random_records(rng, rng.randint(0, 300))
    slo = SLO(ttft=rng.uniform(0.1, 2), tpot=rng.uniform(0.01, 0.2), e2e=rng.uniform(1, 40))
    window = rng.uniform(1, 100)
    want = reference_goodput([as_reference(r) for r in recs], window,
                             {"ttft": slo.ttft, "tpot": slo.tpot, "e2e": slo.e2e})
    rep = evaluate_slo(recs, slo, window_s=window)
    assert rep.goodput == pytest.approx(want, rel=1e-12, abs=0)
    assert rep.measured == len(recs)
    assert rep.finished + sum(rep.failures.values()) == len(recs)
    for kind in KINDS:
        assert rep.failures[kind] == sum(r.status == kind for r in recs)


def test_unbounded_objectives_match_reference_with_infinity() -> None:
    recs = random_records(random.Random(7), 200)
    rep = evaluate_slo(recs, SLO(ttft=0.5), window_s=10)
    inf = math.inf
    want = reference_goodput([as_reference(r) for r in recs], 10,
                             {"ttft": 0.5, "tpot": inf, "e2e": inf})
    assert rep.goodput == want


def test_failures_count_against_attainment_not_latency() -> None:
    recs = [LatencyRecord("a", 0.0, ttft=0.1, tpot=0.01, e2e=1.0, output_tokens=91),
            LatencyRecord("b", 0.5, status="rejected"),
            LatencyRecord("c", 1.0, status=FailureKind.TIMEOUT, ttft=0.2, e2e=30.0),
            LatencyRecord("d", 1.5, ttft=3.0, tpot=0.01, e2e=4.0, output_tokens=101)]
    rep = evaluate_slo(recs, SLO(ttft=1.0), window_s=2.0)
    assert (rep.measured, rep.finished, rep.met) == (4, 2, 1)
    assert rep.attainment == 0.25 and rep.goodput == 0.5
    assert rep.failures == {"rejected": 1, "http_error": 0, "timeout": 1, "cancelled": 0,
                            "engine_error": 0}
    # the timed-out request's 30 s never enters the E2E statistics
    assert rep.latency["e2e"]["p99"] < 4.0 + 1e-9
    assert rep.output_tokens == 192


def test_warmup_excluded_and_default_window() -> None:
    recs = [LatencyRecord(f"r{i}", float(i), ttft=0.1, e2e=0.5, output_tokens=1)
            for i in range(10)]
    rep = evaluate_slo(recs, SLO(e2e=1.0), warmup_s=3.0)
    assert rep.measured == 7
    assert rep.window_s == pytest.approx(9.5 - 3.0)
    assert rep.goodput == pytest.approx(7 / 6.5)


def test_arrival_window_leaves_out_the_final_drain() -> None:
    # ten arrivals one second apart; the last one takes 20 s to answer (the drain)
    recs = [LatencyRecord(f"r{i}", float(i), ttft=0.1, e2e=20.0 if i == 9 else 0.5,
                          output_tokens=1) for i in range(10)]
    drained = evaluate_slo(recs, SLO(e2e=1.0))
    offered = evaluate_slo(recs, SLO(e2e=1.0), window_s="arrivals", warmup_s=1.0)
    assert drained.window_s == pytest.approx(29.0) and drained.goodput == pytest.approx(9 / 29)
    assert offered.window_s == pytest.approx(8.0) and offered.measured == 9
    assert offered.goodput == pytest.approx(8 / 8.0)       # r1..r8 met; r9 missed E2E
    assert arrival_window(recs, 1.0) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="arrivals"):
        evaluate_slo(recs, SLO(), window_s="drain")
    with pytest.raises(ValueError, match="warm-up"):
        arrival_window(recs, 100.0)


def test_arrival_window_counts_one_cohort_completed_by_its_end() -> None:
    # arrivals at 0..9 s; r7 and r8 end after the last arrival (9 s): in flight, not counted
    recs = [LatencyRecord(f"r{i}", float(i), ttft=0.1, e2e=3.0 if i in (7, 8) else 0.5,
                          output_tokens=4) for i in range(10)]
    rep = evaluate_slo(recs, SLO(e2e=1.0), window_s="arrivals")
    assert rep.window_s == pytest.approx(9.0) and rep.measured == 10
    assert (rep.completed, rep.completed_met) == (7, 7)          # r0..r6; r9 ends at 9.5
    assert rep.throughput == pytest.approx(7 / 9) and rep.offered == pytest.approx(10 / 9)
    assert rep.output_tokens == 28                              # of the completed ones only
    assert (rep.finished, rep.met) == (10, 8)                   # attainment: every request
    assert rep.attainment == pytest.approx(0.8)
    # counted by arrival: r0..r6 and r9 met the SLO, whenever they completed
    assert rep.goodput_by_arrival == pytest.approx(8 / 9) == rep.attainment * rep.offered
    drained = evaluate_slo(recs, SLO(e2e=1.0))                  # the default counts them all
    assert drained.completed == 10 and drained.throughput == pytest.approx(10 / 11)


@pytest.mark.parametrize("seed", range(20))
def test_goodput_le_throughput_le_offered_over_the_arrival_window(seed: int) -> None:
    rng = random.Random(seed)
    recs = random_records(rng, rng.randint(1, 200))
    slo = SLO(ttft=rng.uniform(0.1, 2), tpot=rng.uniform(0.01, 0.2))
    warmup = rng.choice([0.0, rng.uniform(0, 20)])
    if max(r.arrival for r in recs) <= warmup:
        warmup = 0.0                       # an empty (or zero-length) window is refused
    rep = evaluate_slo(recs, slo, window_s="arrivals", warmup_s=warmup)
    assert rep.goodput <= rep.throughput <= rep.offered
    assert rep.goodput <= rep.goodput_by_arrival <= rep.offered
    ends = warmup + rep.window_s
    kept = [r for r in recs if r.arrival >= warmup and r.finished and r.end <= ends]
    assert rep.completed == len(kept)
    assert rep.completed_met == sum(slo.met_by(r) for r in kept)


def test_single_token_request_meets_tpot_vacuously() -> None:
    r = LatencyRecord("one", 0.0, ttft=0.1, e2e=0.1, output_tokens=1)
    assert SLO(tpot=0.0).met_by(r)
    assert not SLO(ttft=0.05).met_by(r)


def test_quality_hook_failure_is_not_goodput() -> None:
    r = LatencyRecord("q", 0.0, ttft=0.1, e2e=0.2, output_tokens=2, tpot=0.1, quality_ok=False)
    rep = evaluate_slo([r], SLO(), window_s=1)
    assert (rep.finished, rep.met, rep.quality_failed) == (1, 0, 1)


@pytest.mark.parametrize("seed", range(20))
def test_percentile_linear_matches_numpy(seed: int) -> None:
    rng = random.Random(seed)
    xs = [rng.expovariate(1.0) for _ in range(rng.randint(1, 100))]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, q, "linear") == pytest.approx(np.percentile(xs, q), rel=1e-12)
        # nearest rank: the smallest observed value with at least q% of the data at or below it
        got = percentile(xs, q, "nearest")
        assert got in xs
        assert sum(x <= got for x in xs) >= q / 100 * len(xs)
        if q > 0:
            assert sum(x < got for x in xs) < q / 100 * len(xs)
        assert got == np.percentile(xs, q, method="inverted_cdf")


def test_percentile_small_cases() -> None:
    assert percentile([15, 20, 35, 40, 50], 30, "nearest") == 20
    assert percentile([15, 20, 35, 40, 50], 40, "linear") == pytest.approx(29.0)
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("bad", [
    lambda: percentile([1], 101), lambda: percentile([1], 50, "midpoint"),
    lambda: SLO(ttft=-1), lambda: SLO(tpot=math.nan),
    lambda: LatencyRecord("x", 0, status="lost"),
    lambda: LatencyRecord("x", 0, status="finished"),
    lambda: LatencyRecord("x", 0, ttft=2.0, e2e=1.0),
    lambda: LatencyRecord("x", -1, status="rejected"),
    lambda: evaluate_slo([], SLO(), window_s=0),
    lambda: evaluate_slo([], SLO()),                       # no records: empty window
    lambda: evaluate_slo([LatencyRecord("x", 0, status="rejected")], SLO(), window_s=1,
                         warmup_s=-1),
])
def test_bad_input_names_the_problem(bad) -> None:
    with pytest.raises(ValueError):
        bad()


def test_report_as_dict_is_plain() -> None:
    import json

    rep = evaluate_slo(random_records(random.Random(1), 50), SLO(ttft=1), window_s=5,
                       percentile_method="nearest")
    d = json.loads(json.dumps(rep.as_dict()))
    assert d["percentile_method"] == "nearest" and d["met_slo"] == rep.met
