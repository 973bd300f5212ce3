"""Chapter 12's figures: the fault lab (which invariant catches which bug) and the chaos soak.

:func:`lab_figure` draws one :func:`kvlab.labs.chaos.fault_lab.run_lab` trace: the block pool at a
chosen step (the culprit block outlined) above a grid of the nine invariants by step (each
check that held, the one that broke, the steps a fault struck). :class:`FaultLab` is the widget
(implementation, fault, step) with a kernel-free twin; :func:`chaos_figure` draws the soak's
figures from ``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from kvlab.viz.style import BLOCK_STATE_COLORS, BLOCK_STATE_LABELS, BLOCK_STATE_ORDER, INK, MUTED

__all__ = ["FaultLab", "chaos_figure", "lab_figure"]

_NAMES = ("refcount", "copy-on-write", "idempotent end", "one state", "monotonic",
          "scope isolation", "spec rollback", "P/D install", "admission")
_WITHHELD = "#495057"


@functools.lru_cache(maxsize=128)
def _trace(implementation: str, fault: str):
    from kvlab.labs.chaos.fault_lab import run_lab

    return run_lab(implementation, fault)


def _culprit_block(trace: Any) -> int | None:
    v = trace.violation
    if v is not None and v.subject.startswith("block "):
        return int(v.subject.split()[1])
    return None


def _pool_legend(blocks, culprit: bool) -> list:
    """What each colour of the pool means: the block states present (and blocks a fault
    withholds), plus the culprit's outline when one is drawn."""
    from matplotlib.patches import Patch

    handles = [Patch(color=BLOCK_STATE_COLORS[s], label=BLOCK_STATE_LABELS[s])
               for s in BLOCK_STATE_ORDER if s in blocks]
    if "withheld" in blocks:
        handles.append(Patch(color=_WITHHELD, label="withheld by the fault"))
    if culprit:
        handles.append(Patch(fill=False, ec="#c44e52", lw=2.5, label="culprit block"))
    return handles


