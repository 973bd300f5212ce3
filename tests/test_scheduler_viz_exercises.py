"""The batch timeline figure and scheduling view, and the chapter 5 and 6 exercise checks."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from conftest import new_reader
from matplotlib.colors import to_rgba
from matplotlib.legend import Legend

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import default_order_key
from kvlab.core.request import RUNNING_STATUSES, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.exercises import ch05, ch06
from kvlab.exercises._common import NotYetAnswered, try_check
from kvlab.labs.recovery import replay
from kvlab.sim.tokens import drive
from kvlab.viz.kernel_free import dropdown, slider
from kvlab.viz.style import BLOCK_STATE_COLORS, request_color
from kvlab.viz.timeline import (
    SchedulingView,
    TimelineRun,
    TimelineStep,
    batch_timeline_figure,
    describe_step,
    steps_from_outputs,
)


def small_run():
    kv = KVCacheManager(14, 4)
    sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12,
                                                  prefill_chunk=8))
    arrivals = {1: [RuntimeRequest(f"r{i}", tuple(range(1 + i, 12 + 3 * i)), max_tokens=6 + i)
                    for i in range(3)],
                4: [RuntimeRequest("long", tuple(range(100, 140)), max_tokens=4)]}
    result = drive(sched, arrivals=arrivals)
    return steps_from_outputs(result.outputs, result.ended)


def test_timeline_records_and_figure():
    steps = small_run()
    assert all(s.num_tokens <= 12 for s in steps)
    assert any(s.preempted for s in steps) and any(s.finished for s in steps)
    fig = batch_timeline_figure(steps, 12, start=2, end=10, highlight=3, title="t")
    (ax,) = fig.axes
    window = steps[2:10]
    # one bar segment per chunk, stacked in chunk order, coloured by first appearance of the
    # request over all steps, hatched iff prefill
    order = ["r0", "r1", "r2", "long"]
    bars = [c.patches[0] for c in ax.containers]
    got = [(round(b.get_x() + b.get_width() / 2), b.get_y(), b.get_height(),
            b.get_hatch() == "///", to_rgba(b.get_facecolor())) for b in bars]
    expected, totals = [], []
    for x, s in enumerate(window):
        bottom = 0
        for rid, n, prefill in s.chunks:
            expected.append((x, bottom, n, prefill, to_rgba(request_color(rid, order))))
            bottom += n
        totals.append(bottom)
    assert got == expected
    assert totals == [10, 12, 3, 3, 3, 10, 10, 9]    # steps 3..10 of small_run
    # the highlighted step (index 3 = window position 1) is the one shaded span
    (span,) = [p for p in ax.patches if p not in bars]
    assert (span.get_x(), span.get_x() + span.get_width()) == pytest.approx((0.5, 1.5))
    # event markers: admitted (row 0), preempted (row 1), finished (row 2) above the bars
    top = 12
    marks = sorted((round(x), round((y - top * 1.08) / (top * 0.07)))
                   for coll in ax.collections for x, y in coll.get_offsets())
    assert marks == [(1, 0), (2, 1), (4, 2), (5, 0), (6, 2)]  # steps 4, 5, 7, 8, 9
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s.step) for s in window]
    assert ax.get_title() == "t" and ax.get_xlabel() == "step"
    plt.close(fig)
    text = describe_step(steps[0], 12)
    assert text.startswith(f"step 1: {steps[0].num_tokens}/12 tokens")
    with pytest.raises(ValueError):
        batch_timeline_figure(steps, 0)
    with pytest.raises(ValueError):
        batch_timeline_figure(steps, 12, start=5, end=2)


def test_timeline_legend_names_requests_and_order_keeps_colours():
    steps = small_run()
    fig = batch_timeline_figure(steps, 12, start=2, end=10)
    (ax,) = fig.axes
    legends = [c for c in ax.get_children() if isinstance(c, Legend)]
    by_title = {lg.get_title().get_text(): lg for lg in legends}
    requests = by_title["request"]
    labels = [t.get_text() for t in requests.get_texts()]
    window = steps[2:10]
    shown = {rid for s in window for rid, _, _ in s.chunks}
    shown |= {rid for s in window for rid in s.admitted + s.preempted + s.finished}
    order = ["r0", "r1", "r2", "long"]
    assert labels == [rid for rid in order if rid in shown]
    colours = [to_rgba(h.get_facecolor()) for h in requests.legend_handles]
    assert colours == [to_rgba(request_color(rid, order)) for rid in labels]
    kinds = [t.get_text() for t in by_title[""].get_texts()]
    assert kinds == ["prefill chunk", "decode token", "admitted", "preempted", "finished"]
    plt.close(fig)
    # one order for two figures: the same request, the same colour, whatever came first
    later = [TimelineStep(1, (("long", 4, True), ("r0", 1, False)))]
    fig = batch_timeline_figure(later, 12, order=order)
    bars = {c.patches[0].get_y(): to_rgba(c.patches[0].get_facecolor())
            for c in fig.axes[0].containers}
    assert bars == {0: to_rgba(request_color("long", order)),
                    4: to_rgba(request_color("r0", order))}
    plt.close(fig)
    with pytest.raises(ValueError, match="does not name"):
        batch_timeline_figure(later, 12, order=["r0"])
    # the narrow layout: both legends below the bars, every request named, the budget too
    fig = batch_timeline_figure(steps, 12, order=[*order, "spare"], narrow=True)
    legends = {lg.get_title().get_text(): [t.get_text() for t in lg.get_texts()]
               for lg in fig.axes[0].get_children() if isinstance(lg, Legend)}
    assert legends["request"] == order and "token budget" in legends[""]
    assert fig.get_size_inches()[0] <= 4.6
    plt.close(fig)


def _view(calls):
    def run(budget, chunk):
        calls.append((budget, chunk))
        kv = KVCacheManager(40, 4)
        sched = BaselineScheduler(kv, SchedulerConfig(max_num_seqs=4, prefill_chunk=chunk,
                                                      max_num_batched_tokens=budget))
        arrivals = {1: [RuntimeRequest(f"r{i}", tuple(range(1 + i, 12 + 3 * i)),
                                       max_tokens=4) for i in range(3)]}
        result = drive(sched, arrivals=arrivals)
        steps = steps_from_outputs(result.outputs, result.ended)
        return TimelineRun(tuple(steps), budget, f"{len(steps)} steps")

    return SchedulingView(run, {"budget": dropdown((8, 12), label="budget"),
                                "chunk": slider((2, 4, 8), label="chunk")},
                          default={"chunk": 4}, order=["r0", "r1", "r2"], title="t")


def test_scheduling_view_reruns_per_setting_and_precomputes_the_grid():
    calls = []
    view = _view(calls)
    fig = view.figure()
    assert fig.axes[0].get_title() == "t: budget 8, chunk 4" and calls == [(8, 4)]
    plt.close(fig)
    plt.close(view.figure(chunk=4))
    assert calls == [(8, 4)]                              # a setting runs once
    small, large = view.result(chunk=2), view.result(budget=12, chunk=8)
    assert len(small.steps) > len(large.steps)            # the knob changes the run
    assert all(s.num_tokens <= 8 for s in small.steps)
    twin = view.kernel_free()
    assert len(twin.frames) == 2 * 3 and twin.default_key == "0-1"
    assert {f.caption for f in twin.frames} == {view.result(budget=b, chunk=c).summary
                                                 for b in (8, 12) for c in (2, 4, 8)}
    assert view.widget() is not None
    with pytest.raises(ValueError, match="not a setting"):
        SchedulingView(view.run, view.knobs, default={"chunk": 3})
    with pytest.raises(ValueError, match="at least one knob"):
        SchedulingView(view.run, {})
    one = [TimelineStep(1, (("a", 3, True),))]
    plt.close(batch_timeline_figure(one, 4))


def test_ch05_crash_scenario_orphans():
    events, kv = ch05.crash_scenario()
    state = replay(events)
    orphans = {rid for rid, e in state.items()
               if kv.has(rid) and e.request.status not in RUNNING_STATUSES}
    assert orphans == {"q3"}


def test_ch05_abort_prediction_check():
    from kvlab.labs.recovery.event_log import EventLog

    log = EventLog()
    sched = ch05.tight_scheduler(log=log)
    drive(sched, arrivals=ch05.tight_arrivals(), aborts={ch05.ABORT["step"]: ["q1"]})
    truth = ["waiting"] + [e.data[1] for e in log.events
                           if e.request_id == "q1" and e.kind == "transition"]
    assert truth == ["waiting", "running", "cancelled"]
    assert sum(r.num_preemptions for r in sched.requests()) == 0
    steps = (sched.get_request("q2").admitted_step, sched.get_request("q0").finished_step)
    assert steps == (3, 9)
    fresh_session()
    assert "Correct" in ch05.check_abort_prediction(truth, "abort", 0, *steps)
    with pytest.raises(NotYetAnswered):
        ch05.check_abort_prediction(truth, "abort", ..., *steps)
    # one message whatever is wrong, and whichever of the five: no part can be tried alone
    messages = set()
    for wrong in ((["waiting", "running", "preempted"], "abort", 0, *steps),
                  (truth[:2], "abort", 0, *steps), ([*truth, "running"], "abort", 0, *steps),
                  (truth, "stop", 0, *steps), (truth, "abort", 1, *steps),
                  (truth, "abort", 0, 4, 9), (truth, "abort", 0, 3, 11)):
        fresh_session()
        with pytest.raises(AssertionError, match="not what the scheduler does") as err:
            ch05.check_abort_prediction(*wrong)
        messages.add(str(err.value))
    assert len(messages) == 1
    text = messages.pop()
    assert "cancelled" not in text and "too" not in text and "0" not in text
    # the wrong prediction is recorded: the right answer after it is not graded
    assert "graded once" in ch05.check_abort_prediction(truth, "abort", 0, *steps)
    fresh_session()
    with pytest.raises(AssertionError, match="not a request status"):
        ch05.check_abort_prediction(["waiting", "ran"], "abort", 0, *steps)
    with pytest.raises(AssertionError, match="not a finish reason"):
        ch05.check_abort_prediction(truth, "done", 0, *steps)
    with pytest.raises(AssertionError, match="whole number"):
        ch05.check_abort_prediction(truth, "abort", "none", *steps)


def test_ch05_pool_sizes_check():
    # the truths, recomputed: 15 tokens of KV at the end, 12 blocks without a reserve, 4
    # under reserve admission (one request at a time, never a preemption)
    assert [ch05.preemptions_with(b) > 0 for b in (11, 12)] == [True, False]
    assert ch05.preemptions_with(4, admission="reserve") == 0
    # the watermark exercise: a reserve at admission delays q2 on 8 and 9 blocks only
    assert [ch05.preemptions_with(b, watermark=0.25) for b in range(8, 13)] == [0, 0, 1, 1, 0]
    fresh_session()
    assert "Correct" in ch05.check_pool_sizes(15, 12, 4)
    messages = set()
    for wrong in ((16, 12, 4), (15, 11, 4), (15, 13, 4), (15, 12, 3), (15, 12, 12)):
        fresh_session()
        with pytest.raises(AssertionError, match="not all what the scheduler does") as err:
            ch05.check_pool_sizes(*wrong)
        messages.add(str(err.value))
    assert len(messages) == 1 and "too" not in messages.pop()
    # looping over the check learns nothing once a wrong answer is recorded
    assert "graded once" in ch05.check_pool_sizes(15, 12, 4)
    fresh_session()
    with pytest.raises(AssertionError, match="positive whole numbers"):
        ch05.check_pool_sizes(15, 12.0, 4)


def _fixed_plan(state, tables):
    """A solution of ``check_fixed_plan``: compact_plan, freeing every non-running table."""
    from kvlab.labs.recovery import RecoveryPlan

    plan = ch05.compact_plan(state, tables)
    orphans = tuple(rid for rid, e in state.items() if rid in tables and rid not in plan.free
                    and e.request.status not in RUNNING_STATUSES)
    return RecoveryPlan(plan.resume, plan.requeue, plan.finish, plan.free + orphans,
                        plan.unaccounted)


def test_ch05_fixed_plan_check():
    from kvlab.labs.recovery import plan_recovery

    # compact_plan's mistakes on the tight run: orphans left to nobody, waiting or preempted
    n = ch05._tight_event_count()
    wrong = {k: ch05.planner_mistakes(ch05.compact_plan, *ch05._crash_tight(k))
             for k in range(n)}
    wrong = {k: v for k, v in wrong.items() if v}
    assert wrong and all(m == ("nothing", "free") for v in wrong.values() for m in v.values())
    statuses = set()
    for k, v in wrong.items():
        events, _ = ch05._crash_tight(k)
        statuses |= {replay(events)[rid].request.status.value for rid in v}
    assert statuses == {"waiting", "preempted"}
    assert "Correct" in ch05.check_fixed_plan(_fixed_plan)
    assert "Correct" in ch05.check_fixed_plan(lambda state, tables: plan_recovery(state, tables))
    with pytest.raises(AssertionError, match="decides a request differently") as err:
        ch05.check_fixed_plan(ch05.compact_plan)
    assert "waiting" not in str(err.value) and "preempted" not in str(err.value)

    def frees_running_too(state, tables):
        from kvlab.labs.recovery import RecoveryPlan

        return RecoveryPlan(free=tuple(tables))

    with pytest.raises(AssertionError, match="differently"):
        ch05.check_fixed_plan(frees_running_too)
    with pytest.raises(AssertionError, match="not a RecoveryPlan"):
        ch05.check_fixed_plan(lambda state, tables: None)
    with pytest.raises(AssertionError, match="library's planner"):
        ch05.check_fixed_plan(plan_recovery)
    assert "Not answered" in try_check(ch05.check_fixed_plan, ...)
    # the planner agrees with the real one on the chapter's own crash point
    events, kv = ch05._crash_tight(38)
    tables = {r: kv.num_slots(r) for r in kv.requests()}
    assert ch05.compact_plan(replay(events), tables) == plan_recovery(replay(events), tables)


def _crash_points(events):
    """A solution of ``check_crash_points``, from the log alone."""
    from kvlab.labs.recovery.replay import met_stop

    points = []
    for k in range(len(events)):
        running = [e.request for e in replay(events[:k]).values()
                   if e.request.status in RUNNING_STATUSES]
        done = [r for r in running if met_stop(r) is not None]
        if done and len(done) < len(running):
            points.append(k)
    return points


def test_ch05_crash_points_check():
    from kvlab.labs.recovery import recover

    for spec in ch05.CRASH_TEST_RUNS:              # the truth, computed independently
        good = []
        for k in range(len(spec.events())):
            events, kv = spec.crashed(k)
            _, report = recover(events, kv, spec.scheduler)
            if report.finished and report.resumed:
                good.append(k)
        assert good and _crash_points(spec.events()) == good
    assert "Correct" in ch05.check_crash_points(_crash_points)
    # only the visible run right, or every point that merely finishes one: both refused
    scripted = ch05.SCRIPTED.events()
    for wrong in (lambda events: _crash_points(scripted),
                  lambda events: [k for k in range(len(events)) if k in _crash_points(events)
                                  or k == len(events) - 1],
                  lambda events: []):
        with pytest.raises(AssertionError, match="not the ones where recovery takes both"):
            ch05.check_crash_points(wrong)
    with pytest.raises(AssertionError, match="pass a function"):
        ch05.check_crash_points([36])


def _edf_then_priority(request, hit_tokens, step):
    """A solution of ``check_deadline_policy``: earliest deadline first, then priority."""
    import math

    deadline = request.deadline if request.deadline is not None else math.inf
    return (deadline, request.priority, -hit_tokens)


RIGHT_BATCH = [("d0", 1), ("d1", 1), ("p0", 4), ("w0", 2)]


@pytest.mark.parametrize("wrong, rule", [
    ([("p0", 4), ("d0", 1)], "prefill comes before a decode"),
    ([("d0", 1), ("d1", 1), ("p0", 6)], "p0 gets 6 tokens, more than"),
    ([("d0", 1), ("d1", 1), ("p0", 4)], "a prefill waits"),
    ([("d0", 1), ("p0", 4)], "decoding request is left out"),
    ([("d1", 1), ("d0", 1), ("p0", 4), ("w0", 2)], "out of the order"),
    ([("d0", 1), ("d1", 1), ("w0", 4), ("p0", 2)], "out of the order"),
    ([("d0", 1), ("d1", 1), ("p0", 4), ("w1", 2)], "passed over"),
    ([("d0", 1), ("d1", 1), ("p0", 3), ("w0", 3)], "not build_batch's"),
    ([("d0", 2), ("d1", 1), ("p0", 4), ("w0", 1)], "one token a step"),
    ([("d0", 1), ("d1", 1), ("p0", 4), ("w0", 1), ("w1", 1)], "exceed max_sequences"),
    ([("d0", 1), ("d1", 1), ("p0", 4), ("w0", 4)], "exceed the token budget"),
    ([("d0", 1), ("d0", 1)], "appears twice"),
    ([("x", 1)], "no request 'x'"),
    ([("d0", 1), ("d1", 1), ("p0", 0)], "positive whole number"),
    (5, "list of"),
])
def test_ch06_batch_check_names_the_rule_not_the_answer(wrong, rule):
    assert "Correct" in ch06.check_batch(RIGHT_BATCH)
    with pytest.raises(AssertionError, match=rule) as err:
        ch06.check_batch(wrong)
    message = str(err.value)
    # no position to bisect on, no right entry, no right count
    assert "entry" not in message and "('w0', 2)" not in message and "min(" not in message


def test_ch06_checks():
    assert "Correct" in ch06.check_deadline_policy(_edf_then_priority)
    assert not hasattr(ch06, "edf_then_priority")        # no solution in the check's module
    with pytest.raises(AssertionError, match="first token at step"):
        ch06.check_deadline_policy(default_order_key)
    with pytest.raises(AssertionError):
        ch06.check_deadline_policy(42)
    with pytest.raises(AssertionError, match="after its deadline") as err:
        ch06.check_deadline_policy(default_order_key)
    assert "deadline before" not in str(err.value) and "inf" not in str(err.value)


def _doc_rule(chats, left, doc, budget, prefill_chunk):
    """A solution of ``check_doc_ttft``."""
    beside = min(prefill_chunk, budget - chats)
    if doc <= beside * left:
        return -(-doc // beside)
    return left + -(-(doc - beside * left) // min(prefill_chunk, budget))


def test_ch06_doc_ttft_check():
    import random

    # the check's measurement: the real scheduler, stepped by EngineCore
    doc_ttft_behind_decodes = ch06._measured_doc_ttft
    case = ch06.DOC_BEHIND_DECODES
    # 10 steps at 64 - 40 = 24 tokens beside the decodes, then the chunk (48) caps the rest
    assert doc_ttft_behind_decodes(**case) == 10 + -(-(1000 - 240) // 48) == 26
    assert doc_ttft_behind_decodes(**{**case, "prefill_chunk": 64}) == 10 + 12
    shown = {k: case[k] for k in ("chats", "left", "doc", "budget", "prefill_chunk")}
    assert {case["max_num_seqs"], case["arrive"]} == {64, 3}
    rng = random.Random(0)
    for _ in range(40):               # the rule is the scheduler's on the workloads it draws
        c = ch06._draw_doc_case(rng)
        assert _doc_rule(**c) == doc_ttft_behind_decodes(**c)
    assert "Correct" in ch06.check_doc_ttft(_doc_rule)
    assert not hasattr(ch06, "DOC_CASES")          # no list of the cases it grades on

    def budget_minus_chats_throughout(chats, left, doc, budget, prefill_chunk):
        return -(-doc // min(prefill_chunk, budget - chats))

    def shown_case_only(**c):
        return 26 if c == shown else 0

    for wrong in (budget_minus_chats_throughout, shown_case_only, lambda **c: "26"):
        with pytest.raises(AssertionError, match="does not agree with the scheduler") as err:
            ch06.check_doc_ttft(wrong)
        assert "26" not in str(err.value) and "too" not in str(err.value)
    with pytest.raises(AssertionError, match="pass a function"):
        ch06.check_doc_ttft(26)
    with pytest.raises(ValueError):
        doc_ttft_behind_decodes(**{**case, "chats": 64})


def fresh_session() -> None:
    """Forget the predictions recorded so far (a new notebook session)."""

    new_reader()


def test_ch06_chunk_design_check():
    fresh_session()
    from kvlab.sim.itl import inter_token_latencies, percentile

    d = ch06.CHUNK_DESIGN
    slo = d["itl_p99_slo_s"]
    p99 = {c: percentile(inter_token_latencies(ch06.run_chunk(c, d)), 99) for c in d["chunks"]}
    assert all(a < b for a, b in zip(list(p99.values()), list(p99.values())[1:], strict=False))
    truth = max(c for c, v in p99.items() if v <= slo)
    assert truth == 512
    # not a lookup: the chapter's H100 sweep at its own target would answer differently
    h100 = {c: ch06.itl_p99(c) for c in (512, 1024)}
    assert h100[1024] <= slo < p99[1024]
    ms = {c: v * 1e3 for c, v in p99.items()}
    good = {truth: ms[truth], 2 * truth: ms[2 * truth]}
    assert "Correct" in ch06.check_chunk_design(truth, good)
    # a prediction scaled from the H100 sweep by the bf16 rates passes (the worked solution)
    from kvlab.sim.catalog import get_gpu

    ratio = get_gpu(ch06.CHUNK_SWEEP["gpu"]).bf16_tflops / get_gpu(d["gpu"]).bf16_tflops
    scaled = {c: h100[c] * 1e3 * ratio for c in (512, 1024)}
    assert "Correct" in ch06.check_chunk_design(512, scaled)
    # the budget verdict comes only with predictions the simulator reproduces: trying the
    # five options with made-up predictions says nothing about the budget
    for budget in d["chunks"]:
        fresh_session()
        made_up = {c: 1.0 for c in d["chunks"]}
        with pytest.raises(AssertionError, match="not both within 25%") as err:
            ch06.check_chunk_design(budget, made_up)
        message = str(err.value)
        assert "too" not in message and "high" not in message and "low" not in message
        assert f"{ms[budget]:.0f}" not in message and "itl_p99" not in message
    # a wrong budget with good predictions: one message, no direction, no right budget
    messages = set()
    for budget in (256, 1024):
        fresh_session()
        with pytest.raises(AssertionError, match="not the largest budget") as err:
            ch06.check_chunk_design(budget, {budget: ms[budget], 2 * budget: ms[2 * budget]})
        messages.add(str(err.value).replace(str(budget), "B"))
    (message,) = messages
    assert "512" not in message and "too" not in message
    # the first wrong answer is the prediction: the right one after it is not graded
    assert "graded once" in ch06.check_chunk_design(truth, good)
    fresh_session()
    with pytest.raises(AssertionError, match="for each of"):
        ch06.check_chunk_design(512, {512: ms[512]})          # the next larger one is missing
    with pytest.raises(AssertionError, match="choose one of"):
        ch06.check_chunk_design(300, good)
    with pytest.raises(AssertionError, match="as a dict"):
        ch06.check_chunk_design(512, 27.0)


def test_ch06_stream_gaps_debug_check():
    from kvlab.sim.itl import inter_token_latencies, percentile

    run = ch06.run_chunk(512, {**ch06.DASHBOARD, "chunks": (512,)})
    longest = max(s.duration for s in run.steps)
    # the symptom the exercise states: the dashboard's p99 exceeds every step of the run
    assert percentile(ch06.stream_gaps(run), 99) > longest
    assert percentile(inter_token_latencies(run), 99) <= longest
    assert "Correct" in ch06.check_stream_gaps(inter_token_latencies)
    for wrong in (ch06.stream_gaps, lambda r: [g / 2 for g in inter_token_latencies(r)],
                  lambda r: inter_token_latencies(r)[1:]):
        with pytest.raises(AssertionError, match="not the ones a streaming client") as err:
            ch06.check_stream_gaps(wrong)
        assert "too" not in str(err.value) and "arrival" not in str(err.value)
    with pytest.raises(AssertionError, match="no gaps"):
        ch06.check_stream_gaps(lambda r: [])
    with pytest.raises(AssertionError, match="pass a function"):
        ch06.check_stream_gaps(3)


def test_recovery_figure_and_explorer():
    from kvlab.core.production_scheduler import ProductionScheduler
    from kvlab.viz.lifecycle import RecoveryExplorer, RecoveryRow, event_text, recovery_figure

    def make(kv, log):
        return ProductionScheduler(kv, ch05.CONFIG, log=log)

    explorer = RecoveryExplorer(ch05.crash_scenario, make, 49, start=37)
    snap = explorer.snapshot()
    rows = {r.request_id: r for r in snap.rows}
    assert rows["q3"].decision == "free orphan" and rows["q3"].held_kv
    assert rows["q3"].logged_status == "finished"
    assert snap.tail[-1].endswith("transition running -> finished (length)")
    assert snap.rows == (
        RecoveryRow("q0", "running", True, "resume"),
        RecoveryRow("q1", "cancelled", False, "nothing"),
        RecoveryRow("q2", "running", True, "resume"),
        RecoveryRow("q3", "finished", True, "free orphan"),
    )
    fig = recovery_figure(snap)
    (ax,) = fig.axes
    # one row per request, top to bottom: id, logged status, KV held, decision
    cells: dict[float, list[str]] = {}
    for t in sorted(ax.texts, key=lambda t: t.get_position()[0]):
        x, y = t.get_position()
        if x < 6:
            cells.setdefault(round(y, 6), []).append(t.get_text())
    header = round(len(snap.rows) - 0.1, 6)
    assert cells == {
        3: ["q0", "running", "table", "resume"],
        2: ["q1", "cancelled", "none", "nothing"],
        1: ["q2", "running", "table", "resume"],
        0: ["q3", "finished", "table", "free orphan"],
        header: ["status in the log", "KV at the crash", "recovery"],
    }
    log = [t.get_text() for t in ax.texts if t.get_position()[0] > 6]
    assert log == ["durable log, crash before event 37:", *snap.tail]
    # the status box is filled (may hold KV) exactly for running statuses
    status_boxes = sorted((p for p in ax.patches if p.get_x() == 1.0), key=lambda p: -p.get_y())
    assert [to_rgba(p.get_facecolor()) == to_rgba(BLOCK_STATE_COLORS["exclusive"])
            for p in status_boxes] == [True, False, True, False]
    plt.close(fig)
    events, _ = ch05.crash_scenario(5)
    assert event_text(events[-1]).endswith("acquired admit, 0 tokens already computed")
    with pytest.raises(ValueError):
        RecoveryExplorer(ch05.crash_scenario, make, 0)
