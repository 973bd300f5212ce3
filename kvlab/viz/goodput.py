"""Goodput and SLO attainment against request rate: the figure and its widget (chapter 11).

The input is precomputed: for each serving set-up, the request rates tried and, per rate, the
:class:`~kvlab.labs.slo.LatencyRecord` list one run produced (from the simulator or the load
client). Changing the SLO only re-evaluates those records, so the widget answers instantly.

Every rate of a run is counted over one window, from the start of its records to its last
arrival (``evaluate_slo(..., window_s="arrivals")``), and over the requests that arrived in it.
The goodput rate here is counted *by arrival*: the requests offered in the window that met the
SLO, whenever they finished, per second of the window, i.e. attainment x offered rate. (Counted
by completion within the window, as chapter 11's live run does, it would also lose the requests
still in flight at the window's end, about offered rate x E2E of them: a large share of a
simulated run of a few hundred chat requests.) So a run's goodput rate is never above the rate
it was offered as counted in its window, which is what the goodput panel plots it against (a
Poisson stream's count is a few percent off the rate it was drawn at). A deployment's capacity
in DistServe's sense (its *goodput* in the paper) is the highest rate per GPU, as set for the
sweep, whose attainment still reaches the target (90%), read off the curve by
:func:`~kvlab.labs.serving.rate_at_attainment`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvlab.labs.slo import SLO, LatencyRecord, evaluate_slo
from kvlab.viz.style import request_color

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["attainment_curve", "goodput_explorer", "goodput_figure", "goodput_kernel_free",
           "goodput_table", "rate_figure"]

Curves = Mapping[str, tuple[Sequence[float], Sequence[Sequence[LatencyRecord]]]]
#: The measurement window of every run: up to its last arrival (see the module docstring).
WINDOW = "arrivals"


def attainment_curve(rates: Sequence[float], runs: Sequence[Sequence[LatencyRecord]],
                     slo: SLO, *, per: float = 1.0
                     ) -> tuple[list[float], list[float], list[float]]:
    """(attainment, goodput rate by arrival, offered rate) per run, both rates counted over the
    run's one window (see the module docstring) and divided by ``per``, e.g. GPUs."""
    att, good, offered = [], [], []
    for _, recs in zip(rates, runs, strict=True):
        rep = evaluate_slo(recs, slo, window_s=WINDOW)
        att.append(rep.attainment)
        good.append(rep.goodput_by_arrival / per)
        offered.append(rep.offered / per)
    return att, good, offered


def goodput_figure(curves: Curves, slo: SLO, *, rate: float | None = None,
                   gpus: Mapping[str, int] | None = None, target: float = 0.9,
                   title: str | None = None) -> Figure:
    """Attainment against the rate set for each run (left), and each run's goodput rate
    against the rate it was offered as counted in its window (right), one line per set-up,
    named (with its capacity at ``target``) in one legend under both panels, clear of the
    curves. ``rate`` marks a rate on the left panel. Rates and goodput are per GPU when
    ``gpus`` gives each set-up's GPU count."""
    import matplotlib.pyplot as plt

    from kvlab.labs.serving import rate_at_attainment

    # constrained layout makes room for the shared legend under the panels, off the curves
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.5, 4.0), layout="constrained")
    names = list(curves)
    unit = " per GPU" if gpus else ""
    lines, counted = [], []
    for i, name in enumerate(names):
        rates, runs = curves[name]
        n = gpus[name] if gpus else 1
        x = [r / n for r in rates]
        att, good, offered = attainment_curve(rates, runs, slo, per=n)
        color = request_color(i, list(range(len(names))))
        cap = rate_at_attainment(x, att, target)
        lines += ax1.plot(x, att, marker="o", color=color,
                          label=f"{name}: {cap:.1f}/s at {target:.0%}")
        ax2.plot(offered, good, marker="o", color=color)
        counted += offered
    lo, hi = min(counted), max(counted)
    lines += ax2.plot([lo, hi], [lo, hi], ls=":", color="0.6", label="goodput = offered")
    ax1.axhline(target, ls="--", color="0.5", lw=1)
    if rate is not None:
        ax1.axvline(rate, color="0.3", lw=1)
    ax1.set_xlabel(f"offered rate, as set (requests/s{unit})")
    ax2.set_xlabel(f"offered rate, as counted (requests/s{unit})")
    ax1.set_ylabel("SLO attainment")
    ax1.set_ylim(-0.02, 1.02)
    ax2.set_ylabel(f"goodput rate (requests/s{unit})")
    fig.legend(handles=lines, loc="outside lower center", ncol=2, fontsize=8)
    bounds = ", ".join(f"{k} ≤ {v * 1e3:g} ms" for k, v in
                       (("TTFT", slo.ttft), ("TPOT", slo.tpot), ("E2E", slo.e2e))
                       if v is not None)
    fig.suptitle(title or f"SLO: {bounds}")
    return fig


