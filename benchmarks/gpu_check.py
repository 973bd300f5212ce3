"""One GPU check (< 5 min on one GPU): the fused Triton ops and the Triton attention kernels vs
torch, decode speed with and without CUDA graphs and with overlap scheduling off and on, HF
parity with graphs on (and with overlap on). Writes
``benchmarks/results/gpu_check.json`` after every section, so a run cut short still leaves
what it measured (``complete: false``); a section that fails records its error and the run
goes on.

1. **Fused ops vs torch** (``fused_ops_vs_torch``): :mod:`kvlab.labs.parity.fused` on CUDA
   (RMSNorm with residual add, SiLU-and-mul, RoPE in float32 and bfloat16; kvlab-tiny's greedy
   tokens with and without them).
2. **Decode** of a 0.5B-class random Llama (Qwen2-0.5B's shape, bfloat16) at batch 1, 16 and
   64, every request decoding, in five engines: ``decode`` is the default (CUDA graphs and
   fused ops), ``decode_async`` the same with overlap scheduling (``async_scheduling=True``:
   step n+1 planned on the host while step n runs), ``decode_graphs_unfused`` (graphs, torch
   ops), ``decode_eager_fused`` and ``decode_eager`` (``enforce_eager=True``, torch ops: the
   path before graphs). Two timings: ``median_step_ms``, each step alone (a device
   synchronisation before and after it, which also drains overlap's pipeline), and
   ``steady_step_ms``, the same number of steps back to back with one synchronisation at each
   end (what a running server gets: the one that shows overlap). Per batch: both step times,
   tokens/s (steady), HBM bandwidth utilisation = (weight
   bytes + KV bytes read per step) / step time / peak (the peak looked up from the device name:
   H200, H100 SXM/PCIe, A100 40/80 GB; another GPU gets ``peak_bw_GBps: null`` and a flag),
   graph replays per step; and, for ``decode``, ``decode_async`` and ``decode_eager``, from
   ``torch.profiler``
   over a few steps of a second run made last (``profile``: a profiler failure cannot cost the
   timings): kernel-launch calls per step (a replayed graph is one), GPU operations per step,
   GPU busy time and its share of the steady step.
3. **HF parity on CUDA with graphs on** (``hf_parity_cuda``), and with overlap on too
   (``hf_parity_cuda_async``): kvlab generating greedily (float32, TF32 off, Triton decode,
   decode steps replayed from graphs) re-scored by transformers; every position.
4. **Triton attention vs torch**: every case of :mod:`kvlab.labs.parity.triton`.

``targets`` says which GPU targets hold for the default engine, and ``targets["overlap_on"]``
for ``decode_async`` (GPU busy >= 85% of the steady decode step at every batch, <= 4 ms per
steady step at batch 64, batch-1 tok/s >= 5x the eager engine's and >= the 476 of the
committed CUDA-graph run). The committed H200 run took 83 s before ``decode_async`` and
``hf_parity_cuda_async`` were added (not yet run on a GPU); ``--budget-s`` skips the sections
left past it. Exits with status
2 and a clear message when no CUDA device or no Triton is present. ``--smoke`` runs every
section on CPU with a tiny model (Triton under its interpreter, the graphs' CPU stand-in) into
``--out`` (a temporary folder by default), which ``tests/test_gpu_check_smoke.py`` runs, so the
script cannot fail on a trivial error when it reaches a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_results  # noqa: E402
from profile_gpu_decode import profile_steps, sync  # noqa: E402

#: Peak HBM bandwidth (GB/s) by a substring of ``torch.cuda.get_device_name()``, most specific
#: first (vendor data sheets).
PEAK_BW_GBPS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
                ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0)]

#: Qwen2-0.5B's shape as a Llama (~494M parameters with the tied embedding).
MODEL_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=4096, initializer_range=0.02,
                  tie_word_embeddings=True)

#: the smoke run's model (seconds on a CPU)
MODEL_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                   max_position_embeddings=256, initializer_range=0.02,
                   tie_word_embeddings=True)

#: batch-1 decode before CUDA graphs: the committed H200 run of this script (torch 2.11)
BASELINE_B1_TOK_S = 67.40

#: batch-1 decode with CUDA graphs: the committed H200 run of this script before overlap
BASELINE_GRAPHS_B1_TOK_S = 476.0

#: (name, enforce_eager, fused ops, async_scheduling): the decode engines, the default first,
#: then the ones ``profile`` profiles and the smoke run takes (the first three)
DECODE_CONFIGS = (("decode", False, True, False), ("decode_async", False, True, True),
                  ("decode_eager", True, False, False), ("decode_eager_fused", True, True, False),
                  ("decode_graphs_unfused", False, False, False))
PROFILED = 3


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BW_GBPS if key in name), None)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_fused(device: str) -> dict:
    from kvlab.labs.parity.fused import compare_engine, compare_ops

    out = {"ops_float32": compare_ops(device, torch.float32),
           "ops_bfloat16": compare_ops(device, torch.bfloat16),
           "engine": compare_engine(device)}
    # bfloat16: one rounding each way on a GPU (round to nearest even); two in the interpreter
    bf16_tol = 2 ** -6 if device == "cuda" else 2 ** -5
    # float32: a few ulps (the GPU's fast exp and rsqrt, FMA contraction, the sums' order)
    out["ok"] = (all(r["rel_vs_torch"] < 4e-6 for r in out["ops_float32"].values())
                 and all(r["rel_vs_float32"] < bf16_tol for r in out["ops_bfloat16"].values())
                 and out["engine"]["tokens_identical"]
                 and out["engine"]["max_logprob_diff"] < 1e-4)
    log(f"fused ops: ok={out['ok']} engine={out['engine']}")
    return out


def check_triton(device: str, limit: int | None = None) -> dict:
    from kvlab.labs.parity.triton import CASES, compare

    out = {}
    for name, case in list(CASES.items())[:limit]:
        r = compare(case, device)
        tol = 2e-5 if case.dtype == "float32" else 2 ** -5
        r["ok"] = r["store_exact"] and r["max_abs_diff_vs_torch_path"] < tol
        out[name] = r
        log(f"triton {name:20s} store exact {r['store_exact']}  max|diff| "
            f"{r['max_abs_diff_vs_torch_path']:.2e}  {'ok' if r['ok'] else 'FAIL'}")
    return out


def check_hf_parity(device: str, smoke: bool, async_scheduling: bool = False) -> dict:
    from kvlab.engine.cuda_graphs import counter
    from kvlab.labs.parity.hf import compare_with_hf, save_random_hf_model

    size = dict(MODEL_SMOKE) if smoke else dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=512)
    path = save_random_hf_model(Path(tempfile.mkdtemp()) / "parity", "llama", seed=1, **size)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 60))] for _ in range(8)]
    replays = counter.replayed
    rep = compare_with_hf(path, prompts, max_tokens=24, device=device, dtype=torch.float32,
                          block_size=16, kv_cache_memory=1 << 28,
                          async_scheduling=async_scheduling)
    r = {"sequences": rep.num_sequences, "positions": rep.num_tokens,
         "max_logprob_diff": rep.max_logprob_diff, "mismatches": rep.greedy_mismatches,
         "unexplained_mismatches": rep.unexplained_mismatches,
         "graph_replays": counter.replayed - replays, "async_scheduling": async_scheduling}
    r["ok"] = rep.ok(1e-3) and r["graph_replays"] > 0
    log(f"HF parity with graphs on{' and overlap' if async_scheduling else ''} ({device}): {r}")
    return r


def decode_run(path: Path, device: str, batches: list[int], steps: int, prompt: int, *,
               enforce_eager: bool, fused: bool, profile_steps_n: int,
               async_scheduling: bool = False) -> dict:
    """Decode at each batch size in one engine: timing, bandwidth, graph replays; the profile
    too when ``profile_steps_n`` > 0."""
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.cuda_graphs import counter
    from kvlab.engine.llm import LLM

    os.environ["KVLAB_FUSED_OPS"] = "1" if fused else "0"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    llm = LLM(path, device=device, dtype=dtype, max_num_seqs=max(batches),
              max_num_batched_tokens=8192, kv_cache_memory=4 << 30,
              enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    eng = llm.engine
    cfg = eng.model.cfg
    graphs = eng.executor.graphs
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * eng.cache.data.itemsize
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_bandwidth(name)
    out = {"device": name, "peak_bw_GBps": peak, "weight_bytes": weight_bytes,
           "params": cfg.num_params, "enforce_eager": enforce_eager, "fused_ops": fused,
           "async_scheduling": async_scheduling,
           "graph_sizes": list(graphs.sizes) if graphs is not None else None,
           "graph_capture_error": None if enforce_eager else counter.capture_error,
           "build_s": time.perf_counter() - t0, "batches": {}}
    if peak is None:
        out["flag"] = f"unknown peak bandwidth for {name!r}: utilisation not computed"
    rng = random.Random(0)
    for b in batches:
        for i in range(b):
            eng.add_request(f"b{b}-{i}", [rng.randrange(cfg.vocab_size) for _ in range(prompt)],
                            SamplingParams(max_tokens=2 * steps + profile_steps_n + 8,
                                           temperature=0, ignore_eos=True))
        while True:  # prefill until every request decodes
            eng.step()
            chunks = eng.last_trace.scheduler_output.chunks
            if len(chunks) == b and all(c.num_tokens == 1 for c in chunks):
                break
        times, kv_bytes, replays = [], 0, counter.replayed
        for _ in range(steps):
            sync(device)
            t1 = time.perf_counter()
            eng.step()
            sync(device)
            times.append(time.perf_counter() - t1)
            chunks = eng.last_trace.scheduler_output.chunks
            kv_bytes += sum(c.start_pos + 1 for c in chunks) * kv_per_token
        step_s = sorted(times)[len(times) // 2]
        graph_replays = (counter.replayed - replays) / steps
        sync(device)      # the same steps back to back: overlap keeps its pipeline full
        t1 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(device)
        steady_s = (time.perf_counter() - t1) / steps
        bytes_per_step = weight_bytes + kv_bytes / steps
        r = {"median_step_ms": 1e3 * step_s, "steady_step_ms": 1e3 * steady_s,
             "tokens_per_s": b / steady_s, "tokens_per_s_median": b / step_s,
             "bytes_per_step": bytes_per_step,
             "achieved_GBps": bytes_per_step / steady_s / 1e9,
             "bw_utilisation": (bytes_per_step / steady_s / 1e9 / peak) if peak else None,
             "graph_replays_per_step": graph_replays}
        try:
            if profile_steps_n:
                r.update(busy_share(profile_steps(eng, profile_steps_n), r, device))
        except Exception as error:   # the timings stand without the profile
            r["profile_error"] = f"{type(error).__name__}: {error}"
        out["batches"][str(b)] = r
        busy = r.get("gpu_busy_share")
        log(f"  batch {b:3d}: {r['median_step_ms']:.2f} ms/step alone, "
            f"{r['steady_step_ms']:.2f} steady, {r['tokens_per_s']:.0f} tok/s, "
            f"{r['achieved_GBps']:.0f} GB/s, launches/step "
            f"{r.get('kernel_launches_per_step', float('nan')):.0f}, GPU busy "
            f"{'n/a' if busy is None else f'{busy:.0%}'}, graph replays/step "
            f"{r['graph_replays_per_step']:.2f}")
        while eng.has_unfinished_requests():
            eng.step()
    del llm, eng, graphs
    free_memory()
    return out


#: what :func:`profile_decode` merges into a timed row
PROFILE_KEYS = ("kernel_launches_per_step", "graph_launches_per_step", "gpu_ops_per_step",
                "gpu_busy_ms_per_step", "step_ms_profiled", "gpu_top", "flag",
                "profile_error")


def busy_share(prof: dict, timed: dict, device: str) -> dict:
    """``prof`` (:func:`profile_steps`) with the GPU-busy share of the ``timed`` steady step."""
    seen = device == "cuda" and prof["gpu_ops_per_step"] > 0
    prof["gpu_busy_share"] = (prof["gpu_busy_ms_per_step"] / timed["steady_step_ms"]
                              if seen else None)
    if device == "cuda" and not seen:
        prof["flag"] = "the profiler saw no GPU operations: busy share not measured"
    return prof


def profile_decode(result: dict, path: Path, device: str, batches: list[int], prompt: int,
                   profile_steps_n: int) -> dict:
    """The profile of the default, the overlapped and the eager engine, run after every timing
    (a profiler failure cannot cost the step times): each batch's figures are merged into its
    row of ``result[name]``, the busy share against that row's steady step."""
    out = {}
    for name, eager, fused, overlap in DECODE_CONFIGS[:PROFILED]:
        timed = result.get(name, {}).get("batches")
        if not timed:
            continue
        run = decode_run(path, device, batches, 2, prompt, enforce_eager=eager, fused=fused,
                         profile_steps_n=profile_steps_n, async_scheduling=overlap)
        out[name] = {}
        for b, r in run["batches"].items():
            prof = {k: r[k] for k in PROFILE_KEYS if k in r}
            if "profile_error" not in prof and b in timed:
                prof = busy_share(prof, timed[b], device)
                timed[b].update(prof)
            out[name][b] = prof
    return out


