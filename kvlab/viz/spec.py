"""Chapter 9: acceptance of speculative decoding — a pure figure and the AcceptanceView widget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvlab.viz._widgets import figure_widget
from kvlab.viz.style import request_color

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from kvlab.labs.speculation.acceptance import AcceptanceData
    from kvlab.sim.costmodel import SpecStepCost

__all__ = ["AcceptanceView", "acceptance_caption", "acceptance_figure",
           "conditional_rates", "speedup_figure"]


def conditional_rates(data: AcceptanceData) -> tuple[float, ...]:
    """Per draft position, the share of drafts kept among those reached (the draft before
    kept): ``per_pos[0]``, then ``per_pos[i] / per_pos[i - 1]`` (0 where none was reached).
    Under the independent model every entry is the same ``α``. A verification with fewer
    drafts (lookahead is capped at a request's last token) counts as reaching every position,
    so later rates are slightly underestimated."""
    rates = []
    for i, share in enumerate(data.per_pos):
        reached = 1.0 if i == 0 else data.per_pos[i - 1]
        rates.append(share / reached if reached else 0.0)
    return tuple(rates)


def acceptance_figure(data: AcceptanceData) -> Figure:
    """Three panels: acceptance per draft position against the independent model ``α^i`` for
    two estimates of ``α`` (the first position's rate ``α₁`` and the estimate over all
    positions ``α̂``, :attr:`AcceptanceData.alpha`), tokens emitted per verification step per
    request, and ``p(x)`` against ``q(x)`` for every rejected draft (a draft is rejected with
    probability ``1 - p/q``, so all lie below the diagonal). The legends sit under their
    panels, off the data."""
    import matplotlib.pyplot as plt

    # the column's width (9 in at 96 px per inch): shown at its point size, not narrowed
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(9.0, 4.2))
    under = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.22), "fontsize": 8}
    pos = range(1, data.k + 1)
    first = data.per_pos[0] if data.per_pos else 0.0
    a.bar(pos, data.per_pos, color="#4C72B0", label="measured")
    a.plot(pos, [first ** i for i in pos], "s:", color="#55A868", ms=4,
           label=rf"$\alpha_1^i$, $\alpha_1$ = {first:.2f} (first position)")
    a.plot(pos, [data.alpha ** i for i in pos], "o--", color="#DD8452",
           label=rf"$\hat\alpha^i$, $\hat\alpha$ = {data.alpha:.2f} (all positions)")
    a.set(xlabel="draft position i", ylabel="share accepted", ylim=(0, 1.05),
          title=f"{data.method}, k={data.k}, T={data.temperature:g}")
    a.legend(**under)
    if data.method == "ngram" and max(data.per_pos, default=0.0) < 0.1:
        # the bars are (almost) empty: say why, in the panel, not only in the prose
        a.text(0.5, 0.45, "n-gram drafts copy what\nfollowed an earlier match\nof the last "
               "tokens; this text\nrarely repeats, so nearly\nevery draft is rejected",
               transform=a.transAxes, ha="center", va="center", fontsize=8, color="#333333")
    for j, (name, steps) in enumerate(data.lengths.items()):
        if steps:
            xs, ys = zip(*steps, strict=True)
            b.plot(xs, ys, "o-", ms=3, color=request_color(j), label=name)
    b.axhline(data.mean_length, color="grey", ls=":", label=f"mean {data.mean_length:.2f}")
    b.set(xlabel="engine step", ylabel="tokens emitted", ylim=(0, data.k + 1.5),
          title="accepted drafts + 1, per step")
    b.legend(ncol=2, **under)
    if data.rejected:
        p, q = zip(*data.rejected, strict=True)
        c.scatter(q, p, s=12, color="#C44E52")
    c.plot([0, 1], [0, 1], color="grey", lw=0.8)
    c.set(xlabel="draft q(x)", ylabel="target p(x)", xlim=(0, 1.02), ylim=(0, 1.02),
          title=f"{len(data.rejected)} rejected drafts")
    fig.tight_layout()
    return fig


def speedup_figure(curves: Mapping[str, Sequence[SpecStepCost]], title: str = "",
                   max_batch: int | None = None) -> Figure:
    """Speedup of speculation against batch size, one line per labelled curve of
    :class:`~kvlab.sim.costmodel.SpecStepCost` (same batches, ascending); filled markers where
    the verification step is compute-bound, hollow where it is memory-bound. ``max_batch``, when
    given, draws the largest batch the GPUs' memory holds (a dashed line). ValueError for an
    empty curve, batches out of order, or a point whose weights and KV do not fit its GPUs:
    a scenario that cannot be deployed is not plotted."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for j, (label, costs) in enumerate(curves.items()):
        if not costs:
            raise ValueError(f"curve {label!r} has no points")
        xs = [c.batch for c in costs]
        if xs != sorted(xs):
            raise ValueError(f"curve {label!r}: batches must ascend, got {xs}")
        for c in costs:
            if not c.fits:
                raise ValueError(f"curve {label!r}: batch {c.batch} needs "
                                 f"{c.memory_bytes / 1e9:.0f} GB, more than the "
                                 f"{c.memory_capacity / 1e9:.0f} GB its GPUs may use")
        ys = [c.speedup for c in costs]
        color = request_color(j)
        ax.plot(xs, ys, "-", color=color, label=label)
        for c, y in zip(costs, ys, strict=True):
            ax.plot(c.batch, y, "o", ms=5, color=color,
                    mfc=color if c.verify_bound == "compute" else "white")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    if max_batch is not None:
        ax.axvline(max_batch, color="black", lw=0.9, ls="--",
                   label=f"memory full: {max_batch} requests")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size (decoding requests)", ylabel="speedup over plain decoding",
           title=title or "speculation on the roofline")
    ax.plot([], [], "o", color="grey", label="verification compute-bound")
    ax.plot([], [], "o", color="grey", mfc="white", label="verification memory-bound")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


