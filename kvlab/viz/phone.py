"""A figure's phone variant: the same figure laid out for a 390 px phone's column.

The book's figures are drawn for a laptop's column (up to 880 CSS px). Shrunk to a phone's
column their text would fall far below 9 px, so every figure also gets a *phone variant*,
at most :data:`kvlab.viz.style.PHONE` wide with its text at its point size, which the site
serves to narrow screens (``<picture>``; :mod:`kvlab.viz.kernel_free`, ``docs/_ext/kvlab_site.py``).

:func:`phone_variant` makes it. A figure function marked :func:`kvlab.viz.style.phone_aware`
is simply called again inside :func:`kvlab.viz.style.phone_layout` (it knows its content
best: a block table wraps its rows, a tree narrows its levels). Any other figure is re-laid in
place by :func:`fit_phone`: its panels stacked in one column, legends beside an axes moved
under it and legends under a figure given fewer columns, long titles wrapped, crowded tick
labels thinned. Then the result is checked: every text inside the figure, no two texts
overlapping, no panel squeezed narrow. A figure that fails (a
diagram whose boxes are placed by hand) has no phone variant: the site shows it scaled to the
screen, says so, and opens it full size on tap.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from dataclasses import dataclass

from kvlab.viz.style import PHONE, phone_layout

#: The shortest a stacked panel's plotting area may be, in inches (about 100 CSS px).
MIN_PANEL_IN = 1.05
#: Gap, in pixels, two tick labels keep before every other one is hidden.
TICK_GAP_PX = 3.0
#: Where a figure legend goes on a phone: under the panels.
OUTSIDE = "outside lower center"


@dataclass(frozen=True)
class Fit:
    """What :func:`fit_phone` did: ``ok`` when the re-laid figure is readable, else ``why``."""

    ok: bool
    why: str = ""


def phone_variant(fig):
    """``(phone_figure, Fit)`` for ``fig``: the figure drawn again for the phone when its
    function is :func:`~kvlab.viz.style.phone_aware`, else ``fig`` itself re-laid by
    :func:`fit_phone` (call it after ``fig``'s wide rendering is saved). A figure already as
    narrow as the phone's column is returned as it is."""
    redraw = getattr(fig, "kvlab_redraw", None)
    if redraw is not None:
        with phone_layout():
            phone = redraw()
        if phone.get_size_inches()[0] <= PHONE.width_in + 1e-6:
            return phone, Fit(True)
        fig = phone
    if fig.get_size_inches()[0] <= PHONE.width_in + 1e-6:
        return fig, Fit(True)
    return fig, fit_phone(fig)


def fit_phone(fig, width_in: float = PHONE.width_in) -> Fit:
    """Re-lay ``fig`` in place to be ``width_in`` inches wide (see the module docstring) and
    say whether the result is readable. The figure is changed even when it is not."""
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_subplotspec() is not None]
    height = _stack(fig, panels)
    fig.set_size_inches(width_in, height)
    if not isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
        fig.set_layout_engine("constrained")
    renderer = _draw(fig)
    if _wrap_texts(fig, renderer):   # before legends go under their axes' (longer) labels
        renderer = _draw(fig)
    _move_side_legends(fig, renderer)
    renderer = _draw(fig)
    for _ in range(5):  # legends and titles first: until they settle, the panels are squeezed
        changed = _narrow_legends(fig, renderer)
        changed |= _wrap_texts(fig, renderer)
        changed |= _grow_flat_panels(fig, panels, renderer)
        if not changed and not _thin_ticks(fig, renderer):
            break
        renderer = _draw(fig)
    return _check(fig, renderer, panels)


def _draw(fig):
    import warnings

    with warnings.catch_warnings():   # a layout that collapses is what _check reports
        warnings.filterwarnings("ignore", "constrained_layout not applied", UserWarning)
        fig.canvas.draw()
    return fig.canvas.get_renderer()


def _stack(fig, panels) -> float:
    """Put ``panels`` (the axes of one grid) in one column, in reading order; return the new
    figure height in inches (each panel keeps the height of its grid row)."""
    fig_h = fig.get_size_inches()[1]
    grids = {id(ax.get_subplotspec().get_gridspec()) for ax in panels}
    if len(panels) < 2 or len(grids) != 1:
        return fig_h
    grid = panels[0].get_subplotspec().get_gridspec()
    nrows, ncols = grid.get_geometry()
    if ncols == 1:
        return fig_h
    ratios = grid.get_height_ratios() or [1] * nrows
    row_h = [fig_h * r / sum(ratios) for r in ratios]
    spans = sorted(((ax.get_subplotspec().rowspan, ax.get_subplotspec().colspan, ax)
                    for ax in panels), key=lambda s: (s[0].start, s[1].start))
    heights = [max(sum(row_h[i] for i in rows), 1.6) for rows, _, _ in spans]
    column = fig.add_gridspec(len(spans), 1, height_ratios=heights)
    for i, (_, _, ax) in enumerate(spans):
        ax.set_subplotspec(column[i])
    return sum(heights)


