"""Chapter 9: acceptance of speculative decoding — a pure figure and the AcceptanceView widget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._widgets import figure_widget
from .style import request_color

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from kvlab.engine.spec_decode.acceptance import AcceptanceData

__all__ = ["AcceptanceView", "acceptance_figure"]


def acceptance_figure(data: AcceptanceData) -> Figure:
    """Three panels: acceptance per draft position (with the i.i.d. model ``alpha^(i+1)``),
    tokens emitted per verification step per request, and ``p(x)`` against ``q(x)`` for every
    rejected draft (a draft is rejected with probability ``1 - p/q``, so all lie below the
    diagonal)."""
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    pos = range(1, data.k + 1)
    a.bar(pos, data.per_pos, color="#4C72B0", label="measured")
    a.plot(pos, [data.alpha ** i for i in pos], "o--", color="#DD8452",
           label=f"alpha^i, alpha={data.alpha:.2f}")
    a.set(xlabel="draft position i", ylabel="share accepted", ylim=(0, 1.05),
          title=f"{data.method}, k={data.k}, T={data.temperature:g}")
    a.legend(fontsize=8)
    for j, (name, steps) in enumerate(data.lengths.items()):
        if steps:
            xs, ys = zip(*steps, strict=True)
            b.plot(xs, ys, "o-", ms=3, color=request_color(j), label=name)
    b.axhline(data.mean_length, color="grey", ls=":", label=f"mean {data.mean_length:.2f}")
    b.set(xlabel="engine step", ylabel="tokens emitted", ylim=(0, data.k + 1.5),
          title="accepted drafts + 1, per step")
    b.legend(fontsize=7, ncol=2)
    if data.rejected:
        p, q = zip(*data.rejected, strict=True)
        c.scatter(q, p, s=12, color="#C44E52")
    c.plot([0, 1], [0, 1], color="grey", lw=0.8)
    c.set(xlabel="draft q(x)", ylabel="target p(x)", xlim=(0, 1.02), ylim=(0, 1.02),
          title=f"{len(data.rejected)} rejected drafts")
    fig.tight_layout()
    return fig


class AcceptanceView:
    """Sliders for k and temperature, a method menu and a prompt box over a live engine
    (:func:`~kvlab.engine.spec_decode.acceptance.run_acceptance`); any change re-runs and
    redraws :func:`acceptance_figure`."""

    def __init__(self, k: int = 4, temperature: float = 0.0, method: str = "draft_model",
                 prompt: str = "The town of Harrow is") -> None:
        import ipywidgets as w

        from kvlab.engine.spec_decode.acceptance import run_acceptance

        controls = {
            "k": w.IntSlider(value=k, min=1, max=8, description="k"),
            "temperature": w.FloatSlider(value=temperature, min=0.0, max=1.5, step=0.1,
                                         description="temperature"),
            "method": w.Dropdown(options=["draft_model", "ngram"], value=method,
                                 description="method"),
            "prompt": w.Text(value=prompt, description="prompt", continuous_update=False),
        }
        self.widget = figure_widget(
            controls, lambda **kw: acceptance_figure(run_acceptance(**kw)))

    def display(self) -> AcceptanceView:
        from IPython.display import display

        display(self.widget)
        return self
