"""Load every page of the built book in headless Chromium and fail on what a reader would see.

    python tools/site_check.py [_build/html] [--width 1280 --width 390]
                               [--page notebooks/01-kv-capacity.html]

The site is served from a local HTTP server; each page is loaded at each width (1280 and 390 CSS
px by default: a laptop and a phone, light mode) with console and network logging on
(``goog:loggingPrefs``). A page fails on

* ``console``: any console message of level SEVERE (a JavaScript error, a failed resource);
* ``request``: a response with status >= 400, a request that failed, or any request that left
  the local server (the book must load offline: no CDN);
* ``math``: a math element MathJax did not render (no ``mjx-container``), or a MathJax error;
* ``image``: an image that did not load;
* ``clipped``: a table, code or output box, figure or widget whose content is cut off sideways:
  wider than its box with overflow hidden, or spilling past the text column with nothing to
  scroll it; the page itself scrolling sideways; and, at 1200 px and wider, a table wider than
  the column (it would hide behind a scrollbar on a laptop);
* ``wrapped``: a code or output line that the browser broke over two lines (code scrolls
  sideways; wrapped lines break printed tables and put continuations at column 0);
* ``figure``: a figure or widget frame wider than the screen or its box (it would be cut off,
  or scroll sideways with no cue that more exists), or whose smallest text is under 9 CSS px as
  displayed (from the text size the variant shown declares: ``data-min-text-px`` on a
  kernel-free frame or on the ``<source>`` of its phone variant, the ``kvlab:min-text-px`` text
  chunk in output PNGs), or that declares none. A figure with no phone layout may be smaller
  only where it says so and opens full size on tap (``.kvlab-zoom-note`` shown under it);
* ``alt``: a figure without alt text (missing, empty, or a file path / data URI);
* ``caption``: a static figure (an image in a cell output, not a kernel-free widget's frame)
  that is not inside a ``<figure>`` with a non-empty ``<figcaption>`` (MyST-NB writes one from
  the cell's ``mystnb: figure: caption:`` metadata);
* ``menu``: the ☰ button that does not open the chapter list, or the page-contents button that
  does not open the page's contents (a real click; the panel's first link must then be visible
  and on top), or neither button nor panel to reach them; and on a narrow screen a
  page-contents drawer that stays open after a pick, or that Esc does not close;
* ``twin``: a widget output shown as its text fallback (``[interactive widget: … Run this cell
  in Jupyter …]``): its kernel-free twin is missing from the notebook;
* ``nbval``: an nbval marker comment visible in a rendered cell;
* ``duplicate``: the same figure shown twice on one page;
* ``widget``: a kernel-free widget (``.kvlab-kf``) whose script did not run, or whose visible
  frame does not change when one of its controls is moved;
* ``favicon``: the page declares no icon;
* ``search``: the search page opened from disk (``file://``, as a reader opens a downloaded
  copy) finds nothing, shows results without their summaries, or logs a console error.

Each page is loaded as a first visit (browser cache off); what it downloads is reported per
page (``--weights``) and in total.

Needs selenium and Debian's ``chromium`` + ``chromium-driver`` (``make site-check`` installs
them where it can). Exit status 1 when any page fails, 2 when no browser can be started.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHROMIUM_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")
WIDTHS = (1280, 390)
#: Boxes that must not be cut off sideways (their content scrolls, fits, or wraps as prose).
CLIPPABLE = ("div.highlight pre, div.cell_output pre, div.output pre, div.cell_output img, "
             "article table, .kvlab-kf, .kvlab-kf-frame img")
#: Boxes whose lines must not wrap: code and printed output.
UNWRAPPED = "div.highlight pre, div.cell_output pre, div.output pre"
#: Figures: images in cell outputs and kernel-free widget frames.
FIGURES = "div.cell_output img, .kvlab-kf-frame img"
#: A word the search page is asked for when the site is opened from disk.
SEARCH_WORD = "cache"
MIN_TEXT_CSS_PX = 9.0
#: The text/plain fallback of a widget output (kvlab.viz.kernel_free.FALLBACK_TEXT).
NO_TWIN = re.compile(r"\[interactive widget: .{0,200}?Run this cell in Jupyter[^\]]{0,40}\]", re.S)


@dataclass(frozen=True)
class Problem:
    page: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.page}: {self.kind}: {self.detail}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):   # a load the browser dropped
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve(root: Path) -> Iterator[str]:
    """Serve ``root`` on a free local port; yields its base URL (``http://127.0.0.1:PORT/``)."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def set_viewport(driver, width: int, height: int = 900, *, dark: bool = False,
                 scale: float = 1.0) -> None:
    """Emulate a ``width`` x ``height`` CSS-px viewport (a phone below 600 px: touch, mobile
    layout), ``scale`` device pixels per CSS pixel, and the OS colour scheme. Chromium's
    window cannot be made narrower than 500 px; the emulation can."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": scale, "mobile": width < 600})
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [
        {"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]})


def start_browser(width: int = 1280, height: int = 900):
    """Headless Chromium through the system chromedriver (no driver download)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if driver_path is None or binary is None:
        raise RuntimeError("chromium and chromedriver are needed: "
                           "apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in CHROMIUM_ARGS:
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    set_viewport(driver, width, height)
    return driver


_REDIRECT = re.compile(r'<meta http-equiv="Refresh"', re.I)


def pages(root: Path) -> list[str]:
    """Every HTML page of the build, relative to ``root`` (Sphinx's own folders excluded, and
    pages that only redirect to another: the book's ``index.html``)."""
    skip = ("_static", "_sources", "_images", "_panels_static")
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.html")
                  if p.relative_to(root).parts[0] not in skip
                  and not (p.stat().st_size < 2000 and _REDIRECT.search(p.read_text())))


