"""Kernel-free widgets: precomputed frames over a control grid, switched by plain HTML controls.

A live ipywidget needs a kernel; the published book has none. :func:`static_widget` renders a
figure for every point of a small control grid (the product of each control's values), stores
the frames as palette PNGs inside one self-contained HTML fragment, and adds plain ``<select>``
and ``<input type="range">`` controls with a few lines of inline JavaScript that show the frame
of the current selection. No CDN, no require.js, no kernel: the fragment works in the built site
and in any trusted notebook front end.

Where scripts do not run (an untrusted notebook in JupyterLab, GitHub: the HTML is sanitized, no
``<script>`` and no styles), the fragment shows one frame (the default), its caption and one line
saying how to get the live widget: the controls and the other frames travel inside
``<script type="text/html">`` blocks, which a sanitizer drops whole and a browser never runs;
the widget's own script moves them into the page.

Frames are sized for the book's column: :data:`CSS_DPI` CSS pixels per figure inch, narrowed to
:data:`COLUMN_PX` when the figure is wider, and rendered at :data:`SCALE` times that resolution
so they stay sharp on high-density screens. Each ``<img>`` carries ``data-min-text-px``, the
font size of the smallest text of its figure in image pixels, which ``tools/site_check.py``
turns into the size a reader sees (it fails under 9 CSS pixels).

Every frame also has a phone variant (:func:`kvlab.viz.phone.phone_variant`: the figure laid
out :data:`PHONE_PX` wide, panels stacked) wherever the wide one would not stay legible on a
390 px screen; a ``<picture>`` serves it to screens narrower than the width at which the wide
frame's text would drop under 9 px (:func:`phone_media`). A frame that cannot be laid out for
a phone says so (``data-phone="none"``): the site shows it scaled and opens it full size on
tap. Frames other than the one shown first load lazily (``loading="lazy"``).

    from kvlab.viz.kernel_free import static_widget
    static_widget(lambda step: my_figure(step), {"step": range(8)}, default={"step": 3})

Frames are keyed by the index of each control's value, joined by ``-`` in control order
(``data-key="1-0-3"``). ``max_frames`` guards the page weight: a grid larger than it is refused.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Environment variable that turns the kernel-free export of chapter widgets on (the notebook
#: executor that writes the book's ``.ipynb`` files sets it; interactive sessions skip the cost).
EXPORT_ENV = "KVLAB_KERNEL_FREE"

#: The text/plain fallback of every chapter widget (shown where no widget renderer exists).
FALLBACK_TEXT = "[interactive widget: {what}. Run this cell in Jupyter to use it.]"


def export_enabled() -> bool:
    """True when chapter widgets should carry their kernel-free twin (``KVLAB_KERNEL_FREE=1``)."""
    return os.environ.get(EXPORT_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class Control:
    """One control of a kernel-free widget: the values it offers and how it is drawn.

    ``kind`` is ``"slider"`` (a range input over the values in order) or ``"dropdown"``;
    ``labels`` are the texts shown for the values (default ``str(value)``).
    """

    values: tuple
    kind: str = "dropdown"
    label: str = ""
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"control {self.label!r} offers no values")
        if self.kind not in ("slider", "dropdown"):
            raise ValueError(f"control kind must be 'slider' or 'dropdown', not {self.kind!r}")
        if self.labels and len(self.labels) != len(self.values):
            raise ValueError(f"control {self.label!r}: {len(self.labels)} labels for "
                             f"{len(self.values)} values")

    def text(self, i: int) -> str:
        return self.labels[i] if self.labels else str(self.values[i])


def slider(values: Iterable, *, label: str = "", labels: Sequence[str] = ()) -> Control:
    """A range control stepping through ``values`` in order."""
    return Control(tuple(values), "slider", label, tuple(labels))


def dropdown(values: Iterable, *, label: str = "", labels: Sequence[str] = ()) -> Control:
    """A ``<select>`` over ``values``."""
    return Control(tuple(values), "dropdown", label, tuple(labels))


def _as_control(name: str, spec: Control | Iterable) -> Control:
    if isinstance(spec, Control):
        return spec if spec.label else Control(spec.values, spec.kind, name, spec.labels)
    values = tuple(spec)
    numeric = bool(values) and all(isinstance(v, int | float) and not isinstance(v, bool)
                                   for v in values)
    return Control(values, "slider" if numeric and len(values) > 2 else "dropdown", name)


def spread(n: int, k: int, include: Iterable[int] = ()) -> list[int]:
    """At most about ``k`` indices of ``range(n)``, evenly spread, always with the ends and
    ``include`` — to subsample a long slider into a modest number of frames."""
    if n < 1 or k < 1:
        raise ValueError(f"spread needs n >= 1 and k >= 1, got n={n}, k={k}")
    m = min(n, k)
    picked = {round(i * (n - 1) / max(1, m - 1)) for i in range(m)}
    picked |= {0, n - 1} | {i for i in include if 0 <= i < n}
    return sorted(picked)


#: CSS pixels per figure inch (the CSS inch): a figure's text is shown at its point size.
CSS_DPI = 96
#: The widest a frame is shown: the book's text column at 1280 px, less the frame's padding.
COLUMN_PX = 880
#: Image pixels per CSS pixel: frames are rendered at twice their display size.
SCALE = 2
#: The widest a phone variant is shown: a 390 px screen's column less a frame's padding.
PHONE_PX = 340
#: What a narrow screen (below 960 px) keeps around a widget frame: the column's padding,
#: the frame's border and padding. Above 959 px the theme's sidebars take over.
NARROW_CHROME_PX = 50
NARROW_SCREEN_MAX_PX = 959


@dataclass(frozen=True)
class Rendered:
    """A rendered figure: PNG bytes, the CSS size to show it at, its smallest text and a
    description of what it shows (for ``alt``)."""

    png: bytes
    width: int
    height: int
    min_text_px: float
    description: str

    @property
    def min_text_css_px(self) -> float:
        """The smallest text's size, in CSS pixels, when shown at ``width`` x ``height``."""
        return self.min_text_px / SCALE


