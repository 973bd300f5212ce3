"""KV layouts of 2026 models: what the window saving and the MLA latent are worth, planned, and
what a sliding window saves in kvlab's engine, measured.

The plans are the capacity planner (``kvlab.labs.capacity.hybrid_plan``) on the published
``config.json`` files shipped in ``kvlab/labs/capacity/configs/``; no engine runs for them, so
those numbers are plans, not measurements of a server:

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

The engine section (``engine``) is measured: one small random Qwen3-shaped checkpoint (4 layers,
hidden 256, 4 heads of 64, float32) served three ways with the same weights, its config saying
which layers slide: **no window**, **every layer a 1,024-token window** (one KV cache group)
and **layer 0 full, layers 1-3 windowed** (four groups: the hybrid manager). On the compiled
CPU path (the default), blocks of 16 tokens, steps of at most 2,048 tokens:

* **Blocks held by one request** at 8,192 tokens (8,128-token prompt, 64 generated), per
  group, at its peak (a 2,048-token prefill chunk in flight) and at the end (decoding), with
  the bytes they are (a block is a page in each layer slot of its group).
* **Throughput** of two such requests together (8,064-token prompts, 128 generated each): the
  steps that prefill and the steps that only decode, wall clock first and process CPU time
  beside (both timed with ``time.perf_counter`` / ``time.process_time``), in tokens per
  second; with the machine's load average before and after (the machine is shared: wall
  times move with it, CPU time less). Each layout runs ``--repeats`` times (3), round robin,
  and a phase's figure is the median of its runs (every run's wall time is kept beside). One
  torch thread unless ``--threads`` says otherwise.

Run: ``python benchmarks/bench_kv_layouts.py`` (``--plans-only`` keeps the stored engine
section). Writes ``benchmarks/results/kv_layouts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _results import RESULTS_DIR, write_results

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


ENGINE = {"block_size": 16, "max_num_batched_tokens": 2048, "window": 1024, "context": 8192,
          "one_request_generated": 64, "throughput_requests": 2, "throughput_generated": 128}
LAYOUTS = {"no_window": None,
           "window_every_layer": ["sliding_attention"] * 4,
           "window_layers_1_3": ["full_attention"] + ["sliding_attention"] * 3}


def _checkpoints(root: Path) -> dict[str, Path]:
    """One random checkpoint, saved once per layout with the same weights."""
    from kvlab.labs.parity.hf import save_random_hf_model

    base = save_random_hf_model(root / "base", "qwen3", seed=0, hidden_size=256,
                                intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                                vocab_size=512, max_position_embeddings=ENGINE["context"])
    paths = {}
    for name, types in LAYOUTS.items():
        path = root / name
        path.mkdir()
        for f in base.iterdir():
            (path / f.name).symlink_to(f)
        cfg = json.loads((base / "config.json").read_text())
        cfg.update(use_sliding_window=types is not None, sliding_window=ENGINE["window"],
                   layer_types=types or ["full_attention"] * 4)
        (path / "config.json").unlink()
        (path / "config.json").write_text(json.dumps(cfg))
        paths[name] = path
    return paths


def _prompts(n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(1)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(n)]


def _blocks_held(path: Path) -> dict:
    """One request to 8,192 tokens: blocks held per group at the peak and at the end."""
    from kvlab import LLM, SamplingParams

    llm = LLM(path, block_size=ENGINE["block_size"],
              max_num_batched_tokens=ENGINE["max_num_batched_tokens"])
    engine, kv = llm.engine, llm.engine.kv
    gen = ENGINE["one_request_generated"]
    engine.add_request("r", _prompts(1, ENGINE["context"] - gen)[0],
                       SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True))
    peak: list[int] = []
    end: list[int] = []
    while engine.has_unfinished_requests():
        engine.step()
        if kv.has("r"):
            tables = kv.block_tables("r") if hasattr(kv, "block_tables") else (
                kv.block_table("r"),)
            end = [sum(b is not None for b in t) for t in tables]
            peak = [max(a, b) for a, b in zip(peak or end, end, strict=True)]
    groups = getattr(engine.cache, "groups", None)
    block_bytes = engine.cache.block_bytes
    return {"groups": [{"window": g.window, "layers": list(g.layers)} for g in groups]
            if groups else [{"window": 0, "layers": list(range(engine.config.num_layers))}],
            "block_bytes": block_bytes,
            "peak_blocks_per_group": peak, "end_blocks_per_group": end,
            "peak_blocks": sum(peak), "end_blocks": sum(end),
            "peak_mib": round(sum(peak) * block_bytes / 2**20, 3),
            "end_mib": round(sum(end) * block_bytes / 2**20, 3)}


def _throughput(path: Path) -> dict:
    """Two requests of 8,064 + 128 tokens: prefill and decode steps timed apart."""
    from kvlab import LLM, SamplingParams

    llm = LLM(path, block_size=ENGINE["block_size"],
              max_num_batched_tokens=ENGINE["max_num_batched_tokens"])
    engine = llm.engine
    gen, n = ENGINE["throughput_generated"], ENGINE["throughput_requests"]
    for i, prompt in enumerate(_prompts(n, ENGINE["context"] - gen)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=gen, temperature=0,
                                                          ignore_eos=True))
    times = {"prefill": [0.0, 0.0, 0], "decode": [0.0, 0.0, 0]}   # wall, cpu, tokens
    tokens = {}
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        chunks = engine.last_trace.scheduler_output.chunks
        phase = "decode" if all(not c.is_prefill for c in chunks) else "prefill"
        times[phase][0] += wall
        times[phase][1] += cpu
        times[phase][2] += sum(c.num_tokens for c in chunks)
        for o in outs:
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    return {"times": times, "generated": [tokens[str(i)] for i in range(n)]}


def _median_row(runs: list[dict]) -> dict:
    """The repeats of one layout as one row: per phase, the median wall and CPU seconds (each
    over the runs), every run's wall seconds beside; the runs must generate the same tokens."""
    assert all(r["generated"] == runs[0]["generated"] for r in runs), "runs disagree"
    row: dict = {}
    for phase in ("prefill", "decode"):
        walls = sorted(r["times"][phase][0] for r in runs)
        cpus = sorted(r["times"][phase][1] for r in runs)
        count = runs[0]["times"][phase][2]
        wall, cpu = walls[len(walls) // 2], cpus[len(cpus) // 2]
        row[phase] = {"tokens": count, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                      "tokens_per_s_wall": round(count / wall, 1),
                      "tokens_per_s_cpu": round(count / cpu, 1),
                      "wall_s_runs": [round(r["times"][phase][0], 3) for r in runs]}
    row["generated"] = runs[0]["generated"]
    return row


def engine_rows(threads: int = 1, repeats: int = 3) -> dict:
    """The engine section (module docstring): measured, on this machine, now, with
    ``threads`` torch threads (one by default: on a shared machine more threads mostly wait
    for each other)."""
    import torch

    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = _checkpoints(Path(tmp))
        held = {name: _blocks_held(path) for name, path in paths.items()}
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        for _ in range(repeats):       # round robin: a change of load hits every layout
            for name, path in paths.items():
                runs[name].append(_throughput(path))
        speed = {name: _median_row(rows) for name, rows in runs.items()}
    generated = {name: row.pop("generated") for name, row in speed.items()}
    base = speed["no_window"]
    for row in speed.values():
        for phase in ("prefill", "decode"):
            row[phase]["speedup_wall"] = round(
                row[phase]["tokens_per_s_wall"] / base[phase]["tokens_per_s_wall"], 2)
            row[phase]["speedup_cpu"] = round(
                row[phase]["tokens_per_s_cpu"] / base[phase]["tokens_per_s_cpu"], 2)
    return {"kind": "measured in kvlab's engine (compiled CPU path)",
            "setup": {**ENGINE, "model": "random Qwen3-shaped checkpoint: 4 layers, hidden 256, "
                      "4 heads (and 4 KV heads) of 64, vocab 512, float32",
                      "layouts": {k: v or ["full_attention"] * 4 for k, v in LAYOUTS.items()},
                      "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      "repeats": repeats},
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "blocks_held_one_request": held,
            "throughput_two_requests": speed,
            "windowed_tokens_differ_from_unwindowed": generated["window_every_layer"]
            != generated["no_window"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans-only", action="store_true",
                    help="recompute the plans, keep the stored engine measurements")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the engine")
    ap.add_argument("--repeats", type=int, default=3, help="runs per layout (median)")
    args = ap.parse_args()
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
    stored = RESULTS_DIR / "kv_layouts.json"
    if args.plans_only and stored.is_file():
        engine = json.loads(stored.read_text()).get("engine")
    else:
        engine = engine_rows(args.threads, args.repeats)
    if engine is not None:
        for name, row in engine["blocks_held_one_request"].items():
            print(f"{name:<19} one request at 8k: {row['peak_blocks']:>4} blocks at the peak, "
                  f"{row['end_blocks']:>4} at the end ({row['end_mib']} MiB)")
        for name, row in engine["throughput_two_requests"].items():
            print(f"{name:<19} prefill {row['prefill']['tokens_per_s_wall']:>8} tok/s "
                  f"(x{row['prefill']['speedup_wall']}), decode "
                  f"{row['decode']['tokens_per_s_wall']:>7} tok/s "
                  f"(x{row['decode']['speedup_wall']}) wall")
    write_results("kv_layouts", {
        "benchmark": "kv_layouts",
        "kind": "plans (kvlab.labs.capacity.hybrid_plan); the engine section is measured",
        "assumptions": {"gpu": GPU, "gpu_memory_utilization": 0.9,
                        "reserve_gib": RESERVE / GiB, "kv_dtype": "bf16", "block_size": 16,
                        "weights": {"gemma-3-27b-it": f"{GEMMA_PARAMS:,} params x 2 B (bf16)",
                                    "gpt-oss-120b": "MXFP4 experts (4.25 bits), rest bf16"}},
        "requests_per_gpu": rows,
        "mla_vs_gqa": mla,
        **({"engine": engine} if engine is not None else {}),
    })


if __name__ == "__main__":
    main()
