"""The ipywidgets glue every chapter widget shares: controls -> pure figure function -> output.

Each widget in :mod:`kvlab.viz` is a thin front end over a pure drawing function
(plain data -> matplotlib ``Figure``). What they all repeat is the glue: an ``Output`` area
that, on every change, is cleared, shows the freshly drawn figure (closing it afterwards, so
pyplot does not keep one figure alive per redraw) and optionally a line of text beneath it.

* :func:`figure_output` — that output area plus the function that redraws it, for widgets whose
  redraws are triggered by hand (buttons, an engine step).
* :func:`figure_widget` — the common case: value controls (sliders, dropdowns) whose current
  values are the drawing function's keyword arguments; any change redraws.
* :func:`chapter_box` — the ``VBox`` every chapter widget is shown in. It displays as the live
  widget where a widget manager runs (JupyterLab), with a readable ``text/plain`` fallback
  ("interactive widget: ... run this cell") where none does (an untrusted notebook, GitHub), and,
  when the book is built (``KVLAB_KERNEL_FREE=1``), with a ``text/html`` kernel-free twin
  (:mod:`kvlab.viz.kernel_free`) in the same output: the site renders that one instead.

``ipywidgets``, ``IPython`` and ``matplotlib.pyplot`` are imported inside the functions, so
importing a :mod:`kvlab.viz` module stays light and its figure functions work without them.
"""

from __future__ import annotations

import functools
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
    what: str | None = None,
    kernel_free: Callable[[], Any] | None = None,
) -> ipywidgets.VBox:
    """Value controls above a figure that is redrawn whenever one of them changes.

    ``controls`` maps a keyword to a widget with a ``value`` (slider, dropdown, ...): the
    figure is ``draw(**{name: control.value})``, and ``caption(**same)``, when given, is printed
    beneath it. The figure is drawn once before this returns, then again on every change of a
    control's ``value``. The result is ``VBox([*header, output])``, where ``header`` (default:
    the controls, one per row) lets the caller lay the controls out, e.g. in ``HBox`` rows.
    ``what`` and ``kernel_free`` are passed to :func:`chapter_box`.
    """

    def values() -> dict[str, Any]:
        return {name: control.value for name, control in controls.items()}

    out, redraw = figure_output(
        lambda: draw(**values()),
        None if caption is None else lambda: caption(**values()),
    )
    for control in controls.values():
        control.observe(lambda _change: redraw(), names="value")
    redraw()
    return chapter_box([*(controls.values() if header is None else header), out], what=what,
                       kernel_free=kernel_free)


@functools.cache
def _box_class() -> type:
    import ipywidgets as w

    from kvlab.viz.kernel_free import FALLBACK_TEXT, export_enabled

    class ChapterBox(w.VBox):
        """A VBox whose display bundle adds a text fallback and, on export, a kernel-free twin."""

        what = "run this cell in Jupyter to see it"
        kernel_free: Callable[[], Any] | None = None

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            data, metadata = data if isinstance(data, tuple) else (data, None)
            data = dict(data)
            data["text/plain"] = FALLBACK_TEXT.format(what=self.what)
            if self.kernel_free is not None and export_enabled():
                data["text/html"] = self.kernel_free().to_html()
            return data if metadata is None else (data, metadata)

    return ChapterBox


def chapter_box(
    children: Sequence[ipywidgets.Widget],
    *,
    what: str | None = None,
    kernel_free: Callable[[], Any] | None = None,
) -> ipywidgets.VBox:
    """``VBox(children)`` that displays with a readable text fallback naming ``what`` it is and,
    when exporting, the kernel-free widget ``kernel_free()`` returns (called only then)."""
    box = _box_class()(list(children))
    if what is not None:
        box.what = what
    box.kernel_free = kernel_free
    return box
