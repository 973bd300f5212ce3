"""BatchTimeline: what each scheduler step put in the batch (chapter 6).

Per step, a stacked bar of the tokens each request got, coloured per request (a legend on the
right names the colours); prefill chunks are hatched, decode tokens solid. A dashed line marks
the token budget. Markers above the bars show admissions (▲), preemptions (✕) and finishes (●).
Pass the same ``order`` to several figures and each request keeps its colour in all of them.
The figure function is pure: plain :class:`TimelineStep` records in, a matplotlib Figure out.
:class:`BatchTimeline` is a thin ipywidgets wrapper (a slider over steps) around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from kvlab.viz._widgets import chapter_box, figure_output
from kvlab.viz.style import INK, MUTED, PHASE_COLORS, request_color


@dataclass(frozen=True)
class TimelineStep:
    """One step: chunks as ``(request_id, num_tokens, is_prefill)`` and the step's events."""

    step: int
    chunks: tuple[tuple[str, int, bool], ...]
    admitted: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.chunks)


def steps_from_outputs(outputs: Iterable,
                       ended: Iterable[Sequence[str]] = ()) -> list[TimelineStep]:
    """Timeline records from scheduler outputs (``SchedulerOutput``) and, per step, the ids of
    requests that finished (e.g. ``kvlab.sim.tokens.drive(...).ended``)."""
    ended = list(ended)
    steps = []
    for i, out in enumerate(outputs):
        steps.append(TimelineStep(
            step=out.step,
            chunks=tuple((c.request_id, c.num_tokens, c.is_prefill) for c in out.chunks),
            admitted=tuple(out.admitted), preempted=tuple(out.preempted),
            finished=tuple(ended[i]) if i < len(ended) else ()))
    return steps


def steps_from_sim(records: Iterable) -> list[TimelineStep]:
    """Timeline records from ``kvlab.sim.executor.SimResult.steps``."""
    return [TimelineStep(r.step, tuple(r.chunks), tuple(r.admitted), tuple(r.preempted),
                         tuple(r.finished)) for r in records]


