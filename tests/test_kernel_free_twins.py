"""Kernel-free twins of the widgets of chapters 9-11: grid, default frame, captions, and that
precomputing them leaves the live objects (engines, demos) as they were."""

from __future__ import annotations

import base64
import re

import pytest

from kvlab.viz.kernel_free import EXPORT_ENV, figure_png


def _visible_key(html: str) -> str:
    (key,) = re.findall(r'data-kf-key="([\d-]+)">', html)    # the one frame shown without JS
    return key


def _curves():
    from kvlab.labs.slo import LatencyRecord

    def run(rate, ttft, tpot):
        return [LatencyRecord(f"r{i}", arrival=i / rate, ttft=ttft * (1 + i / 10),
                              tpot=tpot * (1 + i / 20), e2e=ttft * 2 + 40 * tpot,
                              output_tokens=21)
                for i in range(10)]

    return {"a": ([2.0, 4.0, 6.0], [run(r, 0.05 * r, 0.002 * r) for r in (2, 4, 6)]),
            "b": ([2.0, 4.0, 6.0], [run(r, 0.03 * r, 0.003 * r) for r in (2, 4, 6)])}


def test_goodput_twin_grid_default_frame_and_every_rate_in_the_caption():
    from kvlab.labs.slo import SLO, evaluate_slo
    from kvlab.viz.goodput import KERNEL_FREE_GRID, goodput_figure, goodput_kernel_free

    curves = _curves()
    kf = goodput_kernel_free(curves, ttft_ms=150, tpot_ms=9, rate=4.0)
    ttfts = sorted({*KERNEL_FREE_GRID["ttft_ms"], 150.0})      # the initial value is added
    assert len(kf.frames) == len(ttfts) * len(KERNEL_FREE_GRID["tpot_ms"])
    default = next(f for f in kf.frames if f.key == kf.default_key)
    slo = SLO(ttft=0.15, tpot=0.009)
    assert default.png == figure_png(goodput_figure(curves, slo, rate=4.0))
    lines = default.caption.splitlines()
    for name, (rates, runs) in curves.items():
        i = lines.index(name)
        rate, offered, attained, goodput = (lines[i + j].split()[1:] for j in (1, 2, 3, 4))
        assert rate == [f"{r:g}/s" for r in rates]
        reports = [evaluate_slo(recs, slo, window_s="arrivals") for recs in runs]
        assert offered == [f"{rep.offered:.2f}/s" for rep in reports]
        assert attained == [f"{evaluate_slo(recs, slo).attainment:.0%}" for recs in runs]
        assert goodput == [f"{rep.goodput_by_arrival:.2f}/s" for rep in reports]
    assert len({f.png for f in kf.frames}) > 1               # the objectives change the picture
    assert _visible_key(kf.to_html()) == kf.default_key


def test_goodput_explorer_bundle(monkeypatch):
    from kvlab.viz.goodput import goodput_explorer

    box = goodput_explorer(_curves(), ttft_ms=200, tpot_ms=10)
    monkeypatch.delenv(EXPORT_ENV, raising=False)
    bundle = box._repr_mimebundle_()
    assert "goodput explorer" in bundle["text/plain"] and "text/html" not in bundle
    monkeypatch.setenv(EXPORT_ENV, "1")
    assert box._repr_mimebundle_()["text/html"].count('class="kvlab-kf-frame"') == 12


def test_fault_twin_runs_on_a_fresh_pair_and_leaves_the_live_demo_alone(monkeypatch):
    from kvlab.labs.pd.demo import PDDemo
    from kvlab.viz.pd import fault_explorer

    made = []

    def replay():
        made.append(PDDemo())
        return made[-1]

    demo = PDDemo()
    faults = ["none", "corrupt_payload", "drop"]
    box = fault_explorer(demo, faults, replay=replay)
    assert demo.runs == 1                                     # the live widget's first run
    monkeypatch.setenv(EXPORT_ENV, "1")
    html = box._repr_mimebundle_()["text/html"]
    assert demo.runs == 1 and made[0].runs == 3
    assert html.count('class="kvlab-kf-frame"') == 3 and _visible_key(html) == "0"
    captions = re.findall(r'<pre class="kvlab-kf-caption">fault=([a-z_]+): decision', html)
    assert captions == faults
    assert "-&gt; install" in html and "-&gt; recompute" in html
    monkeypatch.delenv(EXPORT_ENV)
    no_replay = fault_explorer(demo, faults)._repr_mimebundle_()
    assert "text/html" not in no_replay and "fault explorer" in no_replay["text/plain"]


def test_fault_explorer_refuses_unknown_fault():
    from kvlab.viz.pd import fault_kernel_free

    class Demo:
        def run(self, fault):
            raise AssertionError("must not run")

    with pytest.raises(ValueError, match="not one of"):
        fault_kernel_free(Demo(), ["none"], first="drop")


def test_acceptance_twin_runs_on_engines_of_its_own(monkeypatch):
    from kvlab.labs.speculation import acceptance
    from kvlab.viz import spec

    shared: dict = {}
    monkeypatch.setattr(acceptance, "_ENGINES", shared)       # the shared cache, observed
    monkeypatch.setattr(spec, "KERNEL_FREE_GRID",
                        {"k": (1, 2), "temperature": (0.0,), "method": ("ngram",)})
    view = spec.AcceptanceView(k=1, temperature=0.0, method="ngram")
    live = view.data(1, 0.0, "ngram", view.prompt)            # remembered: no second run
    assert list(shared) == [("ngram", 1)]
    monkeypatch.setenv(EXPORT_ENV, "1")
    html = view.widget._repr_mimebundle_()["text/html"]
    assert list(shared) == [("ngram", 1)]                     # k=2 ran on an engine of its own
    assert html.count('class="kvlab-kf-frame"') == 2 and _visible_key(html) == "0-0-0"
    assert html.count("mean tokens per verification = ") == 2
    assert spec.acceptance_caption(live) in html
    own: dict = {}
    a = acceptance.run_acceptance("ngram", k=2, engines=own)
    b = acceptance.run_acceptance("ngram", k=2, engines={})
    assert list(own) == [("ngram", 2)] and a == b             # a fresh engine measures the same
    assert list(shared) == [("ngram", 1)]


def test_quantization_twin_grid_default_frame_and_bytes_caption(monkeypatch):
    from kvlab.viz.quantization import (
        KERNEL_FREE_GRID,
        example_row,
        quantization_caption,
        quantization_explorer,
        quantization_figure,
    )

    monkeypatch.setenv(EXPORT_ENV, "1")
    html = quantization_explorer()._repr_mimebundle_()["text/html"]
    n = 1
    for values in KERNEL_FREE_GRID.values():
        n *= len(values)
    assert html.count('class="kvlab-kf-frame"') == n
    assert _visible_key(html) == "1-1-0"                       # 4 bits, group 32, symmetric
    row = example_row(12.0)
    caption = quantization_caption(row, 4, 32, True)
    assert caption.startswith("144 bytes for 256 weights")    # 128 B of nibbles + 8 fp16 scales
    assert caption in html and quantization_caption(row, 2, 8, False) in html
    png = figure_png(quantization_figure(row, 4, 32, True))
    assert base64.b64encode(png).decode() in html              # the default frame is that figure
