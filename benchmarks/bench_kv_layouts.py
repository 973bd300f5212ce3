"""KV layouts of 2026 models, planned: what the window saving and the MLA latent are worth.

Everything here is the capacity planner (``kvlab.labs.capacity.hybrid_plan``) on the published
``config.json`` files shipped in ``kvlab/labs/capacity/configs/``; no engine runs, so the numbers
are plans, not measurements of a server:

* **Requests per H100** (CUDA's 79.11 GiB total, 90% usable, 4 GiB reserve, bf16 KV, blocks
  of 16 tokens) for Gemma 3 27B and gpt-oss-120b at 8k, 32k and 128k tokens per request, with
  the sliding windows kept as windows (vLLM's hybrid KV cache manager) and with every layer
  keeping every token (an engine without one), in steady decode (one token in flight: the
  packing once every request decodes), reserving a 2,048-token prefill chunk in flight, and
  reserving what vLLM 0.32 reserves for every request, ``VllmConfig.max_in_flight_tokens``
  (``max_concurrent_batches × max_num_batched_tokens``, 2 × 8,192 = 16,384 for ``vllm serve``
  on an H100), with vLLM's fractional "maximum concurrency" beside the whole requests.
  Weights per GPU: Gemma 3 27B (``google/gemma-3-27b-it``) is 27,432,406,640 bf16 parameters
  (its safetensors metadata); gpt-oss-120b's 116,829,156,672 parameters are
  ``36 × 128 × 2880 × (2 × 2880 + 2880)`` expert weights in MXFP4 (4-bit values with one 8-bit
  scale per 32: 4.25 bits each) and the rest (attention, router, embeddings, biases) in bf16.
* **Bytes per token**: DeepSeek-V3's MLA latent (61 layers × (512 + 64) elements) against the
  largest dense GQA model of the catalogue, Llama 3.1 405B (126 layers × 8 KV heads × 128 × 2),
  and against DeepSeek-V3's own 128 heads cached as multi-head attention would cache them
  (K of 128 + 64, V of 128); per rank at TP 8 as well.

Run: ``python benchmarks/bench_kv_layouts.py``. Writes ``benchmarks/results/kv_layouts.json``.
"""

from __future__ import annotations

from _results import write_results

from kvlab.labs.capacity.hf_config import shipped_config, shipped_layout
from kvlab.labs.capacity.hybrid_plan import (
    GiB,
    bytes_by_layer,
    max_in_flight_tokens,
    plan_layout,
)
from kvlab.reference import kv_bytes
from kvlab.sim.catalog import get_gpu, get_model

GPU = "H100-80GB SXM"
RESERVE = 4 * GiB
CONTEXTS = (8192, 32768, 131072)
IN_FLIGHT = (1, 2048, max_in_flight_tokens())

GEMMA_PARAMS = 27_432_406_640
GPT_OSS_PARAMS = 116_829_156_672
MXFP4_BYTES = 4.25 / 8          # 4-bit values + one 8-bit scale per 32 values


def gpt_oss_weight_bytes() -> float:
    """gpt-oss-120b on one GPU: MXFP4 expert matrices, everything else bf16."""
    cfg = shipped_config("gpt-oss-120b")
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    experts = cfg["num_hidden_layers"] * cfg["num_local_experts"] * hidden * (2 * inter + inter)
    return experts * MXFP4_BYTES + (GPT_OSS_PARAMS - experts) * 2


WEIGHTS = {"gemma-3-27b-it": GEMMA_PARAMS * 2.0, "gpt-oss-120b": gpt_oss_weight_bytes()}


