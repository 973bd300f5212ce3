"""Chapter 10 exercise checks: right answers pass, wrong ones say what is wrong, not the answer."""

from __future__ import annotations

import pytest

from kvlab.disagg.entry import check_delivery
from kvlab.exercises._common import NotYetAnswered
from kvlab.exercises.ch10 import (
    INSTALL_STEPS,
    check_classification,
    check_install_order,
    check_transfer_ms,
    classify_entries,
)


def test_transfer_ms():
    # K and V, 80 layers, 8 KV heads of 128, 1 byte each, a quarter of the heads per GPU
    truth = 1e3 * (10e-6 + 2 * 80 * 4096 * 8 * 128 * 1 / 4 / 50e9)
    assert "Correct" in check_transfer_ms(truth * 1.01)
    for wrong in (truth * 8, truth * 2, truth * 4):   # query heads; bf16; the whole model's KV
        with pytest.raises(AssertionError, match="too high") as err:
            check_transfer_ms(wrong)
        assert str(err.value).endswith("too high")    # the direction, and nothing else
        assert f"{truth:.2f}" not in str(err.value)
    with pytest.raises(AssertionError, match="too low"):
        check_transfer_ms(truth / 2)            # K only
    with pytest.raises(AssertionError, match="positive"):
        check_transfer_ms(-1)
    with pytest.raises(NotYetAnswered):
        check_transfer_ms(...)


def test_classification():
    entries, expected = classify_entries()
    truth = [check_delivery(d, expected) for d in entries]
    assert None not in truth and len(set(truth)) == 5
    assert "Correct" in check_classification(truth)
    one_wrong = ["corrupt_descriptor", *truth[1:]]
    two_wrong = [truth[1], truth[0], *truth[2:]]
    messages = set()
    for answer in (one_wrong, two_wrong):
        with pytest.raises(AssertionError, match="not every kind is right") as err:
            check_classification(answer)
        messages.add(str(err.value))
        assert "[" not in str(err.value)                  # no list of entry indices
        for kind in truth:                                 # never names a right kind
            assert kind not in str(err.value)
    # one wrong and two wrong read the same: no count to search entry by entry
    assert len(messages) == 1
    with pytest.raises(AssertionError, match="not a kind"):
        check_classification(["checksum", *truth[1:]])
    with pytest.raises(AssertionError, match="installs none"):
        check_classification([None, *truth[1:]])
    with pytest.raises(AssertionError, match="one kind per entry"):
        check_classification(truth[:3])


KVLAB = ["record begin", "allocate", "record allocated", "write payload", "record written",
         "commit to cache", "record committed"]


@pytest.mark.parametrize("order,match", [
    (["allocate", "record begin", *KVLAB[2:]], "leaks the table"),
    (["record begin", "allocate", "record allocated", "commit to cache", "write payload",
      "record written", "record committed"], "half-written"),
    ([*KVLAB[:5], "record committed", "commit to cache"], "has not happened yet"),
    # the journal claims 'written' before the write: a crash in between leaves a lie
    (["record begin", "allocate", "record allocated", "record written", "write payload",
      "commit to cache", "record committed"], "has not happened yet"),
    (["record begin", "record allocated", "allocate", *KVLAB[3:]], "has not happened yet"),
    ([*KVLAB[:4], "commit to cache", "record written", "record committed"],
     "reads the journal wrongly"),
    (["write payload", *[s for s in KVLAB if s != "write payload"]], "no blocks"),
    (KVLAB[:6], "exactly once"),
    (KVLAB, "kvlab's own order"),
])
def test_install_order_design(order, match):
    with pytest.raises(AssertionError, match=match):
        check_install_order(order)


def test_install_order_accepts_every_safe_order():
    assert sorted(INSTALL_STEPS) == list(INSTALL_STEPS) != KVLAB   # printed: not an answer
    with pytest.raises(AssertionError):
        check_install_order(INSTALL_STEPS)
    # the 'allocated' record may come after the write: a crash between leaves 'begin', which
    # names the operation, so recovery still frees the table
    alt = ["record begin", "allocate", "write payload", "record allocated", "record written",
           "commit to cache", "record committed"]
    assert "Correct" in check_install_order(alt)
    # records out of the protocol's order: kvlab's own recovery refuses such a journal as
    # corrupt (a simulation of the rule alone accepted this order)
    late = ["record begin", "allocate", "write payload", "record written", "commit to cache",
            "record allocated", "record committed"]
    with pytest.raises(AssertionError, match="refuses as corrupt"):
        check_install_order(late)
    # every accepted order leaves nothing held and a journal recovery reads, at every crash
    from kvlab.exercises.ch10 import _run_install
    for crash in range(len(alt) + 1):
        st = _run_install(alt, crash)
        assert not st["refused"] and not st["leaked"]
        assert st["installed"] == (st["committed"] and st["written"])


def test_colleague_check_installs_exactly_one_damaged_entry():
    from kvlab.exercises.ch10 import (
        DAMAGE_KINDS,
        check_colleague,
        colleague_check,
        damaged_entries,
    )

    entries, expected = damaged_entries()
    assert set(entries) == set(DAMAGE_KINDS)
    assert all(check_delivery(d, expected) is not None for d in entries.values())
    passed = [k for k, d in entries.items() if colleague_check(d, expected) is None]
    assert len(passed) == 1
    assert check_colleague(passed[0]).startswith("Correct")
    for kind in DAMAGE_KINDS:
        if kind != passed[0]:
            with pytest.raises(AssertionError, match="refuses") as err:
                check_colleague(kind)
            assert passed[0] not in str(err.value)          # never names the right one
            assert "every entry" not in str(err.value)      # nor the method
    with pytest.raises(AssertionError, match="one of"):
        check_colleague("checksum")
    with pytest.raises(NotYetAnswered):
        check_colleague(...)
