"""Chapter 10 exercises: transfer arithmetic, classifying damaged entries, a crash-safe install.

Each check computes the truth with :mod:`kvlab.core` and raises ``AssertionError`` saying what
is wrong (too high / too low, which entry, which crash breaks which rule) without printing the
answer.
"""

from __future__ import annotations

from kvlab.core.catalog import get_model
from kvlab.core.kv_transfer import (
    Delivery,
    check_delivery,
    decode_frame,
    encode_frame,
    make_descriptor,
    make_header,
)
from kvlab.core.transfer_cost import LINKS, kv_transfer_bytes, transfer_seconds
from kvlab.core.transfer_faults import Fault, FaultInjector, FaultSchedule

from ._common import require_answer

# ------------------------------------------------------------------ 1. arithmetic
TRANSFER_MODEL, TRANSFER_TOKENS, TRANSFER_LINK = "Llama-3-70B", 4096, "InfiniBand NDR 400G"


def check_transfer_ms(answer) -> str:
    """``answer``: milliseconds to ship the bf16 prefill KV of a :data:`TRANSFER_TOKENS`-token
    prompt of :data:`TRANSFER_MODEL` over :data:`TRANSFER_LINK` (nominal bandwidth plus the
    link's latency, see ``kvlab.core.transfer_cost.LINKS``). Within 2 %."""
    require_answer(answer, "milliseconds")
    want = 1e3 * transfer_seconds(kv_transfer_bytes(get_model(TRANSFER_MODEL), TRANSFER_TOKENS),
                                  LINKS[TRANSFER_LINK])
    got = float(answer)
    if abs(got - want) > 0.02 * want:
        hint = ("too high: K and V, every layer, kv_heads (not query heads) x head_dim, 2 bytes"
                if got > want else
                "too low: did you count both K and V, and every layer?")
        raise AssertionError(f"{got:.3g} ms is {hint}")
    return f"Correct: {want:.2f} ms."


# ------------------------------------------------------------------ 2. classify entries
_FIELDS = {"model_version": "weights-v7", "layers": 32, "kv_heads": 8, "head_dim": 128,
           "dtype": "bfloat16", "layout": "token-major", "rope": "theta=500000"}
_PROMPT = tuple(range(100, 164))
_FAULTS = ("rope", "corrupt_payload", "truncate", "security_domain", "corrupt_descriptor")


def classify_entries() -> tuple[list[Delivery], dict]:
    """Five entries as the consumer receives them (entry ``i`` was hit by the ``i``-th fault
    of ``_FAULTS``), and the consumer's expectation."""
    payload = bytes(range(256)) * 8
    desc = make_descriptor("p-1", _PROMPT, "tenant-a", _FIELDS)
    frame = encode_frame(make_header(desc, 64, payload), payload)
    out = []
    for i, kind in enumerate(_FAULTS):
        plan = FaultInjector(FaultSchedule((Fault(kind, 0),), seed=100 + i)).on_send(frame)
        out.append(decode_frame(plan.frames[0]))
    expected = {k: v for k, v in desc.items() if k != "request_id"}
    return out, expected


def check_classification(answer) -> str:
    """``answer``: for each entry of :func:`classify_entries`, in order, the kind the consumer
    records (one of ``kvlab.core.kv_transfer.REJECT_KINDS``, or None to install it)."""
    require_answer(answer, "a list of five kinds")
    entries, expected = classify_entries()
    want = [check_delivery(d, expected) for d in entries]
    got = list(answer)
    if len(got) != len(want):
        raise AssertionError(f"give one kind per entry ({len(want)}), got {len(got)}")
    wrong = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    if wrong:
        raise AssertionError(f"entries {wrong} are classified wrong: the checks run in the order "
                             "header seal, descriptor fields, length, checksum")
    return "Correct: every damaged entry is refused, each for its own reason."


# ------------------------------------------------------------------ 3. design: install order
INSTALL_STEPS = ("record begin", "allocate", "record allocated", "write payload",
                 "record written", "commit to cache", "record committed")


def _simulate(order: list[str], crash: int) -> dict:
    done = order[:crash]
    journal = [s.split(" ", 1)[1] for s in done if s.startswith("record")]
    state = {"held": "allocate" in done, "written": "write payload" in done,
             "committed": "commit to cache" in done, "journal": journal}
    # kvlab's recovery: frees a table of an operation the journal names; says "installed" if
    # the journal has 'committed', or has 'written' and the manager shows the commit
    state["found"] = bool(journal)
    state["installed"] = "committed" in journal or ("written" in journal and state["committed"])
    return state


def check_install_order(order) -> str:
    """``order``: the seven :data:`INSTALL_STEPS` in the order a consumer should run them so
    that a crash before *any* step leaves (1) no leaked table, (2) no half-written block visible
    in the prefix cache, and (3) a journal from which recovery answers "installed?" correctly.
    Several orders are right; the check simulates a crash before every step."""
    require_answer(order, "a list of the seven steps")
    order = list(order)
    if sorted(order) != sorted(INSTALL_STEPS):
        raise AssertionError("use each of INSTALL_STEPS exactly once")
    pos = {s: i for i, s in enumerate(order)}
    if pos["write payload"] < pos["allocate"] or pos["commit to cache"] < pos["allocate"]:
        raise AssertionError("there are no blocks to write or commit before 'allocate'")
    for crash in range(len(order) + 1):
        st = _simulate(order, crash)
        after = f"a crash after {order[crash - 1]!r}" if crash else "a crash at once"
        if st["held"] and not st["found"]:
            raise AssertionError(f"{after} leaks the table: the journal names no operation")
        if st["committed"] and not st["written"]:
            raise AssertionError(f"{after} leaves a half-written block readable in the cache")
        if st["installed"] != (st["committed"] and st["written"]):
            raise AssertionError(f"{after}: recovery reads the journal wrongly ('installed' is "
                                 "claimed for blocks that never reached the cache, or missed)")
    return ("Correct: every crash point is safe. kvlab's consumer uses: " +
            " → ".join(s for s in INSTALL_STEPS) + ".")
