"""Seal the exercises' answers: compute each truth with the instructor edition
(``course/answers.py``) and write ``kvlab/exercises/sealed_answers.json``, which the checks read.

    python tools/seal_answers.py --write    # after changing kvlab or an exercise
    python tools/seal_answers.py --check    # exit 1 and name each drifted answer

The output is deterministic (each salt is derived from its key), so a truth that changes shows
as a changed line in review, and ``--check`` (``tests/test_sealed_answers.py``) fails when the
committed seals no longer match what kvlab computes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEALED_FILE = ROOT / "kvlab" / "exercises" / "sealed_answers.json"
ANSWERS_FILE = ROOT / "course" / "answers.py"

def load_answers():
    """The instructor module ``course/answers.py`` (not part of the installed package)."""
    if not ANSWERS_FILE.exists():
        raise SystemExit(f"{ANSWERS_FILE} is missing: sealing needs the instructor edition")
    spec = importlib.util.spec_from_file_location("kvlab_course_answers", ANSWERS_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def compute() -> dict:
    """Every truth of the instructor edition, computed: ``{key: Truth}``."""
    return {key: fn() for key, fn in sorted(load_answers().TRUTHS.items())}


def render(truths: dict | None = None) -> str:
    """The text of ``sealed_answers.json`` for ``truths`` (default: :func:`compute`): one
    key per line, ``[salt, digest, encoded number, encrypted facts, {option id: verdict}]``
    (``null`` where absent), so a drifted truth is one changed line in review."""
    from kvlab.exercises._common import seal

    truths = compute() if truths is None else truths
    lines = []
    for key in sorted(truths):
        t = truths[key]
        s = seal(key, t.answer, number=t.number, reveal=t.reveal or None,
                 notes=t.notes or None)
        entry = [s.salt, s.digest, s.number, s.reveal, s.notes or None]
        lines.append(f"{json.dumps(key)}: {json.dumps(entry, sort_keys=True)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def drifted(text: str, committed: str) -> list[str]:
    """The keys whose entry differs between two renderings (added and removed ones too)."""
    new, old = json.loads(text), json.loads(committed)
    return sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the sealed answers")
    mode.add_argument("--check", action="store_true", help="fail on a drifted answer")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        SEALED_FILE.write_text(text)
        print(f"sealed {len(json.loads(text))} answers into {SEALED_FILE.relative_to(ROOT)}")
        return 0
    committed = SEALED_FILE.read_text() if SEALED_FILE.exists() else "{}"
    changed = drifted(text, committed)
    if changed:
        print("sealed answers drifted from what kvlab computes (run tools/seal_answers.py "
              "--write and review): " + ", ".join(changed))
        return 1
    print("sealed answers match the instructor edition")
    return 0


if __name__ == "__main__":
    sys.exit(main())