def rate_figure(offered: Sequence[float], throughput: Sequence[float],
                goodput: Sequence[float], *, title: str = "") -> Figure:
    """Throughput and goodput rate (requests/s) against the offered rate of each run, the
    offered rate itself dotted. The rate axis is logarithmic with one tick per run, labelled
    as a plain number (the runs' rates should be spread, as a log axis suits)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(offered, throughput, marker="o", label="throughput")
    ax.plot(offered, goodput, marker="s", label="goodput rate")
    ax.plot(offered, offered, ls=":", color="0.6", label="offered")
    ax.set_xscale("log")
    # the default log ticks label some minor ticks as 3x10^1, 4x10^1, ... that run together
    ax.set_xticks(offered, [f"{r:.3g}" for r in offered])
    ax.minorticks_off()
    ax.set(xlabel="offered rate (requests/s)", ylabel="requests/s", title=title)
    ax.legend()
    fig.tight_layout()
    return fig


def goodput_explorer(curves: Curves, *, ttft_ms: float = 200.0, tpot_ms: float = 10.0,
                     gpus: Mapping[str, int] | None = None, target: float = 0.9):
    """Sliders for the TTFT and TPOT objectives and the rate; the figure and, beneath it, each
    set-up's attainment and goodput at the chosen rate."""
    import ipywidgets as w

    from kvlab.viz._widgets import figure_widget

    rates = sorted({r / (gpus[name] if gpus else 1) for name, (rs, _) in curves.items()
                    for r in rs})
    controls = {
        "ttft_ms": w.FloatSlider(value=ttft_ms, min=20, max=1000, step=10,
                                 description="TTFT ≤ ms", continuous_update=False),
        "tpot_ms": w.FloatSlider(value=tpot_ms, min=4, max=60, step=0.5,
                                 description="TPOT ≤ ms", continuous_update=False),
        "rate": w.SelectionSlider(options=rates, value=rates[len(rates) // 2],
                                  description="rate", continuous_update=False),
    }

    def slo_of(ttft_ms: float, tpot_ms: float) -> SLO:
        return SLO(ttft=ttft_ms / 1e3, tpot=tpot_ms / 1e3)

    def draw(ttft_ms: float, tpot_ms: float, rate: float):
        return goodput_figure(curves, slo_of(ttft_ms, tpot_ms), rate=rate, gpus=gpus,
                              target=target)

    def caption(ttft_ms: float, tpot_ms: float, rate: float) -> str:
        lines = []
        for name, (rs, runs) in curves.items():
            n = gpus[name] if gpus else 1
            i = min(range(len(rs)), key=lambda j: abs(rs[j] / n - rate))
            rep = evaluate_slo(runs[i], slo_of(ttft_ms, tpot_ms), window_s=WINDOW)
            lines.append(f"{name} at {rs[i] / n:g}/s{' per GPU' if gpus else ''}: attainment "
                         f"{rep.attainment:.0%}, goodput {rep.goodput_by_arrival / n:.2f}/s")
        return "\n".join(lines)

    start = controls["rate"].value
    return figure_widget(
        controls, draw, caption=caption,
        what="goodput explorer (TTFT and TPOT objectives, offered rate)",
        kernel_free=lambda: goodput_kernel_free(curves, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                                                rate=start, gpus=gpus, target=target))


#: The kernel-free explorer's grid: 3 TTFT x 4 TPOT objectives (ms) = 12 frames; the rate is
#: not a control there: every rate's attainment and goodput is listed under each frame.
KERNEL_FREE_GRID = {"ttft_ms": (100.0, 200.0, 400.0), "tpot_ms": (8.0, 9.0, 10.0, 12.0)}


def goodput_table(curves: Curves, slo: SLO, *, gpus: Mapping[str, int] | None = None) -> str:
    """Each set-up's runs: a name line, then four aligned rows (the rate set, the offered rate
    as counted in the run's window, attainment, goodput rate by arrival; per GPU when ``gpus``
    is given)."""
    lines = []
    for name, (rates, runs) in curves.items():
        n = gpus[name] if gpus else 1
        reps = [evaluate_slo(recs, slo, window_s=WINDOW) for recs in runs]
        lines += [f"{name}{' (per GPU)' if gpus else ''}",
                  "  set       " + "".join(f"{f'{r / n:g}/s':>8}" for r in rates),
                  "  offered   " + "".join(f"{f'{rep.offered / n:.2f}/s':>8}" for rep in reps),
                  "  attained  " + "".join(f"{rep.attainment:>8.0%}" for rep in reps),
                  "  goodput   " + "".join(f"{f'{rep.goodput_by_arrival / n:.2f}/s':>8}"
                                           for rep in reps)]
    return "\n".join(lines)


def goodput_kernel_free(curves: Curves, *, ttft_ms: float = 200.0, tpot_ms: float = 10.0,
                        rate: float | None = None, gpus: Mapping[str, int] | None = None,
                        target: float = 0.9):
    """The explorer without a kernel: :data:`KERNEL_FREE_GRID` (plus the initial objectives)
    precomputed, the rate marker fixed at ``rate``, every rate's numbers under each frame."""
    from kvlab.viz.kernel_free import slider, static_widget

    def values(name: str, start: float) -> tuple[float, ...]:
        return tuple(sorted({*KERNEL_FREE_GRID[name], float(start)}))

    def slo_of(ttft_ms: float, tpot_ms: float) -> SLO:
        return SLO(ttft=ttft_ms / 1e3, tpot=tpot_ms / 1e3)

    where = "" if rate is None else f", marker at {rate:g}/s{' per GPU' if gpus else ''}"
    return static_widget(
        lambda ttft_ms, tpot_ms: goodput_figure(curves, slo_of(ttft_ms, tpot_ms), rate=rate,
                                                gpus=gpus, target=target),
        {"ttft_ms": slider(values("ttft_ms", ttft_ms), label="TTFT ≤ ms",
                           labels=[f"{v:g}" for v in values("ttft_ms", ttft_ms)]),
         "tpot_ms": slider(values("tpot_ms", tpot_ms), label="TPOT ≤ ms",
                           labels=[f"{v:g}" for v in values("tpot_ms", tpot_ms)])},
        default={"ttft_ms": float(ttft_ms), "tpot_ms": float(tpot_ms)},
        caption=lambda ttft_ms, tpot_ms: goodput_table(curves, slo_of(ttft_ms, tpot_ms),
                                                       gpus=gpus),
        title=f"goodput explorer (objectives precomputed{where})")
