"""Start JupyterLab the way ``make lab`` does and check, in headless Chromium, that a chapter's
``.md`` source opens as a notebook (the shipped ``.jupyter/lab/settings/overrides.json`` makes
Jupytext Notebook the default viewer for Markdown).

    python tools/lab_check.py [notebooks/04-prefix-reuse.md]

Exit status 0 when the file opens in a notebook panel with code cells, 1 when it opens as text
(or not at all), 2 when no browser or server can be started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = Path(os.environ.get("KVLAB_LAB_SETTINGS", ROOT / ".jupyter" / "lab" / "settings"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_command(port: int) -> list[str]:
    """The server ``make lab`` starts, headless and without a token, on ``port``."""
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=",
           f"--LabApp.app_settings_dir={SETTINGS}", f"--ServerApp.root_dir={ROOT}"]
    if hasattr(os, "getuid") and os.getuid() == 0:
        cmd.append("--allow-root")
    return cmd


def check(chapter: str = "notebooks/04-prefix-reuse.md", timeout: float = 120) -> bool:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
    from site_check import start_browser

    port = free_port()
    server = subprocess.Popen(lab_command(port), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
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
            driver.get(f"{base}/lab/tree/{chapter}")
            wait = WebDriverWait(driver, timeout)
            panel = wait.until(ec.presence_of_element_located(
                (By.CSS_SELECTOR, ".jp-NotebookPanel, .jp-FileEditor")))
            time.sleep(3)
            kind = "notebook" if "jp-NotebookPanel" in panel.get_attribute("class") else "text"
            cells = len(driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-CodeCell"))
            print(f"lab-check: {chapter} opened as {kind} ({cells} code cells)")
            return kind == "notebook" and cells > 0
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    argv = sys.argv[1:] if argv is None else argv
    try:
        return 0 if check(*argv[:1]) else 1
    except RuntimeError as exc:
        print(f"lab-check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