def _legend_entries(legend):
    handles = list(legend.legend_handles)
    labels = [t.get_text() for t in legend.get_texts()]
    title = legend.get_title().get_text() or None
    size = legend.get_texts()[0].get_fontsize() if labels else None
    return handles, labels, title, size


def _move_side_legends(fig, renderer) -> None:
    """An axes legend anchored beside its axes (right of it) goes under its x-axis labels; a
    figure legend goes under the figure, outside the panels."""
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None or not legend.get_visible():
            continue
        anchor = legend.get_bbox_to_anchor()
        if anchor.x0 < ax.bbox.x1 - 1:
            continue
        handles, labels, title, size = _legend_entries(legend)
        legend.remove()
        below = ax.get_tightbbox(renderer)
        pad_pt = (ax.bbox.y0 - below.y0) * 72 / fig.dpi + 4
        ax.legend(handles, labels, title=title, fontsize=size, loc="upper center",
                  bbox_to_anchor=(0.5, 0.0), ncols=len(labels),
                  borderaxespad=pad_pt / (size or 10))
    for legend in list(fig.legends):
        handles, labels, title, size = _legend_entries(legend)
        legend.remove()
        fig.legend(handles, labels, title=title, fontsize=size, loc=OUTSIDE,
                   ncols=len(labels)).kvlab_outside = True


def _legend_again(legend, ncols: int) -> None:
    """Draw ``legend`` again, where it was, in ``ncols`` columns (a legend lays out its
    columns once, when it is made). Call it after a draw: the anchor is read back from it."""
    handles, labels, title, size = _legend_entries(legend)
    parent = legend.parent
    if getattr(legend, "kvlab_outside", False):
        legend.remove()
        parent.legend(handles, labels, title=title, fontsize=size, loc=OUTSIDE,
                      ncols=ncols).kvlab_outside = True
        return
    frame = parent.transAxes if hasattr(parent, "transAxes") else parent.transFigure
    anchor = legend.get_bbox_to_anchor()
    (x0, y0), (x1, y1) = frame.inverted().transform([(anchor.x0, anchor.y0),
                                                      (anchor.x1, anchor.y1)])
    where = legend._loc                     # matplotlib keeps no public getter
    legend.remove()
    parent.legend(handles, labels, title=title, fontsize=size, ncols=ncols, loc=where,
                  bbox_to_anchor=(x0, y0, x1 - x0, y1 - y0), borderaxespad=legend.borderaxespad,
                  frameon=legend.get_frame_on())


def _narrow_legends(fig, renderer) -> bool:
    """Fewer columns for a legend wider than the figure: as many as its measured column
    width leaves room for."""
    changed = False
    room = fig.bbox.width - 8
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]:
        if legend is None or not legend.get_visible():
            continue
        width = legend.get_window_extent(renderer).width
        ncols = getattr(legend, "_ncols", 1)   # matplotlib keeps no public getter
        if width <= room or ncols <= 1:
            continue
        _legend_again(legend, max(1, min(ncols - 1, math.floor(ncols * room / width))))
        changed = True
    return changed


def _wrap_texts(fig, renderer) -> bool:
    """Wrap a title, label or figure text that runs past the figure's edges onto more
    lines (a left-aligned title keeps its start: it wraps within the room right of it; a
    centred one keeps its centre).
    Legends are narrowed by :func:`_narrow_legends` instead."""
    from matplotlib.text import Text

    changed = False
    frame = fig.bbox
    legends = [leg for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if leg]
    entries = {id(t) for leg in legends for t in [*leg.get_texts(), leg.get_title()]}
    for text in fig.findobj(Text):
        content = text.get_text()
        if (id(text) in entries or not text.get_visible() or not content.strip()
                or "$" in content):
            continue
        box = text.get_window_extent(renderer)
        if (box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1) or len(content) < 12:
            continue
        if text.get_horizontalalignment() == "left":
            room = frame.x1 - 4 - max(box.x0, frame.x0 + 2)
        elif text.get_horizontalalignment() == "right":
            room = min(box.x1, frame.x1) - 4 - frame.x0
        else:                            # centred on its axes, not on the figure
            centre = (box.x0 + box.x1) / 2
            room = 2 * min(centre - frame.x0, frame.x1 - centre) - 8
        longest = max(len(line) for line in content.splitlines())
        chars = max(8, math.floor(longest * max(room, 1) / box.width * 0.95))
        wrapped = "\n".join(textwrap.fill(line, chars) for line in content.splitlines())
        if wrapped != content:
            text.set_text(wrapped)
            changed = True
    return changed


