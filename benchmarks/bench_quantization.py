"""Group quantization, measured: error vs bits and group size, perplexity, memory and speed.

Side by side in one run, on the shipped ``kvlab-tiny`` (float32 activations, CPU):

1. **Reconstruction error** of the model's 16 decoder weight matrices and of a synthetic matrix
   with outliers, for bits 2/3/4/8 and group sizes 16..256, symmetric and zero-point.
2. **Perplexity** on held-out corpus text (documents 1,000,000+ of the corpus, never trained
   on), teacher-forced in chunks of 16 tokens so every chunk after the first reads quantized
   KV: fp32; int8 and int4 weights with g = 32, 64 and 128 (128 is refused: it does not divide
   the 192-wide layers, and the row says so); int8 and fp8 e4m3 KV.
3. **Memory**: stored linear-weight bytes vs ``effective_bits x params / 8``, KV bytes/token.
4. **Speed**: generated tokens/s of the engine relative to fp32, and one linear layer
   (kvlab-tiny's 512x192 and a Llama-sized 4096x4096) per kernel: fp32 GEMM, dequantize +
   GEMM, ``_weight_int8pack_mm`` (per-row scale) and ``_weight_int4pack_mm_for_cpu``, with
   float32 and bfloat16 activations.
5. **Published formats' effective bits**, computed with ``effective_bits``.

Timings on a shared CPU are noisy: re-run on a quiet machine before quoting them.

Run: ``python benchmarks/bench_quantization.py`` (about 1-2 minutes). Writes
``benchmarks/results/quantization.json``.
"""

from __future__ import annotations

import platform
import time

import torch
from _results import write_results

from kvlab import LLM, SamplingParams
from kvlab.engine.quantization import KernelLog, QuantConfig, QuantizedLinear, dequantize, quantize
from kvlab.labs.perplexity import heldout_token_ids, perplexity
from kvlab.models.corpus import sample_prompts
from kvlab.reference import effective_bits

MODEL = "kvlab-tiny"


def reconstruction(weights: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    for label, mats in weights.items():
        for bits in (2, 3, 4, 8):
            for g in (16, 32, 64, 128, 256):
                for symmetric in (True, False):
                    if any(w.shape[1] % g for w in mats):
                        continue
                    cfg = QuantConfig(bits=bits, group_size=g, symmetric=symmetric)
                    num = den = 0.0
                    worst = 0.0
                    for w in mats:
                        err = w - dequantize(quantize(w, cfg))
                        num += float(err.square().sum())
                        den += float(w.square().sum())
                        worst = max(worst, float(err.abs().max()))
                    rows.append({"weights": label, "bits": bits, "group_size": g,
                                 "symmetric": symmetric,
                                 "effective_bits": cfg.effective_bits(),
                                 "relative_rms_error": (num / den) ** 0.5, "max_abs_error": worst})
    return rows


def outlier_matrix() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g) * 0.02
    w[:, torch.randint(0, 1024, (8,), generator=g)] *= 50   # a few outlier input channels
    return w


def tokens_per_second(kwargs: dict, prompts: list[str], repeats: int = 2) -> float:
    llm = LLM(MODEL, num_blocks=256, **kwargs)
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        best = max(best, sum(len(o.outputs[0].token_ids) for o in out) / dt)
    return best


def layer_timing(n: int, k: int, batch: int, reps: int,
                 dtype: torch.dtype = torch.float32) -> dict:
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False).to(dtype)
    x = torch.randn(batch, k, dtype=dtype)
    log = KernelLog()
    dense = f"{str(dtype)[6:]} aten.linear"
    cases = {dense: lin}
    cases["int8 g=64 dequant+linear"] = QuantizedLinear.from_linear(
        lin, QuantConfig(8, 64, kernel="dequant"), log)
    cases[f"int8 g={k} _weight_int8pack_mm"] = QuantizedLinear.from_linear(
        lin, QuantConfig(8, k, kernel="packed"), log)
    cases["int4 g=64 dequant+linear"] = QuantizedLinear.from_linear(
        lin, QuantConfig(4, 64, kernel="dequant"), log)
    cases["int4 g=64 _weight_int4pack_mm_for_cpu"] = QuantizedLinear.from_linear(
        lin, QuantConfig(4, 64, kernel="packed"), log)
    out = {}
    with torch.inference_mode():
        for name, mod in cases.items():
            mod(x)
            t0 = time.perf_counter()
            for _ in range(reps):
                mod(x)
            out[name] = (time.perf_counter() - t0) / reps * 1e6
    base = out[dense]
    return {"shape": [n, k], "batch": batch, "activation_dtype": str(dtype)[6:],
            "kernels_ran": log.summary(),
            "us_per_call": {name: round(us, 1) for name, us in out.items()},
            "speedup_vs_dense": {name: round(base / us, 3) for name, us in out.items()}}


