"""The visual language of the book: one colour per request, one per block state, one type scale.

Every figure and widget takes its colours from here so that a block that is *shared* looks the
same in chapter 3 as in chapter 12, and request ``r2`` keeps its colour across a whole chapter.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import matplotlib as mpl

# Block states of the KV pool. Keys are the names used by kvlab.core snapshots.
BLOCK_STATE_COLORS: dict[str, str] = {
    "free": "#e9ecef",          # light grey: nothing lives here
    "exclusive": "#4c72b0",     # blue: one owner
    "shared": "#dd8452",        # orange: several owners, copy before a partial write
    "cached": "#8fbc8f",        # sage: no live owner, holds a cached prefix, evictable (LRU)
    "pending_copy": "#c44e52",  # red: source or target of an in-flight copy, fenced
}
BLOCK_STATE_ORDER = ("free", "exclusive", "shared", "cached", "pending_copy")
BLOCK_STATE_LABELS = {
    "free": "free",
    "exclusive": "exclusive (1 owner)",
    "shared": "shared (>1 owner)",
    "cached": "cached, evictable",
    "pending_copy": "pending copy",
}

# A qualitative palette for requests, distinct from the block-state colours above
# (colour-blind friendly: Okabe–Ito order, then muted extras).
REQUEST_PALETTE: tuple[str, ...] = (
    "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9",
    "#d55e00", "#f0e442", "#6a3d9a", "#8c564b", "#17becf",
)

# Phases of scheduled work in batch timelines.
PHASE_COLORS: dict[str, str] = {"prefill": "#6baed6", "decode": "#fd8d3c", "idle": "#f0f0f0"}

INK = "#212529"      # text and outlines
MUTED = "#868e96"    # secondary text, gridlines
FONT_SIZE = 11


@dataclass(frozen=True)
class Layout:
    """The screen a figure is drawn for: ``width_in`` is the widest it should be, in inches at
    96 CSS px per inch (the book's column at 1280 px, or a phone's)."""

    name: str
    width_in: float

    @property
    def phone(self) -> bool:
        return self.name == "phone"


#: The book's column on a laptop (880 CSS px) and on a 390 px phone (340 CSS px: the column
#: less a widget frame's padding). A phone figure's text is shown at its point size.
WIDE = Layout("wide", 880 / 96)
PHONE = Layout("phone", 340 / 96)
_LAYOUT: contextvars.ContextVar[Layout] = contextvars.ContextVar("kvlab_layout", default=WIDE)


def layout() -> Layout:
    """The layout figures are being drawn for now (:data:`WIDE` unless inside
    :func:`phone_layout`). A figure function marked :func:`phone_aware` reads it to stack its
    panels or wrap its rows for a phone."""
    return _LAYOUT.get()


@contextlib.contextmanager
def phone_layout() -> Iterator[Layout]:
    """Draw figures for a phone's column inside this block (see :func:`layout`)."""
    token = _LAYOUT.set(PHONE)
    try:
        yield PHONE
    finally:
        _LAYOUT.reset(token)


def phone_aware(draw: Callable) -> Callable:
    """Mark a figure function that lays itself out for :func:`layout`: the Figure it returns
    remembers the call (``fig.kvlab_redraw``), so the book's renderers draw its phone variant
    by calling it again inside :func:`phone_layout` (:func:`kvlab.viz.phone.phone_variant`).
    A figure from an unmarked function is re-laid for the phone by
    :func:`kvlab.viz.phone.fit_phone` instead."""

    @functools.wraps(draw)
    def drawn(*args, **kwargs):
        fig = draw(*args, **kwargs)
        fig.kvlab_redraw = functools.partial(draw, *args, **kwargs)
        return fig

    return drawn


