"""Where a CUDA decode step's time goes (one GPU): kvlab on the 0.5B-class random Llama of
``gpu_check.py`` at batch 1 and 64, torch.profiler over a few steps: CPU time by operator,
kernel-launch calls per step (a replayed CUDA graph is one ``cudaGraphLaunch``), GPU operations
per step, GPU busy time per step against the step's wall time; the engine's own phase counters
(schedule, metadata, forward, sampling, output: host milliseconds per step, where a phase that
waits for the GPU absorbs its time) and the host functions that take the most time per step
(cProfile). Twice: the engine's default
(decode in CUDA graphs, fused Triton ops) and eager with torch ops (``enforce_eager=True``,
``KVLAB_FUSED_OPS=0``, the path before them). For finding what to optimise; it asserts nothing
and writes ``benchmarks/results/gpu_decode_profile.json`` (``batches``: the default engine,
``eager``: the other). :func:`profile_steps` is shared with ``gpu_check.py``.

Run on a GPU machine: ``python benchmarks/profile_gpu_decode.py``; ``--smoke`` runs it on CPU
with a tiny model into a temporary folder (``tests/test_gpu_check_smoke.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

#: host API calls that launch work on the GPU (name prefixes): one per kernel, one per replayed
#: graph
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch")


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def profile_steps(eng, steps: int, table_rows: int = 0) -> dict:
    """Profile ``steps`` calls of ``eng.step()`` (every one a decode of the same batch):
    launch calls, GPU operations and GPU busy milliseconds per step, and the profiled step's
    wall time. On CPU the GPU fields are 0. ``table_rows`` > 0 prints the top operators."""
    cuda = eng.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(eng.device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            eng.step()
        sync(eng.device)
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    # by prefix: some CUDA versions report versioned names (``cudaGraphLaunch_v10000``)
    launches = sum(e.count for e in events if e.key.startswith(LAUNCH_CALLS))
    graph_launches = sum(e.count for e in events if e.key.startswith("cudaGraphLaunch"))
    # GPU-side events only: a CPU operator (aten::mm) also carries the time of the kernels it
    # launched, which are listed again on their own, so summing every event counts them twice
    gpu = [e for e in events
           if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    device_ops = sum(e.count for e in gpu)
    busy_us = sum(getattr(e, "self_device_time_total", 0) for e in gpu) / steps
    if table_rows:
        print(events.table(sort_by="self_cpu_time_total", row_limit=table_rows))
    gpu.sort(key=lambda e: -e.self_device_time_total)
    return {"kernel_launches_per_step": launches / steps,
            "graph_launches_per_step": graph_launches / steps,
            "gpu_ops_per_step": device_ops / steps, "gpu_busy_ms_per_step": busy_us / 1e3,
            "step_ms_profiled": 1e3 * wall,
            "gpu_top": [{"name": e.key[:120], "calls_per_step": e.count / steps,
                         "us_per_step": e.self_device_time_total / steps} for e in gpu[:12]]}


#: the engine's phase counters (:class:`kvlab.engine.outputs.EngineStats`) by phase name
PHASE_FIELDS = {"schedule": "schedule_time_s", "metadata": "prepare_time_s",
                "forward": "model_time_s", "sampling": "sample_time_s"}


def host_phases(eng, steps: int) -> dict:
    """Host milliseconds per step by phase over ``steps`` calls of ``eng.step()``, from the
    engine's own counters; ``output`` is the rest of ``step()``."""
    st = eng.stats
    before = {f: getattr(st, f) for f in (*PHASE_FIELDS.values(), "step_time_s")}
    for _ in range(steps):
        eng.step()
    sync(eng.device)
    d = {f: (getattr(st, f) - v) * 1e3 / steps for f, v in before.items()}
    out = {name: d[field] for name, field in PHASE_FIELDS.items()}
    out["output"] = d["step_time_s"] - sum(out.values())
    out["step"] = d["step_time_s"]
    return out


