"""The book's KV-transfer arithmetic: how long moving one request's prefill KV takes.

``seconds = latency + kv_bytes(prompt) / bandwidth``, with the bytes from the reference
:func:`~kvlab.reference.rule01_capacity.kv_bytes` (chapter 1) and one-direction link
bandwidths. The links are nominal figures from the vendors' specifications (per GPU, one
direction); real transfers reach a fraction of them, which is why the efficiency factor exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.reference.rule01_capacity import kv_bytes
from kvlab.sim.catalog import GB, ModelShape

__all__ = ["LINKS", "Link", "kv_transfer_bytes", "transfer_seconds", "transfer_table"]


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float        # bytes per second, one direction
    latency: float          # seconds per transfer (setup, first byte)
    source: str


LINKS: dict[str, Link] = {link.name: link for link in (
    Link("NVLink 4 (H100)", 450 * GB, 5e-6,
         "https://www.nvidia.com/en-us/data-center/nvlink/ (900 GB/s total, 450 each way)"),
    Link("InfiniBand NDR 400G", 50 * GB, 10e-6,
         "https://www.nvidia.com/en-us/networking/infiniband-adapters/ (400 Gb/s per port)"),
    Link("RoCE 400GbE", 50 * GB, 20e-6, "IEEE 802.3ck 400 Gb/s Ethernet (400 Gb/s per port)"),
    Link("PCIe Gen5 x16", 64 * GB, 10e-6, "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, ~64 GB/s"),
)}


def kv_transfer_bytes(model: ModelShape, prompt_tokens: int, element_bytes: float = 2.0) -> float:
    """Bytes of one request's prefill KV: every layer's K and V for ``prompt_tokens``."""
    return kv_bytes(model.layers, 1, prompt_tokens, model.kv_heads, model.head_dim,
                    element_bytes)


def transfer_seconds(nbytes: float, link: Link, efficiency: float = 1.0) -> float:
    """Seconds to move ``nbytes`` over ``link`` at ``efficiency`` of its nominal bandwidth."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return link.latency + nbytes / (link.bandwidth * efficiency)


def transfer_table(models: list[ModelShape], prompt_tokens: int,
                   element_bytes: float = 2.0) -> list[dict]:
    """One row per model: KV bytes of a ``prompt_tokens`` prefill and seconds on every link."""
    rows = []
    for m in models:
        nbytes = kv_transfer_bytes(m, prompt_tokens, element_bytes)
        rows.append({"model": m.name, "prompt_tokens": prompt_tokens, "kv_bytes": nbytes,
                     "bytes_per_token": nbytes / prompt_tokens,
                     "seconds": {name: transfer_seconds(nbytes, link)
                                 for name, link in LINKS.items()}})
    return rows
