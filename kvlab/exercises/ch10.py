"""Chapter 10 exercises: transfer arithmetic, classifying damaged entries, a crash-safe install.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with :mod:`kvlab.labs.capacity` and :mod:`kvlab.disagg`); the design
and debug checks run the reader's order or case on kvlab's own code (the install journal's
recovery). Each raises ``AssertionError`` saying what is wrong (too high / too low, that some
kind is wrong, which crash breaks which rule) without printing the answer.
"""

from __future__ import annotations

import hashlib

from kvlab.core.kv_cache_manager import KVCacheManager
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
from kvlab.disagg.install_journal import InstallJournal, recover_installs
from kvlab.disagg.transfer_faults import Fault, FaultSchedule, TransferFaultInjector
from kvlab.exercises._common import require_answer, sealed

# ------------------------------------------------------------------ 1. arithmetic
TRANSFER_MODEL, TRANSFER_TOKENS, TRANSFER_LINK = "Llama-3-70B", 4096, "InfiniBand NDR 400G"
#: The deployment of exercise 1: KV stored in FP8 (1 byte per element), tensor parallelism 4,
#: each GPU sending its own share of the KV heads over its own port.
TRANSFER_ELEMENT_BYTES, TRANSFER_TP = 1.0, 4


def check_transfer_ms(answer) -> str:
    """``answer``: milliseconds for one GPU to ship its share of the FP8 prefill KV of a
    :data:`TRANSFER_TOKENS`-token prompt of :data:`TRANSFER_MODEL` at tensor parallelism
    :data:`TRANSFER_TP`, over its own :data:`TRANSFER_LINK` port (nominal bandwidth plus the
    link's latency, ``kvlab.labs.capacity.transfer_cost.LINKS``). Within 2 %; a wrong answer is told
    only its direction."""
    require_answer(answer, "milliseconds")
    got = float(answer)
    if not got > 0 or got != got:
        raise AssertionError("give a positive number of milliseconds")
    truth = sealed("ch10.transfer_ms")
    way = truth.direction(got, tolerance=0.02 * truth.value())
    if way:
        raise AssertionError(f"{got:.3g} ms is {way}")
    return f"Correct: {truth.value():.2f} ms."


# ------------------------------------------------------------------ 2. classify entries
_FIELDS = {"model_version": "weights-v7", "layers": 32, "kv_heads": 8, "head_dim": 128,
           "dtype": "bfloat16", "layout": "token-major", "rope": "theta=500000"}
_PROMPT = tuple(range(100, 164))
_FAULTS = ("rope", "corrupt_payload", "truncate", "security_domain", "corrupt_descriptor")


def _damaged(kinds: tuple[str, ...]) -> tuple[list[Delivery], dict]:
    payload = bytes(range(256)) * 8
    desc = make_descriptor("p-1", _PROMPT, "tenant-a", _FIELDS)
    frame = encode_frame(make_header(desc, 64, payload), payload)
    out = []
    for i, kind in enumerate(kinds):
        plan = TransferFaultInjector(FaultSchedule((Fault(kind, 0),), seed=100 + i)).on_send(frame)
        out.append(decode_frame(plan.frames[0]))
    expected = {k: v for k, v in desc.items() if k != "request_id"}
    return out, expected


def classify_entries() -> tuple[list[Delivery], dict]:
    """Five entries as the consumer receives them (entry ``i`` was hit by the ``i``-th fault
    of ``_FAULTS``), and the consumer's expectation."""
    return _damaged(_FAULTS)


def check_classification(answer) -> str:
    """``answer``: for each entry of :func:`classify_entries`, in order, the kind the consumer
    records (one of ``kvlab.disagg.entry.REJECT_KINDS``, or None to install it)."""
    require_answer(answer, "a list of five kinds")
    got = list(answer)
    if len(got) != len(_FAULTS):
        raise AssertionError(f"give one kind per entry ({len(_FAULTS)}), got {len(got)}")
    unknown = sorted({repr(g) for g in got if g is not None and g not in REJECT_KINDS})
    if unknown:
        raise AssertionError(f"{', '.join(unknown)}: not a kind the consumer records (see "
                             "kvlab.disagg.entry.REJECT_KINDS)")
    if None in got:
        raise AssertionError("every one of these entries was damaged; the consumer installs "
                             "none of them")
    if not sealed("ch10.classification").is_answer(got):   # no count: a count would grade
        # entry by entry
        raise AssertionError("not every kind is right: for each entry, ask which check runs "
                             "first and whether that check can see what the fault changed")
    return "Correct: every damaged entry is refused, each for its own reason."


# ------------------------------------------------------------------ 3. design: install order
#: kvlab's consumer's order (``RemoteKVScheduler``'s install, described in chapter 10).
_KVLAB_ORDER = ("record begin", "allocate", "record allocated", "write payload",
                "record written", "commit to cache", "record committed")
#: The seven steps, in alphabetical order (not an order to run them in).
INSTALL_STEPS = tuple(sorted(_KVLAB_ORDER))
#: The step each completion record reports as done.
_RECORDED_STEP = {"allocated": "allocate", "written": "write payload",
                  "committed": "commit to cache"}


_OP, _RID, _SCOPE = "p-1@entry", "p-1", (("model", "weights-v7"),)
_INSTALL_PROMPT = tuple(range(200, 213))       # 13 tokens: 3 full blocks of 4 are installed
_INSTALL_TOKENS = 12