# Waits for MathJax (when the page loads it), opens every collapsed cell (<details>: solutions
# are checked too) and returns what the DOM shows. arguments: selectors, then the minimum size.
_INSPECT = """
const done = arguments[arguments.length - 1];
const [clip, unwrapped, figures, minText] = arguments;
// MathJax's loader starts its components after the page loads: wait until every formula is
// drawn (or one fails, or 30 s pass), then for MathJax's own startup to finish
const drawn = () => [...document.querySelectorAll('.math, span.math, div.math')]
  .every(el => el.querySelector('mjx-container')) || !!document.querySelector('mjx-merror');
const started = new Promise(resolve => {
  const until = Date.now() + 30000;
  (function poll() {
    if (drawn() || Date.now() > until) resolve(); else setTimeout(poll, 50);
  })();
});
const ready = started.then(() => (window.MathJax && MathJax.startup && MathJax.startup.promise)
  ? MathJax.startup.promise : null);
const timeout = new Promise(resolve => setTimeout(resolve, 20000));
const shown = el => el.offsetParent !== null && el.getBoundingClientRect().width > 0;
const what = el => (el.tagName + ' ' + ((el.tagName === 'IMG' ? el.alt : el.textContent) || '')
                    .trim().replace(/\\s+/g, ' ').slice(0, 60));
const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
// the kvlab:min-text-px text chunk of a PNG (null when absent)
const pngMinText = async src => {
  try {
    const bytes = new Uint8Array(await (await fetch(src)).arrayBuffer());
    const view = new DataView(bytes.buffer);
    for (let at = 8; at + 8 <= bytes.length;) {
      const length = view.getUint32(at), type = String.fromCharCode(...bytes.slice(at + 4, at + 8));
      if (type === 'tEXt') {
        const text = String.fromCharCode(...bytes.slice(at + 8, at + 8 + length));
        const [key, value] = text.split('\\0');
        if (key === 'kvlab:min-text-px') return parseFloat(value);
      }
      if (type === 'IDAT' || type === 'IEND') break;  // text chunks before the image data
      at += 12 + length;
    }
  } catch (err) { return null; }
  return null;
};
Promise.race([ready, timeout]).catch(() => null).then(async () => { try {
  document.querySelectorAll('details:not([open])').forEach(d => { d.open = true; });
  await new Promise(resolve => requestAnimationFrame(() => setTimeout(resolve, 50)));
  const out = {math: [], mathErrors: 0, images: [], clipped: [], wrapped: [], figures: [],
               alts: [], captions: [], nbval: false, widgets: 0, text: '',
               icon: !!document.querySelector('link[rel~="icon"]'), shown: {}};
  document.querySelectorAll('.math, span.math, div.math').forEach(el => {
    if (!el.querySelector('mjx-container')) out.math.push(el.textContent.slice(0, 60));
  });
  out.mathErrors = document.querySelectorAll('mjx-merror').length;
  document.querySelectorAll('img').forEach(img => {
    // a lazy image not shown yet (a widget's other frames) loads when it is shown
    if (img.loading === 'lazy' && img.offsetParent === null) return;
    if (!img.complete || img.naturalWidth === 0) out.images.push((img.src || '').slice(0, 80));
    else if (img.offsetParent !== null) {
      const key = img.currentSrc || img.src;
      out.shown[key] = (out.shown[key] || 0) + 1;
    }
  });
  const column = document.querySelector('article.bd-article') || document.body;
  const columnRight = column.getBoundingClientRect().right;
  document.querySelectorAll(clip).forEach(el => {
    if (!shown(el)) return;
    const overflow = getComputedStyle(el).overflowX;
    const hidden = el.scrollWidth - el.clientWidth;
    if (hidden > 1 && el.clientWidth > 0 && ['hidden', 'clip'].includes(overflow)) {
      out.clipped.push(what(el) + ': ' + hidden + ' px cut off (overflow ' + overflow + ')');
      return;
    }
    if (scrolls(el)) return;                 // the box scrolls its own content
    let box = el.parentElement;
    while (box && box !== column && !scrolls(box)) box = box.parentElement;
    const r = el.getBoundingClientRect();
    const right = r.left + Math.max(r.width, el.scrollWidth);
    if ((!box || box === column) && right > columnRight + 1)
      out.clipped.push(what(el) + ': ' + Math.round(right - columnRight)
                       + ' px past the text column, nothing to scroll it');
    if (el.tagName === 'TABLE' && innerWidth >= 1200 && box && box !== column
        && r.width > box.clientWidth + 1)
      out.clipped.push('table wider than the column (' + Math.round(r.width) + ' > '
                       + box.clientWidth + ' px), cut off at a scrollbar: ' + what(el));
  });
  // against the screen's width, not innerWidth: on a phone a page wider than the screen widens
  // the layout viewport itself (innerWidth grows with it) and the reader pans the whole page,
  // and the page-contents drawer, anchored to its right edge, opens partly off the screen
  const screenWidth = document.documentElement.clientWidth;
  if (document.documentElement.scrollWidth > screenWidth + 1)
    out.clipped.push('the page scrolls sideways: ' + document.documentElement.scrollWidth
                     + ' px on a ' + screenWidth + ' px screen');
  document.querySelectorAll(unwrapped).forEach(pre => {
    if (!shown(pre)) return;
    const lines = pre.textContent.replace(/\\n$/, '').split('\\n');
    const range = document.createRange();
    range.selectNodeContents(pre);
    const tops = [];
    for (const rect of range.getClientRects()) {
      if (rect.width === 0 || rect.height === 0) continue;
      if (!tops.some(top => Math.abs(top - rect.top) < 3)) tops.push(rect.top);
    }
    if (tops.length > lines.length) {
      const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
      out.wrapped.push(lines.length + ' lines shown on ' + tops.length + ': '
                       + longest.trim().slice(0, 60));
    }
  });
  const figs = [...document.querySelectorAll(figures)];
  out.fitting = 0; out.visible = 0; out.zoomed = 0;
  for (const [i, img] of figs.entries()) {
    const alt = (img.getAttribute('alt') || '').trim();
    const name = 'figure ' + (i + 1) + (alt ? ' (' + alt.slice(0, 50) + ')' : '');
    const path = /^(data:|\\.\\.?\\/|\\/|https?:)/i.test(alt)
                 || /\\.(png|svg|jpe?g|gif)$/i.test(alt);
    if (!alt || path)
      out.alts.push(name + (alt ? ': the alt text is a file name' : ': no alt text'));
    if (img.closest('div.cell_output') && !img.closest('.kvlab-kf')) {  // a static figure
      const caption = img.closest('figure')?.querySelector('figcaption');
      if (!caption || !caption.textContent.trim())
        out.captions.push(name + ': a static figure without a caption');
    }
    if (!shown(img) || !img.naturalWidth) continue;
    out.visible += 1;
    let problem = '';
    // wider than the screen, or than the box it sits in (cut off, or scrolled with no cue)
    const r = img.getBoundingClientRect();
    const box = img.closest('.kvlab-kf-frame, figure, div.output, div.cell_output')
                || img.parentElement;
    const b = box.getBoundingClientRect();
    if (r.width > screenWidth + 1 || r.right > screenWidth + 1 || r.left < -1)
      problem = 'wider than the screen (' + Math.round(r.width) + ' px shown from '
                + Math.round(r.left) + ' on a ' + screenWidth + ' px screen)';
    else if (r.width > box.clientWidth + 1 || r.right > b.right + 1)
      problem = 'wider than its box (' + Math.round(r.width) + ' > ' + box.clientWidth
                + ' px): cut off, or scrolled sideways';
    // the text size of the variant shown: its <source> when a <picture> chose one
    let declared = img.getAttribute('data-min-text-px');
    if (img.parentElement && img.parentElement.tagName === 'PICTURE') {
      for (const source of img.parentElement.querySelectorAll('source')) {
        if (new URL(source.getAttribute('srcset'), document.baseURI).href === img.currentSrc)
          declared = source.getAttribute('data-min-text-px');
      }
    }
    let px = parseFloat(declared);
    if (isNaN(px)) px = await pngMinText(img.currentSrc || img.src);
    const zoom = (img.closest('.kvlab-kf-frame, figure') || img.parentElement)
      .querySelector('.kvlab-zoom-note');
    const zoomShown = zoom && zoom.offsetParent !== null;
    if (px === null || isNaN(px)) {
      problem = problem || 'declares no text size (re-render it with kvlab.viz)';
    } else {
      const css = px * r.width / img.naturalWidth;
      if (css < minText && zoomShown) { out.zoomed += 1; if (!problem) continue; }
      else if (css < minText)
        problem = problem || ('smallest text ' + css.toFixed(1) + ' px as displayed');
    }
    if (problem) out.figures.push(name + ': ' + problem);
    else out.fitting += 1;
  }
  out.nbval = /# ?NBVAL_[A-Z_]+/.test(document.body.innerText);
  out.text = document.body.innerText;
  out.widgets = document.querySelectorAll('.kvlab-kf').length;
  done(out);
  } catch (err) { done({error: String(err)}); } });
"""

