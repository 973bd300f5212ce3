"""KV transfer for prefill/decode disaggregation: bytes, transfer and install time, side by side.

For kvlab-tiny (float32, 4 layers, 2 KV heads of 32) and prompts of 64, 256 and 1024 tokens:

* **bytes**: the payload of one entry (safetensors) against ``kv_bytes`` of chapter 1 for the
  same tokens (the difference is the safetensors header), per request and per token;
* **transfer time** of one entry over each real connector: shared storage (atomic write with
  fsync + read back) and loopback TCP (connect, send, parse into the consumer's inbox);
* **install time**: decode + check + write of the payload into the consumer's paged cache;
* the **prefill it replaces**: the producer's prefill of a prompt of the same length on this CPU
  (median of several, each a fresh prompt so no prefix-cache hit), so the ratio says whether
  shipping KV beats recomputing it here; ``shipping_loses`` marks the lengths where it does not.

Torch's intra-op thread count is pinned (``--threads``, default 1) and recorded: left unset,
torch starts one thread per core, and on a machine shared with other processes the prefill
column then measures the oversubscription (an earlier run without pinning was 16-55x slow).
Pinned, the wall-clock prefill still includes the time the process waited for a CPU on a
loaded machine, so the prefill's process CPU time is recorded beside it (``prefill_cpu_s``;
with one thread it is the prefill's own cost) and the ratio is given against both.

Then the book's arithmetic: seconds per request for the catalogue models' KV (bf16) at NVLink,
InfiniBand/RoCE and PCIe Gen5 bandwidths (:mod:`kvlab.labs.capacity.transfer_cost`).

Run: ``python benchmarks/bench_pd_transfer.py [--threads N]``. Writes
``benchmarks/results/pd_transfer.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch
from _results import write_results

from kvlab.core.sampling_params import SamplingParams
from kvlab.disagg.entry import check_delivery, encode_frame, make_descriptor, make_header
from kvlab.disagg.transfer_faults import SendPlan
from kvlab.engine.checkpoint import load_checkpoint
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.kv_transfer import KVPayloadCodec, engine_model_fields
from kvlab.engine.kv_transfer.connectors import SharedStorageConnector, TcpConnector
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.capacity.transfer_cost import LINKS, transfer_table
from kvlab.reference import kv_bytes
from kvlab.sim.catalog import MODELS

PROMPTS = (64, 256, 1024)
REPEATS = 5
BLOCK = 16


def _median(fn, repeats=REPEATS):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(ckpt, fields, n: int) -> dict:
    """One prompt length: bytes, export, storage and TCP round trips, install, prefill."""
    cfg = ckpt.config
    engine = LLMEngine(EngineArgs(ckpt, block_size=BLOCK, num_blocks=2 * n // BLOCK + 8))
    prompt = [(13 * i) % 1000 + 2 for i in range(n)]

    def prefill(rid: str, ids: list[int]) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one prefill."""
        t0, c0 = time.perf_counter(), time.process_time()
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t0, time.process_time() - c0
    prefill("warm", [(17 * i) % 1000 + 2 for i in range(n)])   # this engine's first-step costs
    # fresh prompts of the same length (no prefix-cache hit), then the one that is shipped
    runs = [prefill(f"q{k}", [(31 * i + 7 * k) % 1000 + 2 for i in range(n)])
            for k in range(REPEATS)]
    prefill_s = statistics.median(w for w, _ in runs)
    prefill_cpu_s = statistics.median(c for _, c in runs)
    prefill("p", prompt)
    tokens = n // BLOCK * BLOCK
    blocks = list(range(tokens // BLOCK))     # the bytes do not depend on which blocks
    codec = KVPayloadCodec(engine.cache)
    payload = codec.export(blocks, tokens)
    desc = make_descriptor("p", prompt, "default", fields)
    header = make_header(desc, tokens, payload)
    frame = encode_frame(header, payload)
    ref = kv_bytes(cfg.num_layers, 1, tokens, cfg.num_kv_heads, cfg.head_dim, 4)
    export_s = _median(lambda: codec.export(blocks, tokens))

    with tempfile.TemporaryDirectory() as root:
        counter = iter(range(10**6))

        def storage_round_trip():   # a fresh directory each time: first writer wins
            store = SharedStorageConnector(f"{root}/{next(counter)}")
            store.send(header["key"], SendPlan([frame]))
            return store.fetch([header["key"]])[0]
        storage_s = _median(storage_round_trip)
    recv = TcpConnector("consumer")
    send = TcpConnector("producer", port=recv.port)

    def tcp_round_trip():
        send.send(header["key"], SendPlan([frame]))
        got = recv.fetch([header["key"]])
        assert len(got) == 1
        return got[0]
    tcp_s = _median(tcp_round_trip)
    delivery = tcp_round_trip()
    recv.close()
    expected = {k: v for k, v in desc.items() if k != "request_id"}

    def install():
        assert check_delivery(delivery, expected) is None
        codec.write(codec.decode(delivery, tokens), blocks, 0)
    install_s = _median(install)
    row = {
        "prompt_tokens": n, "transferred_tokens": tokens,
        "payload_bytes": len(payload), "frame_bytes": len(frame),
        "kv_bytes_chapter1": ref, "payload_over_kv_bytes": len(payload) / ref,
        "bytes_per_token": len(payload) / tokens,
        "prefill_s": prefill_s, "prefill_cpu_s": prefill_cpu_s, "export_s": export_s,
        "storage_round_trip_s": storage_s, "tcp_loopback_s": tcp_s, "install_s": install_s,
        "ship_over_recompute": (export_s + tcp_s + install_s) / prefill_s,
        "shipping_loses": export_s + tcp_s + install_s > prefill_s,
        # against the prefill's own CPU time (one thread: what waiting for a CPU on a shared
        # machine does not inflate); the shipping side stays wall-clock (sockets, copies)
        "ship_over_recompute_cpu": (export_s + tcp_s + install_s) / prefill_cpu_s,
        "shipping_loses_cpu": export_s + tcp_s + install_s > prefill_cpu_s,
        "tcp_MB_per_s": len(frame) / tcp_s / 1e6,
        "storage_MB_per_s": len(frame) / storage_s / 1e6,
    }
    r = row
    print(f"{n:5d} tokens: payload {r['payload_bytes']:>9,d} B "
          f"({r['payload_over_kv_bytes']:.4f} x kv_bytes), storage {storage_s * 1e3:7.2f} ms, "
          f"tcp {tcp_s * 1e3:6.2f} ms, install {install_s * 1e3:6.2f} ms, "
          f"prefill {prefill_s * 1e3:7.1f} ms (CPU {prefill_cpu_s * 1e3:7.1f} ms), "
          f"ship/recompute {r['ship_over_recompute']:.2f} "
          f"(CPU {r['ship_over_recompute_cpu']:.2f})")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (pinned and recorded; default 1)")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ckpt = load_checkpoint("kvlab-tiny")
    cfg = ckpt.config
    fields = engine_model_fields(ckpt.weights_hash, cfg, torch.float32)
    rows = []
    # first-call costs, not timed
    warm = LLMEngine(EngineArgs(ckpt, block_size=BLOCK, num_blocks=16))
    warm.add_request("w", list(range(2, 40)), SamplingParams(max_tokens=2, temperature=0.0))
    while warm.has_unfinished_requests():
        warm.step()
    for n in PROMPTS:
        rows.append(measure(ckpt, fields, n))
    book = {str(t): transfer_table(list(MODELS.values()), t) for t in (1024, 8192)}
    for t, table in book.items():
        for row in table:
            secs = ", ".join(f"{k.split(' (')[0]} {v * 1e3:.2f} ms"
                             for k, v in row["seconds"].items())
            print(f"{row['model']:>16s} {t:>5s} tok: {row['kv_bytes'] / 1e9:6.3f} GB  {secs}")
    write_results("pd_transfer", {
        "benchmark": "pd_transfer", "model": "kvlab-tiny", "dtype": "float32",
        "block_size": BLOCK, "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "ship_path": "export + tcp loopback + install", "rows": rows,
        "links": {k: {"bandwidth_bytes_per_s": v.bandwidth, "latency_s": v.latency,
                      "source": v.source} for k, v in LINKS.items()},
        "book_arithmetic_bf16": book,
    })


if __name__ == "__main__":
    main()
