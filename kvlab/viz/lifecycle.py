"""The request state machine and crash recovery, drawn (chapter 5).

:func:`state_diagram_figure` draws the allowed transitions; :func:`recovery_snapshot` and
:func:`recovery_figure` show what recovery from the event log decides for each request at a
crash point, and :class:`RecoveryExplorer` is a slider over crash points. Figures are pure:
plain records in, a matplotlib Figure out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvlab.viz._widgets import chapter_box, figure_output
from kvlab.viz.style import INK, MUTED, PHONE, layout, phone_aware

_STATE_POS = {
    "waiting": (0.0, 1.0), "running": (2.1, 1.0),
    "preempted": (2.1, 2.1), "finished": (4.2, 1.0), "cancelled": (2.8, -0.2),
    "failed": (1.4, -0.2), "rejected": (0.0, -0.2), "waiting_for_remote_kv": (0.0, 2.1),
}
#: Arrows drawn as arcs (``arc3`` radius): the two ways between preempted and running, and
#: those from preempted that would otherwise cut through the running box.
_CURVED = {("preempted", "running"): 0.25, ("running", "preempted"): 0.25,
           ("preempted", "failed"): 0.3, ("preempted", "cancelled"): -0.3}


def state_diagram_figure(transitions: dict, holds_kv: dict[str, bool],
                         highlight: Sequence[str] = ()) -> Figure:
    """The request state machine: ``transitions`` maps a status name to the names it may move
    to; ``holds_kv`` says which statuses own a KV block table (drawn filled). Terminal statuses
    (no way out) get a double border. ``highlight``: status names to outline in red."""
    from matplotlib.patches import FancyBboxPatch

    from kvlab.viz.style import BLOCK_STATE_COLORS

    unknown = set(transitions) - set(_STATE_POS)
    if unknown:
        raise ValueError(f"no position for states {sorted(unknown)}")
    fig, ax = plt.subplots(figsize=(9.0, 4.0))
    w, h = 0.95, 0.42
    boxes = {}
    for name, (x, y) in _STATE_POS.items():
        if name not in transitions:
            continue
        held = holds_kv.get(name, False)
        face = BLOCK_STATE_COLORS["exclusive"] if held else BLOCK_STATE_COLORS["free"]
        edge = "#c44e52" if name in highlight else INK
        terminal = not transitions[name]
        boxes[name] = ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                                  boxstyle="round,pad=0.02,rounding_size=0.08",
                                                  facecolor=face, edgecolor=edge,
                                                  linewidth=2.5 if name in highlight else 1.2))
        if terminal:
            ax.add_patch(FancyBboxPatch((x - w / 2 + 0.04, y - h / 2 + 0.04), w - 0.08, h - 0.08,
                                        boxstyle="round,pad=0.02,rounding_size=0.06",
                                        facecolor="none", edgecolor=edge, linewidth=0.8))
        ax.text(x, y, name.upper().replace("_", " ").replace(" FOR ", " FOR\n"), ha="center",
                va="center", fontsize=9 if "_" not in name else 7.5,
                color="white" if held else INK, fontweight="bold")
    for src, targets in transitions.items():
        for dst in targets:
            rad = _CURVED.get((src, dst), 0.0)
            # centre to centre, clipped at the two boxes' edges: the head stays visible
            ax.annotate("", xy=_STATE_POS[dst], xytext=_STATE_POS[src],
                        arrowprops=dict(arrowstyle="-|>", color=MUTED, lw=1.0,
                                        patchA=boxes[src], patchB=boxes[dst],
                                        shrinkA=2, shrinkB=2,
                                        connectionstyle=f"arc3,rad={rad}"))
    ax.set_xlim(-0.7, 4.9)
    ax.set_ylim(-0.6, 2.5)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [Patch(facecolor=BLOCK_STATE_COLORS["exclusive"], edgecolor=INK,
                     label="holds a KV block table"),
               Patch(facecolor=BLOCK_STATE_COLORS["free"], edgecolor=INK, label="holds no KV"),
               Patch(facecolor="white", edgecolor=INK, linewidth=2.0,
                     label="terminal (double border)")]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    # the title is also the figure's alt text (kernel_free.describe_figure reads it)
    held = [name for name in transitions if holds_kv.get(name, False)]
    ax.set_title(f"request state machine: {len(transitions)} statuses, "
                 f"KV held only in {', '.join(held) or 'none'}", loc="left", fontsize=11)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------- crash and recovery


@dataclass(frozen=True)
class RecoveryRow:
    """One request at a crash: its last logged status, whether the KV manager still held a
    table for it, and what recovery decided (resume, requeue, free, finish or nothing)."""

    request_id: str
    logged_status: str
    held_kv: bool
    decision: str


@dataclass(frozen=True)
class RecoverySnapshot:
    """Plain data for :func:`recovery_figure`: the crash point, the last durable events (as
    text) and one :class:`RecoveryRow` per request known to the log."""

    crash_at: int
    tail: tuple[str, ...]
    rows: tuple[RecoveryRow, ...]


def recovery_snapshot(crash_at: int, events: Sequence, held: dict[str, bool],
                      report) -> RecoverySnapshot:
    """Build a snapshot from the durable ``events``, which requests the KV manager ``held``
    *before* recovery, and the :class:`~kvlab.labs.recovery.RecoveryReport`."""
    from kvlab.labs.recovery import replay

    decisions: dict[str, str] = {}
    for what, ids in (("resume", report.resumed), ("requeue", report.requeued),
                      ("free orphan", report.freed), ("finish", report.finished)):
        for rid in ids:
            decisions[rid] = what
    rows = []
    for rid, entry in replay(events).items():
        rows.append(RecoveryRow(rid, entry.request.status.value, bool(held.get(rid, False)),
                                decisions.get(rid, "nothing")))
    tail = tuple(event_text(e) for e in list(events)[-4:])
    return RecoverySnapshot(crash_at, tail, tuple(rows))


def event_text(event) -> str:
    """A short human-readable line for a :class:`~kvlab.labs.recovery.event_log.Event`."""
    d = event.data
    if event.kind == "transition":
        what = f"{d[0]} -> {d[1]}" + (f" ({d[2]})" if d[2] else "")
    elif event.kind == "progress":
        what = f"computed {d[0]}" + (f", token {d[1]}" if d[1] is not None else "")
    elif event.kind == "acquired":
        what = f"{d[0]}, {d[1]} tokens already computed"
    elif event.kind in ("acquire", "released"):
        what = str(d[0])
    else:
        what = ""
    return f"{event.index:>3} {event.request_id} {event.kind} {what}".rstrip()


_DECISION_COLORS = {"resume": "#009e73", "requeue": "#e69f00", "free orphan": "#c44e52",
                    "finish": "#0072b2", "nothing": "#adb5bd"}


@phone_aware
def recovery_figure(snapshot: RecoverySnapshot) -> Figure:
    """One row per request: logged status (filled if it is a running status, i.e. may hold
    KV), whether the manager held KV at the crash, and recovery's decision; the tail of the
    durable log beside them (under them in a phone's layout)."""
    from kvlab.viz.style import BLOCK_STATE_COLORS

    rows = snapshot.rows
    phone = layout().phone
    tail_lines = len(snapshot.tail) if phone else 0
    fig, ax = plt.subplots(figsize=(PHONE.width_in if phone else 9.0,
                                    1.2 + 0.42 * max(len(rows), 1) + 0.3 * tail_lines))
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        running = row.logged_status == "running"
        face = BLOCK_STATE_COLORS["exclusive" if running else "free"]
        ax.add_patch(plt.Rectangle((1.0, y - 0.35), 1.6, 0.7, edgecolor=INK, facecolor=face))
        ax.text(1.8, y, row.logged_status, ha="center", va="center", fontsize=9,
                color="white" if running else INK)
        ax.add_patch(plt.Rectangle((3.0, y - 0.35), 1.2, 0.7, edgecolor=INK,
                                   facecolor=BLOCK_STATE_COLORS["exclusive" if row.held_kv
                                                                else "free"]))
        ax.text(3.6, y, "table" if row.held_kv else "none", ha="center", va="center", fontsize=9,
                color="white" if row.held_kv else INK)
        ax.add_patch(plt.Rectangle((4.6, y - 0.35), 1.8, 0.7, edgecolor=INK,
                                   facecolor=_DECISION_COLORS.get(row.decision, MUTED)))
        ax.text(5.5, y, row.decision, ha="center", va="center", fontsize=9, color="white")
        ax.text(0.9, y, row.request_id, ha="right", va="center", fontsize=10)
    top = len(rows) - 0.3
    for x, label in ((1.8, "status in the log"), (3.6, "KV at the crash"), (5.5, "recovery")):
        ax.text(x, top + 0.2, label, ha="center", va="bottom", fontsize=9, color=MUTED)
    # the log's tail: right of the table, or under it on a phone (and cut shorter)
    x, y, width = (0.0, -1.0, 44) if phone else (6.7, top + 0.2, 52)
    ax.text(x, y, f"durable log, crash before event {snapshot.crash_at}:",
            ha="left", va="bottom", fontsize=9, color=MUTED)
    for j, line in enumerate(snapshot.tail):
        ax.text(x, y - 0.45 * j - 0.5, line[:width], ha="left", va="center", fontsize=8,
                family="monospace", color=INK)
    ax.set_xlim(0, 6.5 if phone else 11.5)
    ax.set_ylim(-1.6 - 0.45 * tail_lines if phone else -0.6, len(rows) + 0.3)
    ax.axis("off")
    fig.tight_layout()
    return fig


class RecoveryExplorer:
    """Slider over crash points: ``crash(k)`` returns ``(events, kv)`` of a run crashed before
    event ``k``; the widget recovers it (with ``make_scheduler``) and draws the decisions."""

    def __init__(self, crash, make_scheduler, num_events: int, start: int | None = None) -> None:
        import ipywidgets as widgets

        if num_events < 1:
            raise ValueError("num_events must be >= 1")
        self.crash, self.make_scheduler = crash, make_scheduler
        self.slider = widgets.IntSlider(value=start if start is not None else num_events // 2,
                                        min=0, max=num_events - 1, description="crash at",
                                        continuous_update=False)
        self.out, self._redraw = figure_output(lambda: recovery_figure(self.snapshot()))
        self.slider.observe(lambda change: self.draw(), names="value")
        self.widget = chapter_box([self.slider, self.out],
                                  what="recovery explorer (a slider over crash points)",
                                  kernel_free=self.kernel_free)
        self.draw()

    def kernel_free(self, max_frames: int = 16):
        """About ``max_frames`` crash points precomputed (evenly spread, the default included)."""
        from kvlab.viz.kernel_free import slider, spread, static_widget

        keep = spread(self.slider.max + 1, max_frames, include=[self.slider.value])
        return static_widget(lambda k: recovery_figure(self.snapshot(k)),
                             {"k": slider(keep, label="crash at")},
                             default={"k": self.slider.value}, title="recovery after a crash")

    def snapshot(self, k: int | None = None) -> RecoverySnapshot:
        from kvlab.labs.recovery import recover

        k = self.slider.value if k is None else k
        events, kv = self.crash(k)
        held = {rid: kv.has(rid) for rid in {e.request_id for e in events}}
        _, report = recover(events, kv, self.make_scheduler)
        return recovery_snapshot(k, events, held, report)

    def draw(self) -> None:
        """Redraw the output: the recovery decisions at the slider's crash point."""
        self._redraw()

    def _ipython_display_(self) -> None:  # pragma: no cover - notebook only
        from IPython.display import display

        display(self.widget)
