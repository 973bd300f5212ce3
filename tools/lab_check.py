"""Start JupyterLab the way ``make lab`` does and check a chapter in headless Chromium, as a
student meets it.

    python tools/lab_check.py [notebooks/04-prefix-reuse.md] [--no-run]

1. **Opens as a notebook**: the ``.md`` source opens in a notebook panel with code cells (the
   shipped ``.jupyter/lab/settings/overrides.json`` makes Jupytext Notebook the default viewer).
2. **MyST renders** (jupyterlab-myst), in the ``.md`` and in the trusted ``.ipynb``: every
   markdown cell is rendered by MyST, admonitions are boxes, citations are rendered, and no raw
   ``{term}``/``{cite}``/``{ref}`` role or ``:::`` fence is left in the text. (jupyterlab-myst
   2.7 loads no BibTeX file: a citation shows its key with a "Citation Not Found" mark, which
   counts as rendered.)
3. **Numbers in prose are numbers**: in the ``.ipynb`` every ``{eval}`name``` role shows its
   value, not ``name`` (jupyterlab-myst renders the cell's stored ``user_expressions``, which
   ``tools/inline_values.py`` writes from the glued outputs), and no name of a glued value is
   left in the text (a ``{glue:text}`` role, which Lab cannot render, shows its name). In the
   ``.md``, which holds no outputs, a role shows its name until the cell runs; the count is
   reported. After Run All (step 6) the values the kernel computed for the roles must be the
   stored ones, and be shown.
4. **Opens unmodified and saves unchanged**: a copy of the stored ``.ipynb`` and of the ``.md``
   source is not marked modified once its kernel is idle, and saving it from Lab writes the same
   notebook (cells, outputs, metadata, widget state) or the same bytes back. (For the
   ``.ipynb``: the kernelspec that ``tools/execute_notebook.py`` writes, and ``saveState:
   false`` in the book's Lab settings — with it on, the widget manager marks every notebook with
   widgets modified as it restores them, and a save before the cells run writes an empty widget
   state over the stored one. For the ``.md``: the ``language_info`` in its header, which the
   kernel writes into the notebook as it starts, and ``notebooks/jupytext.toml``, which keeps it
   there; the check copies it beside its copies, as Jupytext finds it beside the chapters.)
   The same holds under another Python: a copy of the ``.md`` whose header names a Python
   version other than the server's opens unmodified and saves byte for byte (the contents
   manager in ``.jupyter/jupyter_server_config.py`` shows Lab the running version and writes
   the stored one back).
5. **Solutions collapsed**, in the ``.md`` and the ``.ipynb``: every solution cell (tag
   ``hide-cell``) shows as a collapsed bar,
   and the bar says "Solution" (its first line) instead of the start of the answer.
6. **Run All, then save, keeps the site's widgets**: Run All in Lab finishes without an error,
   and in the saved notebook every widget output still carries its kernel-free twin
   (``text/html``), which the published site shows (``make lab`` starts the kernels with
   ``KVLAB_KERNEL_FREE=1``; without it a saved widget output has no twin and the site would show
   the "Run this cell in Jupyter" text). ``--no-run`` skips this step.
7. **Run All, then save, keeps the solutions collapsed**: after Run All every solution cell is
   still collapsed with its outputs hidden (no output of it is on screen: Lab shows the outputs
   of every cell it runs, and the book's Lab extension, ``.jupyter/labextensions/
   kvlab-solutions``, hides an unopened solution's again), each solution ran (it has outputs),
   and the saved notebook stores every solution with its outputs and ``jupyter.source_hidden``
   and ``jupyter.outputs_hidden`` set, so it opens collapsed again. Part of step 6's run.

Exit status 0 when every check holds, 1 when one fails (each is printed), 2 when no browser or
server can be started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = Path(os.environ.get("KVLAB_LAB_SETTINGS", ROOT / ".jupyter" / "lab" / "settings"))
WORK = ROOT / "_build" / "lab-check"   # copies the check may save over (git-ignored)
EVAL_ROLE = re.compile(r"\{eval\}`([^`]+)`")
RAW_ROLES = ("term", "cite", "cite:p", "cite:t", "ref", "numref", "doc", "abbr", "eq")
GLUE_ROLE = re.compile(r"\{glue(?::\w+)?\}`([\w.-]+)`")
SOLUTION_TAGS = frozenset({"hide-cell", "solution"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_settings() -> Path:
    """The book's Lab settings, plus one for the check only: every cell is kept in the page
    (Lab's default windowing renders the cells near the viewport only, so a check could not see
    the rest). Returns the settings folder."""
    folder = WORK / "settings"
    folder.mkdir(parents=True, exist_ok=True)
    overrides = json.loads((SETTINGS / "overrides.json").read_text())
    overrides.setdefault("@jupyterlab/notebook-extension:tracker", {})["windowingMode"] = "none"
    (folder / "overrides.json").write_text(json.dumps(overrides, indent=2))
    return folder


def lab_env() -> dict[str, str]:
    """The environment ``make lab`` gives the server: kernels export the kernel-free twins, and
    the book's server settings (``.jupyter/jupyter_server_config.py``) are read."""
    return {**os.environ, "KVLAB_KERNEL_FREE": "1",
            "JUPYTER_CONFIG_PATH": os.pathsep.join(
                filter(None, [str(ROOT / ".jupyter"), os.environ.get("JUPYTER_CONFIG_PATH")]))}