def _drawn_tick_labels(axis, renderer, horizontal: bool):
    """The tick labels of ``axis`` drawn inside its axes' span, with their boxes."""
    span = axis.axes.bbox
    out = []
    for tick in axis.get_major_ticks():
        label = tick.label1
        if not label.get_visible() or not label.get_text().strip():
            continue
        box = label.get_window_extent(renderer)
        centre = (box.x0 + box.x1) / 2 if horizontal else (box.y0 + box.y1) / 2
        lo, hi = (span.x0, span.x1) if horizontal else (span.y0, span.y1)
        if lo - 1 <= centre <= hi + 1:
            out.append((label, box))
    return out


def _thin_ticks(fig, renderer) -> bool:
    """Keep every other numeric x tick label where neighbours touch (every third, ... if
    needed). Named ticks (categories) are all kept: hiding one would hide what it names."""
    from matplotlib.category import StrCategoryFormatter
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    changed = False
    for ax in fig.axes:
        named = isinstance(getattr(ax.xaxis.get_major_formatter(), "kvlab_original",
                                   ax.xaxis.get_major_formatter()),
                           FixedFormatter | StrCategoryFormatter)
        if not ax.get_visible() or named:
            continue
        labels = sorted(_drawn_tick_labels(ax.xaxis, renderer, True), key=lambda lb: lb[1].x0)
        crowded = any(b.x0 - a.x1 < TICK_GAP_PX for (_, a), (_, b) in itertools.pairwise(labels))
        if not crowded:
            continue
        base = ax.xaxis.get_major_formatter()
        step = getattr(base, "kvlab_step", 1) + 1
        original = getattr(base, "kvlab_original", base)

        def every(x, pos, original=original, step=step):
            return original(x, pos) if pos is None or pos % step == 0 else ""

        thinned = FuncFormatter(every)
        thinned.kvlab_step, thinned.kvlab_original = step, original
        if hasattr(original, "set_locs"):
            thinned.set_locs = original.set_locs
        ax.xaxis.set_major_formatter(thinned)
        changed = True
    return changed


def _grow_flat_panels(fig, panels, renderer) -> bool:
    """Make the figure taller when the layout squeezed a panel's plotting area flat."""
    if not panels:
        return False
    shortest = min(ax.bbox.height for ax in panels) / fig.dpi
    if shortest >= MIN_PANEL_IN:
        return False
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + (MIN_PANEL_IN - shortest) * len(panels) + 0.1)
    return True


def _texts(fig, renderer):
    """``[(id, box)]`` of every drawn, non-empty text of ``fig`` (tick labels outside their
    axes' span are not drawn and not counted)."""
    from matplotlib.text import Text

    ticks = set()
    kept = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for axis, horizontal in ((ax.xaxis, True), (ax.yaxis, False)):
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                ticks.update((id(tick.label1), id(tick.label2)))
            kept += [(id(label), box)
                     for label, box in _drawn_tick_labels(axis, renderer, horizontal)]
    for text in fig.findobj(Text):
        if id(text) in ticks or not text.get_visible() or not text.get_text().strip():
            continue
        if text.axes is not None and not text.axes.get_visible():
            continue
        box = text.get_window_extent(renderer)
        if box.width > 0 and box.height > 0:
            kept.append((id(text), box))
    return kept


def _overlaps(texts) -> set[tuple[int, int]]:
    pairs = set()
    for i, (a, box_a) in enumerate(texts):
        for b, box_b in texts[i + 1:]:
            dx = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
            dy = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
            if dx > 1.5 and dy > 1.5:
                pairs.add((min(a, b), max(a, b)))
    return pairs


def _check(fig, renderer, panels) -> Fit:
    texts = _texts(fig, renderer)
    frame = fig.bbox
    for _, box in texts:
        if box.x0 < frame.x0 - 2 or box.x1 > frame.x1 + 2:
            return Fit(False, "a text runs past the figure's edge")
    overlaps = _overlaps(texts)
    if overlaps:
        return Fit(False, f"{len(overlaps)} pairs of texts overlap")
    if panels and min(ax.bbox.width for ax in panels) < 0.35 * frame.width:
        return Fit(False, "a panel is squeezed narrow")
    return Fit(True)
