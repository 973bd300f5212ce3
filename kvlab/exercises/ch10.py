"""Chapter 10 exercises: transfer arithmetic, classifying damaged entries, a crash-safe install,
forging past a colleague's check.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with :mod:`kvlab.labs.capacity` and :mod:`kvlab.disagg`); the design
and debug checks run the reader's order or entry on kvlab's own code (the install journal's
recovery, the consumer's check). Each raises ``AssertionError`` naming the concept to revisit
(which check, which crash breaks which rule), never a direction or the answer.
"""

from __future__ import annotations

import hashlib

from kvlab.disagg.entry import (
    ENTRY_FORMAT,
    REJECT_KINDS,
    Delivery,
    check_delivery,
    decode_frame,
    encode_frame,
    make_descriptor,
    make_header,
    seal,
)
from kvlab.disagg.transfer_faults import Fault, FaultSchedule, TransferFaultInjector
from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed

# ------------------------------------------------------------------ 1. arithmetic
TRANSFER_MODEL, TRANSFER_TOKENS, TRANSFER_LINK = "Llama-3-70B", 4096, "InfiniBand NDR 400G"
#: The deployment of exercise 1: KV stored in FP8 (1 byte per element), tensor parallelism 4,
#: each GPU sending its own share of the KV heads over its own port.
TRANSFER_ELEMENT_BYTES, TRANSFER_TP = 1.0, 4


def check_transfer(megabytes, ms) -> str:
    """``megabytes``: the bytes (in units of 10^6) one GPU sends, its share of the FP8 prefill
    KV of a :data:`TRANSFER_TOKENS`-token prompt of :data:`TRANSFER_MODEL` at tensor
    parallelism :data:`TRANSFER_TP`; ``ms``: the milliseconds that takes over its own
    :data:`TRANSFER_LINK` port (nominal bandwidth plus the link's latency,
    ``kvlab.labs.capacity.transfer_cost.LINKS``). Both within 2 %, the bytes judged first; a wrong
    value is told which concept to revisit, never its direction."""
    require_answer(megabytes, "megabytes one GPU sends")
    require_answer(ms, "milliseconds")
    got = {}
    for name, value in (("megabytes", megabytes), ("ms", ms)):
        try:
            got[name] = float(value)
        except (TypeError, ValueError):
            raise AssertionError(f"{name}: give a number, got {value!r}") from None
        if not got[name] > 0 or got[name] == float("inf"):
            raise AssertionError(f"{name}: give a positive, finite number")
    truth_mb, truth_ms = sealed("ch10.transfer_mb").value(), sealed("ch10.transfer_ms").value()
    if abs(got["megabytes"] - truth_mb) > 0.02 * truth_mb:
        raise AssertionError("the bytes are not right: revisit chapter 1's KV bytes (what is "
                             "stored per token, in which format) and what tensor parallelism "
                             "divides among the GPUs")
    if abs(got["ms"] - truth_ms) > 0.02 * truth_ms:
        raise AssertionError("the bytes are right, the time is not: revisit what a transfer "
                             "over a link costs, and the units of its bandwidth")
    return f"Correct: {truth_mb:.1f} MB per GPU, {truth_ms:.2f} ms."


# ------------------------------------------------------------------ 2. classify entries
_FIELDS = {"model_version": "weights-v7", "layers": 32, "kv_heads": 8, "head_dim": 128,
           "dtype": "bfloat16", "layout": "token-major", "rope": "theta=500000"}
_PROMPT = tuple(range(100, 164))
#: Exercise 2: entry ``i`` is hit by both faults of ``FAULT_PAIRS[i]``, the first then the
#: second (``kvlab.disagg.transfer_faults``; the chapter's tables show one fault at a time).
FAULT_PAIRS = (("truncate", "corrupt_descriptor"), ("corrupt_payload", "rope"),
               ("corrupt_payload", "truncate"), ("security_domain", "corrupt_payload"),
               ("truncate", "security_domain"))


