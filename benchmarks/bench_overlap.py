"""Overlap ("async") scheduling on the CPU: kvlab's tokens per second with it off and on.

With ``async_scheduling=True`` the engine core runs each step's forward on a worker thread and
plans the next step meanwhile (scheduling, metadata, and the previous step's update and output
processing), so the host work of step n+1 hides behind the forward of step n. On a CPU that
host work is a few percent of a step, torch releases the GIL inside its kernels but not in the
Python around them, and the forward already uses the cores: the gain is bounded by that share.

Models: the shipped kvlab-tiny (trained weights) and the seeded random ~25M Llama of
``bench_vs_vllm.py`` (hidden 512, 6 layers, vocab 2048). Workloads: ``bench_vs_vllm.py``'s
``mixed``, ``long`` and ``chat`` (greedy, ``ignore_eos``, fresh token ids each run). Engines,
each in its own process (``_engine_driver.py``), one torch thread, on the same two CPUs:
``sync`` and ``async`` (what overlap adds is a second thread, which the second CPU runs); and
both again pinned to one CPU (``sync_1cpu``, ``async_1cpu``: overlap without a spare core, the
two threads take turns). Runs alternate between the engines; each keeps its best of
``--repeats`` (wall and CPU separately). The greedy tokens of every run must be identical
across the engines (exit status 1 after the JSON otherwise). The one-minute load average is
recorded with every run. Wall-clock first, CPU time beside it.

Run: ``python benchmarks/bench_overlap.py`` (writes benchmarks/results/overlap.json after each
size, ``complete: false`` until the last).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import write_results  # noqa: E402
from bench_vs_vllm import ENGINES, REPO, SIZES, Engine, best, run_variants, write_checkpoint  # noqa: E402

#: the variants compared: name -> (engine of bench_vs_vllm.ENGINES, CPUs it may use)
VARIANTS = {"sync": ("kvlab", 2), "async": ("kvlab_async", 2),
            "sync_1cpu": ("kvlab", 1), "async_1cpu": ("kvlab_async", 1)}
MODELS = {"kvlab-tiny": (REPO / "kvlab" / "models" / "kvlab-tiny", 1024), "25M": (None, 2048)}


def measure(size: str, model: Path, vocab: int, repeats: int, seed: int,
            workload_names: list[str]) -> dict:
    """Every variant on every workload of ``model``, runs interleaved; ratios to ``sync``."""
    variants = run_variants(vocab, seed, repeats)
    variants = {k: v for k, v in variants.items() if k.split("-")[0] in workload_names
                or k.startswith("warmup-")}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(variants, f)
    engines: dict[str, Engine] = {}
    runs: dict[str, dict[str, list]] = {w: {v: [] for v in VARIANTS} for w in workload_names}
    try:
        for name, (engine, cores) in VARIANTS.items():
            engines[name] = Engine(engine, Path(sys.executable), model, Path(f.name), 1, cores)
        for r in range(repeats):
            for w in workload_names:
                for name, engine in engines.items():
                    runs[w][name].append(engine.run(f"{w}-{r}"))
    finally:
        for engine in engines.values():
            engine.close()
        os.unlink(f.name)
    out = {"startup": {n: e.ready for n, e in engines.items()}, "workloads": {}}
    ok = True
    for w, r in runs.items():
        same = all(x["outputs"] == ref["outputs"] for v in r.values()      # run by run
                   for x, ref in zip(v, r["sync"], strict=True))
        ok &= same
        b = {v: best(x) for v, x in r.items()}
        s = b["sync"]
        load = [x["load_1min"] for v in r.values() for x in v]
        out["workloads"][w] = {
            "requests": len(variants[f"{w}-0"]),
            "generated_tokens": s["generated_tokens"],
            **{f"{v}_vs_sync_wall": b[v]["tokens_per_s"] / s["tokens_per_s"]
               for v in VARIANTS if v != "sync"},
            **{f"{v}_vs_sync_cpu": b[v]["tokens_per_cpu_s"] / s["tokens_per_cpu_s"]
               for v in VARIANTS if v != "sync"},
            **b, "identical_tokens": same, "load_1min": [min(load), max(load)]}
        o = out["workloads"][w]
        one = b["async_1cpu"]["tokens_per_s"] / b["sync_1cpu"]["tokens_per_s"]
        o["async_vs_sync_wall_1cpu"] = one
        print(f"{size:>10s} {w:6s} tok/s (CPU tok/s): sync {s['tokens_per_s']:6.0f} "
              f"({s['tokens_per_cpu_s']:6.0f}) | async {b['async']['tokens_per_s']:6.0f} "
              f"({b['async']['tokens_per_cpu_s']:6.0f}) | async/sync wall "
              f"{o['async_vs_sync_wall']:.3f}x (cpu {o['async_vs_sync_cpu']:.3f}x), on one CPU "
              f"{one:.3f}x | load {min(load):.1f}-{max(load):.1f} | identical {same}",
              flush=True)
    out["identical_tokens"] = ok
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="kvlab-tiny,25M")
    ap.add_argument("--workloads", default="mixed,chat,long")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="overlap")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    names = [w for w in args.workloads.split(",") if w]
    if any(s not in MODELS for s in sizes) or args.repeats < 1 or not names or any(
            w not in ("mixed", "long", "chat") for w in names):
        raise SystemExit(f"bad arguments: sizes {sizes} (have {sorted(MODELS)}), workloads "
                         f"{names} (mixed, long, chat), repeats {args.repeats}")
    assert all(e in ENGINES for e, _ in VARIANTS.values())
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvlab-overlap-"))
    result: dict = {"machine": {"cpu": platform.processor() or platform.machine(),
                                "cpus": os.cpu_count(), "python": platform.python_version()},
                    "headline": "tokens per wall second, async / sync (*_vs_sync_wall); per "
                                "process CPU-second beside it (*_vs_sync_cpu)",
                    "variants": {v: {"engine": e, "cpus": c} for v, (e, c) in VARIANTS.items()},
                    "results": {}}
    ok = True
    for size in sizes:
        model, vocab = MODELS[size]
        if model is None:
            model = write_checkpoint(size, root)
            result.setdefault("random_checkpoints", {})[size] = SIZES[size]
        r = measure(size, model, vocab, args.repeats, args.seed, names)
        result["results"][size] = r
        ok &= r["identical_tokens"]
        result["identical_tokens"] = ok
        result["bench_wall_s"] = time.perf_counter() - t0
        result["complete"] = size == sizes[-1]
        write_results(args.out, result)   # after every size: a run cut short keeps what it has
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
