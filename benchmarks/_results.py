"""Where the benchmarks write their numbers: ``benchmarks/results/<name>.json``.

Every ``bench_*.py`` script ends by calling :func:`write_results` with its topic and a plain
JSON-serialisable dict, so all result files share one location and one format (2-space
indentation, trailing newline). Imported by the scripts as ``from _results import
write_results``: running ``python benchmarks/bench_x.py`` puts this folder on ``sys.path``.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_results(name: str, result: dict, *, directory: Path | None = None) -> Path:
    """Write ``result`` as JSON to ``<directory>/<name>.json`` and print where it went.

    ``directory`` defaults to ``benchmarks/results`` and is created if missing. ``name`` is the
    file's stem (``"allocator"``, not ``"allocator.json"`` or a path). The result is serialised
    before anything on disk is touched, so a name or a value that cannot be written raises
    (``ValueError`` / ``TypeError``) and leaves no file or folder behind. Returns the path.
    """
    if not name or name in (".", "..") or Path(name).name != name or name.endswith(".json"):
        raise ValueError(f"result name must be a bare file stem like 'allocator', got {name!r}")
    text = json.dumps(result, indent=2) + "\n"
    path = (RESULTS_DIR if directory is None else Path(directory)) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return path