#: The kernel-free view's grid: 4 values of k x 2 temperatures x 2 methods = 16 frames.
KERNEL_FREE_GRID = {
    "k": (1, 2, 4, 8),
    "temperature": (0.0, 0.8),
    "method": ("draft_model", "ngram"),
}


def acceptance_caption(data: AcceptanceData) -> str:
    """The line under the figure: both estimates of alpha, what each is and, from the
    conditional rates (:func:`conditional_rates`), why they differ; the mean tokens per
    verification (and, for n-gram drafts that almost never hold, why the left panel is
    empty)."""
    if data.method == "ngram" and max(data.per_pos, default=0.0) < 0.1:
        return (f"{data.method}, k={data.k}, T={data.temperature:g}: "
                f"alpha_1 = {data.per_pos[0]:.2f}, mean tokens per verification = "
                f"{data.mean_length:.2f} (n-gram drafts copy an earlier continuation of the "
                "last tokens; this text rarely repeats itself, so almost none is kept)")
    rates = conditional_rates(data)
    first, pooled = rates[0], data.alpha
    if len(rates) == 1:
        why = "with one draft position they are the same estimate"
    elif abs(pooled - first) < 0.03:
        why = "close: here acceptance hardly depends on the position"
    else:
        later = "more" if pooled > first else "less"
        why = (f"they differ because a draft reached after kept drafts is kept {later} often "
               f"than a first draft (kept share by position, among drafts reached: "
               + ", ".join(f"{r:.2f}" for r in rates) + "), so acceptance is not independent "
               "of the position")
    return (f"{data.method}, k={data.k}, T={data.temperature:g}: alpha_1 = {first:.2f} is the "
            f"share of first drafts kept; alpha-hat = {pooled:.2f} is kept / (kept + rejected) "
            f"over all positions, the independent model's maximum-likelihood fit; {why}. Mean "
            f"tokens per verification = {data.mean_length:.2f}.")


class AcceptanceView:
    """Sliders for k and temperature, a method menu and a prompt box over a live engine
    (:func:`~kvlab.labs.speculation.acceptance.run_acceptance`); any change re-runs and
    redraws :func:`acceptance_figure`. Its kernel-free twin (:meth:`kernel_free`) precomputes
    :data:`KERNEL_FREE_GRID` for the initial prompt."""

    def __init__(self, k: int = 4, temperature: float = 0.0, method: str = "draft_model",
                 prompt: str = "The town of Harrow is") -> None:
        import ipywidgets as w

        self.k, self.temperature, self.method, self.prompt = k, temperature, method, prompt
        self._runs: dict[tuple, AcceptanceData] = {}
        controls = {
            "k": w.IntSlider(value=k, min=1, max=8, description="k"),
            "temperature": w.FloatSlider(value=temperature, min=0.0, max=1.5, step=0.1,
                                         description="temperature"),
            "method": w.Dropdown(options=["draft_model", "ngram"], value=method,
                                 description="method"),
            "prompt": w.Text(value=prompt, description="prompt", continuous_update=False),
        }
        self.widget = figure_widget(
            controls, lambda **kw: acceptance_figure(self.data(**kw)),
            caption=lambda **kw: acceptance_caption(self.data(**kw)),
            what="acceptance view (k, temperature, method, prompt over a live engine)",
            kernel_free=self.kernel_free)

    def data(self, k: int, temperature: float, method: str, prompt: str,
             engines: dict | None = None) -> AcceptanceData:
        """The run for these settings (computed once per settings, then remembered); ``engines``
        is passed to ``run_acceptance`` (None: its shared engine cache)."""
        from kvlab.labs.speculation.acceptance import run_acceptance

        key = (k, round(float(temperature), 6), method, prompt)
        if key not in self._runs:
            self._runs[key] = run_acceptance(method, k=k, temperature=temperature,
                                             prompt=prompt, engines=engines)
        return self._runs[key]

    def kernel_free(self):
        """:data:`KERNEL_FREE_GRID` (plus the initial settings) precomputed for the initial
        prompt, each frame captioned with its alpha and mean tokens per verification. The frames
        run on engines of their own, so the shared ones (and later cells) are unaffected."""
        from kvlab.viz.kernel_free import dropdown, slider, static_widget

        own: dict = {}

        def values(name, start):
            return tuple(sorted({*KERNEL_FREE_GRID[name], start}))

        return static_widget(
            lambda k, temperature, method: acceptance_figure(
                self.data(k, temperature, method, self.prompt, own)),
            {"k": slider(values("k", self.k)),
             "temperature": dropdown(values("temperature", self.temperature)),
             "method": dropdown(values("method", self.method))},
            default={"k": self.k, "temperature": self.temperature, "method": self.method},
            caption=lambda k, temperature, method: acceptance_caption(
                self.data(k, temperature, method, self.prompt, own)),
            title=f"acceptance view (prompt {self.prompt!r} plus three fixed ones)",
            max_frames=24)

    def display(self) -> AcceptanceView:
        from IPython.display import display

        display(self.widget)
        return self
