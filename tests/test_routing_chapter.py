"""Chapter 13's lab, widget and checks: the live JSON's rows, the widget's frames (cache contents
match each replica's radix cache; the twin fits a phone), and that the checks refuse wrong and
placeholder answers without naming the answer."""

from __future__ import annotations

import pytest

from kvlab.exercises._common import NotYetAnswered
from kvlab.viz.kernel_free import EXPORT_ENV


def test_live_rows_and_validation_read_the_stored_run():
    from kvlab.labs.routing import LIVE_TO_SIM, live_rows, load_live, validate

    live = load_live()
    rows = live_rows(live)
    engines = {r["engine"] for r in rows}
    assert engines == {"kvlab", "vllm"}
    for r in rows:
        assert sum(r["requests"]) == live["workload"]["num_requests"] and r["failed"] == 0
        assert 0 < r["hit_rate"] < 1
    for v in validate(live, "kvlab", "8"):
        assert LIVE_TO_SIM[v["live_policy"]] == v["sim_policy"]
        assert sum(v["sim_requests"]) == live["workload"]["num_requests"]
        assert abs(v["sim_hit_rate"] - v["live_hit_rate"]) < 0.06


def test_widget_frames_follow_the_stream():
    from kvlab.viz.routing import StreamSetup, route_frames

    setup = StreamSetup(n=16, rate=4.0)
    for policy in ("round_robin", "precise_index"):
        frames = route_frames(policy, setup)
        assert [f.index for f in frames] == list(range(16))
        assert sum(frames[-1].routed) == 16
        for f in frames:
            assert all(sum(h) + o <= setup.num_blocks for h, o in zip(f.held, f.other, strict=True))
            assert 0 <= f.hit_blocks <= f.prompt_blocks
    rr = route_frames("round_robin", setup)
    assert rr[-1].routed == (4, 4, 4, 4)


def test_routing_twin_fits_a_phone_and_shows_the_default(monkeypatch):
    from kvlab.viz.routing import StreamSetup, routing_explorer

    box = routing_explorer(StreamSetup(n=12, rate=4.0), policy="dynamo_cost", step=5)
    monkeypatch.setenv(EXPORT_ENV, "1")
    html = box._repr_mimebundle_()["text/html"]
    assert html.count('class="kvlab-kf-frame"') == 4 * 8
    widths = [int(w) for w in __import__("re").findall(r'width="(\d+)"', html)]
    assert widths and max(widths) <= 390


def test_checks_refuse_placeholders_and_wrong_answers():
    from kvlab.exercises import ch13

    with pytest.raises(NotYetAnswered):
        ch13.check_tenant_hits(..., 1)
    with pytest.raises(AssertionError) as wrong:
        ch13.check_tenant_hits(1.5, 2)
    assert "1.5" not in str(wrong.value)
    with pytest.raises(AssertionError, match="revisit"):
        ch13.check_subscriber(lambda batches, tokens, block_size: 0)
    with pytest.raises(AssertionError, match="among"):
        ch13.check_weight(3.0, 0.5, 0.1)
    with pytest.raises(AssertionError, match="not the numbers"):
        ch13.check_weight(1.0, 0.5, 0.1)


def test_the_weight_is_graded_once():
    """After a wrong weight, no other weight is graded in the session: looping over the six
    choices learns nothing."""
    from kvlab.exercises import ch13

    runs = {w: ch13.run_weight(w) for w in ch13.WEIGHT_CHOICES}
    missing = next(w for w, r in runs.items() if r["ttft_p99_s"] > ch13.WEIGHT_SLO_P99_S)
    # a fresh reader: tests/conftest.py empties the prediction record for each test
    with pytest.raises(AssertionError, match="not the numbers"):   # no run: not graded
        ch13.check_weight(missing, 0.5, 0.01)
    with pytest.raises(AssertionError, match="misses the objective"):
        ch13.check_weight(missing, runs[missing]["hit_rate"], runs[missing]["ttft_p99_s"])
    for w, r in runs.items():
        if w != missing:
            reply = ch13.check_weight(w, r["hit_rate"], r["ttft_p99_s"])
            assert "graded once" in reply and not reply.startswith("Right")


def test_the_router_is_graded_on_workloads_the_page_does_not_show():
    from kvlab.exercises import ch13
    from kvlab.sim.routers import make_policy

    assert not set(ch13._GRADED_SEEDS) & set(ch13.POLICY_SEEDS)
    with pytest.raises(AssertionError, match="revisit where the hot tenant"):
        ch13.check_router(lambda: make_policy("precise_index"))
    with pytest.raises(AssertionError, match="revisit what affinity keeps"):
        ch13.check_router(lambda: make_policy("least_loaded"))
