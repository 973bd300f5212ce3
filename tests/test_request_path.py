"""The reader's path: which kvlab modules a default ``LLM.generate`` runs after construction.

Issue 24's bound, 14 modules and 3,500 lines (README, "Layout"): a change that puts more
modules or lines on the default path fails here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import kvlab

MAX_MODULES = 14
MAX_LINES = 3500


def test_default_generate_runs_a_bounded_set_of_modules():
    from kvlab import LLM, SamplingParams
    from kvlab.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():    # without the compiled kernel, decode takes the torch path
        pytest.skip(f"the CPU attention kernel did not build: {cpu_kernels.build_error()}")
    root = os.path.dirname(kvlab.__file__)
    llm = LLM("kvlab-tiny")
    seen: dict[str, None] = {}

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.setdefault(frame.f_code.co_filename)

    sys.settrace(trace)
    try:
        outs = llm.generate(["Trern Thyvet was a generous shepherd who lived in", "The river"],
                            SamplingParams(max_tokens=16, temperature=0.8, seed=1),
                            use_tqdm=False)
    finally:
        sys.settrace(None)
    assert len(outs) == 2 and all(o.finished and o.outputs[0].token_ids for o in outs)
    lines = {os.path.relpath(f, root): len(Path(f).read_text().splitlines()) for f in seen}
    for name, n in lines.items():
        print(f"{n:5d}  kvlab/{name}")
    total = sum(lines.values())
    print(f"{len(lines)} modules, {total} lines")
    # labs stay off the default path: no log, no observers, no faults, no snapshots
    assert not {n for n in lines if n.startswith(("disagg/", "invariants/", "faults/"))}
    for lab in ("core/event_log.py",
                "engine/snapshot.py", "core/spec_plan.py", "core/production_scheduler.py",
                "core/paging.py", "core/checks.py",
                "kernels/cpu.py", "core/kv_snapshot.py"):
        assert lab not in lines, f"{lab} runs on a default generate"
    assert len(lines) <= MAX_MODULES and total <= MAX_LINES, (len(lines), total)