def min_display_width(width: int, min_text_px: float, *, scale: int = SCALE,
                      min_css_px: float = 9.25) -> int:
    """The narrowest a figure shown ``width`` CSS px wide (rendered at ``scale`` x, smallest text
    ``min_text_px`` image pixels) may be drawn and keep that text at ``min_css_px`` or more;
    0 when either size is unknown."""
    if width <= 0 or min_text_px <= 0:
        return 0
    # one pixel to spare: the image is round(width * scale) pixels wide, not exactly that; and
    # the default aims a quarter pixel above the site check's 9 px, since the stored text size
    # is rounded to 0.1 image px (at 9.0 a figure measured 8.99 px on a phone)
    return min(width, math.ceil(width * min_css_px * scale / min_text_px) + 1)


def phone_media(width: int, min_text_px: float) -> str:
    """The media query of the screens that get a figure's phone variant: those narrower than
    where its wide rendering (``width`` CSS px, smallest text ``min_text_px`` image px) would
    shrink its text under 9 px, up to :data:`NARROW_SCREEN_MAX_PX`."""
    floor = min_display_width(width, min_text_px) or width
    return f"(max-width: {min(floor + NARROW_CHROME_PX, NARROW_SCREEN_MAX_PX)}px)"


def display_dpi(fig, column_px: int = COLUMN_PX) -> float:
    """CSS pixels per inch for ``fig``: :data:`CSS_DPI`, or less when that is wider than
    ``column_px`` (the browser would scale the image down anyway; this way it is not)."""
    width_in = fig.get_size_inches()[0]
    return min(float(CSS_DPI), column_px / width_in)


def smallest_text_pt(fig) -> float:
    """Font size in points of the smallest visible, non-empty text of ``fig`` (0 if none).
    Tick labels get their text when the figure is drawn: call it after a draw or save."""
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip()]
    return min(sizes, default=0.0)


def describe_figure(fig) -> str:
    """What ``fig`` shows, from its titles and axis labels, on one line (for alt text)."""
    parts = []
    suptitle = getattr(fig, "_suptitle", None)
    if suptitle is not None and suptitle.get_text().strip():
        parts.append(suptitle.get_text().strip())
    for ax in fig.get_axes():
        if not ax.get_visible():
            continue
        title = " ".join(t.get_text().strip() for t in (ax.title, ax._left_title, ax._right_title)
                         if t.get_text().strip())
        axes = [label for label in (ax.get_xlabel().strip(), ax.get_ylabel().strip()) if label]
        text = title + (f" ({' against '.join(reversed(axes))})" if axes else "")
        if text.strip():
            parts.append(text.strip())
    return " ".join("; ".join(dict.fromkeys(parts)).split())


