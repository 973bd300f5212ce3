"""Load every page of the built book in headless Chromium and fail on what a reader would see.

    python tools/site_check.py [_build/html] [--width 1280] [--page notebooks/01-kv-capacity.html]

The site is served from a local HTTP server; each page is loaded with console and network
logging on (``goog:loggingPrefs``). A page fails on

* ``console``: any console message of level SEVERE (a JavaScript error, a failed resource);
* ``request``: a response with status >= 400, a request that failed, or any request that left
  the local server (the book must load offline: no CDN);
* ``math``: a math element MathJax did not render (no ``mjx-container``), or a MathJax error;
* ``image``: an image that did not load;
* ``clipped``: a code or output box whose content is wider than the box (hidden sideways);
* ``nbval``: an nbval marker comment visible in a rendered cell;
* ``duplicate``: the same figure shown twice on one page;
* ``widget``: a kernel-free widget (``.kvlab-kf``) whose script did not run, or whose visible
  frame does not change when one of its controls is moved;
* ``favicon``: the page declares no icon.

Needs selenium and Debian's ``chromium`` + ``chromium-driver`` (``make site-check`` installs
them where it can). Exit status 1 when any page fails, 2 when no browser can be started.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import shutil
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHROMIUM_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")
CLIPPABLE = "div.highlight pre, div.cell_output pre, div.output pre, div.cell_output img"


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


@contextlib.contextmanager
def serve(root: Path) -> Iterator[str]:
    """Serve ``root`` on a free local port; yields its base URL (``http://127.0.0.1:PORT/``)."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


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
    return driver


def pages(root: Path) -> list[str]:
    """Every HTML page of the build, relative to ``root`` (Sphinx's own folders excluded)."""
    skip = ("_static", "_sources", "_images", "_panels_static")
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.html")
                  if p.relative_to(root).parts[0] not in skip)


# Waits for MathJax (when the page loads it) and returns what the DOM shows.
_INSPECT = """
const done = arguments[arguments.length - 1];
const clip = arguments[0];
const ready = (window.MathJax && MathJax.startup && MathJax.startup.promise)
  ? MathJax.startup.promise : Promise.resolve();
const timeout = new Promise(resolve => setTimeout(resolve, 20000));
Promise.race([ready, timeout]).catch(() => null).then(() => { try {
  const out = {math: [], mathErrors: 0, images: [], clipped: [], nbval: false, widgets: 0,
               icon: !!document.querySelector('link[rel~="icon"]'), shown: {}};
  document.querySelectorAll('.math, span.math, div.math').forEach(el => {
    if (!el.querySelector('mjx-container')) out.math.push(el.textContent.slice(0, 60));
  });
  out.mathErrors = document.querySelectorAll('mjx-merror').length;
  document.querySelectorAll('img').forEach(img => {
    if (!img.complete || img.naturalWidth === 0) out.images.push((img.src || '').slice(0, 80));
    else if (img.offsetParent !== null) {
      const key = img.currentSrc || img.src;
      out.shown[key] = (out.shown[key] || 0) + 1;
    }
  });
  document.querySelectorAll(clip).forEach(el => {
    if (el.scrollWidth > el.clientWidth + 1 && el.clientWidth > 0)
      out.clipped.push(el.tagName + ' ' + el.scrollWidth + '>' + el.clientWidth + ': '
                       + (el.textContent || el.src || '').trim().slice(0, 50));
  });
  out.nbval = /# ?NBVAL_[A-Z_]+/.test(document.body.innerText);
  out.widgets = document.querySelectorAll('.kvlab-kf').length;
  done(out);
  } catch (err) { done({error: String(err)}); } });
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


def check_page(driver, base: str, page: str) -> list[Problem]:
    """Load ``base + page`` and return everything wrong with it."""
    if driver.current_url.startswith(base):  # each page as a first visit: no stored theme mode
        driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get_log("browser")
    driver.get_log("performance")
    driver.get(base + page)
    seen = driver.execute_async_script(_INSPECT, CLIPPABLE)
    if "error" in seen:
        return [Problem(page, "checker", f"page inspection failed: {seen['error']}")]
    problems = [Problem(page, "math", f"unrendered: {text!r}") for text in seen["math"]]
    if seen["mathErrors"]:
        problems.append(Problem(page, "math", f"{seen['mathErrors']} MathJax errors"))
    problems += [Problem(page, "image", f"did not load: {src}") for src in seen["images"]]
    problems += [Problem(page, "clipped", box) for box in seen["clipped"]]
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
    problems += _network_problems(driver.get_log("performance"), base, page)
    return problems


def check_site(root: Path, only: list[str] | None = None, width: int = 1280
               ) -> tuple[list[str], list[Problem], int]:
    """(pages checked, problems, kernel-free widgets exercised) for the build under ``root``."""
    checked = only or pages(root)
    problems: list[Problem] = []
    widgets = 0
    with serve(root) as base:
        driver = start_browser(width)
        try:
            for page in checked:
                problems += check_page(driver, base, page)
                widgets += driver.execute_script(
                    "return document.querySelectorAll('.kvlab-kf').length")
        finally:
            driver.quit()
    return checked, problems, widgets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="_build/html", type=Path)
    parser.add_argument("--width", type=int, default=1280, help="window width in CSS pixels")
    parser.add_argument("--page", action="append", help="check only this page (repeatable)")
    args = parser.parse_args(argv)
    if not (args.root / "index.html").exists():
        parser.error(f"{args.root} holds no built site: run `make book` first")
    try:
        checked, problems, widgets = check_site(args.root, args.page, args.width)
    except RuntimeError as exc:
        print(f"site-check: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    print(f"site-check: {len(checked)} pages, {widgets} kernel-free widgets moved, "
          f"{len(problems)} problems at {args.width}px")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