# Navigation panels. arguments[0] is "primary" (the chapter list) or "secondary" (the page's
# contents). _PANEL_LINKS: how many links the panel has at all; _PANEL_OPEN: whether one of
# them is shown in the viewport and on top (a reader could click it).
_LINKS = {"primary": "nav.bd-links a", "secondary": "nav.page-toc a, #pst-page-toc-nav a"}
_PANEL_LINKS = "return document.querySelectorAll(arguments[0]).length;"
_PANEL_OPEN = """
for (const a of document.querySelectorAll(arguments[0])) {
  const r = a.getBoundingClientRect();
  if (r.width < 1 || r.height < 1) continue;
  const x = r.left + Math.min(r.width / 2, 20), y = r.top + r.height / 2;
  if (x < 0 || y < 0 || x >= innerWidth || y >= innerHeight) continue;
  const hit = document.elementFromPoint(x, y);
  if (hit && (hit === a || a.contains(hit))) return true;
}
return false;
"""
_CLOSE_PANELS = """
document.querySelectorAll('dialog[open]').forEach(d => d.close());
document.dispatchEvent(new KeyboardEvent('keydown', {key: 'Escape', bubbles: true}));
"""

# For kernel-free widget number arguments[0]: move each control, report whether the visible
# frame changed. Returns {ready, controls: [{name, changed, before, after}]}.
_WIDGET = """
const root = document.querySelectorAll('.kvlab-kf')[arguments[0]];
const visible = () => {
  const shown = [...root.querySelectorAll('.kvlab-kf-frame')].filter(f => !f.hidden
                                                                      && f.offsetParent !== null);
  return shown.map(f => f.getAttribute('data-kf-key') + '|'
                   + ((f.querySelector('img') || {}).src || '').length + '|'
                   + ((f.querySelector('img') || {}).src || '').slice(-40)).join(',');
};
const result = {ready: root.getAttribute('data-kf-ready') === '1', id: root.id, controls: []};
root.querySelectorAll('[data-kf-control]').forEach(ctl => {
  const n = ctl.tagName === 'SELECT' ? ctl.options.length : (+ctl.max - +ctl.min + 1);
  const old = ctl.value;
  const before = visible();
  const next = ctl.tagName === 'SELECT' ? String((ctl.selectedIndex + 1) % n)
               : String(+ctl.value === +ctl.max ? +ctl.min : +ctl.value + 1);
  if (ctl.tagName === 'SELECT') ctl.selectedIndex = +next; else ctl.value = next;
  ctl.dispatchEvent(new Event('input', {bubbles: true}));
  ctl.dispatchEvent(new Event('change', {bubbles: true}));
  const after = visible();
  result.controls.push({name: ctl.getAttribute('data-kf-control'), options: n,
                        changed: n > 1 && after !== before && after !== '' , before, after});
  if (ctl.tagName === 'SELECT') ctl.value = old; else ctl.value = old;
  ctl.dispatchEvent(new Event('input', {bubbles: true}));
});
return result;
"""