#: PNG text keys: what the figure shows, and its smallest text in image pixels.
PNG_DESCRIPTION = "Description"
PNG_MIN_TEXT = "kvlab:min-text-px"
#: A notebook figure's phone variant travels inside its PNG, in a private ancillary chunk
#: (viewers skip it; the site extension serves it to phones): :func:`add_phone_chunk`.
PNG_PHONE_CHUNK = b"kvPh"
#: The chunk's content when the figure has no phone layout (it is shown scaled on a phone).
NO_PHONE = b"none"


def _png_chunks(png: bytes):
    """``(type, data, start, end)`` of each chunk of ``png`` (after the 8-byte signature)."""
    import struct

    at = 8
    while at + 12 <= len(png):
        (length,) = struct.unpack(">I", png[at:at + 4])
        kind = png[at + 4:at + 8]
        yield kind, png[at + 8:at + 8 + length], at, at + 12 + length
        at += 12 + length


def add_phone_chunk(png: bytes, phone: bytes | None) -> bytes:
    """``png`` with ``phone`` (a PNG, or None: :data:`NO_PHONE`) in a :data:`PNG_PHONE_CHUNK`
    chunk before its end."""
    import struct
    import zlib

    data = phone if phone is not None else NO_PHONE
    chunk = (struct.pack(">I", len(data)) + PNG_PHONE_CHUNK + data
             + struct.pack(">I", zlib.crc32(PNG_PHONE_CHUNK + data) & 0xFFFFFFFF))
    end = next(start for kind, _, start, _ in _png_chunks(png) if kind == b"IEND")
    return png[:end] + chunk + png[end:]


def split_phone_chunk(png: bytes) -> tuple[bytes, bytes | None, bool]:
    """``(png without the chunk, phone PNG or None, has a phone layout)``; a PNG without the
    chunk gives ``(png, None, True)``: it shrinks to a phone as it is."""
    for kind, data, start, end in _png_chunks(png):
        if kind == PNG_PHONE_CHUNK:
            rest = png[:start] + png[end:]
            return (rest, None, False) if data == NO_PHONE else (rest, data, True)
    return png, None, True


def render_figure(fig, *, column_px: int = COLUMN_PX, colors: int = 96, close: bool = True,
                  tight: bool = False) -> Rendered:
    """Render ``fig`` for the book's column at :data:`SCALE` x, palette-quantized to ``colors``
    (flat-colour charts lose nothing visible and shrink several-fold). ``tight`` crops to the
    drawn content (as notebook outputs do). The PNG carries the description and the smallest
    text size as text chunks (:data:`PNG_DESCRIPTION`, :data:`PNG_MIN_TEXT`). ``close``
    closes the figure."""
    import matplotlib.pyplot as plt
    from PIL import Image, PngImagePlugin

    dpi = display_dpi(fig, column_px)
    description = describe_figure(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi * SCALE, **({"bbox_inches": "tight"} if tight else {}))
    min_text = smallest_text_pt(fig) * dpi * SCALE / 72   # after drawing: tick labels exist
    if close:
        plt.close(fig)
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    info = PngImagePlugin.PngInfo()
    if description:
        info.add_text(PNG_DESCRIPTION, description)
    info.add_text(PNG_MIN_TEXT, f"{min_text:.1f}")
    out = io.BytesIO()
    image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(
        out, "PNG", optimize=True, pnginfo=info)
    width, height = image.size
    return Rendered(out.getvalue(), round(width / SCALE), round(height / SCALE), min_text,
                    description)


def figure_png(fig, *, column_px: int = COLUMN_PX, colors: int = 96) -> bytes:
    """PNG bytes of ``fig`` as a frame shows it (see :func:`render_figure`). Closes ``fig``."""
    return render_figure(fig, column_px=column_px, colors=colors).png


