"""Chapter 10 exercise checks: right answers pass, wrong ones say what is wrong, not the answer."""

from __future__ import annotations

import pytest

from kvlab.core.kv_transfer import check_delivery
from kvlab.exercises._common import NotYetAnswered
from kvlab.exercises.ch10 import (
    INSTALL_STEPS,
    check_classification,
    check_install_order,
    check_transfer_ms,
    classify_entries,
)


def test_transfer_ms():
    truth = 1e3 * (10e-6 + 2 * 80 * 4096 * 8 * 128 * 2 / 50e9)
    assert "Correct" in check_transfer_ms(truth * 1.01)
    with pytest.raises(AssertionError, match="too high") as err:
        check_transfer_ms(truth * 8)            # query heads instead of KV heads
    assert f"{truth:.2f}" not in str(err.value)
    with pytest.raises(AssertionError, match="too low"):
        check_transfer_ms(truth / 2)            # K only
    with pytest.raises(NotYetAnswered):
        check_transfer_ms(...)


def test_classification():
    entries, expected = classify_entries()
    truth = [check_delivery(d, expected) for d in entries]
    assert None not in truth and len(set(truth)) == 5
    assert "Correct" in check_classification(truth)
    with pytest.raises(AssertionError, match=r"entries \[0\]"):
        check_classification(["corrupt_descriptor", *truth[1:]])
    with pytest.raises(AssertionError, match="one kind per entry"):
        check_classification(truth[:3])


@pytest.mark.parametrize("order,match", [
    (["allocate", "record begin", *INSTALL_STEPS[2:]], "leaks the table"),
    (["record begin", "allocate", "record allocated", "commit to cache", "write payload",
      "record written", "record committed"], "half-written"),
    ([*INSTALL_STEPS[:5], "record committed", "commit to cache"], "reads the journal wrongly"),
    (["write payload", *[s for s in INSTALL_STEPS if s != "write payload"]], "no blocks"),
    (INSTALL_STEPS[:6], "exactly once"),
])
def test_install_order_design(order, match):
    with pytest.raises(AssertionError, match=match):
        check_install_order(order)


def test_install_order_accepts_every_safe_order():
    assert "Correct" in check_install_order(INSTALL_STEPS)
    # the 'allocated' record may come after the write: a crash between leaves 'begin', which
    # names the operation, so recovery still frees the table
    alt = ["record begin", "allocate", "write payload", "record allocated", "record written",
           "commit to cache", "record committed"]
    assert "Correct" in check_install_order(alt)