def host_functions(eng, steps: int, rows: int = 20) -> list[dict]:
    """The ``rows`` host functions with the most own time per step (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    sync(eng.device)
    prof.disable()
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]
    return [{"function": f"{Path(file).name}:{line}:{name}", "calls_per_step": cc / steps,
             "own_ms_per_step": 1e3 * tt / steps, "cum_ms_per_step": 1e3 * ct / steps}
            for (file, line, name), (_, cc, tt, ct, _) in top]


def profile_engine(path: Path, batches: tuple[int, ...], *, enforce_eager: bool,
                   fused: bool, steps: int = 10, device: str = "cuda") -> dict:
    """Build the engine on ``path`` and profile decode steps at each batch size."""
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    os.environ["KVLAB_FUSED_OPS"] = "1" if fused else "0"
    llm = LLM(path, device=device,
              dtype=torch.bfloat16 if device == "cuda" else torch.float32,
              max_num_seqs=max(batches), max_num_batched_tokens=8192,
              kv_cache_memory=(4 << 30) if device == "cuda" else (64 << 20),
              enforce_eager=enforce_eager)
    eng = llm.engine
    rng = random.Random(0)
    out = {}
    for b in batches:
        for i in range(b):
            prompt = [rng.randrange(eng.model.cfg.vocab_size)
                      for _ in range(256 if device == "cuda" else 12)]
            eng.add_request(f"b{b}-{i}", prompt,
                            SamplingParams(max_tokens=5 * steps + 12, temperature=0,
                                           ignore_eos=True))
        for _ in range(8):
            eng.step()
        stats = eng.stats
        before = (stats.step_time_s, stats.model_time_s)
        r = profile_steps(eng, steps, table_rows=18)
        sync(eng.device)
        t1 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(eng.device)
        r["step_ms_unprofiled"] = 1e3 * (time.perf_counter() - t1) / steps
        r["gpu_busy_share"] = r["gpu_busy_ms_per_step"] / r["step_ms_unprofiled"]
        r["model_share_of_step"] = ((stats.model_time_s - before[1])
                                    / max(stats.step_time_s - before[0], 1e-9))
        r["host_ms_per_step_by_phase"] = host_phases(eng, steps)
        r["host_functions"] = host_functions(eng, steps)
        for k in r["gpu_top"]:
            print(f"    GPU {k['us_per_step']:8.1f} us/step {k['calls_per_step']:6.1f}x  "
                  f"{k['name'][:90]}")
        print(f"=== batch {b}, host ms/step by phase: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step_by_phase"].items()))
        for f in r["host_functions"][:12]:
            print(f"    {f['own_ms_per_step']:7.3f} ms own  {f['cum_ms_per_step']:7.3f} cum  "
                  f"{f['calls_per_step']:6.1f}x  {f['function']}")
        print(f"=== batch {b}: {r}", flush=True)
        out[str(b)] = r
        while eng.has_unfinished_requests():
            eng.step()
    del llm, eng
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    from gpu_check import MODEL_0_5B, MODEL_SMOKE

    from kvlab.labs.parity.hf import save_random_hf_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="on CPU with a tiny model")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default benchmarks/results; --smoke: a temp folder)")
    args = ap.parse_args(argv)
    device, batches, steps = ("cpu", (1, 3), 2) if args.smoke else ("cuda", (1, 64), 10)
    out_dir = args.out or (Path(tempfile.mkdtemp(prefix="gpu_profile_smoke_"))
                           if args.smoke else None)
    if device == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(1, device="cuda").add_(1)   # CUPTI on before any graph is captured
    path = save_random_hf_model(Path(tempfile.mkdtemp()) / "llama", "llama", seed=0,
                                **(MODEL_SMOKE if args.smoke else MODEL_0_5B))
    kw = dict(steps=steps, device=device)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
           "torch": torch.__version__,
           "batches": profile_engine(path, batches, enforce_eager=False, fused=True, **kw),
           "eager": {"batches": profile_engine(path, batches, enforce_eager=True,
                                               fused=False, **kw)}}
    write_results("gpu_decode_profile", out, directory=out_dir)
    return out


if __name__ == "__main__":
    main()