def batch_timeline_figure(
    steps: Sequence[TimelineStep],
    budget: int,
    *,
    start: int = 0,
    end: int | None = None,
    highlight: int | None = None,
    order: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """Stacked bars of ``steps[start:end]`` against the token ``budget``.

    ``order``: request ids in colour order (default: first appearance in ``steps``); pass the
    same list to several figures and a request keeps its colour across them. It must name every
    request of ``steps``. ``highlight``: index into ``steps`` of a step to outline. The legend
    on the right lists the requests that appear in the window, in ``order``.
    """
    if budget <= 0:
        raise ValueError("budget must be positive")
    end = len(steps) if end is None else end
    if not 0 <= start <= end <= len(steps):
        raise ValueError(f"bad window [{start}, {end}) for {len(steps)} steps")
    window = steps[start:end]
    if order is None:
        seen: dict[str, None] = {}
        for s in steps:
            for rid, _, _ in s.chunks:
                seen.setdefault(rid, None)
            for rid in s.admitted + s.preempted + s.finished:
                seen.setdefault(rid, None)
        order = list(seen)
    order = list(order)
    shown = {rid for s in window for rid, _, _ in s.chunks}
    shown |= {rid for s in window for rid in s.admitted + s.preempted + s.finished}
    missing = sorted({rid for s in steps for rid, _, _ in s.chunks} - set(order))
    if missing:
        raise ValueError(f"order does not name requests {missing}")
    fig, ax = plt.subplots(figsize=(10.0, 4.2))
    top = max([budget, *(s.num_tokens for s in window)])
    mark_y = top * 1.08
    for x, s in enumerate(window):
        bottom = 0
        for rid, n, prefill in s.chunks:
            ax.bar(x, n, bottom=bottom, width=0.8, color=request_color(rid, order),
                   hatch="///" if prefill else None, edgecolor="white", linewidth=0.6)
            bottom += n
        for k, (ids, marker, color) in enumerate((
                (s.admitted, "^", PHASE_COLORS["prefill"]),
                (s.preempted, "x", "#c44e52"),
                (s.finished, "o", INK))):
            if ids:
                ax.scatter([x], [mark_y + k * top * 0.07], marker=marker, s=22 + 6 * len(ids),
                           color=color, zorder=3)
    if highlight is not None and start <= highlight < end:
        ax.axvspan(highlight - start - 0.5, highlight - start + 0.5, color=MUTED, alpha=0.15)
    ax.axhline(budget, color=INK, linestyle="--", linewidth=1)
    ax.text(len(window) - 0.4, budget, " budget", va="bottom", ha="right", color=INK, fontsize=9)
    ax.set_xlim(-0.6, max(len(window), 1) - 0.4)
    ax.set_ylim(0, top * 1.3)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= top])
    ticks = list(range(0, len(window), max(1, len(window) // 10)))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(window[i].step) for i in ticks])
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in the batch")
    handles = [
        Patch(facecolor="white", edgecolor=INK, hatch="///", label="prefill chunk"),
        Patch(facecolor=MUTED, edgecolor=INK, label="decode token"),
        plt.Line2D([], [], marker="^", linestyle="", color=PHASE_COLORS["prefill"],
                   label="admitted"),
        plt.Line2D([], [], marker="x", linestyle="", color="#c44e52", label="preempted"),
        plt.Line2D([], [], marker="o", linestyle="", color=INK, label="finished"),
    ]
    kinds = ax.legend(handles=handles, loc="upper center", ncol=5, fontsize=8,
                      bbox_to_anchor=(0.5, -0.18))
    ax.add_artist(kinds)
    kinds.set_clip_on(False)   # add_artist clips to the axes; this legend sits below them
    names = [rid for rid in order if rid in shown]
    limit = 14
    request_handles = [Patch(facecolor=request_color(rid, order), edgecolor="white", label=rid)
                       for rid in names[:limit]]
    if len(names) > limit:
        request_handles.append(Patch(facecolor="white", edgecolor="white",
                                     label=f"+{len(names) - limit} more"))
    if request_handles:
        ax.legend(handles=request_handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=8, title="request", title_fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    # room for the two legends outside the axes: the kinds below, the requests on the right
    fig.tight_layout(rect=(0.0, 0.07, 0.89, 1.0))
    return fig


def describe_step(step: TimelineStep, budget: int) -> str:
    """One line per chunk of ``step``: what the widget prints under the figure."""
    n_req = len(step.chunks)
    lines = [f"step {step.step}: {step.num_tokens}/{budget} tokens, "
             f"{n_req} request{'s' * (n_req != 1)}"]
    for rid, n, prefill in step.chunks:
        lines.append(f"  {rid}: {n} {'prefill' if prefill else 'decode'} "
                     f"token{'s' * (n != 1)}")
    for what, ids in (("admitted", step.admitted), ("preempted", step.preempted),
                      ("finished", step.finished)):
        if ids:
            lines.append(f"  {what}: {', '.join(ids)}")
    return "\n".join(lines)


class BatchTimeline:
    """Slider over steps; shows a window of ``width`` steps ending at the selected one. The
    slider reads the step's number (as the x axis and the caption do); its value is the
    step's index in ``steps``."""

    def __init__(self, steps: Sequence[TimelineStep], budget: int, *, width: int = 30,
                 title: str | None = None, order: Sequence[str] | None = None) -> None:
        import ipywidgets as widgets

        if not steps:
            raise ValueError("no steps to show")
        self.steps, self.budget, self.width, self.title = list(steps), budget, width, title
        self.order = None if order is None else list(order)
        self.slider = widgets.SelectionSlider(
            options=[(str(s.step), i) for i, s in enumerate(self.steps)],
            value=min(width, len(steps)) - 1, description="step", continuous_update=False)
        self.out, self._redraw = figure_output(
            self.figure, lambda: describe_step(self.steps[self.slider.value], self.budget))
        self.slider.observe(lambda change: self.draw(), names="value")
        self.widget = chapter_box([self.slider, self.out],
                                  what="batch timeline (a slider over scheduler steps)",
                                  kernel_free=self.kernel_free)
        self.draw()

    def kernel_free(self, max_frames: int = 16):
        """About ``max_frames`` steps precomputed (evenly spread, the default one included)."""
        from kvlab.viz.kernel_free import slider, spread, static_widget

        keep = spread(len(self.steps), max_frames, include=[self.slider.value])
        return static_widget(self.figure,
                             {"index": slider(keep, label="step",
                                              labels=[str(self.steps[i].step) for i in keep])},
                             default={"index": self.slider.value},
                             caption=lambda index: describe_step(self.steps[index], self.budget),
                             title=self.title or "batch timeline")

    def figure(self, index: int | None = None) -> Figure:
        """The static figure the widget shows at ``index`` (default: the slider's value)."""
        i = self.slider.value if index is None else index
        start = max(0, i - self.width + 1)
        end = min(len(self.steps), start + self.width)
        return batch_timeline_figure(self.steps, self.budget, start=start, end=end,
                                     highlight=i, title=self.title, order=self.order)

    def draw(self) -> None:
        """Redraw the output: the figure at the slider's step, that step described beneath."""
        self._redraw()

    def _ipython_display_(self) -> None:  # pragma: no cover - notebook only
        from IPython.display import display

        display(self.widget)


# Layout of the request state diagram (x, y) for chapter 5.
