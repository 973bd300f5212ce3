"""A seeded fault injector for KV transfer, driven by a fault schedule that is plain data.

A :class:`FaultSchedule` is a tuple of :class:`Fault` records ``(kind, point, step)``: *which*
fault, *where* in the protocol it strikes, and at the *step*-th event of that point (0-based:
the ``step``-th entry sent, the ``step``-th entry delivered, the ``step``-th record of the
install journal). It serialises to a list of dicts (:meth:`FaultSchedule.to_data`), so a test, a
notebook or a later general fault injector can read and write it. The points:

``send``      the producer, after encoding an entry and before the transport writes it
              (frame faults; a crash leaves a partial write behind);
``deliver``   the consumer, after the transport read an entry and before the scheduler sees
              it (duplicate, out-of-order, drop);
``consumer``  the consumer's client: the request is aborted before its entry arrives;
``install``   the consumer's install journal: the process dies before that record is written.

Every frame fault works on the encoded bytes, so the same schedule hits every connector and the
consumer parses real damaged bytes. Randomness (which byte, how much is cut) comes from one
``random.Random(seed)``: a schedule and a seed replay exactly.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvlab.disagg.entry import Delivery, encode_frame, seal

__all__ = ["DEFAULT_POINT", "FAULT_KINDS", "Fault", "FaultSchedule", "SendPlan",
           "TransferFaultInjector"]

DEFAULT_POINT: dict[str, str] = {
    "drop": "send", "truncate": "send", "corrupt_payload": "send",
    "corrupt_descriptor": "send", "stale_model_version": "send", "security_domain": "send",
    "layers": "send", "kv_heads": "send", "dtype": "send", "rope": "send",
    "producer_crash": "send", "duplicate": "deliver", "out_of_order": "deliver",
    "after_abort": "consumer", "consumer_crash": "install",
}
FAULT_KINDS = tuple(DEFAULT_POINT)
_POINTS = {"send": set(FAULT_KINDS) - {"after_abort", "consumer_crash"},
           "deliver": {"duplicate", "out_of_order", "drop"},
           "consumer": {"after_abort"}, "install": {"consumer_crash"}}


@dataclass(frozen=True)
class Fault:
    """One scheduled fault. ``point`` defaults to :data:`DEFAULT_POINT` of ``kind``."""

    kind: str
    step: int = 0
    point: str = ""

    def __post_init__(self) -> None:
        if self.kind not in DEFAULT_POINT:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {list(FAULT_KINDS)}")
        if not self.point:
            object.__setattr__(self, "point", DEFAULT_POINT[self.kind])
        if self.kind not in _POINTS.get(self.point, ()):
            raise ValueError(f"fault {self.kind!r} cannot strike at point {self.point!r}")
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise ValueError(f"fault step must be an int >= 0, got {self.step!r}")

    def to_data(self) -> dict:
        return {"kind": self.kind, "point": self.point, "step": self.step}


@dataclass(frozen=True)
class FaultSchedule:
    """Faults to inject, plus the seed of the injector's randomness."""

    faults: tuple[Fault, ...] = ()
    seed: int = 0

    def at(self, point: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.point == point and f.step == step]

    def to_data(self) -> dict:
        return {"seed": self.seed, "faults": [f.to_data() for f in self.faults]}

    @classmethod
    def from_data(cls, data: dict) -> FaultSchedule:
        return cls(tuple(Fault(**f) for f in data.get("faults", ())), int(data.get("seed", 0)))

    @classmethod
    def random(cls, seed: int, num_entries: int, *, rate: float = 0.5,
               kinds: Sequence[str] = FAULT_KINDS) -> FaultSchedule:
        """Each of ``num_entries`` entries gets one fault of ``kinds`` with probability
        ``rate`` (send/deliver faults by entry, ``after_abort`` by entry, a consumer crash at
        a random journal record)."""
        rng = random.Random(seed)
        faults = []
        for i in range(num_entries):
            if rng.random() < rate:
                kind = rng.choice(list(kinds))
                step = rng.randrange(6 * num_entries) if kind == "consumer_crash" else i
                faults.append(Fault(kind, step))
        return cls(tuple(faults), seed)


@dataclass
class SendPlan:
    """What the transport does with one entry: write ``frames`` in order; ``partial`` (if not
    None) is the prefix a producer wrote before it crashed mid-write."""

    frames: list[bytes]
    partial: bytes | None = None


def _split(frame: bytes) -> tuple[dict, bytes, int]:
    (n,) = struct.unpack(">I", frame[8:12])
    return json.loads(frame[12:12 + n]), frame[12 + n:], n


