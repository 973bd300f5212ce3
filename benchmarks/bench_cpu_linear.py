"""The CPU's linear layers: ``F.linear`` vs oneDNN with the weight packed once
(:class:`kvlab.engine.linear.OneDnnLinearMethod`), at the projection shapes of bench_vs_vllm's ~25M
model
(hidden 512, 8/4 heads of 64, intermediate 2048, vocabulary 2048 for the logits' matmul) and a
real model's ``lm_head`` (TinyLlama-1.1B's: vocabulary 32,000, hidden 2,048, untied), at the
row counts of decode (1-64) and prefill chunks (256; the logits' matmul sees only the sampled
rows).

One torch thread; per case the two paths alternate for five rounds of ``--calls`` calls each
(fewer for a weight over 4M entries, about the same work), timed in process CPU time, best
round kept; the outputs' largest difference relative to the largest |output| is recorded.
Run: ``python benchmarks/bench_cpu_linear.py`` (writes benchmarks/results/cpu_linear.json).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import write_results

from kvlab.engine.linear import Linear, OneDnnLinearMethod

SHAPES = {"qkv": (1024, 512), "o": (512, 512), "gate_up": (4096, 512), "down": (512, 2048),
          "lm_head": (2048, 512), "lm_head 32K": (32000, 2048)}
ROWS = (1, 4, 16, 64, 256)


def cpu_time(layer: nn.Module, x: torch.Tensor, calls: int) -> float:
    t = time.process_time()
    for _ in range(calls):
        layer(x)
    return (time.process_time() - t) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not OneDnnLinearMethod.available(torch.float32):
        print("oneDNN linear is not available in this torch build")
        return 1
    gen = torch.Generator().manual_seed(0)
    cases = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            plain = nn.Linear(k, n, bias=False)
            packed = Linear(k, n, bias=False)
            packed.weight.copy_(plain.weight)
            assert packed.use_method(OneDnnLinearMethod())
            calls = args.calls if n * k <= 2**22 else max(3, args.calls * 2**22 // (n * k))
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                ref, out = F.linear(x, plain.weight), packed(x)
                rel = float((out - ref).abs().max() / ref.abs().max())
                best = {"F.linear": float("inf"), "packed": float("inf")}
                for _ in range(2):
                    plain(x), packed(x)
                for _ in range(5):
                    best["F.linear"] = min(best["F.linear"], cpu_time(plain, x, calls))
                    best["packed"] = min(best["packed"], cpu_time(packed, x, calls))
                speedup = best["F.linear"] / best["packed"]
                gflops = 2 * m * n * k / best["packed"] / 1e9
                cases.append({"layer": name, "rows": m, "out": n, "in": k,
                              "f_linear_us": best["F.linear"] * 1e6,
                              "packed_us": best["packed"] * 1e6, "speedup": speedup,
                              "packed_gflops": gflops, "max_rel_diff": rel})
                print(f"{name:11s} {m:4d} x {k:4d} -> {n:5d}  "
                      f"F.linear {best['F.linear'] * 1e6:8.1f} us  "
                      f"packed {best['packed'] * 1e6:8.1f} us  {speedup:5.2f}x  "
                      f"{gflops:6.1f} GFLOP/s  rel diff {rel:.1e}")
    speedups = [c["speedup"] for c in cases]
    print(f"packed / F.linear: {min(speedups):.2f}-{max(speedups):.2f}x")
    write_results("cpu_linear", {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "capability": torch.backends.cpu.get_cpu_capability(),
                    "torch": torch.__version__},
        "timing": "process CPU time, one thread, best of 5 interleaved rounds",
        "cases": cases, "speedup_range": [min(speedups), max(speedups)]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
