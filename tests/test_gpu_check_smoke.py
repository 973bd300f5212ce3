"""benchmarks/gpu_check.py runs end to end before it reaches a GPU: ``--smoke`` takes every
section through the same code on CPU (a tiny model, Triton under its interpreter, the CUDA
graphs' CPU stand-in) and writes the JSON; without a GPU and without ``--smoke`` it exits 2
with a clear message. (GPU time is scarce: the device run must not die on a trivial error.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="the smoke run needs triton and transformers (the dev extra)")
def test_smoke_run_covers_every_section(tmp_path):
    proc = run("--smoke", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["complete"] and result["smoke"]
    for key in ("fused_ops_vs_torch", "decode", "decode_async", "decode_eager",
                "hf_parity_cuda", "hf_parity_cuda_async", "triton_vs_torch", "profile"):
        assert "error" not in result[key] and "skipped" not in result[key], (key, result[key])
    graphs, eager = result["decode"], result["decode_eager"]
    assert graphs["graph_sizes"] == [1, 2, 3] and eager["graph_sizes"] is None
    for b in ("1", "3"):
        assert graphs["batches"][b]["graph_replays_per_step"] == 1.0
        assert eager["batches"][b]["graph_replays_per_step"] == 0.0
        for key, engine in (("decode", graphs), ("decode_eager", eager)):   # profiled last
            assert "profile_error" not in engine["batches"][b]
            assert engine["batches"][b]["step_ms_profiled"] > 0
            assert "kernel_launches_per_step" in engine["batches"][b]
            assert set(result["profile"][key][b]) >= {"gpu_busy_ms_per_step",
                                                      "kernel_launches_per_step"}
            assert "bytes_per_step" not in result["profile"][key][b]   # the timing's own
        assert graphs["batches"][b]["tokens_per_s"] > 0
    assert result["hf_parity_cuda"]["graph_replays"] > 0
    assert result["fused_ops_vs_torch"]["ok"] and result["hf_parity_cuda"]["ok"]
    assert result["ok"] and set(result["targets"]) >= {"busy_ge_85pct", "step_le_4ms_at_64",
                                                       "batch1_ge_5x", "overlap_on"}
    # overlap on: the same graphs, steps timed back to back, the same targets, parity with HF
    overlap = result["decode_async"]
    assert overlap["async_scheduling"] and overlap["graph_sizes"] == [1, 2, 3]
    for b in ("1", "3"):
        row = overlap["batches"][b]
        assert row["graph_replays_per_step"] == 1.0 and row["steady_step_ms"] > 0
        assert "gpu_busy_ms_per_step" in result["profile"]["decode_async"][b]
    assert result["hf_parity_cuda_async"]["async_scheduling"]
    assert result["hf_parity_cuda_async"]["ok"] and result["hf_parity_cuda_async"]["positions"]
    assert set(result["targets"]["overlap_on"]) >= {"busy_ge_85pct", "step_le_4ms_at_64",
                                                    "batch1_ge_committed_graphs"}
    assert "wrote" in proc.stdout and "done in" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run")
def test_without_a_gpu_it_exits_2_and_says_why(tmp_path):
    proc = run("--out", str(tmp_path), timeout=300)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--smoke" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_decode_profile_smoke_run_writes_phases_and_host_functions(tmp_path):
    script = REPO / "benchmarks" / "profile_gpu_decode.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_decode_profile.json").read_text())
    for rows in (result["batches"], result["eager"]["batches"]):
        assert set(rows) == {"1", "3"}
        for r in rows.values():
            phases = r["host_ms_per_step_by_phase"]
            assert set(phases) == {"schedule", "metadata", "forward", "sampling", "output",
                                   "step"}
            assert phases["forward"] > 0 and phases["step"] >= phases["forward"]
            assert r["host_functions"] and all(f["own_ms_per_step"] >= 0
                                               for f in r["host_functions"])
