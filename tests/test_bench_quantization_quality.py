"""benchmarks/bench_quantization_quality.py: its statistics, and the committed result that
chapter 8 prints (consistent intervals, fp32 against itself, the formats it claims)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULT = BENCHMARKS / "results" / "quantization_quality.json"


def _load():
    sys.path.insert(0, str(BENCHMARKS))          # the script imports _results at run time
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_quantization_quality", BENCHMARKS / "bench_quantization_quality.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


bench = _load()


def test_kl_and_top1_on_known_distributions():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64).log()
    q = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.8, 0.1]], dtype=torch.float64).log()
    kl, same = bench.kl_and_top1(p, q)
    want = sum(float((a.exp() * (a - b)).sum()) for a, b in zip(p, q, strict=True))
    assert kl == pytest.approx(want) and kl > 0
    assert same == 1                                   # row 0 agrees on argmax, row 1 does not
    assert bench.kl_and_top1(p, p) == (0.0, 2)
    with pytest.raises(ValueError, match="positions, vocab"):
        bench.kl_and_top1(p, q[:1])


def test_agreement_prefix():
    assert bench.agreement_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bench.agreement_prefix([5, 6], [5, 6]) == 2
    assert bench.agreement_prefix([], [1]) == 0


def test_bootstrap_interval_brackets_the_statistic_and_narrows_with_more_units():
    def mean(xs):
        return sum(xs) / len(xs)

    few = [0.0, 1.0] * 5
    many = [0.0, 1.0] * 200
    lo_f, hi_f = bench.bootstrap_ci(few, mean, resamples=500)
    lo_m, hi_m = bench.bootstrap_ci(many, mean, resamples=500)
    assert lo_f <= 0.5 <= hi_f and lo_m <= 0.5 <= hi_m
    assert hi_m - lo_m < (hi_f - lo_f) / 3            # ~ 1/sqrt(n): 40x the units
    assert bench.bootstrap_ci(few, mean, resamples=500) == (lo_f, hi_f)   # seeded
    assert bench.bootstrap_ci([2.0] * 7, mean, resamples=50) == (2.0, 2.0)
    with pytest.raises(ValueError, match="no units"):
        bench.bootstrap_ci([], mean)


@pytest.fixture(scope="module")
def result():
    if not RESULT.exists():
        pytest.skip("run benchmarks/bench_quantization_quality.py first")
    return json.loads(RESULT.read_text())


def test_committed_result_is_consistent(result):
    rows = {r["config"]: r for r in result["rows"]}
    want = {"fp32", "kv int8", "kv fp8_e4m3"} | {f"int{b} g{g}" for b in bench.BITS
                                                   for g in bench.GROUPS}
    assert want <= set(rows)
    fp32 = rows["fp32"]
    assert fp32["kl_nats"] == 0 and fp32["ppl_ratio"] == 1
    assert fp32["top1_agreement"] == fp32["greedy_agreement"] == 1
    for name, r in rows.items():
        for key in ("ppl_ratio", "kl_nats", "top1_agreement", "greedy_agreement"):
            lo, hi = r[f"{key}_ci95"]
            assert lo - 1e-12 <= r[key] <= hi + 1e-12, (name, key)
        assert 0 <= r["greedy_agreement"] <= 1 and r["kl_nats"] >= 0
        if r["bits"]:
            assert r["effective_bits"] == pytest.approx(
                r["bits"] + (16 + (0 if r["symmetric"] else 8)) / r["group_size"])
    # fewer bits cost more at a fixed group size (the sweep's main shape)
    for g in bench.GROUPS:
        kls = [rows[f"int{b} g{g}"]["kl_nats"] for b in bench.BITS]
        assert kls == sorted(kls, reverse=True), (g, kls)
    i4 = rows["int4 g64"]
    assert i4["ppl_ratio"] < 1.02 and i4["greedy_agreement"] < 0.9   # perplexity hides it
    assert result["predicted_tokens"] > 1000 and result["heldout_documents"] >= 10
    assert not math.isnan(result["wall_s"])


def test_quality_figure_draws_every_format_with_intervals(result):
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.viz.quantization import QUALITY_METRICS, quality_figure

    fig = quality_figure(result["rows"])
    assert len(fig.axes) == len(QUALITY_METRICS)
    labels = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    assert {f"g={g}" for g in bench.GROUPS} <= labels
    with pytest.raises(ValueError, match="no weight-quantized rows"):
        quality_figure([r for r in result["rows"] if not r["bits"]])
