"""kvlab's compiled CPU ops vs vLLM's CPU build's own ops, one call at a time, in one process.

``bench_vs_vllm.py`` compares the engines; this script takes their largest costs apart. It runs
in vLLM's environment (``.venv-vllm``, made by ``bench_vs_vllm.py``; the script re-executes
itself there), imports kvlab from this checkout (its CPU ops build once for that interpreter)
and times, on the same data, one torch/OpenMP thread (``OMP_NUM_THREADS=1``):

- **decode attention**: kvlab's row op (the unchecked op the engine calls, ``decode_attention`` of
  ``kvlab.kernels.cpu.compiled()``) vs vLLM's
  ``cpu_attention_with_kv_cache`` with one query token per request, at kvlab-tiny's heads
  (6/2 x 32) and ~25M's (8/4 x 64), with contexts that stay in the caches, ones that stream
  from DRAM, and calls timed one at a time after the caches were flushed (their reads come
  from DRAM; an engine step finds a layer's KV somewhere between the two, as the other
  layers' work passes through the caches in between);
- **prefill attention**: kvlab's chunk op (``chunk_attention`` of the same build) vs the same vLLM
  op on whole causal
  prompts, one long and several short;
- **linear layers**: kvlab's packed oneDNN call (``kvlab.engine.linear.OneDnnLinearMethod``) vs
  vLLM's
  ``onednn_mm`` at the engine's shapes (a decode batch and a prefill step).

vLLM's KV cache is filled by its own ``cpu_attn_reshape_and_cache`` from the same K/V (its
blocks of 128 tokens store K transposed, ``[head_dim, block]``, for its "vec" ISA), kvlab's by
its slot mapping (blocks of 16, ``[block, kv_heads, head_dim]`` per token), both in sequence
order; every pair of outputs must agree to 1e-4 (exit 1 otherwise). Each case runs 7 rounds of
the two ops interleaved (alternating which goes first) and reports the median round's mean
microseconds per call and vLLM ÷ kvlab time (> 1: kvlab is faster). Writes
``benchmarks/results/vs_vllm_kernels.json``.

Run: ``python benchmarks/bench_vs_vllm_kernels.py`` (about a minute after the first build).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: (label, heads, kv_heads, head_dim, requests, context, query tokens per request, cold)
#: cold: the CPU's caches are flushed before every call (timed alone), so its reads come from
#: DRAM; otherwise calls repeat on data that stays in the caches
ATTENTION = (
    ("decode tiny, 8 x 1,300 (in cache)", 6, 2, 32, 8, 1300, 1, False),
    ("decode tiny, 36 x 120 (in cache)", 6, 2, 32, 36, 120, 1, False),
    ("decode tiny, 36 x 200 (in cache)", 6, 2, 32, 36, 200, 1, False),
    ("decode tiny, 36 x 200 (cold)", 6, 2, 32, 36, 200, 1, True),
    ("decode 25M, 16 x 300 (in cache)", 8, 4, 64, 16, 300, 1, False),
    ("decode 25M, 32 x 1,200 (DRAM)", 8, 4, 64, 32, 1200, 1, False),
    ("prefill tiny, 1 x 1,536", 6, 2, 32, 1, 1536, 1536, False),
    ("prefill tiny, 16 x 128", 6, 2, 32, 16, 128, 128, False),
    ("prefill 25M, 4 x 512", 8, 4, 64, 4, 512, 512, False),
)
#: (label, rows, in features, out features)
LINEAR = (
    ("tiny gate_up, decode 36 rows", 36, 192, 1024),
    ("tiny gate_up, prefill 2,048 rows", 2048, 192, 1024),
    ("25M gate_up, decode 36 rows", 36, 512, 4096),
    ("25M qkv, prefill 2,048 rows", 2048, 512, 1024),
)
ROUNDS = 7


def _mean_us(fn, calls: int, flush=None) -> float:
    """Mean process CPU microseconds of ``fn()``; with ``flush``, each call is timed alone
    after ``flush()`` has run untimed."""
    if flush is None:
        t = time.process_time()
        for _ in range(calls):
            fn()
        return (time.process_time() - t) / calls * 1e6
    total = 0.0
    for _ in range(calls):
        flush()
        t = time.process_time()
        fn()
        total += time.process_time() - t
    return total / calls * 1e6


def _interleaved(fns: dict, calls: int, flush=None) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for _ in range(ROUNDS):
        for k in order:
            times[k].append(_mean_us(fns[k], calls, flush))
        order.reverse()   # alternate which op runs first
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _compare(kvlab_fn, vllm_fn, diff: float, calls: int, flush=None) -> dict:
    """Time the two ops; the case's record with their outputs' largest difference ``diff``."""
    t = _interleaved({"kvlab": kvlab_fn, "vllm": vllm_fn}, calls, flush)
    return {"kvlab_us": t["kvlab"], "vllm_us": t["vllm"], "vllm_over_kvlab": t["vllm"] / t["kvlab"],
            "max_abs_diff": diff}


def _report(label: str, r: dict, extra: str = "") -> None:
    print(f"{label:38s} kvlab {r['kvlab_us']:9.0f} us  vLLM {r['vllm_us']:9.0f} us  "
          f"vLLM/kvlab {r['vllm_over_kvlab']:.2f}  max|diff| {r['max_abs_diff']:.1e}{extra}",
          flush=True)


def attention_case(torch, ops, isa, kv_cpu, heads, kv_heads, dim, reqs, ctx, q_len,
                   cold) -> dict:
    """Both ops on one set of requests: ``reqs`` sequences of ``ctx`` cached tokens, the last
    ``q_len`` of each the query (``q_len == ctx``: a whole prompt, causal); ``cold``: each
    call timed alone after 128 MiB were read (more than the CPU's caches; read only, so no
    dirty lines are written back during the timed call)."""
    gen = torch.Generator().manual_seed(heads * ctx + reqs)
    k = torch.randn(reqs, ctx, kv_heads, dim, generator=gen)
    v = torch.randn(reqs, ctx, kv_heads, dim, generator=gen)
    q = torch.randn(reqs * q_len, heads, dim, generator=gen)
    scale = dim ** -0.5
    # kvlab: blocks of 16, each sequence's blocks in order
    bs = 16
    per = -(-ctx // bs)
    kc = torch.zeros(reqs * per, bs, kv_heads, dim)
    vc = torch.zeros_like(kc)
    slots = (torch.arange(reqs)[:, None] * per * bs + torch.arange(ctx)).reshape(-1)
    kc.view(-1, kv_heads, dim)[slots] = k.reshape(-1, kv_heads, dim)
    vc.view(-1, kv_heads, dim)[slots] = v.reshape(-1, kv_heads, dim)
    tables = torch.arange(reqs * per).view(reqs, per)
    ours = torch.empty_like(q)
    # the unchecked ops the engine calls (the checked entry points validate every index first)
    build = kv_cpu.compiled()
    row_op = build.decode_attention
    if q_len == 1:
        lens = torch.full((reqs,), ctx)
        kvlab_fn = lambda: row_op(ours, q, kc, vc, tables, lens, scale, 0)
    else:
        chunk_op = build.chunk_attention
        qs, starts = tuple(range(0, reqs * q_len + 1, q_len)), (0,) * reqs
        every = tuple(range(reqs))
        kvlab_fn = lambda: chunk_op(ours, q, kc, vc, tables, qs, starts, every, scale, 0)
    # vLLM: blocks of 128 written by its own op, [blocks, kv_heads, 2 * 128, dim] split in K, V
    vbs = 128
    vper = -(-ctx // vbs)
    cache = torch.zeros(reqs * vper, kv_heads, 2 * vbs, dim)
    key_cache, value_cache = cache.chunk(2, dim=2)
    vslots = (torch.arange(reqs)[:, None] * vper * vbs + torch.arange(ctx)).reshape(-1)
    ops.cpu_attn_reshape_and_cache(k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim),
                                   key_cache, value_cache, vslots, isa)
    qsl = torch.arange(reqs + 1, dtype=torch.int32) * q_len
    seq = torch.full((reqs,), ctx, dtype=torch.int32)
    vtables = torch.arange(reqs * vper, dtype=torch.int32).view(reqs, vper)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=reqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False)   # splits only move work between threads: one here
    theirs = torch.empty_like(q)

    def vllm_fn():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=theirs,
            query_start_loc=qsl, seq_lens=seq, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=vtables, softcap=0.0, scheduler_metadata=meta,
            s_aux=None)

    kvlab_fn()
    vllm_fn()
    diff = float((ours - theirs).abs().max())
    work = reqs * (ctx if q_len == 1 else ctx * (ctx + 1) / 2) * heads * dim * 4
    if not cold:
        return _compare(kvlab_fn, vllm_fn, diff, max(5, int(3e8 / work)))
    scratch = torch.zeros(32 << 20)
    return _compare(kvlab_fn, vllm_fn, diff, 40, scratch.sum)


def linear_case(torch, ops, rows, k_in, n_out) -> dict:
    from kvlab.engine.linear import Linear, OneDnnLinearMethod

    gen = torch.Generator().manual_seed(rows + n_out)
    layer = Linear(k_in, n_out, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, k_in, generator=gen) * k_in ** -0.5)
    x = torch.randn(rows, k_in, generator=gen)
    assert layer.use_method(OneDnnLinearMethod())
    handler = ops.create_onednn_mm(layer.weight.t(), 32)
    flops = 2 * rows * k_in * n_out
    with torch.no_grad():
        diff = float((layer(x) - ops.onednn_mm(handler, x, None)).abs().max())
        r = _compare(lambda: layer(x), lambda: ops.onednn_mm(handler, x, None), diff,
                     max(3, int(2e9 / flops)))
    return {**r, "kvlab_gflops": flops / r["kvlab_us"] / 1e3}


def main() -> int:
    if Path(sys.prefix).resolve() != (REPO / ".venv-vllm").resolve():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_vs_vllm import ensure_vllm_venv

        python = str(ensure_vllm_venv())
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0",
                   PYTHONPATH=str(REPO))
        return os.execve(python, [python, __file__, *sys.argv[1:]], env)
    import torch

    torch.set_num_threads(1)
    import vllm
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvlab.kernels import cpu as kv_cpu

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import write_results

    if not kv_cpu.available():
        raise SystemExit(f"kvlab's CPU ops did not build: {kv_cpu.build_error()}")
    result: dict = {"threads": 1, "rounds": ROUNDS,
                    "time": "median over rounds of the mean process CPU microseconds per call",
                    "vllm": vllm.__version__, "torch": torch.__version__,
                    "machine": platform.processor() or platform.machine(),
                    "attention": {}, "linear": {}}
    ok = True
    for label, *shape in ATTENTION:
        isa = _get_attn_isa(torch.float32, 128, shape[2])   # what vLLM's engine picks
        r = attention_case(torch, ops, isa, kv_cpu, *shape)
        names = ("heads", "kv_heads", "head_dim", "requests", "context", "query_tokens",
                 "cold")
        result["attention"][label] = {"shape": dict(zip(names, shape, strict=True)),
                                      "vllm_isa": isa, **r}
        ok &= r["max_abs_diff"] < 1e-4
        _report(label, r)
    for label, *shape in LINEAR:
        r = linear_case(torch, ops, *shape)
        names = ("rows", "in", "out")
        result["linear"][label] = {"shape": dict(zip(names, shape, strict=True)), **r}
        ok &= r["max_abs_diff"] < 1e-4
        _report(label, r, f"  ({r['kvlab_gflops']:.0f} GFLOP/s)")
    result["outputs_agree"] = ok
    write_results("vs_vllm_kernels", result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