def _damaged(pairs) -> tuple[list[Delivery], dict]:
    payload = bytes(range(256)) * 8
    desc = make_descriptor("p-1", _PROMPT, "tenant-a", _FIELDS)
    frame = encode_frame(make_header(desc, 64, payload), payload)
    out = []
    for i, kinds in enumerate(pairs):
        faults = tuple(Fault(kind, 0) for kind in kinds)
        plan = TransferFaultInjector(FaultSchedule(faults, seed=100 + i)).on_send(frame)
        out.append(decode_frame(plan.frames[0]))
    expected = {k: v for k, v in desc.items() if k != "request_id"}
    return out, expected


def classify_entries() -> tuple[list[Delivery], dict]:
    """Five entries as the consumer receives them (entry ``i`` was hit by both faults of
    :data:`FAULT_PAIRS` ``[i]``), and the consumer's expectation."""
    return _damaged(FAULT_PAIRS)


def check_classification(answer) -> str:
    """``answer``: for each entry of :func:`classify_entries`, in order, the kind the consumer
    records (one of ``kvlab.disagg.entry.REJECT_KINDS``, or None to install it). A prediction:
    graded once per session (``_common.earlier_prediction``)."""
    require_answer(answer, "a list of five kinds")
    got = list(answer)
    if len(got) != len(FAULT_PAIRS):
        raise AssertionError(f"give one kind per entry ({len(FAULT_PAIRS)}), got {len(got)}")
    unknown = sorted({repr(g) for g in got if g is not None and g not in REJECT_KINDS})
    if unknown:
        raise AssertionError(f"{', '.join(unknown)}: not a kind the consumer records (see "
                             "kvlab.disagg.entry.REJECT_KINDS)")
    if None in got:
        raise AssertionError("every one of these entries was damaged; the consumer installs "
                             "none of them")
    # graded as a whole (a count would grade entry by entry) and once: the first answer is the
    # prediction, so trying the kinds one after another learns nothing
    right = sealed("ch10.classification").is_answer(got)
    earlier = earlier_prediction("ch10.classification", got, right)
    if earlier is not None:
        return graded_once(earlier)
    if not right:
        raise AssertionError("not every kind is right: for each entry, ask what each of its "
                             "two faults changes, which of the consumer's checks can see each "
                             "change, and which of those checks runs first; then run "
                             "check_delivery on the entries to see")
    return "Correct: every damaged entry is refused, each for its own reason."


# ------------------------------------------------------------------ 3. design: install order
#: The seven steps of the consumer's install, in alphabetical order (not an order to run them
#: in). What a crash before each step leaves is for the reader to work out (on kvlab's
#: ``KVCacheManager``, ``InstallJournal`` and ``recover_installs``); the safe orders are sealed.
INSTALL_STEPS = ("allocate", "commit to cache", "record allocated", "record begin",
                 "record committed", "record written", "write payload")


def check_install_orders(orders) -> str:
    """``orders``: *every* order of the seven :data:`INSTALL_STEPS` (each a list of them)
    in which a consumer may run the install so that a crash before *any* step leaves (1) no
    leaked table, (2) no half-written block visible in the prefix cache, and (3) a truthful
    journal (no record of a step that has not happened) from which recovery answers
    "installed?" correctly — kvlab's own order, which the chapter describes, included. The set
    is graded as a whole and once: the first wrong set is recorded
    (:func:`~kvlab.exercises._common.earlier_prediction`), and a later answer is not graded."""
    require_answer(orders, "a list of orders, each a list of the seven steps")
    try:
        got = [list(o) for o in orders]
    except TypeError:
        raise AssertionError("give a list of orders, each a list of the seven steps") from None
    if not got:
        raise AssertionError("give at least one order: kvlab's own is safe")
    for o in got:
        if sorted(o) != sorted(INSTALL_STEPS):
            raise AssertionError(f"{o!r}: an order uses each of INSTALL_STEPS exactly once")
    answer = sorted({tuple(o) for o in got})
    if len(answer) != len(got):
        raise AssertionError("an order appears twice: give each order once")
    truth = sealed("ch10.install_orders")
    right = truth.is_answer(answer)
    first = earlier_prediction("ch10.install_orders", answer, right)
    if first is not None:
        return graded_once(first)
    if not right:                 # one message: nothing says which order is wrong or missing
        raise AssertionError("not the set of safe orders: for each pair of steps, ask what a "
                             "crash between them leaves behind (a table no one owns, a block "
                             "the cache serves before its bytes are there, a record that "
                             "claims more than happened) and which order of the two each "
                             "rule therefore imposes")
    return (f"Correct: exactly these {len(answer)} orders are safe. Now give the reason for "
            "each constraint, and the crash point at which the orders' recoveries differ.")