def requests_rows() -> list[dict]:
    gpu = get_gpu(GPU)
    rows = []
    for name, weights in WEIGHTS.items():
        layout = shipped_layout(name)
        for context in CONTEXTS:
            for in_flight in IN_FLIGHT:
                row = {"model": name, "context_len": context, "in_flight_tokens": in_flight,
                       "weight_gib": round(weights / GiB, 2)}
                for windows in (True, False):
                    plan = plan_layout(layout, gpu, weight_bytes=weights, context_len=context,
                                       in_flight_tokens=in_flight, reserve_bytes=RESERVE,
                                       windows=windows)
                    key = "windowed" if windows else "no_window"
                    row[key] = {"requests": plan.max_requests,
                                "max_concurrency": round(plan.max_concurrency, 4),
                                "num_blocks": plan.num_blocks,
                                "token_capacity": plan.token_capacity,
                                "block_mib": round(plan.block_bytes / 2**20, 4),
                                "blocks_per_request": plan.blocks_per_request(),
                                "groups": len(plan.groups),
                                "padding_slots": plan.padding_slots,
                                "kv_gib_per_request": round(
                                    plan.kv_bytes_per_request() / GiB, 4)}
                row["ratio"] = (round(row["windowed"]["requests"] / row["no_window"]["requests"],
                                      2) if row["no_window"]["requests"] else None)
                rows.append(row)
    return rows


def mla_rows() -> dict:
    deepseek = shipped_layout("deepseek-v3")
    cfg = shipped_config("deepseek-v3")
    llama = get_model("Llama-3.1-405B")
    mla = int(sum(bytes_by_layer(deepseek, 1)))
    mla_tp8 = int(sum(bytes_by_layer(deepseek, 1, tp=8)))
    gqa = int(kv_bytes(llama.layers, 1, 1, llama.kv_heads, llama.head_dim, 2))
    gqa_tp8 = int(kv_bytes(llama.layers, 1, 1, llama.kv_heads // 8, llama.head_dim, 2))
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    mha = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * (qk + cfg["v_head_dim"]) * 2
    return {"deepseek_v3_mla_bytes_per_token": mla,
            "deepseek_v3_mla_fp8_bytes_per_token": int(sum(bytes_by_layer(
                deepseek, 1, kv_dtype="fp8"))),
            "deepseek_v3_mla_bytes_per_token_per_rank_tp8": mla_tp8,
            "llama_3_1_405b_gqa_bytes_per_token": gqa,
            "llama_3_1_405b_gqa_bytes_per_token_per_rank_tp8": gqa_tp8,
            "deepseek_v3_as_mha_bytes_per_token": mha,
            "gqa_over_mla": round(gqa / mla, 2),
            "gqa_over_mla_per_rank_tp8": round(gqa_tp8 / mla_tp8, 2),
            "mha_over_mla": round(mha / mla, 2),
            "deepseek_v3_mla_gib_per_128k_request": round(mla * 131072 / GiB, 2),
            "llama_3_1_405b_gib_per_128k_request": round(gqa * 131072 / GiB, 2)}


def main() -> None:
    rows = requests_rows()
    for r in rows:
        print(f"{r['model']:<15} {r['context_len']:>7,} tok, {r['in_flight_tokens']:>5} in flight:"
              f" {r['windowed']['requests']:>4} requests windowed, "
              f"{r['no_window']['requests']:>4} without (x{r['ratio']})")
    mla = mla_rows()
    print(f"DeepSeek-V3 MLA {mla['deepseek_v3_mla_bytes_per_token']:,} B/token vs Llama 3.1 405B "
          f"GQA {mla['llama_3_1_405b_gqa_bytes_per_token']:,} (x{mla['gqa_over_mla']}); "
          f"per rank at TP 8: {mla['deepseek_v3_mla_bytes_per_token_per_rank_tp8']:,} vs "
          f"{mla['llama_3_1_405b_gqa_bytes_per_token_per_rank_tp8']:,}")
    write_results("kv_layouts", {
        "benchmark": "kv_layouts",
        "kind": "plan (kvlab.labs.capacity.hybrid_plan), not an engine measurement",
        "assumptions": {"gpu": GPU, "gpu_memory_utilization": 0.9,
                        "reserve_gib": RESERVE / GiB, "kv_dtype": "bf16", "block_size": 16,
                        "weights": {"gemma-3-27b-it": f"{GEMMA_PARAMS:,} params x 2 B (bf16)",
                                    "gpt-oss-120b": "MXFP4 experts (4.25 bits), rest bf16"}},
        "requests_per_gpu": rows,
        "mla_vs_gqa": mla,
    })


if __name__ == "__main__":
    main()
