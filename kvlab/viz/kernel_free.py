"""Kernel-free widgets: precomputed frames over a control grid, switched by plain HTML controls.

A live ipywidget needs a kernel; the published book has none. :func:`static_widget` renders a
figure for every point of a small control grid (the product of each control's values), stores
the frames as palette PNGs inside one self-contained HTML fragment, and adds plain ``<select>``
and ``<input type="range">`` controls with a few lines of inline JavaScript that show the frame
of the current selection. No CDN, no require.js, no kernel: the fragment works in the built site
and in any trusted notebook front end; without JavaScript it still shows the default frame.

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


def figure_png(fig, *, dpi: int = 80, colors: int = 96) -> bytes:
    """PNG bytes of a matplotlib figure, quantized to a ``colors`` palette (flat-colour charts
    lose nothing visible and shrink several-fold). The figure is closed."""
    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
    return out.getvalue()


@dataclass
class Frame:
    key: str
    png: bytes
    caption: str = ""


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
        return sum(len(f.png) for f in self.frames)

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

    def to_html(self) -> str:
        defaults = [int(i) for i in self.default_key.split("-")]
        controls = "".join(self._control_html(name, c, i)
                           for (name, c), i in zip(self.controls.items(), defaults, strict=True))
        frames = []
        for frame in self.frames:
            data = base64.b64encode(frame.png).decode()
            hidden = "" if frame.key == self.default_key else " hidden"
            caption = (f'<pre class="kvlab-kf-caption">{html.escape(frame.caption)}</pre>'
                       if frame.caption else "")
            frames.append(f'<div class="kvlab-kf-frame" data-kf-key="{frame.key}"{hidden}>'
                          f'<img src="data:image/png;base64,{data}" '
                          f'alt="{html.escape(self.alt or self.title)}">{caption}</div>')
        return (f'<div class="kvlab-kf" id="{self.uid}" data-kf-frames="{len(self.frames)}">'
                f'<div class="kvlab-kf-controls">{controls}</div>{"".join(frames)}'
                f'<div class="kvlab-kf-note">Precomputed views ({len(self.frames)}); run the '
                "notebook for the live widget.</div>"
                f"<script>{_JS.replace('__UID__', self.uid)}</script></div>")

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return {"text/html": self.to_html(),
                "text/plain": FALLBACK_TEXT.format(what=self.title)}


# Shows the frame whose key matches the controls; plain DOM, no library, ES5 for old browsers.
_JS = """(function(){var root=document.getElementById("__UID__");if(!root)return;
var ctl=root.querySelectorAll("[data-kf-control]");
function show(){var key=[];for(var i=0;i<ctl.length;i++){key.push(ctl[i].value);
var out=ctl[i].parentNode.querySelector("output");
if(out){out.textContent=JSON.parse(ctl[i].getAttribute("data-kf-labels"))[+ctl[i].value];}}
key=key.join("-");var fr=root.querySelectorAll(".kvlab-kf-frame");
for(var j=0;j<fr.length;j++){fr[j].hidden=fr[j].getAttribute("data-kf-key")!==key;}}
for(var i=0;i<ctl.length;i++){ctl[i].addEventListener("input",show);
ctl[i].addEventListener("change",show);}root.setAttribute("data-kf-ready","1");})();"""


def static_widget(
    render: Callable[..., Any],
    controls: Mapping[str, Control | Iterable],
    *,
    default: Mapping[str, Any] | None = None,
    caption: Callable[..., str] | None = None,
    title: str = "kernel-free view",
    alt: str = "",
    dpi: int = 80,
    max_frames: int = 48,
) -> KernelFreeWidget:
    """Render ``render(**point)`` (a matplotlib Figure) at every point of the control grid.

    ``controls`` maps each keyword of ``render`` to a :class:`Control` (or a sequence of values:
    numbers become a slider, anything else a dropdown). ``default`` picks the frame shown first
    (each control's first value when absent). ``caption(**point)``, when given, is printed under
    its frame. A grid of more than ``max_frames`` points raises ``ValueError`` before anything is
    drawn; so does a default value that is not among its control's values.
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
    frames = []
    for indices in itertools.product(*(range(len(s.values)) for s in specs.values())):
        point = {name: spec.values[i] for (name, spec), i in zip(specs.items(), indices,
                                                                  strict=True)}
        png = figure_png(render(**point), dpi=dpi)
        frames.append(Frame("-".join(map(str, indices)), png,
                            caption(**point) if caption is not None else ""))
    return KernelFreeWidget(title, specs, frames, "-".join(map(str, start)), alt)