@dataclass(frozen=True)
class Screens:
    """A figure rendered for the book's column (``wide``) and, where that would not stay
    legible on a phone, for a phone's column (``phone``; None when the wide one shrinks to a
    phone legibly, or when the figure cannot be laid out for one: then ``fits_phone`` is
    False)."""

    wide: Rendered
    phone: Rendered | None
    fits_phone: bool


def shrinks_to_phone(shot: Rendered) -> bool:
    """Whether ``shot`` shown :data:`PHONE_PX` wide (or less) keeps its text legible."""
    return shot.width <= PHONE_PX or 0 < min_display_width(shot.width,
                                                           shot.min_text_px) <= PHONE_PX


def render_screens(fig, *, column_px: int = COLUMN_PX, colors: int = 96, tight: bool = False,
                   keep: bool = False, phone: bool = True) -> Screens:
    """Render ``fig`` wide and, when needed, its phone variant
    (:func:`kvlab.viz.phone.phone_variant`; ``phone=False`` skips it: no phone layout).
    ``keep`` leaves ``fig`` open and unchanged (a notebook's figure: the phone variant is laid
    out on a copy), else it is closed."""
    import pickle

    import matplotlib.pyplot as plt

    from kvlab.viz.phone import phone_variant

    wide = render_figure(fig, column_px=column_px, colors=colors, close=False, tight=tight)
    if shrinks_to_phone(wide) or not phone:
        if not keep:
            plt.close(fig)
        return Screens(wide, None, shrinks_to_phone(wide))
    source = fig
    if keep and getattr(fig, "kvlab_redraw", None) is None:
        try:
            source = pickle.loads(pickle.dumps(fig))
        except Exception:  # an artist that does not pickle: lay out the figure itself
            source = fig
    phone_fig, fit = phone_variant(source)
    small = (render_figure(phone_fig, column_px=PHONE_PX, colors=colors, close=False,
                           tight=tight) if fit.ok else None)
    # drawn past its edges (a tight crop wider than the phone's column): it is shown scaled
    # to the column, which must keep its smallest text at 9 px and more
    if small is not None and small.min_text_css_px * min(1.0, PHONE_PX / small.width) < 9.25:
        small = None
    for drawn in {id(f): f for f in (phone_fig, source, fig)}.values():
        if drawn is not fig or not keep:
            plt.close(drawn)
    return Screens(wide, small, small is not None)


@dataclass
class Frame:
    key: str
    png: bytes
    caption: str = ""
    width: int = 0          # CSS pixels to show the image at (0: its own size)
    height: int = 0
    min_text_px: float = 0.0  # smallest text, image pixels
    alt: str = ""
    phone: Rendered | None = None   # the phone variant, where one is needed
    fits_phone: bool = True         # False: no phone layout, shown scaled on a phone


