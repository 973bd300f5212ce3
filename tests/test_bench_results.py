"""benchmarks/_results.py: where and how every benchmark writes its JSON; and the committed
attention results (which benchmarks/README.md quotes) agree with themselves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load():
    # The scripts import it as a top-level module (their folder is sys.path[0]); load it the same
    # way by path, without putting benchmarks/ on sys.path for the rest of the test session.
    spec = importlib.util.spec_from_file_location("_results", BENCHMARKS / "_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results = _load()


def test_default_folder_is_benchmarks_results():
    assert results.RESULTS_DIR == BENCHMARKS / "results"


def test_writes_json_creates_folder_and_prints_path(tmp_path, capsys):
    folder = tmp_path / "nested" / "results"
    data = {"benchmark": "demo", "rows": [{"x": 1, "ratio": 2.5}], "nested": {"ok": True}}
    path = results.write_results("demo", data, directory=folder)
    assert path == folder / "demo.json"
    text = path.read_text()
    assert json.loads(text) == data
    assert text.endswith("}\n") and '\n  "rows": [' in text      # 2-space indent, final newline
    assert capsys.readouterr().out == f"wrote {path}\n"
    results.write_results("demo", {"again": 1}, directory=folder)  # overwrites in place
    assert json.loads(path.read_text()) == {"again": 1}


def test_default_directory_follows_results_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "r")
    path = results.write_results("topic", {"a": 1})
    assert path == tmp_path / "r" / "topic.json" and json.loads(path.read_text()) == {"a": 1}


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "topic.json"])
def test_bad_name_raises_and_writes_nothing(tmp_path, name):
    folder = tmp_path / "out"
    with pytest.raises(ValueError, match="bare file stem"):
        results.write_results(name, {"a": 1}, directory=folder)
    assert not folder.exists()


def test_unserialisable_result_raises_before_touching_disk(tmp_path):
    folder = tmp_path / "out"
    with pytest.raises(TypeError):
        results.write_results("topic", {"a": object()}, directory=folder)
    assert not folder.exists()
    existing = folder / "topic.json"
    folder.mkdir()
    existing.write_text("{}\n")
    with pytest.raises(TypeError):
        results.write_results("topic", {"a": {1, 2}}, directory=folder)
    assert existing.read_text() == "{}\n"                          # the old file is untouched


def _committed(name: str) -> dict:
    return json.loads((results.RESULTS_DIR / f"{name}.json").read_text())


def test_committed_decode_attention_results_are_consistent():
    """benchmarks/README.md's decode-attention figures come from this file: every path's
    output within the run's tolerance of float64, and each ratio the quotient of the times it
    names."""
    r = _committed("decode_attention")
    assert r["benchmark"] == "decode_attention" and r["torch_threads"] == 1 and r["cases"]
    for c in r["cases"]:
        ms = c["ms_per_call"]
        assert set(ms) == set(c["max_abs_diff_vs_float64"]) == set(c["wall_ms_per_call"])
        assert {"torch", "buckets", "buckets_fresh"} <= set(ms)
        assert ("compiled" in ms) == r["compiled_kernel"]
        assert max(c["max_abs_diff_vs_float64"].values()) <= r["tolerance"], c["name"]
        assert c["buckets_vs_torch"] == pytest.approx(ms["torch"] / ms["buckets"])
        if r["compiled_kernel"]:
            assert c["compiled_vs_torch"] == pytest.approx(ms["torch"] / ms["compiled"])
            assert c["compiled_vs_buckets"] == pytest.approx(ms["buckets"] / ms["compiled"])
        pad = c["padded_positions"]
        assert pad["context"] <= pad["buckets"] <= pad["torch"]   # buckets pad less, never more
    assert any(c["context_min"] < c["context_max"] for c in r["cases"])   # a ragged case


def test_committed_verify_attention_results_are_consistent():
    r = _committed("verify_attention")
    assert r["benchmark"] == "verify_attention" and r["torch_threads"] == 1 and r["rows"]
    for row in r["rows"]:
        assert row["rows"] == row["requests"] * (row["k"] + 1)
        assert max(row["max_abs_diff_vs_float64"].values()) <= r["tolerance"]
        assert ("compiled" in row["ms"]) == r["compiled_kernel"]
        assert set(row["ms"]) == set(row["wall_ms"]) == set(row["max_abs_diff_vs_float64"])
        for key in ("torch_vs_per_request", "compiled_vs_per_request", "compiled_vs_torch"):
            v = row[key]
            assert v is None or v["min"] <= v["median"] <= v["max"], key
    assert r["engine"] and all(e["identical_outputs"] for e in r["engine"])
    for e in r["engine"]:
        for key in ("target_speedup", "tokens_per_cpu_s_speedup"):
            assert e[f"{key}_min"] <= e[f"{key}_median"] <= e[f"{key}_max"], key