def _run_install(order: list[str], crash: int) -> dict:
    """Run the first ``crash`` steps of ``order`` on kvlab's own :class:`KVCacheManager` and
    :class:`InstallJournal`, crash, and recover with :func:`recover_installs` (the consumer's
    recovery). The payload bytes are not modelled: whether they were written is a flag."""
    kv, journal = KVCacheManager(16, 4), InstallJournal()
    done = order[:crash]
    got = 0
    for step in done:
        if step == "record begin":
            journal.append("begin", _OP, (_RID, _INSTALL_TOKENS))
        elif step == "allocate":
            got = kv.admit(_OP, _SCOPE, _INSTALL_PROMPT, _INSTALL_TOKENS)
        elif step == "record allocated":
            table = tuple(kv.block_table(_OP)) if kv.has(_OP) else ()
            journal.append("allocated", _OP, (table, got))
        elif step == "record written":
            journal.append("written", _OP)
        elif step == "commit to cache":
            kv.commit(_OP, _INSTALL_PROMPT[:_INSTALL_TOKENS])
        elif step == "record committed":
            journal.append("committed", _OP)
    state = {"written": "write payload" in done, "committed": "commit to cache" in done,
             "refused": False, "leaked": False, "installed": False}
    # a record claims its step is done: 'allocated', 'written', 'committed' before the step
    # happened is a journal that lies to recovery
    state["false_claims"] = [r.kind for r in journal.records if r.kind in _RECORDED_STEP
                             and _RECORDED_STEP[r.kind] not in done]
    try:
        report = recover_installs(journal, kv)
    except ValueError:
        state["refused"] = True
        return state
    state["leaked"] = kv.has(_OP)
    state["installed"] = _OP in report and report[_OP].installed
    return state


def check_install_order(order) -> str:
    """``order``: the seven :data:`INSTALL_STEPS` in the order a consumer should run them so
    that a crash before *any* step leaves (1) no leaked table, (2) no half-written block visible
    in the prefix cache, and (3) a truthful journal (no record of a step that has not
    happened) from which recovery answers "installed?" correctly.
    The exercise asks for an order that is not kvlab's own (the chapter describes that one).
    The check crashes the install before every step, on kvlab's own KV manager and install
    journal, and recovers with ``recover_installs``."""
    require_answer(order, "a list of the seven steps")
    order = list(order)
    if sorted(order) != sorted(INSTALL_STEPS):
        raise AssertionError("use each of INSTALL_STEPS exactly once")
    if tuple(order) == _KVLAB_ORDER:
        raise AssertionError("that is kvlab's own order, described in the chapter: find "
                             "another order that is just as safe")
    pos = {s: i for i, s in enumerate(order)}
    if pos["write payload"] < pos["allocate"] or pos["commit to cache"] < pos["allocate"]:
        raise AssertionError("there are no blocks to write or commit before 'allocate'")
    for crash in range(len(order) + 1):
        st = _run_install(order, crash)
        after = f"a crash after {order[crash - 1]!r}" if crash else "a crash at once"
        if st["refused"]:
            raise AssertionError(f"{after} leaves a journal that kvlab's recovery refuses as "
                                 "corrupt: its records must come in the protocol's order")
        if st["leaked"]:
            raise AssertionError(f"{after} leaks the table: the journal names no operation")
        if st["false_claims"]:
            raise AssertionError(f"{after} leaves a journal that records "
                                 f"{st['false_claims'][0]!r} for a step that has not "
                                 "happened yet: a record must follow what it reports")
        if st["committed"] and not st["written"]:
            raise AssertionError(f"{after} leaves a half-written block readable in the cache")
        if st["installed"] != (st["committed"] and st["written"]):
            raise AssertionError(f"{after}: recovery reads the journal wrongly ('installed' is "
                                 "claimed for blocks that never reached the cache, or missed)")
    return ("Correct: every crash point is safe. kvlab's consumer uses: " +
            " → ".join(_KVLAB_ORDER) + ".")


# ------------------------------------------------------------------ 5. debug: a colleague's check
#: The damage of exercise 5, one entry each (the fault kinds of ``kvlab.disagg.transfer_faults``
#: that change a single entry's bytes).
DAMAGE_KINDS = ("truncate", "corrupt_payload", "corrupt_descriptor", "stale_model_version",
                "security_domain", "layers", "kv_heads", "dtype", "rope")


def damaged_entries() -> tuple[dict[str, Delivery], dict]:
    """``({fault kind: the entry as the consumer receives it}, the consumer's expectation)``
    for every kind of :data:`DAMAGE_KINDS`."""
    entries, expected = _damaged(DAMAGE_KINDS)
    return dict(zip(DAMAGE_KINDS, entries, strict=True)), expected


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


def check_colleague(kind) -> str:
    """``kind``: the fault kind of :func:`damaged_entries` whose entry :func:`colleague_check`
    installs although :func:`~kvlab.disagg.entry.check_delivery` refuses it."""
    require_answer(kind, "a fault kind from DAMAGE_KINDS")
    if kind not in DAMAGE_KINDS:
        raise AssertionError(f"choose one of {DAMAGE_KINDS}")
    entries, expected = damaged_entries()
    verdict = colleague_check(entries[kind], expected)
    if verdict is not None:
        raise AssertionError(f"the colleague's check refuses the {kind!r} entry too (it "
                             f"records {verdict!r})")
    assert check_delivery(entries[kind], expected) is not None
    return ("Correct: that entry would be installed. Say which line of colleague_check lets "
            "it through, and what a reader of the installed KV would see.")