@dataclass
class KernelFreeWidget:
    """Precomputed frames plus their controls; displays as self-contained HTML."""

    title: str
    controls: dict[str, Control]
    frames: list[Frame]
    default_key: str
    alt: str = ""
    uid: str = field(default="", init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(self.title.encode())
        for frame in self.frames:
            digest.update(frame.key.encode() + frame.png + frame.caption.encode())
        self.uid = "kvlab-kf-" + digest.hexdigest()[:12]

    @property
    def nbytes(self) -> int:
        return sum(len(f.png) + (len(f.phone.png) if f.phone else 0) for f in self.frames)

    def _control_html(self, name: str, control: Control, index: int) -> str:
        label = html.escape(control.label or name)
        if control.kind == "slider":
            n = len(control.values) - 1
            text = html.escape(control.text(index))
            names = html.escape(json.dumps([control.text(i) for i in range(n + 1)]))
            return (f'<label>{label} <input type="range" min="0" max="{n}" step="1" '
                    f'value="{index}" data-kf-control="{html.escape(name)}" '
                    f'data-kf-labels="{names}"> <output>{text}</output></label>')
        options = "".join(
            f'<option value="{i}"{" selected" if i == index else ""}>'
            f"{html.escape(control.text(i))}</option>" for i in range(len(control.values)))
        return (f'<label>{label} <select data-kf-control="{html.escape(name)}">{options}'
                "</select></label>")

    def _frame_html(self, frame: Frame, shown: bool) -> str:
        data = base64.b64encode(frame.png).decode()
        size = (f' width="{frame.width}" height="{frame.height}"' if frame.width else "")
        text = f' data-min-text-px="{frame.min_text_px:.1f}"' if frame.min_text_px else ""
        alt = html.escape(frame.alt or self.alt or self.title)
        lazy = "" if shown else ' loading="lazy"'
        phone = "" if frame.fits_phone else ' data-phone="none"'
        image = (f'<img src="data:image/png;base64,{data}"{size}{text}{phone}{lazy} '
                 f'alt="{alt}">')
        if frame.phone is not None:
            small = frame.phone
            image = (f'<picture><source media="{phone_media(frame.width, frame.min_text_px)}" '
                     f'srcset="data:image/png;base64,{base64.b64encode(small.png).decode()}" '
                     f'width="{small.width}" height="{small.height}" '
                     f'data-min-text-px="{small.min_text_px:.1f}">{image}</picture>')
        caption = (f'<pre class="kvlab-kf-caption">{html.escape(frame.caption)}</pre>'
                   if frame.caption else "")
        hidden = "" if shown else " hidden"
        return (f'<div class="kvlab-kf-frame" data-kf-key="{frame.key}"{hidden}>'
                f"{image}{caption}</div>")

    def to_html(self) -> str:
        """The fragment: the default frame and a one-line note as plain HTML; the controls and
        the other frames inside ``<script type="text/html">`` (see the module docstring)."""
        defaults = [int(i) for i in self.default_key.split("-")]
        controls = "".join(self._control_html(name, c, i)
                           for (name, c), i in zip(self.controls.items(), defaults, strict=True))
        shown = next(f for f in self.frames if f.key == self.default_key)
        others = "".join(self._frame_html(f, False) for f in self.frames if f is not shown)
        n = len(self.frames)
        return (f'<div class="kvlab-kf" id="{self.uid}" data-kf-frames="{n}">'
                '<div class="kvlab-kf-controls"></div>'
                f"{self._frame_html(shown, True)}"
                f'<p class="kvlab-kf-note">{html.escape(STATIC_NOTE.format(n=n))}</p>'
                f'<script type="text/html" data-kf-part="controls">{controls}</script>'
                f'<script type="text/html" data-kf-part="frames">{others}</script>'
                f"<script>{_JS.replace('__UID__', self.uid)}</script></div>")

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return {"text/html": self.to_html(),
                "text/plain": FALLBACK_TEXT.format(what=self.title)}


#: The note under a kernel-free widget where its script does not run (sanitized HTML).
STATIC_NOTE = ("One of {n} precomputed views, without its controls: run this cell in Jupyter "
               "(trusted notebook) for the live widget.")
#: The note once the script has run (the published site).
LIVE_NOTE = "Precomputed views ({n}); run the notebook in Jupyter for the live widget."

# Moves the controls and the other frames out of their text/html script blocks, then shows the
# frame whose key matches the controls; plain DOM, no library, ES5 for old browsers.
_JS = """(function(){var root=document.getElementById("__UID__");if(!root)return;
function part(name){var s=root.querySelector('script[data-kf-part="'+name+'"]');
if(!s)return "";var t=s.textContent;s.parentNode.removeChild(s);return t;}
root.querySelector(".kvlab-kf-controls").innerHTML=part("controls");
var note=root.querySelector(".kvlab-kf-note");var box=document.createElement("div");
box.innerHTML=part("frames");while(box.firstChild){root.insertBefore(box.firstChild,note);}
note.textContent=__LIVE__.replace("{n}",root.getAttribute("data-kf-frames"));
var ctl=root.querySelectorAll("[data-kf-control]");
function show(){var key=[];for(var i=0;i<ctl.length;i++){key.push(ctl[i].value);
var out=ctl[i].parentNode.querySelector("output");
if(out){out.textContent=JSON.parse(ctl[i].getAttribute("data-kf-labels"))[+ctl[i].value];}}
key=key.join("-");var fr=root.querySelectorAll(".kvlab-kf-frame");
for(var j=0;j<fr.length;j++){fr[j].hidden=fr[j].getAttribute("data-kf-key")!==key;}}
for(var i=0;i<ctl.length;i++){ctl[i].addEventListener("input",show);
ctl[i].addEventListener("change",show);}root.setAttribute("data-kf-ready","1");})();""".replace(
    "__LIVE__", json.dumps(LIVE_NOTE))



def figure_output_png(fig) -> tuple[str, dict[str, int]]:
    """A figure as a notebook output shows it: rendered for the book's column at twice its
    display size, with the display size as output metadata (so the site shows it sharp, not
    twice as large) and, inside the PNG, what it shows, its smallest text
    (:func:`render_figure`) and its phone variant
    (:func:`render_screens`, :func:`add_phone_chunk`),
    which the site serves to narrow screens. ``fig`` stays open and unchanged. Returns
    IPython's ``(base64, metadata)``."""
    screens = render_screens(fig, colors=256, tight=True, keep=True)
    png = screens.wide.png
    if screens.phone is not None or not screens.fits_phone:
        png = add_phone_chunk(png, screens.phone.png if screens.phone else None)
    return (base64.b64encode(png).decode(),
            {"width": screens.wide.width, "height": screens.wide.height})


def static_widget(
    render: Callable[..., Any],
    controls: Mapping[str, Control | Iterable],
    *,
    default: Mapping[str, Any] | None = None,
    caption: Callable[..., str] | None = None,
    title: str = "kernel-free view",
    alt: str = "",
    column_px: int = COLUMN_PX,
    max_frames: int = 48,
    dpi: int | None = None,
) -> KernelFreeWidget:
    """Render ``render(**point)`` (a matplotlib Figure) at every point of the control grid.

    ``controls`` maps each keyword of ``render`` to a :class:`Control` (or a sequence of values:
    numbers become a slider, anything else a dropdown). ``default`` picks the frame shown first
    (each control's first value when absent). ``caption(**point)``, when given, is printed under
    its frame. Each frame's alt text is ``alt`` (default: what the figure's titles and axis
    labels say, else ``title``) followed by the controls' settings. Frames are shown at most
    ``column_px`` CSS pixels wide (see :func:`render_figure`); ``dpi`` is accepted for older
    callers and ignored (the column decides the size). A grid of more than ``max_frames`` points
    raises ``ValueError`` before anything is drawn; so does a default value that is not among its
    control's values.
    """
    specs = {name: _as_control(name, spec) for name, spec in controls.items()}
    if not specs:
        raise ValueError("a kernel-free widget needs at least one control")
    total = 1
    for spec in specs.values():
        total *= len(spec.values)
    if total > max_frames:
        sizes = " x ".join(f"{n}={len(s.values)}" for n, s in specs.items())
        raise ValueError(f"{total} frames ({sizes}) exceed max_frames={max_frames}: offer fewer "
                         "values per control")
    default = dict(default or {})
    unknown = set(default) - set(specs)
    if unknown:
        raise ValueError(f"default names unknown controls: {sorted(unknown)}")
    start = []
    for name, spec in specs.items():
        if name not in default:
            start.append(0)
        elif default[name] in spec.values:
            start.append(spec.values.index(default[name]))
        else:
            raise ValueError(f"default {name}={default[name]!r} is not one of {spec.values}")
    # once a frame cannot be laid out for a phone (a diagram whose function is not
    # phone-aware), the later ones are not tried: each try costs several draws
    frames = []
    phone = True
    for indices in itertools.product(*(range(len(s.values)) for s in specs.values())):
        point = {name: spec.values[i] for (name, spec), i in zip(specs.items(), indices,
                                                                  strict=True)}
        screens = render_screens(render(**point), column_px=column_px, phone=phone)
        phone = phone and screens.fits_phone
        shot = screens.wide
        setting = ", ".join(f"{spec.label or name} {spec.text(i)}"
                            for (name, spec), i in zip(specs.items(), indices, strict=True))
        what = alt or shot.description or title
        frames.append(Frame("-".join(map(str, indices)), shot.png,
                            caption(**point) if caption is not None else "",
                            shot.width, shot.height, shot.min_text_px, f"{what} ({setting})",
                            screens.phone, screens.fits_phone))
    return KernelFreeWidget(title, specs, frames, "-".join(map(str, start)), alt)