# ------------------------------------------------------------------ 5. debug: a colleague's check
def consumer_expectation() -> dict:
    """What the consumer of exercise 5 expects for its request ``p-1`` of ``tenant-a``: its
    model's fields, the prompt's hash and the tenant (``check_delivery``'s ``expected``)."""
    desc = make_descriptor("p-1", _PROMPT, "tenant-a", _FIELDS)
    return {k: v for k, v in desc.items() if k != "request_id"}


def sound_entry() -> Delivery:
    """The entry the producer sent for that request, as the consumer receives it: every check
    installs it."""
    payload = bytes(range(256)) * 8
    desc = make_descriptor("p-1", _PROMPT, "tenant-a", _FIELDS)
    return decode_frame(encode_frame(make_header(desc, 64, payload), payload))


def colleague_check(delivery: Delivery, expected: dict) -> str | None:
    """A colleague's shorter consumer check: "the same decisions as check_delivery, without
    the classification table". Returns a reject kind, or None to install."""
    if delivery.problem is not None:
        return delivery.problem
    header = delivery.header
    if header is None or header.get("format") != ENTRY_FORMAT or seal(header) != header:
        return "corrupt_descriptor"
    desc = header["descriptor"]
    for key in ("model_version", "token_ids_hash", "layers", "kv_heads", "head_dim", "dtype",
                "layout", "rope"):
        if desc.get(key) != expected.get(key):
            return "stale_model_version" if key == "model_version" else "incompatible"
    if len(delivery.payload) < header["payload_bytes"]:
        return "truncated"
    if hashlib.sha256(delivery.payload).hexdigest() != header["payload_sha256"]:
        return "corrupt_payload"
    return None


def check_forgery(delivery) -> str:
    """``delivery``: an entry you built (a :class:`~kvlab.disagg.entry.Delivery`, e.g.
    ``decode_frame(encode_frame(header, payload))``) that :func:`colleague_check` installs for
    :func:`consumer_expectation` although :func:`~kvlab.disagg.entry.check_delivery` refuses
    it. Graded by running both checks on it."""
    require_answer(delivery, "an entry (a Delivery) you built")
    if not isinstance(delivery, Delivery):
        raise AssertionError("pass a kvlab.disagg.entry.Delivery: decode_frame(encode_frame("
                             "header, payload)) makes one from a header and a payload")
    expected = consumer_expectation()
    try:
        theirs = colleague_check(delivery, expected)
    except Exception as error:   # a crash is a refusal, whatever it is
        raise AssertionError(f"colleague_check crashes on this entry ({type(error).__name__}): "
                             "a crash installs nothing; build a well-formed entry") from None
    if theirs is not None:
        raise AssertionError(f"colleague_check refuses this entry (it records {theirs!r}): to "
                             "get through, an entry must pass every comparison the colleague's "
                             "function makes; set what it compares against what check_delivery "
                             "compares")
    ours = check_delivery(delivery, expected)
    if ours is None:
        raise AssertionError("check_delivery installs this entry too: it is sound for this "
                             "request; build one that only the colleague's check would install")
    return (f"Correct: colleague_check installs it; check_delivery records {ours!r}. You "
            "sealed it yourself, so the seal was no obstacle. Now say which line lets it "
            "through, and what a request decoding on that KV would risk.")