def _flip(data: bytes, pos: int, rng: random.Random) -> bytes:
    out = bytearray(data)
    out[pos] ^= 1 << rng.randrange(8)
    return bytes(out)


@dataclass
class TransferFaultInjector:
    """Applies a :class:`FaultSchedule`; records every fault it applied in ``applied``."""

    schedule: FaultSchedule = field(default_factory=FaultSchedule)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.schedule.seed)
        self.sent = 0                   # entries seen at the send point
        self.delivered = 0              # deliveries seen at the deliver point
        self._held: list[bytes] = []     # out-of-order frames waiting for the next send
        self._held_deliveries: list[Delivery] = []
        self.applied: list[tuple[str, int, str]] = []

    def on_send(self, frame: bytes) -> SendPlan:
        """The frames to transmit for the next entry (faults of point ``send``)."""
        i, self.sent = self.sent, self.sent + 1
        held, self._held = self._held, []
        plan = SendPlan([frame])
        for fault in self.schedule.at("send", i):
            self.applied.append(("send", i, fault.kind))
            plan = self._mutate(fault.kind, plan)
        plan.frames.extend(held)     # an earlier out-of-order frame goes after this one
        return plan

    def flush(self) -> list[bytes]:
        """Frames still held back by ``out_of_order`` (sent last, after everything else)."""
        held, self._held = self._held, []
        return held

    def _mutate(self, kind: str, plan: SendPlan) -> SendPlan:
        rng = self.rng
        out: list[bytes] = []
        for frame in plan.frames:
            header, payload, n = _split(frame)
            if kind == "drop":
                continue
            if kind == "duplicate":
                out += [frame, frame]
            elif kind == "out_of_order":
                self._held.append(frame)
            elif kind == "truncate":
                out.append(frame[:len(frame) - rng.randint(1, max(1, len(payload)))])
            elif kind == "corrupt_payload":
                out.append(_flip(frame, 12 + n + rng.randrange(len(payload)), rng))
            elif kind == "corrupt_descriptor":
                out.append(_flip(frame, 12 + rng.randrange(n), rng))
            elif kind == "producer_crash":
                return SendPlan(out, frame[:rng.randint(1, len(frame) - 1)])
            else:
                out.append(encode_frame(seal(_reshape(kind, header)), payload))
        return SendPlan(out, plan.partial)

    def on_deliver(self, deliveries: Iterable[Delivery]) -> list[Delivery]:
        """What the consumer gets from one read (faults of point ``deliver``; ``step`` counts
        deliveries). A held-back (``out_of_order``) delivery arrives after the next one, or at
        the next read."""
        out, held, self._held_deliveries = [], self._held_deliveries, []
        for d in deliveries:
            i, self.delivered = self.delivered, self.delivered + 1
            copies = [d]
            for fault in self.schedule.at("deliver", i):
                self.applied.append(("deliver", i, fault.kind))
                if fault.kind == "duplicate":
                    copies = copies * 2
                elif fault.kind == "drop":
                    copies = []
                else:
                    self._held_deliveries += copies
                    copies = []
            out += copies
            if copies and held:
                out, held = out + held, []
        return out + held

    def abort_before_delivery(self, entry: int) -> bool:
        """Whether the schedule aborts the request of the ``entry``-th entry first."""
        hit = bool(self.schedule.at("consumer", entry))
        if hit:
            self.applied.append(("consumer", entry, "after_abort"))
        return hit

    def crash_record(self) -> int | None:
        """The install-journal record before which the consumer dies, if any."""
        crashes = [f.step for f in self.schedule.faults if f.point == "install"]
        return min(crashes) if crashes else None


def _reshape(kind: str, header: dict) -> dict:
    """A well-formed, re-sealed header that disagrees with the consumer in one field."""
    d = dict(header["descriptor"])
    if kind == "stale_model_version":
        d["model_version"] = "stale-" + str(d.get("model_version", ""))[:16]
    elif kind == "security_domain":
        d["security_domain"] = str(d.get("security_domain", "")) + "-other-tenant"
    elif kind == "layers":
        d["layers"] = int(d.get("layers", 0)) + 1
    elif kind == "kv_heads":
        d["kv_heads"] = int(d.get("kv_heads", 1)) * 2
    elif kind == "dtype":
        d["dtype"] = "bfloat16" if d.get("dtype") != "bfloat16" else "float16"
    elif kind == "rope":
        d["rope"] = str(d.get("rope", "")) + ",scaled=yes"
    else:  # pragma: no cover - guarded by Fault
        raise ValueError(kind)
    return {**header, "descriptor": d}
