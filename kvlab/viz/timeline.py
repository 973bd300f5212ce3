"""What each scheduler step put in the batch (chapter 6), and a widget that moves a scheduling
knob.

Per step, a stacked bar of the tokens each request got, coloured per request (a legend names
the colours); prefill chunks are hatched, decode tokens solid. A dashed line marks the token
budget. Markers above the bars show admissions (▲), preemptions (✕) and finishes (●). Pass the
same ``order`` to several figures and each request keeps its colour in all of them. The figure
function is pure: plain :class:`TimelineStep` records in, a matplotlib Figure out; its
``narrow`` layout (legends below the bars) fits a phone's width.
:class:`SchedulingView` reruns a workload for each setting of its knobs (a policy, a chunk
size) and shows the whole run; live, a step slider also spells out one step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from kvlab.viz._widgets import chapter_box, figure_output
from kvlab.viz.kernel_free import Control
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
    narrow: bool = False,
) -> Figure:
    """Stacked bars of ``steps[start:end]`` against the token ``budget``.

    ``order``: request ids in colour order (default: first appearance in ``steps``); pass the
    same list to several figures and a request keeps its colour across them. It must name every
    request of ``steps``. ``highlight``: index into ``steps`` of a step to outline. The legend
    titled "request" lists the requests that appear in the window, in ``order``: on the right,
    or, with ``narrow``, below the bars and the marker legend, in a figure 4.6 inches wide.
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
    fig, ax = plt.subplots(figsize=(4.6, 4.6) if narrow else (10.0, 4.2))
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
    if not narrow:   # the narrow layout names the line in its legend instead
        ax.text(len(window) - 0.4, budget, " budget", va="bottom", ha="right", color=INK,
                fontsize=9)
    ax.set_xlim(-0.6, max(len(window), 1) - 0.4)
    ax.set_ylim(0, top * 1.3)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= top])
    every = math.ceil(len(window) / 8) if narrow else max(1, len(window) // 10)
    ticks = list(range(0, len(window), max(1, every)))
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
    if narrow:
        handles.append(plt.Line2D([], [], color=INK, linestyle="--", linewidth=1,
                                  label="token budget"))
    kinds = ax.legend(handles=handles, loc="upper center", ncol=3 if narrow else 5,
                      fontsize=9 if narrow else 8, bbox_to_anchor=(0.5, -0.19 if narrow else -0.18),
                      frameon=False, columnspacing=1.0, handletextpad=0.4)
    ax.add_artist(kinds)
    kinds.set_clip_on(False)   # add_artist clips to the axes; this legend sits below them
    names = [rid for rid in order if rid in shown]
    limit = 14
    request_handles = [Patch(facecolor=request_color(rid, order), edgecolor="white", label=rid)
                       for rid in names[:limit]]
    if len(names) > limit:
        request_handles.append(Patch(facecolor="white", edgecolor="white",
                                     label=f"+{len(names) - limit} more"))
    if request_handles and narrow:
        ax.legend(handles=request_handles, loc="upper center", bbox_to_anchor=(0.5, -0.43),
                  ncol=4, fontsize=9, title="request", title_fontsize=9, frameon=False,
                  columnspacing=1.0, handletextpad=0.4)
    elif request_handles:
        ax.legend(handles=request_handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=8, title="request", title_fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10 if narrow else None)
    if narrow:
        for label in (ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(),
                      *ax.get_yticklabels()):
            label.set_fontsize(9)
        fig.subplots_adjust(left=0.14, right=0.97, top=0.93, bottom=0.42)
    else:
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


@dataclass(frozen=True)
class TimelineRun:
    """One run for :class:`SchedulingView`: its steps, the token budget, and a short summary
    (a few lines of at most 40 characters, printed under the figure)."""

    steps: tuple[TimelineStep, ...]
    budget: int
    summary: str = ""


class SchedulingView:
    """Move a scheduling knob, see the whole run: ``run(**knobs)`` reruns the workload under one
    setting and returns a :class:`TimelineRun`.

    ``knobs`` maps each keyword of ``run`` to a :class:`~kvlab.viz.kernel_free.Control` (the
    values offered, their labels, slider or dropdown); ``default`` picks the first setting. The
    live widget adds a step slider that outlines one step and spells it out; the kernel-free
    twin precomputes the whole run for every setting (the knobs' grid), with its summary.
    ``order`` fixes each request's colour across settings; ``title`` heads every figure.
    """

    def __init__(self, run: Callable[..., TimelineRun], knobs: Mapping[str, Control], *,
                 default: Mapping[str, object] | None = None,
                 order: Sequence[str] | None = None, title: str = "") -> None:
        if not knobs:
            raise ValueError("SchedulingView needs at least one knob")
        self.run, self.knobs = run, dict(knobs)
        self.default = {name: c.values[0] for name, c in self.knobs.items()}
        for name, value in (default or {}).items():
            if name not in self.knobs or value not in self.knobs[name].values:
                raise ValueError(f"default {name}={value!r} is not a setting of the knobs")
            self.default[name] = value
        self.order = None if order is None else list(order)
        self.title = title
        self._runs: dict[tuple, TimelineRun] = {}

    def result(self, **knobs) -> TimelineRun:
        """The run under ``knobs`` (missing ones at their default), computed once."""
        setting = {**self.default, **knobs}
        key = tuple(setting[name] for name in self.knobs)
        if key not in self._runs:
            found = self.run(**setting)
            if not found.steps:
                raise ValueError(f"the run under {setting} has no steps")
            self._runs[key] = found
        return self._runs[key]

    def _setting_text(self, setting: Mapping[str, object]) -> str:
        return ", ".join(f"{c.label} {c.text(c.values.index(setting[name]))}".strip()
                         for name, c in self.knobs.items())

    def figure(self, highlight: int | None = None, **knobs) -> Figure:
        """The whole run under ``knobs``, step ``highlight`` (an index) outlined."""
        found = self.result(**knobs)
        title = f"{self.title}: " if self.title else ""
        return batch_timeline_figure(found.steps, found.budget, highlight=highlight,
                                     order=self.order, narrow=True,
                                     title=title + self._setting_text({**self.default, **knobs}))

    def widget(self):
        """A control per knob and a step slider above the figure; beneath it the run's summary
        and the chosen step, chunk by chunk."""
        import ipywidgets as w

        controls = {}
        for name, c in self.knobs.items():
            options = [(c.text(i), v) for i, v in enumerate(c.values)]
            common = {"options": options, "value": self.default[name],
                      "description": c.label or name}
            controls[name] = (w.SelectionSlider(**common, continuous_update=False)
                              if c.kind == "slider" else w.Dropdown(**common))
        step = w.IntSlider(value=0, min=0, max=len(self.result().steps) - 1,
                           description="step", continuous_update=False)

        def knobs_now():
            return {name: ctl.value for name, ctl in controls.items()}

        def on_knob(_change) -> None:
            step.max = len(self.result(**knobs_now()).steps) - 1
            redraw()

        def caption() -> str:
            found = self.result(**knobs_now())
            index = min(step.value, len(found.steps) - 1)
            return found.summary + "\n" + describe_step(found.steps[index], found.budget)

        out, redraw = figure_output(
            lambda: self.figure(highlight=step.value, **knobs_now()), caption)
        for ctl in controls.values():
            ctl.observe(on_knob, names="value")
        step.observe(lambda _change: redraw(), names="value")
        redraw()
        return chapter_box([*controls.values(), step, out],
                           what="batch timeline (scheduling knobs and a step slider)",
                           kernel_free=self.kernel_free)

    def kernel_free(self):
        """Every setting of the knobs precomputed: the whole run, its summary beneath."""
        from kvlab.viz.kernel_free import static_widget

        return static_widget(lambda **knobs: self.figure(**knobs), self.knobs,
                             default=self.default,
                             caption=lambda **knobs: self.result(**knobs).summary,
                             title=self.title or "batch timeline")

    def _ipython_display_(self) -> None:  # pragma: no cover - notebook only
        from IPython.display import display

        display(self.widget())
