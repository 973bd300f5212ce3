"""Chapter figures read cleanly once drawn: legends clear of the data, tick labels apart, arrows
ending at box edges, each request in one colour across a widget's frames, and slider labels
and captions that name the same step.

The checks measure the drawn figure in display coordinates (after ``canvas.draw()``), so they
catch what a reader sees, whatever the data."""

from __future__ import annotations

import itertools
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.colors import to_rgb
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch, Rectangle
from matplotlib.transforms import Bbox

from kvlab.core.request import TRANSITIONS, RequestStatus, holds_kv
from kvlab.labs.slo import SLO, LatencyRecord
from kvlab.labs.speculation.acceptance import AcceptanceData
from kvlab.viz.blocks import fork_scenario
from kvlab.viz.goodput import goodput_figure, rate_figure
from kvlab.viz.lifecycle import state_diagram_figure
from kvlab.viz.paging import BlockTableView
from kvlab.viz.quantization import example_row, quantization_figure
from kvlab.viz.spec import acceptance_figure
from kvlab.viz.style import use_style
from kvlab.viz.timeline import TimelineStep, describe_step


@pytest.fixture(autouse=True)
def _book_style():
    use_style()
    yield
    plt.close("all")


def _renderer(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def overlapping_tick_labels(fig) -> list[tuple[str, str]]:
    """Pairs of shown tick labels (major and minor, per axis) whose boxes overlap."""
    renderer = _renderer(fig)
    pairs = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            boxes = [(label.get_text(), label.get_window_extent(renderer))
                     for minor in (False, True)
                     for loc, label in zip(axis.get_ticklocs(minor=minor),
                                           axis.get_ticklabels(minor=minor), strict=True)
                     if lo <= loc <= hi and label.get_visible() and label.get_text()]
            pairs += [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
                      if box_a.overlaps(box_b)]
    return pairs


def _covers(artist, box: Bbox, renderer) -> bool:
    """Whether ``artist`` (a line, scatter, line collection or bar) draws inside ``box``."""
    if isinstance(artist, Line2D):
        path = artist.get_transform().transform_path(artist.get_path())
        if artist.get_linestyle() not in ("None", "") and path.intersects_bbox(box, False):
            return True
        if artist.get_marker() in ("None", "", None):
            return False
        near = box.padded(artist.get_markersize() * artist.figure.dpi / 72 / 2)
        return any(near.contains(x, y) for x, y in path.vertices)
    if isinstance(artist, PathCollection):
        points = artist.get_offset_transform().transform(artist.get_offsets())
        return any(box.contains(x, y) for x, y in points)
    if isinstance(artist, LineCollection):
        return any(artist.get_transform().transform_path(p).intersects_bbox(box, False)
                   for p in artist.get_paths())
    if isinstance(artist, Rectangle) and artist.get_width() and artist.get_height():
        return artist.get_window_extent(renderer).overlaps(box)
    return False


def legends_over_data(fig) -> list[str]:
    """First label of every legend whose box, where it lies inside an axes, covers that axes'
    lines, markers, scatter points or bars."""
    renderer = _renderer(fig)
    legends = [*fig.legends, *(c for ax in fig.axes for c in ax.get_children()
                               if isinstance(c, Legend))]
    hits = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            inside = Bbox.intersection(box, ax.bbox)
            data = [*ax.lines, *ax.collections, *ax.patches]
            if inside is not None and any(_covers(a, inside, renderer) for a in data):
                hits.append(legend.get_texts()[0].get_text())
    return hits


# ---------------------------------------------------------------------------- ch11 goodput


def _run(rate: float, attained: float, n: int = 40) -> list[LatencyRecord]:
    """``n`` arrivals at ``rate``; the first ``attained`` share meet a 200 ms TTFT."""
    return [LatencyRecord(f"r{i}", i / rate, ttft=0.05 if i < attained * n else 1.0,
                          e2e=2.0) for i in range(n)]


def _curves():
    # the chapter's shape: set-ups collapsing at different rates, one to near zero
    shape = {"colocated, whole prompts": ((3, 6, 9, 12, 15), (1.0, 0.93, 0.58, 0.22, 0.12)),
             "1 prefill + 1 decode": ((3, 6, 9, 12, 15, 18), (1, 1, 0.98, 0.92, 0.7, 0.2)),
             "colocated, chunk 256": ((12, 18, 24, 30), (1.0, 1.0, 0.87, 0.35))}
    return {name: ([2 * r for r in rates], [_run(2 * r, a) for r, a in zip(rates, att,
                                                                          strict=True)])
            for name, (rates, att) in shape.items()}


def test_goodput_legend_covers_no_curve():
    fig = goodput_figure(_curves(), SLO(ttft=0.2), gpus=dict.fromkeys(_curves(), 2), rate=9)
    assert legends_over_data(fig) == []
    labels = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
    assert any(label.startswith("colocated, whole prompts: ") for label in labels)
    assert "goodput = offered" in labels


@pytest.mark.parametrize("offered", [(19.5, 77.0, 240.0), (30.0, 110.0, 420.0),
                                     (2.0, 8.0, 32.0)])
def test_rate_figure_log_ticks_do_not_run_together(offered):
    fig = rate_figure(offered, [0.9 * r for r in offered], [0.8 * r for r in offered],
                      title="kvlab-tiny on this CPU")
    assert overlapping_tick_labels(fig) == []
    assert fig.axes[0].get_xscale() == "log"
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [f"{r:g}" for r in offered]


# ------------------------------------------------------------------------- ch09 acceptance


def _acceptance(k: int = 4):
    # four requests whose lines sweep the whole panel, as a real run's do
    lengths = {f"req {j}": tuple((s, 1 + (s * (j + 2)) % (k + 1)) for s in range(2, 22))
               for j in range(4)}
    return AcceptanceData("draft_model", k, 0.8, (0.61, 0.44, 0.39, 0.26)[:k], lengths,
                          ((0.05, 0.1), (0.37, 0.7), (0.0, 0.9)), 0.72, 2.7)


def test_acceptance_legends_cover_no_line():
    assert legends_over_data(acceptance_figure(_acceptance())) == []


def test_acceptance_legend_writes_alpha_as_the_greek_letter():
    fig = acceptance_figure(_acceptance())
    texts = [t.get_text() for ax in fig.axes if ax.get_legend()
             for t in ax.get_legend().get_texts()]
    assert any(r"\alpha" in t for t in texts)
    # outside mathtext ($...$) no legend spells the letter out
    assert not any("alpha" in re.sub(r"\$[^$]*\$", "", t) for t in texts)


# ----------------------------------------------------------------------- ch08 quantization


@pytest.mark.parametrize("bits, group_size, symmetric",
                         [(4, 32, True), (2, 128, False), (8, 8, True), (8, 128, True)])
def test_quantization_ticks_readable_and_legend_clear(bits, group_size, symmetric):
    fig = quantization_figure(example_row(12.0), bits, group_size, symmetric)
    assert overlapping_tick_labels(fig) == []
    assert legends_over_data(fig) == []
    lo, hi = fig.axes[1].get_xlim()
    groups = [g for g in fig.axes[1].get_xticks() if lo <= g <= hi]
    assert all(float(g).is_integer() for g in groups)       # group numbers, no 0.25 steps
    assert 2 <= len(groups) <= 10


# -------------------------------------------------------------------------- ch05 diagram


def test_state_diagram_arrows_end_outside_the_boxes():
    fig = state_diagram_figure({s.value: [d.value for d in TRANSITIONS[s]] for s in RequestStatus},
                               {s.value: holds_kv(s) for s in RequestStatus})
    _renderer(fig)
    (ax,) = fig.axes
    boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
    arrows = [t.arrow_patch for t in ax.texts if getattr(t, "arrow_patch", None)]
    assert len(arrows) == sum(len(v) for v in TRANSITIONS.values())
    for arrow in arrows:
        path = arrow.get_transform().transform_path(arrow.get_path())
        drawn = [v for line in path.to_polygons(closed_only=False) for v in line]  # curves too
        inside = [tuple(v) for v in drawn if any(b.contains_point(v) for b in boxes)]
        assert inside == [], "an arrow (or its head) is drawn inside a state's box"


# ------------------------------------------------------------- ch02 one colour per request


def test_block_table_view_keeps_each_request_colour_in_every_frame():
    view = BlockTableView(num_blocks=16, block_size=4)
    for prompt in (6, 9, 3):
        view.add_request(prompt)
    view.finish("r1")                 # r2 moves up a row: its colour must not follow the row
    view.add_request(10)
    view.append("r0", 3)
    colours: dict[str, set] = {}
    for index in range(len(view.history)):
        fig = view.figure(index)
        for patch in fig.axes[0].patches:
            found = re.fullmatch(r"log-(\w+)-\d+", patch.get_gid() or "")
            if found:
                colours.setdefault(found[1], set()).add(to_rgb(patch.get_edgecolor()))
        plt.close(fig)
    assert set(colours) == {"r0", "r1", "r2", "r3"}
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({c for cs in colours.values() for c in cs}) == 4     # and all four distinct


# ------------------------------------------------------------------ ch06 slider and caption


def test_timeline_caption_counts_in_the_singular():
    one = describe_step(TimelineStep(23, (("late1", 1, False),)), 16)
    assert one.splitlines() == ["step 23: 1/16 tokens, 1 request", "  late1: 1 decode token"]
    two = describe_step(TimelineStep(2, (("a", 3, True), ("b", 1, False))), 16)
    assert "2 requests" in two and "a: 3 prefill tokens" in two


# ------------------------------------------------------------------------- ch03 fork label


def test_fork_step_names_one_child_in_the_singular():
    labels = [what for what, _ in fork_scenario(n=2)]
    assert "fork 1 child for n=2: every block shared" in labels
    assert any(what.startswith("fork 2 children") for what, _ in fork_scenario(n=3))