def other_python(source: str) -> str:
    """``source`` (a chapter's MyST text) with its header's Python version replaced by one
    that is not this interpreter's, as a reader with another Python has it."""
    import platform

    other = "3.10.0" if platform.python_version() != "3.10.0" else "3.12.0"
    text, count = re.subn(r"(?m)^(language_info:\n(?:  .*\n)*?  version: ).*$",
                          lambda m: m.group(1) + other, source, count=1)
    if not count:
        raise ValueError("the chapter's header stores no language_info version")
    return text


def lab_command(port: int, settings: Path = SETTINGS) -> list[str]:
    """The server ``make lab`` starts, headless and without a token, on ``port`` (with the app
    object exposed, so the check can read the document model and save through Lab itself)."""
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=",
           f"--LabApp.app_settings_dir={settings}", f"--ServerApp.root_dir={ROOT}",
           "--LabApp.expose_app_in_browser=True"]
    if hasattr(os, "getuid") and os.getuid() == 0:
        cmd.append("--allow-root")
    return cmd


# What the open notebook panel shows: rendered markdown, raw MyST left over, collapsed cells.
_INSPECT = r"""
const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
const md = [...panel.querySelectorAll('.jp-MarkdownCell')];
const rendered = md.filter(c => c.querySelector('.myst'));
const text = md.map(c => (c.querySelector('.jp-RenderedMarkdown, .myst') || c).innerText)
  .join('\n');
const role = new RegExp('\\{(' + arguments[0].map(r => r.replace(':', '\\:')).join('|') +
                        ')\\}`', 'g');
// a {glue:text} role, which Lab cannot render, shows its key as text; an {eval} role without a
// value shows its expression as inline code
const [glued, evals] = arguments[2];
const codes = [...panel.querySelectorAll('.jp-MarkdownCell .myst code')].map(e => e.innerText);
const raw = (text.match(role) || []);
const fences = (text.match(/^(:::|```\{)/mg) || []);
const cells = [...panel.querySelectorAll('.jp-Cell')];
const collapsed = cells.filter(c => c.classList.contains('jp-CodeCell') &&
  c.querySelector('.jp-InputPlaceholder') &&
  getComputedStyle(c.querySelector('.jp-InputPlaceholder')).display !== 'none')
  .map(c => c.querySelector('.jp-PlaceholderText').innerText);
const tab = [...document.querySelectorAll('.lm-TabBar-tab.lm-mod-current')]
  .find(t => t.innerText.trim() === arguments[1]);
return {markdown: md.length, rendered: rendered.length, raw: raw, fences: fences.length,
        names: glued.filter(k => new RegExp('(^|[^\\w])' + k + '([^\\w]|$)').test(text))
          .concat(evals.filter(k => codes.includes(k))),
        text: text,
        admonitions: panel.querySelectorAll('aside.myst-admonition').length,
        citations: panel.querySelectorAll('.myst cite, .myst [data-cite], .myst a.cite').length,
        unresolved: panel.querySelectorAll('.myst [title="Citation Not Found"]').length,
        code: panel.querySelectorAll('.jp-CodeCell').length, collapsed: collapsed,
        dirty: !!(tab && tab.classList.contains('jp-mod-dirty'))};
"""

