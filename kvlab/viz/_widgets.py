"""The ipywidgets glue every chapter widget shares: controls -> pure figure function -> output.

Each widget in :mod:`kvlab.viz` is a thin front end over a pure drawing function
(plain data -> matplotlib ``Figure``). What they all repeat is the glue: an ``Output`` area
that, on every change, is cleared, shows the freshly drawn figure (closing it afterwards, so
pyplot does not keep one figure alive per redraw) and optionally a line of text beneath it.

* :func:`figure_output` — that output area plus the function that redraws it, for widgets whose
  redraws are triggered by hand (buttons, an engine step).
* :func:`figure_widget` — the common case: value controls (sliders, dropdowns) whose current
  values are the drawing function's keyword arguments; any change redraws.

``ipywidgets``, ``IPython`` and ``matplotlib.pyplot`` are imported inside the functions, so
importing a :mod:`kvlab.viz` module stays light and its figure functions work without them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import ipywidgets
    from matplotlib.figure import Figure


def figure_output(
    draw: Callable[[], Figure], caption: Callable[[], str] | None = None
) -> tuple[ipywidgets.Output, Callable[[], None]]:
    """An output area and the function that (re)draws it.

    Calling the returned ``redraw()`` clears the output (``wait=True``: the old figure stays
    until the new one is ready, so the widget does not flicker), calls ``draw()`` and displays
    the figure it returns, closes that figure, and then prints ``caption()`` beneath it when a
    caption is given. ``draw`` and ``caption`` are called on every redraw, so they should read
    the current state (a control's value, a live engine) rather than capture it. Nothing is
    drawn until ``redraw()`` is first called.
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    out = w.Output()

    def redraw() -> None:
        with out:
            out.clear_output(wait=True)
            fig = draw()
            display(fig)
            plt.close(fig)
            if caption is not None:
                print(caption())

    return out, redraw


def figure_widget(
    controls: Mapping[str, ipywidgets.ValueWidget],
    draw: Callable[..., Figure],
    *,
    caption: Callable[..., str] | None = None,
    header: Sequence[ipywidgets.Widget] | None = None,
) -> ipywidgets.VBox:
    """Value controls above a figure that is redrawn whenever one of them changes.

    ``controls`` maps a keyword to a widget with a ``value`` (slider, dropdown, ...): the
    figure is ``draw(**{name: control.value})``, and ``caption(**same)``, when given, is printed
    beneath it. The figure is drawn once before this returns, then again on every change of a
    control's ``value``. The result is ``VBox([*header, output])``, where ``header`` (default:
    the controls, one per row) lets the caller lay the controls out, e.g. in ``HBox`` rows.
    """
    import ipywidgets as w

    def values() -> dict[str, Any]:
        return {name: control.value for name, control in controls.items()}

    out, redraw = figure_output(
        lambda: draw(**values()),
        None if caption is None else lambda: caption(**values()),
    )
    for control in controls.values():
        control.observe(lambda _change: redraw(), names="value")
    redraw()
    return w.VBox([*(controls.values() if header is None else header), out])