def downloaded_bytes(entries: list[dict]) -> int:
    """Bytes a page load downloaded (its requests' encoded lengths; data: URIs are part of
    the page that holds them), from Chromium's performance log."""
    total = 0
    for entry in entries:
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.loadingFinished":
            total += int(message["params"].get("encodedDataLength", 0))
    return total


def _network_problems(entries: list[dict], base: str, page: str) -> list[Problem]:
    problems = []
    requests: dict[str, str] = {}
    for entry in entries:
        message = json.loads(entry["message"])["message"]
        method, params = message.get("method", ""), message.get("params", {})
        if method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            requests[params["requestId"]] = url
            if not url.startswith((base, "data:", "blob:", "about:")):
                problems.append(Problem(page, "request", f"left the local server: {url}"))
        elif method == "Network.responseReceived":
            status = params["response"]["status"]
            if status >= 400:
                problems.append(Problem(page, "request",
                                        f"HTTP {status} for {params['response']['url']}"))
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            url = requests.get(params["requestId"], "?")
            problems.append(Problem(page, "request",
                                    f"failed ({params.get('errorText', '')}): {url}"))
    return problems


def _wait_until(condition, timeout: float = 10.0, step: float = 0.1) -> bool:
    """Poll ``condition()`` until it is true or ``timeout`` seconds pass; its last value. It
    returns as soon as the condition holds: the long timeout matters only on a loaded machine
    (a CI run beside other work once took more than 2 s to reopen a panel)."""
    end = time.monotonic() + timeout
    while True:
        value = bool(condition())
        if value or time.monotonic() >= end:
            return value
        time.sleep(step)


