"""kvlab's time by phase on one workload, for ``bench_vs_vllm.py --profile``.

The engine's own counters split each step into schedule, metadata, forward and sampling (the
rest of ``step()`` is output processing); torch.profiler's operator self-times over the same run
split the forward by op class: linear (matmuls), attention (SDPA, the compiled decode and chunk
ops, the KV writes and gathers), norm+rope+act (elementwise math, the compiled layer ops) and
other (embedding, copies, views). The compiled ops are plain extension functions the profiler
does not see, so the profiled run calls them through ``record_function`` wrappers named
``kvlab::<op>``.
"""

from __future__ import annotations

import contextlib
import time
import types

import torch

#: aten / custom op names by class (substring match on the profiler's key, first class wins)
OP_CLASSES = {
    "linear": ("addmm", "aten::mm", "aten::linear", "mkldnn", "_mkl_linear", "bmm"),
    "attention": ("scaled_dot_product", "attention", "index_copy", "index_select"),
    "norm+rope+act": ("aten::mul", "aten::add", "aten::sub", "rsqrt", "aten::mean",
                      "aten::pow", "square", "silu", "aten::cat", "aten::neg", "kvlab::rms_norm",
                      "kvlab::rope_"),
}


def _named(name: str, fn):
    """``fn`` inside a profiler range called ``name``."""
    def call(*args):
        with torch.profiler.record_function(name):
            return fn(*args)
    return call


@contextlib.contextmanager
def compiled_ops_visible(llm):
    """Within the block, ``llm``'s compiled CPU ops run inside ``kvlab::<op>`` profiler ranges:
    the runner's kernels are rebuilt over the same build with each function wrapped (attention's
    decode and chunk ops, the layer ops); restored afterwards."""
    from kvlab.engine.attention_cpu import CpuAttention
    from kvlab.engine.ops import CpuLayerOps, Kernels
    from kvlab.kernels import cpu

    runner = llm.engine.executor
    chosen = runner.kernels
    build = cpu.compiled()
    try:
        if build is not None:
            named = types.SimpleNamespace(**{
                op: _named(f"kvlab::{op}", getattr(build, op))
                for op in ("decode_attention", "chunk_attention", "rms_norm", "rope_",
                           "silu_and_mul")})
            attention = (CpuAttention(named) if isinstance(chosen.attention, CpuAttention)
                         else chosen.attention)
            ops = CpuLayerOps(named) if isinstance(chosen.ops, CpuLayerOps) else chosen.ops
            runner.kernels = Kernels(attention, ops)
        yield
    finally:
        runner.kernels = chosen


def profile_phases(model_dir, workload, profiled, threads: int = 1, label: str = "") -> dict:
    """Run ``workload`` (prompt ids, max_tokens) through ``LLM(model_dir)`` unprofiled (phases,
    CPU seconds), then ``profiled`` (the same shapes, fresh tokens: no prefix-cache hits from
    the first run) under torch.profiler (op classes); both as dicts."""
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(model_dir)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
    prompts = [p for p, _ in workload]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    st = llm.engine.stats
    fields = ("step_time_s", "schedule_time_s", "prepare_time_s", "model_time_s",
              "sample_time_s")
    before = {f: getattr(st, f) for f in fields}
    c0 = time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    cpu = time.process_time() - c0
    d = {f: getattr(st, f) - before[f] for f in fields}
    phases = {"schedule": d["schedule_time_s"], "metadata": d["prepare_time_s"],
              "forward": d["model_time_s"], "sampling": d["sample_time_s"],
              "output": d["step_time_s"] - d["schedule_time_s"] - d["prepare_time_s"]
              - d["model_time_s"] - d["sample_time_s"]}
    with compiled_ops_visible(llm), torch.profiler.profile() as prof:
        llm.generate([p for p, _ in profiled], params, use_tqdm=False)
    classes = dict.fromkeys((*OP_CLASSES, "other"), 0.0)
    for ev in prof.key_averages():
        name = ev.key
        cls = next((c for c, keys in OP_CLASSES.items() if any(k in name for k in keys)),
                   "other")
        classes[cls] += ev.self_cpu_time_total / 1e6
    total = sum(classes.values())
    shares = {k: v / total for k, v in classes.items()} if total else classes
    step = d["step_time_s"]
    print(f"kvlab {label}, time by phase: " + ", ".join(
        f"{k} {v / step:.1%}" for k, v in phases.items()))
    print("forward by op class (profiler self CPU time): " + ", ".join(
        f"{k} {v:.1%}" for k, v in shares.items()))
    return {"cpu_s": cpu, "step_s": step, "phases_s": phases,
            "phase_shares": {k: v / step for k, v in phases.items()},
            "op_class_self_s": classes, "op_class_shares": shares,
            "note": "op classes are the profiler's self CPU time of every op in the run "
                    "(forward and sampling), so they include the profiler's overhead"}