def published_formats() -> list[dict]:
    return [
        {"format": "GPTQ 4-bit g128, fp16 scale + packed 4-bit zero point",
         "effective_bits": effective_bits(4, 128, 16, 4)},
        {"format": "GPTQ 4-bit g128 symmetric (sym=True), fp16 scale",
         "effective_bits": effective_bits(4, 128, 16, 0)},
        {"format": "AWQ 4-bit g128, fp16 scale + 4-bit zero point",
         "effective_bits": effective_bits(4, 128, 16, 4)},
        {"format": "bitsandbytes NF4 block 64, fp32 absmax (no double quant)",
         "effective_bits": effective_bits(4, 64, 32)},
        {"format": "bitsandbytes NF4 double quant: 8-bit absmax per 64 + fp32 per 256 absmaxes",
         "effective_bits": effective_bits(4, 64, 8 + 32 / 256)},
        {"format": "kvlab int4 g64 symmetric, fp16 scale", "effective_bits": effective_bits(4, 64)},
        {"format": "kvlab int8 g64 symmetric, fp16 scale", "effective_bits": effective_bits(8, 64)},
    ]


def main() -> None:
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    base = LLM(MODEL, num_blocks=256)
    model = base.engine.model
    mats = [m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("layers.")]
    recon = reconstruction({"kvlab-tiny linears": mats, "synthetic 512x1024 with outliers":
                            [outlier_matrix()]})
    seqs = heldout_token_ids(base.tokenizer, 3, 256)
    configs = {"fp32": {}}
    for q in ("int8", "int4"):
        for g in (32, 64, 128):
            configs[f"{q} g={g}"] = {"quantization": q, "quantization_group_size": g}
    configs["kv int8"] = {"kv_cache_dtype": "int8"}
    configs["kv fp8_e4m3"] = {"kv_cache_dtype": "fp8_e4m3"}
    configs["int4 g=64 + kv int8"] = {"quantization": "int4", "kv_cache_dtype": "int8"}
    ppl_rows = []
    fp32_ppl = None
    for name, kw in configs.items():
        try:
            llm = LLM(MODEL, num_blocks=64, **kw)
        except ValueError as err:
            ppl_rows.append({"config": name, "refused": str(err)})
            print(f"{name:>22}: refused ({err})")
            continue
        ppl = perplexity(llm.engine, seqs)
        fp32_ppl = fp32_ppl or ppl
        rep = llm.quantization_report()
        row = {"config": name, "perplexity": ppl, "ppl_ratio_vs_fp32": ppl / fp32_ppl,
               "linear_weight_bytes": rep.linear_weight_bytes,
               "effective_bits": rep.effective_bits, "measured_bits": rep.measured_bits,
               "runtime_extra_bytes": rep.runtime_extra_bytes,
               "kv_bytes_per_token": rep.kv_bytes_per_token,
               "kernels": rep.kernels_executed}
        ppl_rows.append(row)
        print(f"{name:>22}: ppl {ppl:.4f} (x{ppl / fp32_ppl:.4f}), weights "
              f"{rep.linear_weight_bytes:,} B ({rep.measured_bits:.3g} bits), "
              f"KV {rep.kv_bytes_per_token:g} B/token")
    prompts = sample_prompts(3, 8)
    speed_cfgs = {"fp32": {}, "int8 g=64 (dequant)": {"quantization": "int8"},
                  "int4 g=64 (dequant, auto)": {"quantization": "int4"},
                  "int4 g=64 (int4pack kernel)": {
                      "quantization": QuantConfig(4, 64, kernel="packed")},
                  "bf16": {"dtype": "bfloat16"},
                  "bf16 int4 g=64 (int4pack, auto)": {"dtype": "bfloat16", "quantization": "int4"},
                  "kv int8": {"kv_cache_dtype": "int8"},
                  "kv fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"}}
    speed = {name: tokens_per_second(kw, prompts) for name, kw in speed_cfgs.items()}
    for name, tps in speed.items():
        print(f"{name:>28}: {tps:7.1f} tokens/s  (x{tps / speed['fp32']:.2f} vs fp32)")
    bf16_ratio = speed["bf16 int4 g=64 (int4pack, auto)"] / speed["bf16"]
    print(f"bf16 int4 (packed kernel) vs bf16 dense: x{bf16_ratio:.2f}")
    layers = [layer_timing(512, 192, 8, 300), layer_timing(4096, 4096, 8, 20),
              layer_timing(4096, 4096, 8, 3, torch.bfloat16)]
    for lt in layers:
        print(f"layer {lt['shape']} {lt['activation_dtype']} batch {lt['batch']}: " + ", ".join(
            f"{k} x{v}" for k, v in lt["speedup_vs_dense"].items()))
    fmts = published_formats()
    for f in fmts:
        print(f"{f['effective_bits']:7.4f} bits  {f['format']}")
    write_results("quantization", {
        "benchmark": "group quantization: error, perplexity, memory, speed",
        "model": MODEL, "heldout_tokens": sum(len(s) - 1 for s in seqs),
        "reconstruction": recon, "perplexity": ppl_rows,
        "engine_tokens_per_s": {k: round(v, 1) for k, v in speed.items()},
        "engine_speed_ratio_vs_fp32": {k: round(v / speed["fp32"], 3) for k, v in speed.items()},
        "engine_bf16_int4_vs_bf16": round(bf16_ratio, 3),
        "linear_layer_timing": layers, "published_formats": fmts,
        "note": "timings from a shared CPU are noisy; re-run on a quiet machine",
        "platform": platform.platform(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - t_start, 1),
    })


if __name__ == "__main__":
    main()
