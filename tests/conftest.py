"""Shared test setup: every test starts with no exercise prediction recorded, and none is
written to the working directory (the record's file is pointed at the test's own folder)."""

import pytest

from kvlab.exercises import _common


@pytest.fixture(autouse=True)
def _fresh_prediction_record(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "_PREDICTION_FILE", tmp_path / ".kvlab-predictions.json")
    _common._PREDICTIONS.clear()
    yield
    _common._PREDICTIONS.clear()


def new_reader() -> None:
    """Within a test, a reader who has predicted nothing yet: the record emptied in memory and
    in its file (which would otherwise bring a kernel's earlier predictions back)."""
    _common._PREDICTIONS.clear()
    if _common._PREDICTION_FILE is not None:
        _common._PREDICTION_FILE.unlink(missing_ok=True)
