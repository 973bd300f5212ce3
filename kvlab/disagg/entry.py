"""Prefill/decode disaggregation, the torch-free half: descriptors, the entry format, checks.

A *producer* engine prefills a prompt and exports its KV as an **entry**; a *consumer* engine
installs the entry and decodes. This module fixes what an entry is and how a consumer decides
whether it may install one. The tensors (:mod:`kvlab.engine.kv_transfer`) and the scheduler
integration (:mod:`kvlab.disagg.remote_kv_scheduler`) build on it.

**The entry format** (``kvlab-kv/1``), identical on disk and on the wire:

* a **header**, canonical JSON (sorted keys, no spaces), with fields ``format``, ``key``,
  ``entry_id``, ``descriptor``, ``num_tokens``, ``payload_bytes``, ``payload_sha256`` and
  ``header_sha256`` (the SHA-256 of the canonical JSON of every other header field);
* a **payload**, a safetensors file holding, for every layer ``l``, tensors
  ``layers.{l}.key`` and ``layers.{l}.value`` of shape ``[num_tokens, kv_heads, head_dim]``
  (token-major: the layout does not depend on either side's block size).

The ``descriptor`` carries every field of the spec's
:data:`~kvlab.reference.rule09_disagg.REQUIRED_KV_FIELDS`. ``header_sha256`` seals the header
against accidental damage (a changed byte no longer matches); it has no key, so it does not
authenticate: whoever can write an entry can change a field and seal it again. kvlab assumes
that only the deployment's own producers and consumers can write to the store or the channel;
authenticity would need a MAC or signature with a key the consumer checks, or an authenticated
channel. ``token_ids_hash`` is :func:`token_ids_hash` of the
exact prompt; ``model_version`` is the hash of the weights. On shared storage an entry is the
directory ``<root>/<key>/`` holding ``descriptor.json`` (the header) and ``kv.safetensors``; on a
stream it is one **frame**: ``b"KVLABKV1"``, the header length (4 bytes, big endian), the header,
the payload.

**The consumer's decision** (:func:`check_delivery`) names the first problem, in this order, and
a consumer installs only an entry with none: ``corrupt_descriptor`` (unparseable header, bad
``header_sha256``, a required field missing), the descriptor checks of the reference
:func:`~kvlab.reference.rule09_disagg.validate_kv_descriptor` classified by field
(:data:`MISMATCH_KIND`), ``truncated`` (fewer payload bytes than announced) and
``corrupt_payload`` (SHA-256 mismatch).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.reference.rule09_disagg import REQUIRED_KV_FIELDS, validate_kv_descriptor

__all__ = [
    "ENTRY_FORMAT", "FRAME_MAGIC", "LAYOUT", "MISMATCH_KIND", "REJECT_KINDS", "Delivery",
    "check_delivery", "decode_frame", "encode_frame", "entry_key", "make_descriptor",
    "make_header", "parse_entry", "seal", "token_ids_hash",
]

ENTRY_FORMAT = "kvlab-kv/1"
FRAME_MAGIC = b"KVLABKV1"
LAYOUT = "token-major:layers.{l}.{key,value}[tokens,kv_heads,head_dim]"

MISMATCH_KIND: dict[str, str] = {
    "model_version": "stale_model_version",
    "security_domain": "security_domain",
    "token_ids_hash": "wrong_tokens",
    "request_id": "wrong_request",
    "layers": "incompatible",
    "kv_heads": "incompatible",
    "head_dim": "incompatible",
    "dtype": "incompatible",
    "layout": "incompatible",
    "rope": "incompatible",
}
"""Which rejection kind a mismatch of each descriptor field counts as."""

REJECT_KINDS = ("corrupt_descriptor", "stale_model_version", "security_domain", "wrong_tokens",
                "wrong_request", "incompatible", "truncated", "corrupt_payload")
"""Every reason :func:`check_delivery` can give, in the order it checks them."""


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def token_ids_hash(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of the exact token ids, each as a signed 64-bit little-endian int."""
    ids = list(token_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def entry_key(token_hash: str, security_domain: str) -> str:
    """Where an entry lives: 32 hex digits of SHA-256 over the prompt hash and the tenant."""
    return hashlib.sha256(f"{token_hash}|{security_domain}".encode()).hexdigest()[:32]


def make_descriptor(request_id: str, token_ids: Sequence[int], security_domain: str,
                    model_fields: Mapping[str, Any]) -> dict[str, Any]:
    """The immutable descriptor: ``model_fields`` (model_version, layers, kv_heads, head_dim,
    dtype, layout, rope) plus the request's id, prompt hash and security domain."""
    d = dict(model_fields)
    d.update(request_id=request_id, token_ids_hash=token_ids_hash(token_ids),
             security_domain=security_domain)
    missing = REQUIRED_KV_FIELDS - d.keys()
    if missing:
        raise ValueError(f"make_descriptor: model_fields lack {sorted(missing)}")
    return d


def seal(header: dict[str, Any]) -> dict[str, Any]:
    """``header`` with ``header_sha256`` recomputed over its other fields (a checksum against
    damage, not a signature: anyone can call this)."""
    body = {k: v for k, v in header.items() if k != "header_sha256"}
    return {**body, "header_sha256": hashlib.sha256(_canonical(body)).hexdigest()}


def make_header(descriptor: Mapping[str, Any], num_tokens: int, payload: bytes) -> dict[str, Any]:
    """The sealed header of an entry whose payload covers ``num_tokens`` prompt tokens."""
    key = entry_key(descriptor["token_ids_hash"], descriptor["security_domain"])
    digest = hashlib.sha256(payload).hexdigest()
    entry_id = hashlib.sha256(_canonical([dict(descriptor), digest])).hexdigest()[:20]
    return seal({"format": ENTRY_FORMAT, "key": key, "entry_id": entry_id,
                 "descriptor": dict(descriptor), "num_tokens": int(num_tokens),
                 "payload_bytes": len(payload), "payload_sha256": digest})


def encode_frame(header: Mapping[str, Any], payload: bytes) -> bytes:
    """One stream frame: magic, header length, canonical header JSON, payload."""
    blob = _canonical(dict(header))
    return FRAME_MAGIC + struct.pack(">I", len(blob)) + blob + payload


@dataclass
class Delivery:
    """One entry as a consumer received it (possibly damaged; nothing here is trusted yet).

    ``header`` is the parsed JSON (None if unparseable), ``payload`` the bytes that arrived;
    ``problem`` is set when the bytes could not even be split into header and payload.
    """

    header: dict[str, Any] | None
    payload: bytes
    problem: str | None = None
    source: str = ""                   # "storage", "tcp", "inprocess": for traces
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str | None:
        h = self.header
        return h.get("key") if isinstance(h, dict) and isinstance(h.get("key"), str) else None

    @property
    def entry_id(self) -> str:
        h = self.header
        eid = h.get("entry_id") if isinstance(h, dict) else None
        return eid if isinstance(eid, str) else "?"

    @property
    def descriptor(self) -> dict[str, Any]:
        h = self.header
        d = h.get("descriptor") if isinstance(h, dict) else None
        return d if isinstance(d, dict) else {}

    @property
    def num_tokens(self) -> int:
        h = self.header
        n = h.get("num_tokens") if isinstance(h, dict) else None
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0


def parse_entry(header_bytes: bytes, payload: bytes, source: str = "") -> Delivery:
    """A :class:`Delivery` from raw header bytes and payload; never raises."""
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return Delivery(None, payload, "corrupt_descriptor", source)
    if not isinstance(header, dict):
        return Delivery(None, payload, "corrupt_descriptor", source)
    return Delivery(header, payload, None, source)


def decode_frame(frame: bytes, source: str = "") -> Delivery:
    """Split one frame (see the module docstring); never raises. A frame shorter than its
    header is ``corrupt_descriptor``; a short payload is left for :func:`check_delivery`."""
    if len(frame) < 12 or frame[:8] != FRAME_MAGIC:
        return Delivery(None, frame, "corrupt_descriptor", source)
    (n,) = struct.unpack(">I", frame[8:12])
    if len(frame) < 12 + n:
        return Delivery(None, b"", "corrupt_descriptor", source)
    return parse_entry(frame[12:12 + n], frame[12 + n:], source)


def check_delivery(delivery: Delivery, expected: Mapping[str, Any]) -> str | None:
    """The first reason not to install ``delivery`` (one of :data:`REJECT_KINDS`), or None.

    ``expected`` is the consumer's own expectation of the descriptor fields (its model, layout,
    the request's prompt hash and security domain); the reference ``validate_kv_descriptor``
    compares them, and a mismatch is classified by its first field in :data:`MISMATCH_KIND`
    order.
    """
    if delivery.problem is not None:
        return delivery.problem
    header = delivery.header
    assert header is not None
    if header.get("format") != ENTRY_FORMAT or seal(header) != header:
        return "corrupt_descriptor"
    desc = header.get("descriptor")
    n_bytes, digest = header.get("payload_bytes"), header.get("payload_sha256")
    if (not isinstance(desc, dict) or not isinstance(n_bytes, int)
            or not isinstance(digest, str) or delivery.num_tokens != header.get("num_tokens")):
        return "corrupt_descriptor"
    try:
        validate_kv_descriptor(desc, dict(expected))
    except ValueError:
        if REQUIRED_KV_FIELDS - desc.keys():
            return "corrupt_descriptor"
        bad = [k for k in MISMATCH_KIND if k in expected and desc.get(k) != expected[k]]
        return MISMATCH_KIND[bad[0]]
    if len(delivery.payload) < n_bytes:
        return "truncated"
    if len(delivery.payload) != n_bytes or hashlib.sha256(delivery.payload).hexdigest() != digest:
        return "corrupt_payload"
    return None