_KERNEL_IDLE = """
const w = window.jupyterapp.shell.currentWidget;
return !!(w && w.sessionContext && w.sessionContext.session &&
          w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle');
"""

_BUSY = """
const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
const w = window.jupyterapp.shell.currentWidget;
const k = w && w.sessionContext.session && w.sessionContext.session.kernel;
return (k && k.status !== 'idle') ||
  [...p.querySelectorAll('.jp-InputPrompt')].some(e => e.innerText.includes('*'));
"""

_RUN_ALL = """
const done = arguments[arguments.length - 1];
window.jupyterapp.commands.execute('notebook:run-all-cells').then(() => done('ran'),
                                                                   e => done('error: ' + e));
"""

_SAVE = """
const done = arguments[arguments.length - 1];
window.jupyterapp.commands.execute('docmanager:save').then(() => done('saved'),
                                                            e => done('error: ' + e));
"""


# Every solution cell of the open notebook, as Lab shows it: collapsed or not, and how many of
# its outputs are on screen.
_SOLUTIONS = """
const cells = window.jupyterapp.shell.currentWidget.content.widgets;
return cells.map((c, i) => [c, i]).filter(([c]) => c.model.type === 'code' &&
    (c.model.getMetadata('tags') || []).some(t => arguments[0].includes(t))).map(([c, i]) => ({
  index: i, inputHidden: c.inputHidden, outputHidden: c.outputHidden,
  outputs: c.model.outputs.length,
  shown: [...c.node.querySelectorAll('.jp-OutputArea-output')]
    .filter(e => e.getClientRects().length > 0).length}));
"""