def check_panel(driver, page: str, which: str, width: int) -> list[Problem]:
    """Click the visible ``which`` toggle (``primary``: ☰, ``secondary``: page contents) as a
    reader would and check that its panel opens (or, where it was open, closes and reopens)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    label = {"primary": "the ☰ menu", "secondary": "the page-contents button"}[which]
    links = _LINKS[which]
    if not driver.execute_script(_PANEL_LINKS, links):
        return []                                  # nothing to show (a page without contents)

    def is_open() -> bool:
        return driver.execute_script(_PANEL_OPEN, links)

    before = is_open()
    buttons = [b for b in driver.find_elements(By.CSS_SELECTOR, f".{which}-toggle")
               if b.is_displayed() and b.size["width"] > 0]
    if not buttons:
        return [] if before else [Problem(page, "menu", f"{label} at {width}px: no button, "
                                          "and its panel is not shown")]
    problems = []
    try:
        buttons[0].click()
        _wait_until(lambda: is_open() != before)
        after = is_open()
        if after == before:
            problems.append(Problem(page, "menu", f"{label} at {width}px does nothing: its "
                                    f"panel stays {'open' if before else 'closed'}"))
        elif not after:        # it hid a panel that was open (the ☰ on a wide screen): reopen
            buttons[0].click()
            if not _wait_until(is_open):
                problems.append(Problem(page, "menu", f"{label} at {width}px hides its panel "
                                        "and does not bring it back"))
    except WebDriverException as exc:
        problems.append(Problem(page, "menu", f"{label} at {width}px cannot be clicked: "
                                f"{exc.msg.splitlines()[0][:120] if exc.msg else exc}"))
    driver.execute_script(_CLOSE_PANELS)
    _wait_until(lambda: is_open() == before)
    return problems


def check_page(driver, base: str, page: str, width: int = 1280,
               seen_out: dict | None = None) -> list[Problem]:
    """Load ``base + page`` in a ``width``-px viewport and return everything wrong with it;
    ``seen_out``, when given, receives what the page showed: its bytes downloaded (a first
    visit) and its figures (visible, fitting, shown small with a tap-to-open note)."""
    if driver.current_url.startswith(base):  # each page as a first visit: no stored theme mode
        driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get_log("browser")
    driver.get_log("performance")
    driver.get(base + page)
    seen = driver.execute_async_script(_INSPECT, CLIPPABLE, UNWRAPPED, FIGURES, MIN_TEXT_CSS_PX)
    loaded = driver.get_log("performance")   # what the page loaded until its math was drawn
    if "error" in seen:
        return [Problem(page, "checker", f"page inspection failed: {seen['error']}")]
    if seen_out is not None:
        seen_out.update(bytes=downloaded_bytes(loaded), visible=seen["visible"],
                        fitting=seen["fitting"], zoomed=seen["zoomed"])
    at = f" at {width}px"
    problems = [Problem(page, "math", f"unrendered: {text!r}") for text in seen["math"]]
    if seen["mathErrors"]:
        problems.append(Problem(page, "math", f"{seen['mathErrors']} MathJax errors"))
    problems += [Problem(page, "image", f"did not load: {src}") for src in seen["images"]]
    problems += [Problem(page, "clipped", box + at) for box in seen["clipped"]]
    problems += [Problem(page, "wrapped", line + at) for line in seen["wrapped"]]
    problems += [Problem(page, "figure", text + at) for text in seen["figures"]]
    problems += [Problem(page, "alt", text) for text in seen["alts"]]
    problems += [Problem(page, "caption", text) for text in seen["captions"]]
    problems += [Problem(page, "twin", f"a widget without its kernel-free twin: "
                         f"{m.group(0)[:100]!r}") for m in NO_TWIN.finditer(seen["text"])]
    if seen["nbval"]:
        problems.append(Problem(page, "nbval", "an NBVAL marker is visible"))
    if not seen["icon"]:
        problems.append(Problem(page, "favicon", "no <link rel=icon>"))
    problems += [Problem(page, "duplicate", f"figure shown {n} times: {src[:60]}...")
                 for src, n in seen["shown"].items() if n > 1]
    for i in range(seen["widgets"]):
        widget = driver.execute_script(_WIDGET, i)
        if not widget["ready"]:
            problems.append(Problem(page, "widget", f"{widget['id']}: its script did not run"))
        if not widget["controls"]:
            problems.append(Problem(page, "widget", f"{widget['id']}: no controls"))
        for control in widget["controls"]:
            if not control["changed"]:
                problems.append(Problem(page, "widget", f"{widget['id']}: moving "
                                        f"{control['name']!r} does not change the frame"))
    for entry in driver.get_log("browser"):
        if entry["level"] == "SEVERE":
            problems.append(Problem(page, "console", entry["message"][:300]))
    problems += _network_problems(loaded + driver.get_log("performance"), base, page)
    driver.execute_script("window.scrollTo(0, 0)")
    for which in ("primary", "secondary"):
        problems += check_panel(driver, page, which, width)
    problems += check_drawer(driver, page, width)
    return problems


_DRAWER = "#pst-secondary-sidebar-modal"
_DRAWER_OPEN = f"const d = document.querySelector('{_DRAWER}'); return !!(d && d.open);"


def check_drawer(driver, page: str, width: int) -> list[Problem]:
    """On a screen where the page contents open as a drawer: a pick closes it, and so does
    Esc wherever the focus is (also after a pick moved it out of the drawer)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    buttons = [b for b in driver.find_elements(By.CSS_SELECTOR, ".secondary-toggle")
               if b.is_displayed() and b.size["width"] > 0]
    if not buttons or not driver.execute_script(_PANEL_LINKS, _LINKS["secondary"]):
        return []
    is_open = functools.partial(driver.execute_script, _DRAWER_OPEN)
    label = f"the page-contents drawer at {width}px"
    problems = []
    try:
        buttons[0].click()
        if not _wait_until(is_open, 3.0):
            return []                     # not a drawer at this width (check_panel covers it)
        links = [a for a in driver.find_elements(By.CSS_SELECTOR, f"{_DRAWER} a[href]")
                 if a.is_displayed()]
        if links:
            links[min(1, len(links) - 1)].click()
            if _wait_until(lambda: not is_open(), 3.0):
                buttons[0].click()                  # closed: open it again for Esc
                _wait_until(is_open, 3.0)
            else:
                problems.append(Problem(page, "menu", f"{label} stays open after a pick"))
        if is_open():      # Esc, wherever the focus is (a pick moves it out of the drawer)
            driver.execute_script("document.activeElement && document.activeElement.blur()")
            ActionChains(driver).send_keys(Keys.ESCAPE).perform()
            if not _wait_until(lambda: not is_open(), 3.0):
                problems.append(Problem(page, "menu", f"Esc does not close {label}"))
    except WebDriverException as exc:
        problems.append(Problem(page, "menu", f"{label} cannot be used: "
                                f"{exc.msg.splitlines()[0][:120] if exc.msg else exc}"))
    driver.execute_script(_CLOSE_PANELS)
    driver.execute_script("window.scrollTo(0, 0)")
    return problems