def lab_figure(implementation: str = "correct", fault: str = "none", step: int | None = None):
    """The trace of ``run_lab(implementation, fault)`` at ``step`` (default: its last step)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    trace = _trace(implementation, fault)
    n = len(trace.steps)
    step = n if step is None else max(1, min(int(step), n))
    at = trace.steps[step - 1]
    fig, (top, grid) = plt.subplots(2, 1, figsize=(8.2, 5.0),
                                    gridspec_kw={"height_ratios": [1.3, 3.2]})
    culprit = _culprit_block(trace) if step == n else None
    for b, state in enumerate(at.blocks):
        color = _WITHHELD if state == "withheld" else BLOCK_STATE_COLORS[state]
        top.add_patch(Rectangle((b, 0), 0.92, 0.92, color=color))
        if b == culprit:
            top.add_patch(Rectangle((b - 0.06, -0.06), 1.04, 1.04, fill=False, lw=2.5,
                                    ec="#c44e52"))
    top.set_xlim(-0.2, len(at.blocks))
    top.set_ylim(-0.2, 1.1)
    top.axis("off")
    handles = _pool_legend(at.blocks, culprit is not None)
    if handles:
        top.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02),
                   ncol=min(5, len(handles)), fontsize=8, frameon=False, handlelength=1.2,
                   columnspacing=1.2)
    top.set_title(f"block pool after step {step}: {at.waiting} waiting, {at.running} running",
                  fontsize=9, color=INK)
    for s in range(1, n + 1):
        for inv in range(1, 10):
            broken = (trace.violation is not None and s == n
                      and inv == trace.violation.invariant.number)
            held = s < n or trace.violation is None or inv < (trace.caught or 10)
            color = "#c44e52" if broken else ("#8fbc8f" if held else "#f1f3f5")
            alpha = 1.0 if s <= step else 0.25
            grid.add_patch(Rectangle((s - 0.45, inv - 0.42), 0.9, 0.84, color=color,
                                     alpha=alpha))
        if trace.steps[s - 1].faults:
            grid.annotate("▼", (s, 0.25), ha="center", va="center", color="#c44e52",
                          fontsize=10)
    grid.axvline(step + 0.5, color=MUTED, lw=1, ls=":")
    grid.set_xlim(0.4, max(n, 10) + 0.6)
    grid.set_ylim(9.6, -0.2)
    grid.set_yticks(range(1, 10), [f"{i} {name}" for i, name in enumerate(_NAMES, 1)],
                    fontsize=8)
    grid.set_xticks(range(1, max(n, 10) + 1))
    grid.set_xlabel("engine step (▼ a fault struck; green: the invariant held; red: broken)")
    if trace.violation is None:
        verdict = f"all nine invariants held for {n} steps"
    else:
        v = trace.violation
        verdict = (f"invariant {v.invariant.number} ({v.invariant.name}) broke at step {n}, "
                   f"{v.subject}")
    fig.suptitle(f"{implementation} + fault '{fault}': {verdict}", fontsize=10, color=INK)
    fig.tight_layout()
    return fig


class FaultLab:
    """Choose an implementation (correct or broken) and a fault; step through the run."""

    def __init__(self, implementation: str = "cache ignores the tenant",
                 fault: str = "alloc_refusal") -> None:
        from kvlab.labs.chaos.fault_lab import LAB_FAULTS, MUTATIONS

        if implementation not in MUTATIONS or fault not in LAB_FAULTS:
            raise ValueError(f"unknown implementation or fault: {implementation!r}, {fault!r}")
        self.implementation, self.fault = implementation, fault

    def figure(self, implementation: str | None = None, fault: str | None = None,
               step: int | None = None):
        return lab_figure(implementation or self.implementation, fault or self.fault, step)

    def caption(self, implementation: str, fault: str, step: int | None = None) -> str:
        trace = _trace(implementation, fault)
        if trace.violation is None:
            return (f"{len(trace.steps)} steps, {trace.steps[-1].checks} invariant checks, "
                    f"faults injected: {dict(trace.faults) or 'none'}; nothing broke.")
        return f"InvariantViolation: {trace.violation}"

    def widget(self):
        import ipywidgets as w

        from kvlab.labs.chaos.fault_lab import LAB_FAULTS, MUTATIONS
        from kvlab.viz._widgets import figure_widget

        impl = w.Dropdown(options=list(MUTATIONS), value=self.implementation,
                          description="implementation", style={"description_width": "initial"})
        fault = w.Dropdown(options=list(LAB_FAULTS), value=self.fault, description="fault")
        step = w.IntSlider(value=30, min=1, max=30, description="step",
                           continuous_update=False)
        return figure_widget({"implementation": impl, "fault": fault, "step": step},
                             self.figure, caption=self.caption,
                             what="fault lab (implementation, fault, step)",
                             kernel_free=self.kernel_free)

    def kernel_free(self):
        """Every implementation x four faults, each at the run's last step."""
        from kvlab.labs.chaos.fault_lab import MUTATIONS
        from kvlab.viz.kernel_free import dropdown, static_widget

        faults = ("none", "alloc_refusal", "executor_error", "abort_storm")
        return static_widget(
            lambda implementation, fault: self.figure(implementation, fault),
            {"implementation": dropdown(list(MUTATIONS), label="implementation"),
             "fault": dropdown(faults, label="fault")},
            default={"implementation": self.implementation, "fault": self.fault},
            caption=lambda implementation, fault: self.caption(implementation, fault),
            title="fault lab")


def chaos_figure(results: Mapping[str, Any]):
    """Faults survived by kind, and steps per second with the invariant set on and off."""
    import matplotlib.pyplot as plt

    soak, over = results["soak"], results["overhead"]
    faults = soak["faults_by_kind"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4),
                                      gridspec_kw={"width_ratios": [2.2, 1]})
    kinds = list(faults)[::-1]
    left.barh(kinds, [faults[k] for k in kinds], color="#4c72b0")
    left.set_xlabel("faults injected and survived")
    left.set_title(f"{soak['steps']:,} steps, {soak['invariant_checks']:,} checks: "
                   f"{soak['violations']} violations, {soak['leaked_blocks']} leaked blocks, "
                   f"{soak['mismatches']} mismatches", fontsize=9)
    bars = [over["unchecked_steps_per_s"], over["checked_steps_per_s"]]
    right.bar(["invariants off", "every step"], bars, color=[MUTED, "#8fbc8f"])
    right.set_ylabel("steps per second")
    right.set_title(f"checking costs {over['checked_over_unchecked_time']}x time", fontsize=9)
    fig.tight_layout()
    return fig