def _open(driver, base: str, path: str, timeout: float, names: list[list[str]]) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/lab/tree/{path}")
    WebDriverWait(driver, timeout).until(ec.presence_of_element_located(
        (By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell, .jp-FileEditor")))
    deadline = time.monotonic() + timeout
    while not driver.execute_script(_KERNEL_IDLE) and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(3)   # let a metadata update after the kernel's start land, if there is one
    while True:     # MyST renders cell by cell; on a busy machine that takes a while
        view = driver.execute_script(_INSPECT, list(RAW_ROLES), Path(path).name, names)
        if view["rendered"] >= view["markdown"] or time.monotonic() > deadline:
            return view
        time.sleep(2)


def _comparable(nb: dict) -> dict:
    """A notebook as Lab keeps it: ``trusted`` is transient, sources as one string."""
    nb = json.loads(json.dumps(nb))
    for cell in nb["cells"]:
        cell["metadata"].pop("trusted", None)
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        for out in cell.get("outputs", []):
            if isinstance(out.get("text"), list):
                out["text"] = "".join(out["text"])
            for mime, value in out.get("data", {}).items():
                if isinstance(value, list):
                    out["data"][mime] = "".join(value)
    return nb


def _differences(before: dict, after: dict) -> list[str]:
    a, b = _comparable(before), _comparable(after)
    found = [f"notebook metadata {k!r} changed" for k in sorted(set(a["metadata"]) |
             set(b["metadata"])) if a["metadata"].get(k) != b["metadata"].get(k)]
    if len(a["cells"]) != len(b["cells"]):
        found.append(f"{len(a['cells'])} cells became {len(b['cells'])}")
    for i, (x, y) in enumerate(zip(a["cells"], b["cells"], strict=False)):
        found += [f"cell {i}: {key} changed" for key in sorted(set(x) | set(y))
                  if x.get(key) != y.get(key)]
    return found


def widget_twins(nb: dict) -> tuple[int, int]:
    """(widget outputs, those with a kernel-free twin) in notebook ``nb``."""
    widgets = [o for c in nb["cells"] for o in c.get("outputs", [])
               if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    twins = [o for o in widgets if "kvlab-kf" in "".join(o["data"].get("text/html", ""))]
    return len(widgets), len(twins)


def check(chapter: str = "notebooks/04-prefix-reuse.md", timeout: float = 180,
          run: bool = True) -> bool:
    from site_check import start_browser

    ipynb = Path(chapter).with_suffix(".ipynb")
    WORK.mkdir(parents=True, exist_ok=True)
    copy, md_copy = WORK / ipynb.name, WORK / Path(chapter).name   # a save cannot touch the book
    shutil.copy2(ROOT / ipynb, copy)
    shutil.copy2(ROOT / chapter, md_copy)
    shutil.copy2(ROOT / "notebooks" / "jupytext.toml", WORK)   # the chapters' Jupytext rules
    subprocess.run([sys.executable, "-m", "jupyter", "trust", str(copy)], check=True,
                   capture_output=True)   # as `make lab` trusts the stored notebooks
    stored = json.loads(copy.read_text())
    solutions = sum(1 for c in stored["cells"] if c["cell_type"] == "code"
                    and SOLUTION_TAGS & set(c["metadata"].get("tags", [])))

    port = free_port()
    server = subprocess.Popen(lab_command(port, check_settings()), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=lab_env())   # as `make lab`
    base = f"http://127.0.0.1:{port}"
    failures: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("jupyter lab did not start") from None
                time.sleep(1)
        driver = start_browser()
        try:
            source = (ROOT / chapter).read_text()
            names = [sorted(set(GLUE_ROLE.findall(source))),
                     sorted(set(EVAL_ROLE.findall(source)))]
            views = {"md": _open(driver, base, str(md_copy.relative_to(ROOT)), timeout, names)}
            failures += _md_saves_unchanged(driver, views["md"], md_copy, ROOT / chapter)
            # the same chapter as a reader whose Python is not the one that executed the book
            other = WORK / "other-python"
            other.mkdir(exist_ok=True)
            shutil.copy2(ROOT / "notebooks" / "jupytext.toml", other)
            (other / "another-python.md.txt").write_text(other_python((ROOT / chapter).read_text()))
            shutil.copy2(other / "another-python.md.txt", other / md_copy.name)
            view = _open(driver, base, str((other / md_copy.name).relative_to(ROOT)), timeout,
                         names)
            failures += [f"md under another Python: {f.split(': ', 1)[1]}" for f in
                         _md_saves_unchanged(driver, view, other / md_copy.name,
                                             other / "another-python.md.txt")]
            views["ipynb"] = _open(driver, base, str(copy.relative_to(ROOT)), timeout, names)
            for name, v in views.items():
                print(f"lab-check: {chapter} ({name}): {v['code']} code cells, "
                      f"{v['rendered']}/{v['markdown']} markdown cells rendered by MyST, "
                      f"{v['admonitions']} admonitions, {v['citations']} citations "
                      f"(+{v['unresolved']} shown as keys: jupyterlab-myst loads no BibTeX), "
                      f"{len(v['raw'])} raw roles, {v['fences']} raw fences, "
                      f"{len(v['names'])} of {sum(map(len, names))} inline values shown as "
                      "their names, "
                      f"{len(v['collapsed'])} collapsed cells, modified: {v['dirty']}")
                if not v["code"]:
                    failures.append(f"{name}: did not open as a notebook")
                if v["rendered"] < v["markdown"]:
                    failures.append(f"{name}: {v['markdown'] - v['rendered']} markdown cells "
                                    "not rendered by MyST (is jupyterlab-myst installed?)")
                if v["raw"] or v["fences"]:
                    failures.append(f"{name}: raw MyST shown: {sorted(set(v['raw']))} "
                                    f"{v['fences']} fences")
                if not v["admonitions"]:
                    failures.append(f"{name}: no admonition rendered")
            if "{cite" in source:
                failures += [f"{name}: the chapter cites, but no citation is rendered"
                             for name, v in views.items()
                             if not v["citations"] + v["unresolved"]]
            ipv = views["ipynb"]
            failures += _values_shown("ipynb", ipv, stored)
            if ipv["dirty"]:
                failures.append("ipynb: opened already marked modified")
            for name in ("md", "ipynb"):
                view = views[name]
                labelled = [t for t in view["collapsed"]
                            if t.lstrip().startswith("# Solution")]
                if len(labelled) < solutions:
                    failures.append(f"{name}: {solutions} solution cells, "
                                    f"{len(view['collapsed'])} collapsed, {len(labelled)} "
                                    f"labelled 'Solution': {view['collapsed'][:3]}")
            saved = driver.execute_async_script(_SAVE)
            time.sleep(2)
            if saved != "saved":
                failures.append(f"ipynb: save from Lab failed ({saved})")
            else:
                diff = _differences(stored, json.loads(copy.read_text()))
                if diff:
                    failures.append(f"ipynb: saving from Lab changed it: {diff[:6]}")
                else:
                    print(f"lab-check: {ipynb.name} saved from Lab unchanged")
            if run:
                failures += _run_all_and_save(driver, copy, timeout, stored, names)
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)
    for failure in failures:
        print(f"lab-check FAIL: {failure}")
    return not failures


def shown_values(nb: dict) -> dict[str, str]:
    """``{expression: text}`` that jupyterlab-myst shows for the stored ``user_expressions`` of
    notebook ``nb`` (a text/plain result without its quotes, as its plain-text renderer)."""
    values = {}
    for cell in nb["cells"]:
        for entry in cell["metadata"].get("user_expressions", []):
            text = "".join(entry["result"].get("data", {}).get("text/plain", ""))
            values.setdefault(entry["expression"], re.sub(r"""^(["'])(.*)\1$""", r"\2", text))
    return values


def _values_shown(name: str, view: dict, nb: dict) -> list[str]:
    """Step 3: no glued value or ``{eval}`` role shown as its name, and every value that the
    stored ``user_expressions`` hold shown in the text."""
    found = []
    if view["names"]:
        found.append(f"{name}: {len(view['names'])} inline values shown as their names, not "
                     f"their values: {view['names'][:6]}")
    roles = [e for c in nb["cells"] if c["cell_type"] == "markdown"
             for e in EVAL_ROLE.findall("".join(c["source"]))]
    values = shown_values(nb)
    if set(roles) - set(values):
        found.append(f"{name}: {{eval}} roles without a stored value (run "
                     f"tools/inline_values.py): {sorted(set(roles) - set(values))[:6]}")
    missing = sorted(k for k, text in values.items() if text not in view["text"])
    if missing:
        found.append(f"{name}: stored values not shown: {[(k, values[k]) for k in missing][:6]}")
    elif values:
        print(f"lab-check: {name}: {len(roles)} inline values shown as numbers "
              f"({', '.join(f'{k}={values[k]}' for k in sorted(values)[:4])}, ...)")
    return found


def _md_saves_unchanged(driver, view: dict, md_copy: Path, source: Path) -> list[str]:
    """Step 4 for the MyST source: not marked modified when opened, saved back byte for byte."""
    found = ["md: opened already marked modified"] if view["dirty"] else []
    saved = driver.execute_async_script(_SAVE)
    time.sleep(2)
    if saved != "saved":
        return [*found, f"md: save from Lab failed ({saved})"]
    if md_copy.read_bytes() != source.read_bytes():
        pairs = zip(source.read_text().splitlines(), md_copy.read_text().splitlines(),
                    strict=False)
        lines = [f"{i + 1}: {a!r} -> {b!r}" for i, (a, b) in enumerate(pairs) if a != b]
        return [*found, f"md: saving from Lab changed it: {lines[:3] or 'its length'}"]
    print(f"lab-check: {source.name} saved from Lab unchanged")
    return found


def _run_all_and_save(driver, copy: Path, timeout: float, stored: dict,
                      names: list[list[str]]) -> list[str]:
    """Step 6: Run All in Lab, save, and look at the saved widget outputs and at the values
    the kernel computed for the ``{eval}`` roles."""
    started = time.monotonic()
    deadline = started + 10 * timeout
    # the command's promise settles when every cell has run: a long chapter on a busy machine
    # outlasts the script timeout and the driver's 120 s HTTP timeout
    driver.set_script_timeout(10 * timeout)
    driver.command_executor.client_config.timeout = 10 * timeout
    ran = driver.execute_async_script(_RUN_ALL)
    time.sleep(5)
    while driver.execute_script(_BUSY) and time.monotonic() < deadline:
        time.sleep(2)
    if ran != "ran" or driver.execute_script(_BUSY):
        return [f"ipynb: Run All did not finish ({ran})"]
    shown = driver.execute_script(_SOLUTIONS, sorted(SOLUTION_TAGS))
    saved = driver.execute_async_script(_SAVE)
    time.sleep(2)
    if saved != "saved":
        return [f"ipynb: save after Run All failed ({saved})"]
    nb = json.loads(copy.read_text())
    errors = [f"cell {i}: {o.get('ename')}" for i, c in enumerate(nb["cells"])
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    widgets, twins = widget_twins(nb)
    print(f"lab-check: Run All in {time.monotonic() - started:.0f} s, {len(errors)} errors; "
          f"saved: {twins} of {widgets} widget outputs carry their kernel-free twin")
    found = [f"ipynb: Run All raised in {', '.join(errors[:3])}"] if errors else []
    computed, kept = shown_values(nb), shown_values(stored)
    changed = sorted(k for k in set(computed) | set(kept) if computed.get(k) != kept.get(k))
    if changed:
        pairs = [(k, kept.get(k), computed.get(k)) for k in changed]
        found.append("ipynb: after Run All the kernel's values for the {eval} roles differ "
                     f"from the stored ones (name, stored, computed): {pairs[:4]}")
    view = driver.execute_script(_INSPECT, list(RAW_ROLES), copy.name, names)
    found += _values_shown("ipynb after Run All", view, nb)
    found += solutions_kept_collapsed(shown, nb)
    if twins < widgets:
        found.append(f"ipynb: saved after Run All, {widgets - twins} of {widgets} widget "
                     "outputs lost their kernel-free twin (the site would show no widget)")
    return found


def solutions_kept_collapsed(shown: list[dict], nb: dict) -> list[str]:
    """Step 7: ``shown`` (each solution cell as Lab showed it after Run All, from
    ``_SOLUTIONS``) and the notebook ``nb`` saved after it: every solution collapsed, outputs
    hidden and none on screen, every one run, and stored collapsed with its outputs."""
    stored = {i: c for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
              and SOLUTION_TAGS & set(c["metadata"].get("tags", []))}
    found = []
    if [s["index"] for s in shown] != sorted(stored):
        found.append(f"solution cells in Lab {[s['index'] for s in shown]}, in the saved "
                     f"notebook {sorted(stored)}")
    open_ = [s["index"] for s in shown if not s["inputHidden"]]
    visible = [s["index"] for s in shown if not s["outputHidden"] or s["shown"]]
    unrun = [i for i, c in stored.items() if not c.get("outputs")]
    unsaved = [i for i, c in stored.items() if c["metadata"].get("jupyter") != {
        "source_hidden": True, "outputs_hidden": True}]
    if open_:
        found.append(f"after Run All, solution cells {open_} are no longer collapsed")
    if visible:
        found.append(f"after Run All, the outputs of solution cells {visible} are shown")
    if unrun:
        found.append(f"solution cells {unrun} have no output after Run All (did they run?)")
    if unsaved:
        found.append(f"saved after Run All, solution cells {unsaved} lost "
                     "jupyter.source_hidden/outputs_hidden (they would open expanded)")
    if not found:
        print(f"lab-check: after Run All and a save all {len(shown)} solution cells are "
              f"collapsed with their outputs hidden ({sum(s['outputs'] for s in shown)} "
              "outputs, none on screen) and stored collapsed")
    return found


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    argv = sys.argv[1:] if argv is None else argv
    run = "--no-run" not in argv
    argv = [a for a in argv if a != "--no-run"]
    try:
        return 0 if check(*argv[:1], run=run) else 1
    except RuntimeError as exc:
        print(f"lab-check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