_SEARCH_RESULTS = """
const items = document.querySelectorAll('#search-results li');
const status = (document.querySelector('#search-results p.search-summary')
                || {textContent: ''}).textContent;
return {items: items.length, done: /found|did not match/i.test(status),
        summaries: [...items].filter(li => (li.querySelector('p.context') || {textContent: ''})
                                           .textContent.trim()).length};
"""


def check_search_from_disk(driver, root: Path, word: str = SEARCH_WORD) -> list[Problem]:
    """The search page opened from disk finds ``word``, shows each result's summary, and logs
    no console error."""
    page = "search.html (file://)"
    driver.get_log("browser")
    driver.get((root / "search.html").resolve().as_uri() + f"?q={word}")
    _wait_until(lambda: driver.execute_script(_SEARCH_RESULTS)["done"], 20.0)
    time.sleep(1.0)                      # the summaries arrive after the result list
    found = driver.execute_script(_SEARCH_RESULTS)
    problems = [Problem(page, "console", entry["message"][:300])
                for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    if not found["items"]:
        problems.append(Problem(page, "search", f"no result for {word!r}"))
    elif found["summaries"] < found["items"]:
        problems.append(Problem(page, "search", f"{found['items'] - found['summaries']} of "
                                f"{found['items']} results for {word!r} without a summary"))
    return problems


@dataclass
class Report:
    """What :func:`check_site` found: the pages checked, the problems, the kernel-free widgets
    moved, and per width and page what the page showed (:func:`check_page`'s ``seen_out``)."""

    pages: list[str]
    problems: list[Problem]
    widgets: int
    seen: dict[int, dict[str, dict]]

    def figures(self, width: int) -> tuple[int, int, int]:
        """(visible figures, those that fit legibly, those shown small with a tap note)."""
        rows = self.seen.get(width, {}).values()
        return (sum(r["visible"] for r in rows), sum(r["fitting"] for r in rows),
                sum(r["zoomed"] for r in rows))


def check_site(root: Path, only: list[str] | None = None,
               widths: tuple[int, ...] | int = WIDTHS, search: bool = True) -> Report:
    """Every page of the build under ``root`` loaded at each of ``widths`` (the same problem
    found at two widths counts once per width: its detail names the width where it depends on
    it), then the search page opened from disk (``search``)."""
    checked = only or pages(root)
    widths = (widths,) if isinstance(widths, int) else tuple(widths)
    problems: list[Problem] = []
    widgets = 0
    seen: dict[int, dict[str, dict]] = {}
    with serve(root) as base:
        driver = start_browser(widths[0])
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
        try:
            for width in widths:
                set_viewport(driver, width)
                for page in checked:
                    out: dict = {}
                    found = check_page(driver, base, page, width, out)
                    seen.setdefault(width, {})[page] = out
                    problems += [p for p in found if p not in problems]
                    if width == widths[0]:
                        widgets += driver.execute_script(
                            "return document.querySelectorAll('.kvlab-kf').length")
            if search and (root / "search.html").exists():
                problems += check_search_from_disk(driver, root)
        finally:
            driver.quit()
    return Report(checked, problems, widgets, seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="_build/html", type=Path)
    parser.add_argument("--width", type=int, action="append",
                        help=f"viewport width in CSS pixels (repeatable; default {WIDTHS})")
    parser.add_argument("--page", action="append", help="check only this page (repeatable)")
    parser.add_argument("--weights", action="store_true",
                        help="print the bytes each page downloads on a first visit")
    args = parser.parse_args(argv)
    if not (args.root / "index.html").exists():
        parser.error(f"{args.root} holds no built site: run `make book` first")
    widths = tuple(args.width or WIDTHS)
    try:
        report = check_site(args.root, args.page, widths)
    except RuntimeError as exc:
        print(f"site-check: {exc}", file=sys.stderr)
        return 2
    for problem in report.problems:
        print(problem)
    first = report.seen.get(widths[0], {})
    if args.weights:
        for page, row in first.items():
            print(f"{row.get('bytes', 0) / 1e6:8.2f} MB  {page}")
    for width in widths:
        visible, fitting, zoomed = report.figures(width)
        print(f"site-check: at {width}px {fitting} of {visible} visible figures and frames fit "
              f"legibly" + (f", {zoomed} have no layout that fits and say so (a tap opens "
                            "them full size)" if zoomed else ""))
    sizes = [row.get("bytes", 0) for row in first.values()]
    if sizes:
        print(f"site-check: a first visit downloads {sum(sizes) / len(sizes) / 1e6:.2f} MB a "
              f"page on average, {max(sizes) / 1e6:.2f} MB at most")
    print(f"site-check: {len(report.pages)} pages at {', '.join(f'{w}px' for w in widths)}, "
          f"{report.widgets} kernel-free widgets moved, {len(report.problems)} problems")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