def request_color(key: Hashable, order: list | None = None) -> str:
    """Colour of a request: by its index in ``order`` when given, else by a stable hash of ``key``.

    Passing the list of request ids of a figure keeps neighbouring requests distinct; the hash
    fallback is stable across runs (it does not use Python's randomised ``hash``).
    """
    if order is not None and key in order:
        index = order.index(key)
    else:
        index = sum((i + 1) * ord(c) for i, c in enumerate(str(key)))
    return REQUEST_PALETTE[index % len(REQUEST_PALETTE)]


def block_state_color(state: str) -> str:
    """Colour of a block state name (see :data:`BLOCK_STATE_COLORS`); KeyError names the state."""
    try:
        return BLOCK_STATE_COLORS[state]
    except KeyError:
        expected = ", ".join(BLOCK_STATE_ORDER)
        raise KeyError(f"unknown block state {state!r}; expected one of {expected}") from None


RC_PARAMS = {
    "figure.figsize": (8.0, 3.6),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "figure.facecolor": "white",
    "axes.facecolor": "white",
    "axes.edgecolor": MUTED,
    "axes.labelcolor": INK,
    "axes.titlesize": FONT_SIZE + 1,
    "axes.titleweight": "bold",
    "axes.labelsize": FONT_SIZE,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": False,
    "axes.prop_cycle": mpl.cycler(color=list(REQUEST_PALETTE)),
    "font.size": FONT_SIZE,
    "legend.fontsize": FONT_SIZE - 1,
    "legend.frameon": False,
    "xtick.color": INK,
    "ytick.color": INK,
    "xtick.labelsize": FONT_SIZE - 1,
    "ytick.labelsize": FONT_SIZE - 1,
    "grid.color": "#dee2e6",
    "text.color": INK,
}


def use_style() -> None:
    """Apply the book's matplotlib style globally (idempotent). In a kernel,
    :func:`kvlab.viz.notebook.setup_notebook` also displays figures as
    :func:`kvlab.viz.kernel_free.figure_output_png` renders them."""
    mpl.rcParams.update(RC_PARAMS)


@phone_aware
def legend_figure(request_ids: list[str] | None = None):
    """The book's visual key: one swatch per block state and per request colour.

    Pure: returns a new matplotlib Figure with two axes (block states, requests); draws nothing
    else. ``request_ids`` defaults to ``r0 .. r5``. In a phone's layout the swatches wrap
    into rows (two states, three requests a row).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    request_ids = list(request_ids) if request_ids is not None else [f"r{i}" for i in range(6)]
    rows = [
        ("KV block states", [(BLOCK_STATE_LABELS[s], BLOCK_STATE_COLORS[s])
                             for s in BLOCK_STATE_ORDER]),
        ("requests", [(rid, request_color(rid, request_ids)) for rid in request_ids]),
    ]
    phone = layout().phone
    per_row = [2, 3] if phone else [len(swatches) for _, swatches in rows]
    lines = [-(-len(swatches) // n) for (_, swatches), n in zip(rows, per_row, strict=True)]
    width, line_in = (PHONE.width_in, 0.42) if phone else (9.0, 0.55)
    fig, axes = plt.subplots(2, 1, figsize=(width, 0.5 + line_in * sum(lines) + 0.4),
                             gridspec_kw={"height_ratios": lines})
    for ax, (title, swatches), n, height in zip(axes, rows, per_row, lines, strict=True):
        ax.set_xlim(0, n)
        ax.set_ylim(height, 0)
        ax.axis("off")
        ax.set_title(title, loc="left", fontsize=FONT_SIZE)
        for i, (label, color) in enumerate(swatches):
            x, y = i % n, i // n
            ax.add_patch(Rectangle((x + 0.02, y + 0.15), 0.14 if not phone else 0.09, 0.6,
                                   facecolor=color, edgecolor=INK, linewidth=0.6, label=label))
            ax.text(x + (0.2 if not phone else 0.13), y + 0.45, label, va="center",
                    fontsize=FONT_SIZE - 2)
    fig.tight_layout()
    return fig
