"""One GPU check (< 5 min on one GPU): HF parity on CUDA, Triton kernels vs torch, decode
throughput and memory-bandwidth utilisation. Writes ``benchmarks/results/gpu_check.json``.

1. **Triton vs torch**: every case of :mod:`kvlab.engine.triton_parity` (GQA/MQA/MHA, block
   sizes 1-32, ragged lengths, float32/bfloat16) on CUDA tensors, compiled kernels.
2. **HF parity on CUDA**: kvlab generating greedily on CUDA (float32, TF32 off, so the Triton
   decode path runs) re-scored by transformers; every position compared.
3. **Decode throughput** of a 0.5B-class random Llama (Qwen2-0.5B's shape, bfloat16) at batch
   1, 16 and 64: steps where every request decodes, timed with device synchronisation.
   Bandwidth utilisation = (weight bytes + KV bytes read per step) / step time / peak HBM
   bandwidth, the peak looked up from the device name (H200, H100 SXM/PCIe, A100 40/80 GB);
   another GPU gets ``peak_bw_GBps: null`` and a flag.

It exits with status 2 and a clear message when no CUDA device or no Triton is present. Run on
an H200 (torch 2.11 + CUDA 13, Triton 3.6) in 30 s; its JSON is committed. What the decode
figures mean is in ``profile_gpu_decode.py``'s JSON: the steps are bound by kernel launches
(about 690 per step), not by memory bandwidth.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

#: Peak HBM bandwidth (GB/s) by a substring of ``torch.cuda.get_device_name()``, most specific
#: first (vendor data sheets).
PEAK_BW_GBPS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
                ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0)]

#: Qwen2-0.5B's shape as a Llama (~494M parameters with the tied embedding).
MODEL_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=4096, initializer_range=0.02,
                  tie_word_embeddings=True)


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BW_GBPS if key in name), None)


def check_triton() -> dict:
    from kvlab.engine.triton_parity import CASES, compare

    out = {}
    for name, case in CASES.items():
        r = compare(case, "cuda")
        tol = 2e-5 if case.dtype == "float32" else 2 ** -5
        r["ok"] = r["store_exact"] and r["max_abs_diff_vs_torch_path"] < tol
        out[name] = r
        print(f"triton {name:20s} store exact {r['store_exact']}  max|diff| "
              f"{r['max_abs_diff_vs_torch_path']:.2e}  {'ok' if r['ok'] else 'FAIL'}")
    return out


def check_hf_parity() -> dict:
    from kvlab.engine.hf_parity import compare_with_hf, save_random_hf_model

    path = save_random_hf_model(Path(tempfile.mkdtemp()) / "parity", "llama", seed=1,
                                hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2, vocab_size=512)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 60))] for _ in range(8)]
    rep = compare_with_hf(path, prompts, max_tokens=24, device="cuda", dtype=torch.float32,
                          block_size=16)
    r = {"sequences": rep.num_sequences, "positions": rep.num_tokens,
         "max_logprob_diff": rep.max_logprob_diff, "mismatches": rep.greedy_mismatches,
         "unexplained_mismatches": rep.unexplained_mismatches, "ok": rep.ok(1e-3)}
    print(f"HF parity on CUDA: {r}")
    return r


def decode_throughput(batches: list[int], steps: int, prompt: int) -> dict:
    from kvlab.engine.hf_parity import save_random_hf_model
    from kvlab.engine.llm import LLM
    from kvlab.engine.sampler import SamplingParams

    path = save_random_hf_model(Path(tempfile.mkdtemp()) / "llama-0.5b", "llama", seed=0,
                                **MODEL_0_5B)
    llm = LLM(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=max(batches),
              max_num_batched_tokens=8192)
    eng = llm.engine
    cfg = eng.model.cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2   # bf16 K and V
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name)
    rng = random.Random(0)
    out = {"device": name, "peak_bw_GBps": peak, "weight_bytes": weight_bytes,
           "params": cfg.num_params, "batches": {}}
    if peak is None:
        out["flag"] = f"unknown peak bandwidth for {name!r}: utilisation not computed"
    for b in batches:
        for i in range(b):
            eng.add_request(f"b{b}-{i}", [rng.randrange(cfg.vocab_size) for _ in range(prompt)],
                            SamplingParams(max_tokens=steps + 8, temperature=0,
                                           ignore_eos=True))
        while True:  # prefill until every request decodes
            eng.step()
            chunks = eng.last_trace.scheduler_output.chunks
            if len(chunks) == b and all(c.num_tokens == 1 for c in chunks):
                break
        times, kv_bytes = [], 0
        for _ in range(steps):
            chunks = eng.last_trace.scheduler_output.chunks
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            chunks = eng.last_trace.scheduler_output.chunks
            kv_bytes += sum(c.start_pos + 1 for c in chunks) * kv_per_token
        while eng.has_unfinished_requests():
            eng.step()
        step_s = sorted(times)[len(times) // 2]
        bytes_per_step = weight_bytes + kv_bytes / steps
        r = {"median_step_ms": 1e3 * step_s, "tokens_per_s": b / step_s,
             "bytes_per_step": bytes_per_step,
             "achieved_GBps": bytes_per_step / step_s / 1e9,
             "bw_utilisation": (bytes_per_step / step_s / 1e9 / peak) if peak else None}
        out["batches"][str(b)] = r
        util = f"{r['bw_utilisation']:.1%}" if peak else "n/a"
        print(f"batch {b:3d}: {r['median_step_ms']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
              f"{r['achieved_GBps']:.0f} GB/s ({util} of peak)")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per batch")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); this check "
              f"needs one GPU (torch {torch.__version__}).", file=sys.stderr)
        sys.exit(2)
    from kvlab.kernels import triton as triton_kernels

    if not triton_kernels.available():
        print("gpu_check: triton is not installed (pip install -e '.[gpu]').", file=sys.stderr)
        sys.exit(2)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    result = {"benchmark": "gpu_check", "torch": torch.__version__,
              "device": torch.cuda.get_device_name()}
    sections = {"triton_vs_torch": check_triton, "hf_parity_cuda": check_hf_parity,
                "decode": lambda: decode_throughput([1, 16, 64], args.steps, args.prompt)}
    for key, run in sections.items():
        try:
            result[key] = run()
        except Exception as error:  # record it and go on: one GPU run reports every section
            result[key] = {"error": f"{type(error).__name__}: {error}",
                           "traceback": traceback.format_exc()[-3000:]}
            print(f"gpu_check: {key} failed: {result[key]['traceback']}", file=sys.stderr)
    triton = result["triton_vs_torch"]
    result["ok"] = ("error" not in triton and all(r["ok"] for r in triton.values())
                    and result["hf_parity_cuda"].get("ok", False)
                    and "error" not in result["decode"])
    result["wall_s"] = time.perf_counter() - t0
    write_results("gpu_check", result)
    return result


if __name__ == "__main__":
    main()
