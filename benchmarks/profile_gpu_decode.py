"""Where a CUDA decode step's time goes (one GPU): kvlab on the 0.5B-class random Llama of
``gpu_check.py`` at batch 1 and 64, torch.profiler over a few steps: CPU time by operator,
kernel-launch calls per step (a replayed CUDA graph is one ``cudaGraphLaunch``), GPU operations
per step, GPU busy time per step against the step's wall time. Twice: the engine's default
(decode in CUDA graphs, fused Triton ops) and eager with torch ops (``enforce_eager=True``,
``KVLAB_FUSED_OPS=0``, the path before them). For finding what to optimise; it asserts nothing
and writes ``benchmarks/results/gpu_decode_profile.json`` (``batches``: the default engine,
``eager``: the other). :func:`profile_steps` is shared with ``gpu_check.py``.

Run on a GPU machine: ``python benchmarks/profile_gpu_decode.py``.
"""

from __future__ import annotations

import gc
import os
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
    device_ops = sum(e.count for e in events
                     if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    busy_us = sum(getattr(e, "self_device_time_total", 0) for e in events) / steps
    if table_rows:
        print(events.table(sort_by="self_cpu_time_total", row_limit=table_rows))
    return {"kernel_launches_per_step": launches / steps,
            "graph_launches_per_step": graph_launches / steps,
            "gpu_ops_per_step": device_ops / steps, "gpu_busy_ms_per_step": busy_us / 1e3,
            "step_ms_profiled": 1e3 * wall}


def profile_engine(path: Path, batches: tuple[int, ...], *, enforce_eager: bool,
                   fused: bool, steps: int = 10) -> dict:
    """Build the engine on ``path`` and profile decode steps at each batch size."""
    from kvlab.engine.llm import LLM
    from kvlab.engine.sampler import SamplingParams

    os.environ["KVLAB_FUSED_OPS"] = "1" if fused else "0"
    llm = LLM(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=max(batches),
              max_num_batched_tokens=8192, kv_cache_memory=4 << 30,
              enforce_eager=enforce_eager)
    eng = llm.engine
    rng = random.Random(0)
    out = {}
    for b in batches:
        for i in range(b):
            eng.add_request(f"b{b}-{i}", [rng.randrange(1000) for _ in range(256)],
                            SamplingParams(max_tokens=3 * steps + 12, temperature=0,
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
        print(f"=== batch {b}: {r}", flush=True)
        out[str(b)] = r
        while eng.has_unfinished_requests():
            eng.step()
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> dict:
    from gpu_check import MODEL_0_5B

    from kvlab.engine.hf_parity import save_random_hf_model

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        torch.ones(1, device="cuda").add_(1)   # CUPTI on before any graph is captured
    path = save_random_hf_model(Path(tempfile.mkdtemp()) / "llama-0.5b", "llama", seed=0,
                                **MODEL_0_5B)
    out = {"device": torch.cuda.get_device_name(),
           "batches": profile_engine(path, (1, 64), enforce_eager=False, fused=True),
           "eager": {"batches": profile_engine(path, (1, 64), enforce_eager=True,
                                               fused=False)}}
    write_results("gpu_decode_profile", out)
    return out


if __name__ == "__main__":
    main()
