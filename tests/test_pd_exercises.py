"""Chapter 10 exercise checks: right answers pass, wrong ones say what is wrong, not the answer."""

from __future__ import annotations

import pytest

from kvlab.disagg.entry import check_delivery
from kvlab.exercises import _common
from kvlab.exercises._common import NotYetAnswered
from kvlab.exercises.ch10 import (
    INSTALL_STEPS,
    check_classification,
    check_install_orders,
    check_transfer,
    classify_entries,
)


def _answers():
    """The instructor edition (``course/answers.py``), where the install harness lives: the
    package the reader has holds only the sealed set of safe orders."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import seal_answers

    return seal_answers.load_answers()


def new_session():
    """A fresh notebook session in a fresh folder: no prediction recorded."""
    _common._PREDICTIONS.clear()
    _common._PREDICTION_FILE.unlink(missing_ok=True)


def test_transfer_pair_is_judged_together_without_a_direction():
    # K and V, 80 layers, 8 KV heads of 128, 1 byte each, a quarter of the heads per GPU
    nbytes = 2 * 80 * 4096 * 8 * 128 * 1 / 4
    mb, ms = nbytes / 1e6, 1e3 * (10e-6 + nbytes / 50e9)
    assert "Correct" in check_transfer(mb * 1.01, ms * 0.99)
    verdicts = set()
    # query heads; bf16; the whole model's KV; K only: each wrong by bytes, either way
    for factor in (8, 2, 4, 0.5):
        with pytest.raises(AssertionError, match="bytes are not right") as err:
            check_transfer(mb * factor, ms * factor)
        verdicts.add(str(err.value))
        assert "too" not in str(err.value) and f"{ms:.2f}" not in str(err.value)
    assert len(verdicts) == 1                   # above and below read the same
    for wrong_ms in (ms * 8, ms / 1000, ms * 1000):   # bits for bytes; seconds; microseconds
        with pytest.raises(AssertionError, match="time is not") as err:
            check_transfer(mb, wrong_ms)
        assert "too" not in str(err.value)
    with pytest.raises(AssertionError, match="positive"):
        check_transfer(-1, ms)
    with pytest.raises(AssertionError, match="a number"):
        check_transfer(mb, "3 ms")
    with pytest.raises(NotYetAnswered):
        check_transfer(mb, ...)


def test_classification():
    entries, expected = classify_entries()
    truth = [check_delivery(d, expected) for d in entries]
    assert None not in truth and len(set(truth)) == 4
    # each entry carries two faults; the kind is the first check, in the consumer's order,
    # that sees one of them (neither fault alone decides: see the chapter's one-fault table)
    assert truth == ["corrupt_descriptor", "incompatible", "truncated", "security_domain",
                     "security_domain"]
    assert "Correct" in check_classification(truth)
    one_wrong = ["truncated", *truth[1:]]
    two_wrong = [truth[1], truth[0], *truth[2:]]
    messages = set()
    for answer in (one_wrong, two_wrong):
        new_session()
        with pytest.raises(AssertionError, match="not every kind is right") as err:
            check_classification(answer)
        messages.add(str(err.value))
        assert "[" not in str(err.value)                  # no list of entry indices
        for kind in truth:                                 # never names a right kind
            assert kind not in str(err.value)
    # one wrong and two wrong read the same: no count to search entry by entry
    assert len(messages) == 1
    # and the prediction is graded once: the truth after it is not graded
    assert "not right" in check_classification(truth)
    new_session()
    with pytest.raises(AssertionError, match="not a kind"):
        check_classification(["checksum", *truth[1:]])
    with pytest.raises(AssertionError, match="installs none"):
        check_classification([None, *truth[1:]])
    with pytest.raises(AssertionError, match="one kind per entry"):
        check_classification(truth[:3])


KVLAB = ["record begin", "allocate", "record allocated", "write payload", "record written",
         "commit to cache", "record committed"]


ALT = ["record begin", "allocate", "write payload", "record allocated", "record written",
       "commit to cache", "record committed"]


@pytest.mark.parametrize("order,match", [
    (["allocate", "record begin", *KVLAB[2:]], "leaked table"),
    (["record begin", "allocate", "record allocated", "commit to cache", "write payload",
      "record written", "record committed"], "half-written"),
    ([*KVLAB[:5], "record committed", "commit to cache"], "has not happened"),
    # the journal claims 'written' before the write: a crash in between leaves a lie
    (["record begin", "allocate", "record allocated", "record written", "write payload",
      "commit to cache", "record committed"], "has not happened"),
    (["record begin", "record allocated", "allocate", *KVLAB[3:]], "has not happened"),
    ([*KVLAB[:4], "commit to cache", "record written", "record committed"],
     "reads the journal wrongly"),
    (["write payload", *[s for s in KVLAB if s != "write payload"]], "no blocks"),
    # records out of the protocol's order: kvlab's own recovery refuses such a journal as
    # corrupt (a simulation of the rule alone accepted this order)
    (["record begin", "allocate", "write payload", "record written", "commit to cache",
      "record allocated", "record committed"], "refuses as corrupt"),
])
def test_install_harness_names_why_an_order_is_unsafe(order, match):
    assert match in _answers()._install_problem(order)


def test_install_orders_are_graded_as_a_set_once():
    _install_problem, _run_install = _answers()._install_problem, _answers()._run_install
    assert sorted(INSTALL_STEPS) == list(INSTALL_STEPS) != KVLAB   # printed: not an answer
    assert _install_problem(KVLAB) is None and _install_problem(ALT) is None
    import kvlab.exercises.ch10 as ch10  # the reader's module holds no harness
    assert not {"_run_install", "_install_problem", "KVCacheManager"} & set(vars(ch10))
    # every safe order leaves nothing held and a journal recovery reads, at every crash
    for crash in range(len(ALT) + 1):
        st = _run_install(ALT, crash)
        assert not st["refused"] and not st["leaked"]
        assert st["installed"] == (st["committed"] and st["written"])
    assert "Correct" in check_install_orders([ALT, KVLAB])
    # one order alone, a wrong extra order, or the two plus another: the same words
    texts = set()
    for answer in ([KVLAB], [ALT], [KVLAB, ALT, list(INSTALL_STEPS)], [list(INSTALL_STEPS)]):
        new_session()
        with pytest.raises(AssertionError, match="not the set of safe orders") as err:
            check_install_orders(answer)
        texts.add(str(err.value))
    assert len(texts) == 1
    text = texts.pop()
    assert all(repr(step) not in text for step in INSTALL_STEPS)    # names no order
    # graded once: the looping reader gets the same reply to every later set
    assert "not right" in check_install_orders([KVLAB, ALT])
    new_session()
    for bad, match in (([KVLAB[:6]], "exactly once"), ([KVLAB, KVLAB], "twice"),
                       ([], "at least one"), (3, "list of orders")):
        with pytest.raises(AssertionError, match=match):
            check_install_orders(bad)
    assert "Correct" in check_install_orders([KVLAB, ALT])     # malformed answers lock nothing
    with pytest.raises(NotYetAnswered):
        check_install_orders(...)


def test_forgery_check_runs_both_checks_on_the_readers_entry():
    from kvlab.disagg.entry import Delivery, decode_frame, encode_frame, seal
    from kvlab.exercises.ch10 import (
        check_forgery,
        colleague_check,
        consumer_expectation,
        sound_entry,
    )

    expected, sound = consumer_expectation(), sound_entry()
    assert check_delivery(sound, expected) is None and colleague_check(sound, expected) is None

    def resealed(**fields) -> Delivery:
        desc = {**sound.header["descriptor"], **fields}
        return decode_frame(encode_frame(seal({**sound.header, "descriptor": desc}),
                                         sound.payload))

    # the hole: another tenant's entry, re-sealed, gets past the colleague only
    verdict = check_forgery(resealed(security_domain="tenant-b"))
    assert verdict.startswith("Correct") and "security_domain" in verdict
    # every other re-sealed field is refused by the colleague too; the message names no field
    for field, value in (("model_version", "weights-v6"), ("rope", "theta=10000"),
                         ("layers", 31), ("token_ids_hash", "0" * 64)):
        with pytest.raises(AssertionError, match="colleague_check refuses") as err:
            check_forgery(resealed(**{field: value}))
        assert "security_domain" not in str(err.value)
    # a changed field without a new seal, or a cut payload, is refused by both
    unsealed = Delivery({**sound.header, "descriptor": {**sound.header["descriptor"],
                                                        "security_domain": "tenant-b"}},
                        sound.payload)
    with pytest.raises(AssertionError, match="refuses"):
        check_forgery(unsealed)
    with pytest.raises(AssertionError, match="installs this entry too"):
        check_forgery(sound)
    with pytest.raises(AssertionError, match="crashes"):
        check_forgery(Delivery(seal({k: v for k, v in sound.header.items()
                                     if k != "payload_bytes"}), sound.payload))
    with pytest.raises(AssertionError, match="Delivery"):
        check_forgery("security_domain")
    with pytest.raises(NotYetAnswered):
        check_forgery(...)
