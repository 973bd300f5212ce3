"""Chapter 10 figures: the install protocol as a producer/consumer timeline, and one fault's
outcome on the consumer's KV pool.

* :func:`protocol_timeline_figure` — pure: rows of plain data (request, fault injected, the
  consumer's decision and action) in, a Figure out. Producer lane on the left, consumer lane on
  the right; an arrow per entry labelled with its fault; the consumer's decision in a box
  coloured by action (install / recompute / fail / discard).
* :func:`fault_run_figure` — pure: a :class:`~kvlab.labs.pd.demo.FaultRun` in: the
  consumer's pool right after its decision (chapter 3's :func:`~kvlab.viz.blocks.pool_figure`).
* :func:`fault_explorer` — a dropdown of faults and a button that runs one through a live
  :class:`~kvlab.labs.pd.demo.PDDemo` (thin ipywidgets glue); its kernel-free twin
  :func:`fault_kernel_free` runs every fault once on a fresh pair.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvlab.viz._widgets import chapter_box, figure_output
from kvlab.viz.blocks import pool_figure
from kvlab.viz.style import INK, MUTED, PHONE, layout, phone_aware

ACTION_COLORS = {"install": "#009e73", "recompute": "#e69f00", "fail": "#c44e52",
                 "discard": "#868e96", "wait": "#56b4e9"}


@phone_aware
def protocol_timeline_figure(rows: Sequence[Mapping[str, Any]], *, producer: str = "producer",
                             consumer: str = "consumer", title: str | None = None):
    """``rows``: dicts with ``request``, ``fault`` (``""`` for none), ``decision``, ``action``
    and optionally ``order`` (the consumer's decision order, drawn as ``#n``). In a phone's
    layout each entry takes two lines: the producer's export and the fault it met, then the
    consumer's decision under it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    if layout().phone:
        return _protocol_timeline_phone(rows, producer=producer, consumer=consumer,
                                        title=title)
    n = len(rows)
    fig, ax = plt.subplots(figsize=(9.5, 0.42 * n + 1.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(n + 0.2, -1.2)
    ax.axis("off")
    ax.text(1.4, -0.8, producer, ha="center", fontsize=11, color=INK, weight="bold")
    ax.text(7.6, -0.8, consumer, ha="center", fontsize=11, color=INK, weight="bold")
    for i, row in enumerate(rows):
        ax.add_patch(FancyBboxPatch((0.2, i - 0.32), 2.4, 0.64, boxstyle="round,pad=0.02",
                                    fc="#e9ecef", ec=MUTED, lw=0.8, gid=f"producer-{i}"))
        ax.text(1.4, i, f"prefill + export {row['request']}", ha="center", va="center",
                fontsize=8.5, color=INK)
        fault = row.get("fault") or ""
        ax.annotate("", xy=(5.9, i), xytext=(2.7, i),
                    arrowprops={"arrowstyle": "->", "color": "#c44e52" if fault else MUTED,
                                "lw": 1.4, "ls": "--" if fault else "-"})
        ax.text(4.3, i - 0.12, fault or "clean", ha="center", va="bottom", fontsize=8,
                color="#c44e52" if fault else MUTED)
        action = row["action"]
        ax.add_patch(FancyBboxPatch((6.0, i - 0.32), 3.8, 0.64, boxstyle="round,pad=0.02",
                                    fc=ACTION_COLORS.get(action, "#ffffff"), ec=INK, lw=0.6,
                                    alpha=0.85, gid=f"decision-{i}"))
        order = f"#{row['order']} " if row.get("order") is not None else ""
        ax.text(7.9, i, f"{order}{row['decision']} → {action}", ha="center", va="center",
                fontsize=8.5, color="white" if action in ("install", "fail") else INK)
    handles = [Patch(fc=c, ec=INK, label=a) for a, c in ACTION_COLORS.items() if a != "wait"]
    ax.legend(handles=handles, loc="lower center", ncol=4, frameon=False, fontsize=8.5,
              bbox_to_anchor=(0.5, -0.02 - 0.25 / max(n, 1)))
    if title:
        ax.set_title(title, fontsize=11, color=INK)
    fig.tight_layout()
    return fig


def _protocol_timeline_phone(rows, *, producer: str, consumer: str, title: str | None):
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    n = len(rows)
    fig, ax = plt.subplots(figsize=(PHONE.width_in, 0.8 * n + 2.1))
    ax.set_xlim(0, 10)
    ax.set_ylim(2 * n - 0.3, -2.0)
    ax.axis("off")
    ax.text(0.2, -1.5, f"grey: {producer}", ha="left", fontsize=9, color=INK, weight="bold")
    ax.text(0.2, -0.8, f"coloured: {consumer}'s decision", ha="left", fontsize=9, color=INK,
            weight="bold")
    for i, row in enumerate(rows):
        top, bottom = 2 * i, 2 * i + 1
        ax.add_patch(FancyBboxPatch((0.2, top - 0.36), 5.2, 0.72, boxstyle="round,pad=0.02",
                                    fc="#e9ecef", ec=MUTED, lw=0.8, gid=f"producer-{i}"))
        ax.text(2.8, top, f"prefill + export {row['request']}", ha="center", va="center",
                fontsize=8.5, color=INK)
        fault = row.get("fault") or ""
        ax.text(5.7, top, fault or "clean", ha="left", va="center", fontsize=8,
                color="#c44e52" if fault else MUTED)
        ax.annotate("", xy=(1.2, bottom - 0.38), xytext=(1.2, top + 0.38),
                    arrowprops={"arrowstyle": "->", "color": "#c44e52" if fault else MUTED,
                                "lw": 1.2, "ls": "--" if fault else "-"})
        action = row["action"]
        ax.add_patch(FancyBboxPatch((0.2, bottom - 0.36), 9.6, 0.72,
                                    boxstyle="round,pad=0.02",
                                    fc=ACTION_COLORS.get(action, "#ffffff"), ec=INK, lw=0.6,
                                    alpha=0.85, gid=f"decision-{i}"))
        order = f"#{row['order']} " if row.get("order") is not None else ""
        ax.text(5.0, bottom, f"{order}{row['decision']} → {action}", ha="center",
                va="center", fontsize=8.5,
                color="white" if action in ("install", "fail") else INK)
    handles = [Patch(fc=c, ec=INK, label=a) for a, c in ACTION_COLORS.items() if a != "wait"]
    ax.legend(handles=handles, loc="upper center", ncol=2, frameon=False, fontsize=8.5,
              bbox_to_anchor=(0.5, 0.0))
    if title:
        ax.set_title(title, fontsize=10, color=INK)
    fig.tight_layout()
    return fig


def fault_run_caption(run: Any) -> str:
    """One line: the fault, the consumer's decision, and the outcome against a single engine.
    A log-probability difference below 1e-5 (float rounding, whose last digits depend on the
    attention path that ran) is shown as a bound, a larger one as its value."""
    verdict = ("tokens equal the single engine" if run.tokens_equal else
               "request did not complete" if not run.finished else "TOKENS DIFFER")
    diff = run.max_logprob_diff
    shown = "< 1e-5" if diff < 1e-5 else f"= {diff:.1e}"
    return (f"fault={run.fault}: decision {run.decision} -> {run.action}; {verdict}; "
            f"max |logprob diff| {shown}; request table {list(run.table)}")


def fault_run_figure(run: Any, *, per_row: int = 20):
    """The consumer's pool right after it decided on ``run``'s entry: installed blocks are
    *shared* (the request and the prefix cache hold them); recomputed ones are exclusive."""
    return pool_figure(run.snapshot, per_row=per_row,
                       title=f"consumer pool after '{run.fault}': {run.decision} → {run.action}")


def fault_explorer(demo: Any, faults: Sequence[str] | None = None, *,
                   replay: Callable[[], Any] | None = None):
    """Choose a fault, press run: one fresh request goes through ``demo`` (a PDDemo).

    ``replay``, when given, returns a fresh demo set up like ``demo`` (e.g. ``PDDemo``): the
    kernel-free twin (:func:`fault_kernel_free`) runs every fault on that copy, leaving ``demo``
    untouched. Without it the widget has no kernel-free twin.
    """
    import ipywidgets as w

    from kvlab.labs.pd.demo import DEMO_FAULTS

    options = list(faults or DEMO_FAULTS)
    choice = w.Dropdown(options=options, value="none" if "none" in options else options[0],
                        description="fault")
    button = w.Button(description="run it")
    state: dict[str, Any] = {}

    def draw():
        state["run"] = demo.run(choice.value)
        return fault_run_figure(state["run"])

    out, redraw = figure_output(draw, lambda: fault_run_caption(state["run"]))
    button.on_click(lambda _: redraw())
    redraw()
    first = choice.value
    return chapter_box(
        [w.HBox([choice, button]), out],
        what="fault explorer (a fault menu and a run button over a live producer/consumer pair)",
        kernel_free=None if replay is None else lambda: fault_kernel_free(replay(), options,
                                                                          first=first))


def fault_kernel_free(demo: Any, faults: Sequence[str], *, first: str = "none"):
    """The explorer without a kernel: ``first``, then every other fault of ``faults``, run in
    that order on ``demo`` (a fresh PDDemo, as if each were chosen and run in turn), one frame
    each with its caption."""
    from kvlab.viz.kernel_free import dropdown, static_widget

    if first not in faults:
        raise ValueError(f"first={first!r} is not one of the faults {list(faults)}")
    order = [first, *(f for f in faults if f != first)]
    runs = {fault: demo.run(fault) for fault in order}
    return static_widget(lambda fault: fault_run_figure(runs[fault]),
                         {"fault": dropdown(list(faults))}, default={"fault": first},
                         caption=lambda fault: fault_run_caption(runs[fault]),
                         title="fault explorer (each fault run once, in turn, on a fresh pair)")
