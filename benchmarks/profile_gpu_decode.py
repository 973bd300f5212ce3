"""Where a CUDA decode step's time goes (one GPU): kvlab on the 0.5B-class random Llama of
``gpu_check.py`` at batch 1 and 64, torch.profiler over a few steps: CPU time by operator,
CUDA kernel launches per step, GPU busy time per step against the step's wall time. For finding
what to optimise; it asserts nothing and writes ``benchmarks/results/gpu_decode_profile.json``.

Run on a GPU machine: ``python benchmarks/profile_gpu_decode.py``.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402
from gpu_check import MODEL_0_5B  # noqa: E402


def main() -> dict:
    from kvlab.engine.hf_parity import save_random_hf_model
    from kvlab.engine.llm import LLM
    from kvlab.engine.sampler import SamplingParams

    path = save_random_hf_model(Path(tempfile.mkdtemp()) / "llama-0.5b", "llama", seed=0,
                                **MODEL_0_5B)
    llm = LLM(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=64,
              max_num_batched_tokens=8192)
    eng = llm.engine
    rng = random.Random(0)
    out = {"device": torch.cuda.get_device_name(), "batches": {}}
    for b in (1, 64):
        for i in range(b):
            eng.add_request(f"b{b}-{i}", [rng.randrange(1000) for _ in range(256)],
                            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for _ in range(8):
            eng.step()
        steps = 10
        torch.cuda.synchronize()
        stats = eng.stats
        before = (stats.step_time_s, stats.model_time_s)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel",
                                                             "cuLaunchKernel",
                                                             "cudaLaunchKernelExC"))
        gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in events) / steps
        table = events.table(sort_by="self_cpu_time_total", row_limit=18)
        print(f"\n=== batch {b}: {1e3 * wall:.2f} ms per profiled step, "
              f"{launches / steps:.0f} kernel launches per step, GPU busy "
              f"{gpu_us / 1e3:.2f} ms per step")
        print(table)
        t1 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        plain = (time.perf_counter() - t1) / steps
        out["batches"][str(b)] = {
            "step_ms_unprofiled": 1e3 * plain, "step_ms_profiled": 1e3 * wall,
            "kernel_launches_per_step": launches / steps, "gpu_busy_ms_per_step": gpu_us / 1e3,
            "model_share_of_step": (stats.model_time_s - before[1])
            / max(stats.step_time_s - before[0], 1e-9)}
        print(out["batches"][str(b)])
        while eng.has_unfinished_requests():
            eng.step()
    write_results("gpu_decode_profile", out)
    return out


if __name__ == "__main__":
    main()