def targets(result: dict, name: str = "decode") -> dict:
    """The GPU targets against engine ``name``'s figures (None: not measured); the default
    engine's, with ``overlap_on`` (``decode_async``'s) inside."""
    dec = result.get(name, {}).get("batches", {})
    eager = result.get("decode_eager", {}).get("batches", {})
    b1, b64 = dec.get("1", {}), dec.get("64", {})
    busy = [r.get("gpu_busy_share") for r in dec.values()]
    out = {"gpu_busy_share_min": min(busy) if busy and None not in busy else None,
           "step_ms_batch64": b64.get("steady_step_ms"),
           "tok_s_batch1": b1.get("tokens_per_s"),
           "tok_s_batch1_vs_committed_eager": (b1["tokens_per_s"] / BASELINE_B1_TOK_S
                                               if "tokens_per_s" in b1 else None),
           "tok_s_batch1_vs_this_run_eager": (
               b1["tokens_per_s"] / eager["1"]["tokens_per_s"]
               if "tokens_per_s" in b1 and "1" in eager else None)}
    out["busy_ge_85pct"] = None if out["gpu_busy_share_min"] is None else (
        out["gpu_busy_share_min"] >= 0.85)
    out["step_le_4ms_at_64"] = None if out["step_ms_batch64"] is None else (
        out["step_ms_batch64"] <= 4.0)
    ratio = out["tok_s_batch1_vs_committed_eager"]
    out["batch1_ge_5x"] = None if ratio is None else ratio >= 5.0
    out["batch1_ge_committed_graphs"] = (None if out["tok_s_batch1"] is None
                                         else out["tok_s_batch1"] >= BASELINE_GRAPHS_B1_TOK_S)
    if name == "decode":
        out["overlap_on"] = targets(result, "decode_async")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per batch")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--profile-steps", type=int, default=8, help="profiled steps per batch")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="skip the sections left once this many seconds have passed")
    ap.add_argument("--smoke", action="store_true",
                    help="every section on CPU with a tiny model (no GPU needed)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default benchmarks/results; --smoke: a temp folder)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"   # before Triton is first imported
        device, batches, steps, prompt = "cpu", [1, 3], 3, 12
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="gpu_check_smoke_"))
        from kvlab.engine import engine_build  # the graphs' CPU stand-in, as the tests do
        engine_build.use_decode_graphs = lambda *a: not a[0].enforce_eager
    else:
        device, batches, steps, prompt = "cuda", [1, 16, 64], args.steps, args.prompt
        out_dir = args.out
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (torch.cuda.is_available() is False); this check "
                  f"needs one GPU (torch {torch.__version__}); --smoke runs it on CPU.",
                  file=sys.stderr)
            sys.exit(2)
    from kvlab.kernels import triton as triton_kernels

    if not triton_kernels.available():
        print("gpu_check: triton is not installed (pip install -e '.[gpu]').", file=sys.stderr)
        sys.exit(2)
    if device == "cuda":   # start CUPTI before any graph is captured, so it traces their kernels
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(1, device="cuda").add_(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    result = {"benchmark": "gpu_check", "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
              "smoke": args.smoke, "complete": False}
    model_path: list[Path] = []

    def model() -> Path:
        if not model_path:
            from kvlab.labs.parity.hf import save_random_hf_model
            log("saving the random decode model")
            model_path.append(save_random_hf_model(
                Path(tempfile.mkdtemp()) / "llama", "llama", seed=0,
                **(MODEL_SMOKE if args.smoke else MODEL_0_5B)))
        return model_path[0]

    sections: dict[str, Callable[[], dict]] = {
        "fused_ops_vs_torch": lambda: check_fused(device)}
    # the smoke run: the two kinds of engine and two Triton cases are code enough
    for name, eager, fused, overlap in (DECODE_CONFIGS[:PROFILED] if args.smoke
                                        else DECODE_CONFIGS):
        sections[name] = (lambda eager=eager, fused=fused, overlap=overlap: decode_run(
            model(), device, batches, steps, prompt, enforce_eager=eager, fused=fused,
            profile_steps_n=0, async_scheduling=overlap))
    sections["hf_parity_cuda"] = lambda: check_hf_parity(device, args.smoke)
    sections["hf_parity_cuda_async"] = lambda: check_hf_parity(device, args.smoke, True)
    sections["triton_vs_torch"] = lambda: check_triton(device, 2 if args.smoke else None)
    sections["profile"] = lambda: profile_decode(
        result, model(), device, batches, prompt, 2 if args.smoke else args.profile_steps)
    for key, run in sections.items():
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            result[key] = {"skipped": f"time budget: {elapsed:.0f} s > {args.budget_s:.0f} s"}
            log(f"{key}: skipped (time budget)")
            continue
        log(f"{key}: start")
        try:
            result[key] = run()
        except Exception as error:  # record it and go on: one GPU run reports every section
            result[key] = {"error": f"{type(error).__name__}: {error}",
                           "traceback": traceback.format_exc()[-3000:]}
            log(f"{key} failed: {result[key]['traceback']}")
        free_memory()
        result["wall_s"] = time.perf_counter() - t0
        write_results("gpu_check", result, directory=out_dir)
    triton = result["triton_vs_torch"]
    result["targets"] = targets(result)
    result["ok"] = (not any("error" in result[k] or "skipped" in result[k] for k in sections)
                    and all(r["ok"] for r in triton.values())
                    and result["fused_ops_vs_torch"]["ok"] and result["hf_parity_cuda"]["ok"]
                    and result["hf_parity_cuda_async"]["ok"])
    result["complete"] = True
    result["wall_s"] = time.perf_counter() - t0
    write_results("gpu_check", result, directory=out_dir)
    log(f"done in {result['wall_s']:.0f} s: ok={result['ok']} targets={result['targets']}")
    return result


if __name__ == "__main__":
    main()
