"""kvlab's engine vs Hugging Face transformers on the same weights, one offline workload.

Workload (seeded): 64 requests, prompts of 16-256 tokens (a third open with the shared system
prompt of the corpus), outputs of 8-256 tokens, greedy, end-of-sequence ignored so that every
path generates exactly the same number of tokens. Paths, run one after the other in this
process with the same torch thread count:

- kvlab: ``LLM.generate`` (paged KV, continuous batching, prefix caching, chunked prefill);
- HF padded ``generate``: all 64 requests in one left-padded batch, and in four batches of 16
  sorted by output length (less padding waste);
- HF continuous batching (``init_continuous_batching`` / per-request ``max_new_tokens``, the
  machinery behind ``generate_batch``) when the installed transformers has it.

kvlab and the two padded HF paths run ``--repeats`` times, alternating, and each keeps its
fastest run (other processes on a shared machine add noise). Reported: generated tokens/s
(wall clock, and per CPU-second of this process, which is less sensitive to other load on a
shared machine), the ratio kvlab / each HF path, agreement of the greedy outputs, model-FLOP
utilisation against a float32 matmul rate measured in the same run, and the share of kvlab's
step time spent outside the model forward (scheduling, metadata, sampling, bookkeeping), over
the workload and in a steady state of 64 requests decoding together.

Then the same comparison on seeded random Llama checkpoints of several sizes (``--sizes``,
default 4M and the ~25M-parameter model; 60M on request), each reporting tokens/s, the speedup
over HF's fastest path with the greedy-token agreement, linear-layer MFU (linear FLOPs of every
computed token over wall time, against a 1024^3 float32 GEMM timed in this process) and the
share of step time outside the model at 64 running requests, all at the stated torch thread
count (the JSON's ``sizes`` and ``size_summary``; the top-level keys stay the shipped model's).

Run: ``python benchmarks/bench_engine_vs_hf.py`` (writes benchmarks/results/engine_vs_hf.json).
``--threads`` defaults to 1: on a small shared machine several busy threads stall each other at
every parallel region, which distorts both sides; pass 0 for torch's default.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

from kvlab.core.sampling_params import SamplingParams  # noqa: E402
from kvlab.engine.checkpoint import resolve_model_path  # noqa: E402
from kvlab.engine.llm import LLM  # noqa: E402
from kvlab.engine.outputs import EngineStats  # noqa: E402
from kvlab.engine.tokenizer import load_tokenizer  # noqa: E402
from kvlab.labs.invariants import check_engine  # noqa: E402


# --------------------------------------------------------------------------- workload
def build_workload(model_dir: Path, vocab: int, n: int, seed: int
                   ) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, max_tokens) pairs; corpus text when the model has a tokenizer."""
    rng = random.Random(seed)
    tok = load_tokenizer(model_dir)
    lengths = [rng.randint(16, 256) for _ in range(n)]
    outputs = [rng.randint(8, 256) for _ in range(n)]
    prompts: list[list[int]] = []
    if tok is not None:
        from kvlab.models.corpus import generate_corpus, shared_prefix_prompts

        shared = [tok.encode(t) for t in shared_prefix_prompts(seed, n)]
        stream: list[int] = []
        for doc in generate_corpus(0, 4 * n, start=2_000_000 + seed * 10_000):
            stream.extend(tok.encode(doc))
        at = 0
        for i, length in enumerate(lengths):
            if i % 3 == 0:
                prompts.append(shared[i][:256])
            else:
                prompts.append(stream[at:at + length])
                at += length
    else:
        system = [rng.randrange(vocab) for _ in range(64)]
        for i, length in enumerate(lengths):
            p = [rng.randrange(vocab) for _ in range(length)]
            prompts.append(system + p[:max(1, length - 64)] if i % 3 == 0 else p)
    return list(zip(prompts, outputs, strict=True))


def random_tiny_checkpoint() -> Path:
    """A random model with kvlab-tiny's shape (used when the shipped weights are missing)."""
    from kvlab.labs.parity.hf import save_random_hf_model

    return save_random_hf_model(
        Path(tempfile.mkdtemp()) / "random-tiny", "llama", seed=0, hidden_size=192,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024,
        initializer_range=0.02)


#: Random Llama checkpoints of the size sweep (transformers config overrides). ``25M`` is the
#: issue's ~25M-parameter model (26.6M with its tied 8192 x 512 embedding).
SIZES: dict[str, dict] = {
    "4M": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
    "25M": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=8192),
    "60M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                num_attention_heads=12, num_key_value_heads=4, vocab_size=8192),
}


def random_checkpoint(size: str) -> Path:
    """A seeded random Llama of :data:`SIZES` ``[size]`` in a temporary folder."""
    from kvlab.labs.parity.hf import save_random_hf_model

    return save_random_hf_model(
        Path(tempfile.mkdtemp()) / f"random-{size}", "llama", seed=0,
        max_position_embeddings=1024, initializer_range=0.02, tie_word_embeddings=True,
        **SIZES[size])


# --------------------------------------------------------------------------- measurements
def best_time(fn, clock=time.perf_counter, repeats: int = 5) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` by ``clock`` (call it once first)."""
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return max(best, 1e-9)


def matmul_gflops(clock=time.perf_counter) -> float:
    """Sustained float32 matmul rate of this process (best of several 1024x1024x1024), by
    ``clock`` (wall time by default; ``time.process_time`` gives the rate per CPU-second)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    return 2 * 1024**3 / best_time(lambda: a @ b, clock, repeats=8) / 1e9


def stream_read_gbps(clock=time.perf_counter) -> float:
    """Sustained rate at which this process reads float32 memory far beyond the CPU's caches
    (best of several sums of a 256 MiB tensor), in GB/s: about as fast as one core reads what
    is not in its caches (an op beats it only on data still cached)."""
    x = torch.ones(64 * 1024 * 1024)
    x.sum()
    return x.numel() * x.element_size() / best_time(x.sum, clock) / 1e9


def paged_kv_bytes(llm: LLM, meta) -> int:
    """Bytes of K and V the step's paged rows (decodes, short chunks behind a prefix) read
    through their block tables, over all layers: each row reads every position it attends."""
    if meta is None or not meta.paged_lens.numel():
        return 0
    model = llm.engine.model
    per_position = model.cfg.kv_bytes_per_token(model.dtype.itemsize)   # the bench's KV dtype
    return int(meta.paged_lens.sum()) * per_position


def chunk_flops(llm: LLM, chunks) -> float:
    """Model FLOPs of one step's chunks (matmuls + attention; lm_head only on sampled rows)."""
    model = llm.engine.model
    cfg = model.cfg
    body = model.cfg.flops_per_token(0, with_lm_head=False)
    head = 2.0 * cfg.vocab_size * cfg.hidden_size
    per_ctx = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    total = 0.0
    for c in chunks:
        s, e = c.start_pos, c.start_pos + c.num_tokens
        total += c.num_tokens * body + per_ctx * (e * (e + 1) - s * (s + 1)) / 2
        total += head if c.sample else 0.0
    return total


def chunk_linear_flops(llm: LLM, chunks) -> float:
    """Linear-layer FLOPs of one step's chunks: 2 per weight of every projection per computed
    token, plus the lm_head on sampled rows (attention QK^T/PV and elementwise ops excluded)."""
    model = llm.engine.model
    cfg = model.cfg
    body = model.cfg.flops_per_token(0, with_lm_head=False)
    head = 2.0 * cfg.vocab_size * cfg.hidden_size
    return sum(c.num_tokens * body + (head if c.sample else 0.0) for c in chunks)


def linear_floor_s(model, shapes: list[tuple[int, int]], repeats: int = 2) -> float:
    """Seconds the linear layers alone take over a run: for each step's ``(tokens, sampled
    rows)`` in ``shapes``, every projection of every layer on ``tokens`` rows and the lm_head on
    ``sampled`` rows, with the model's own weights and the engine's own calls (the layers'
    ``forward``, oneDNN with packed weights where the engine chose
    :class:`kvlab.engine.linear.OneDnnLinearMethod`;
    the lm_head through ``LlamaModel.logits``), nothing else (best of ``repeats``).
    kvlab's wall time cannot go below it, so HF's time over it bounds the reachable speedup."""
    cfg = model.cfg
    layers = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in model.layers]
    widest = max(n for n, _ in shapes)
    x = torch.randn(widest, cfg.hidden_size)
    xq = torch.randn(widest, layers[0][1].weight.shape[1])
    xi = torch.randn(widest, cfg.intermediate_size)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for n, sampled in shapes:
                for qkv, o, gate_up, down in layers:
                    qkv(x[:n])
                    o(xq[:n])
                    gate_up(x[:n])
                    down(xi[:n])
                if sampled:
                    model.logits(x[:sampled])
            best = min(best, time.perf_counter() - t0)
    return best


def run_kvlab(model: str | Path, workload, *, max_num_seqs: int = 64) -> dict:
    llm = LLM(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    llm.generate([p for p, _ in workload[:4]], SamplingParams(max_tokens=4, temperature=0))
    eng = llm.engine
    eng.stats = EngineStats()  # reset the counters after the warm-up
    for i, (prompt, n) in enumerate(workload):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0,
                                                        ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    flops = linear = 0.0
    kv_read = 0
    shapes: list[tuple[int, int]] = []
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.has_unfinished_requests():
        for out in eng.step(only_finished=True):
            outputs[out.request_id] = out.outputs[0].token_ids
        chunks = eng.last_trace.scheduler_output.chunks
        flops += chunk_flops(llm, chunks)
        linear += chunk_linear_flops(llm, chunks)
        kv_read += paged_kv_bytes(llm, eng.last_trace.metadata)
        shapes.append((sum(c.num_tokens for c in chunks), sum(c.sample for c in chunks)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = eng.stats
    check_engine(eng)
    return {
        "wall_s": wall, "cpu_s": cpu, "generated_tokens": st.generated_tokens,
        "outputs": [outputs[f"r{i}"] for i in range(len(workload))],
        "steps": st.steps, "model_flops": flops, "linear_flops": linear,
        "model_time_s": st.model_time_s,
        "overhead_share": st.overhead_share,
        "time_split_s": {"scheduler": st.schedule_time_s, "metadata": st.prepare_time_s,
                         "model": st.model_time_s, "sampling": st.sample_time_s,
                         "other": st.step_time_s - st.schedule_time_s - st.prepare_time_s
                         - st.model_time_s - st.sample_time_s},
        "prefix_hit_rate": st.prefix_hit_rate,
        "linear_floor_s": linear_floor_s(eng.model, [s for s in shapes if s[0]]),
        "paged_kv_bytes": kv_read,
    }


def steady_engine(model: str | Path, requests: int, prompt: int, output: int, seed: int = 0):
    """An engine holding ``requests`` greedy requests of ``prompt`` random tokens each."""
    rng = random.Random(seed)
    eng = LLM(model, max_num_seqs=requests, max_num_batched_tokens=2048).engine
    vocab = eng.config.vocab_size
    for i in range(requests):
        eng.add_request(f"s{i}", [rng.randrange(vocab) for _ in range(prompt)],
                        SamplingParams(max_tokens=output, temperature=0, ignore_eos=True))
    return eng


def all_decoding(eng, requests: int) -> bool:
    """Whether the engine's last step decoded one token for each of ``requests`` requests."""
    chunks = eng.last_trace.scheduler_output.chunks
    return len(chunks) == requests and all(c.num_tokens == 1 for c in chunks)


def run_kvlab_steady(model: str | Path, *, requests: int = 64, prompt: int = 128,
                     output: int = 96, seed: int = 0) -> dict:
    """Steady state: ``requests`` sequences decoding together; share of step time outside the
    model over the steps in which all of them decode."""
    eng = steady_engine(model, requests, prompt, output, seed)
    fields = ("step_time_s", "model_time_s", "schedule_time_s", "prepare_time_s",
              "sample_time_s")
    sums = dict.fromkeys(fields, 0.0)
    steps = 0
    while eng.has_unfinished_requests():
        before = {f: getattr(eng.stats, f) for f in fields}
        eng.step(only_finished=True)
        if all_decoding(eng, requests):
            steps += 1
            for f in fields:
                sums[f] += getattr(eng.stats, f) - before[f]
    per_step = {f.replace("_time_s", "_ms"): 1e3 * v / max(steps, 1) for f, v in sums.items()}
    return {"steps": steps, "per_step_ms": per_step,
            "overhead_share": 1 - sums["model_time_s"] / sums["step_time_s"] if steps else None}


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    return hf


def run_hf_padded(hf, workload, batch_size: int, sort: bool) -> dict:
    order = list(range(len(workload)))
    if sort:
        order.sort(key=lambda i: workload[i][1])
    outputs: dict[int, list[int]] = {}

    def run(batch):
        width = max(len(workload[i][0]) for i in batch)
        ids = torch.tensor([[0] * (width - len(workload[i][0])) + workload[i][0] for i in batch])
        mask = torch.tensor([[0] * (width - len(workload[i][0])) + [1] * len(workload[i][0])
                             for i in batch])
        new = max(workload[i][1] for i in batch)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)
        for row, i in enumerate(batch):
            outputs[i] = out[row, width:width + workload[i][1]].tolist()

    run(order[:2])  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(0, len(order), batch_size):
        run(order[k:k + batch_size])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "generated_tokens": sum(n for _, n in workload),
            "outputs": [outputs[i] for i in range(len(workload))]}


def run_hf_continuous(hf, workload, timeout_s: float = 120.0) -> dict:
    if not hasattr(hf, "init_continuous_batching"):
        return {"error": "this transformers has no continuous batching"}
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(n for _, n in workload), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    t0, c0 = time.perf_counter(), time.process_time()
    manager = hf.init_continuous_batching(generation_config=cfg)
    manager.start()
    results = {}
    try:
        for i, (prompt, n) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
        while len(results) < len(workload):
            if time.perf_counter() - t0 > timeout_s:
                return {"error": f"timed out after {timeout_s:.0f} s"}
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    return {"error": "the continuous-batching thread stopped"}
                continue
            if res.is_finished():
                results[res.request_id] = list(res.generated_tokens)
    finally:
        manager.stop(block=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    outs = [results[f"r{i}"] for i in range(len(workload))]
    return {"wall_s": wall, "cpu_s": cpu, "generated_tokens": sum(len(o) for o in outs),
            "outputs": outs, "note": "cpu_s counts every thread of the process"}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Exact-match share of requests, and mean share of tokens before the first divergence."""
    exact, prefix = 0, 0.0
    for x, y in zip(a, b, strict=True):
        exact += x == y
        same = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v),
                    min(len(x), len(y)))
        prefix += same / max(len(x), 1)
    return {"exact_requests": exact / len(a), "mean_prefix_agreement": prefix / len(a)}


# --------------------------------------------------------------------------- main
def LLM_params(model_dir: Path) -> int:
    """Parameter count of a checkpoint (from its config, as kvlab's ModelConfig counts)."""
    from kvlab.engine.config import ModelConfig

    return int(ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
               .num_params)


def bench_model(model_dir: Path, model_name: str, args: argparse.Namespace) -> dict:
    """Every path on one checkpoint; the result dict (the JSON's top level for the main model).
    """
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = build_workload(model_dir, vocab, args.requests, args.seed)
    rate = matmul_gflops()
    rate_cpu = matmul_gflops(time.process_time)

    hf = load_hf(model_dir)
    runs: dict[str, list[dict]] = {"kvlab": [], "HF generate, padded x64": [],
                                   "HF generate, padded x16 sorted": []}
    for _ in range(args.repeats):  # alternate the paths; keep each one's fastest run
        runs["kvlab"].append(run_kvlab(model_dir, workload, max_num_seqs=args.requests))
        runs["HF generate, padded x64"].append(
            run_hf_padded(hf, workload, len(workload), sort=False))
        runs["HF generate, padded x16 sorted"].append(
            run_hf_padded(hf, workload, 16, sort=True))
    paths = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
    kv = paths["kvlab"]
    if not args.no_continuous:
        paths["HF continuous batching"] = run_hf_continuous(hf, workload)
    steady = run_kvlab_steady(model_dir, requests=args.requests)
    rate = max(rate, matmul_gflops())
    rate_cpu = max(rate_cpu, matmul_gflops(time.process_time))

    print(f"\nmodel: {model_name} | {len(workload)} requests | prompts "
          f"{sum(len(p) for p, _ in workload)} tokens | generated {kv['generated_tokens']} "
          f"tokens | torch threads {torch.get_num_threads()}")
    print(f"{'path':34s} {'wall s':>8s} {'tok/s':>8s} {'tok/cpu-s':>10s} {'kvlab x':>8s} "
          f"{'exact':>6s} {'prefix':>7s}")
    table = {}
    for name, r in paths.items():
        if "error" in r:
            print(f"{name:34s} unavailable: {r['error']}")
            table[name] = {"error": r["error"]}
            continue
        tps = r["generated_tokens"] / r["wall_s"]
        tpc = r["generated_tokens"] / r["cpu_s"]
        ratio = (kv["generated_tokens"] / kv["wall_s"]) / tps
        agree = agreement(kv["outputs"], r["outputs"])
        print(f"{name:34s} {r['wall_s']:8.2f} {tps:8.0f} {tpc:10.0f} {ratio:8.2f} "
              f"{agree['exact_requests']:6.2f} {agree['mean_prefix_agreement']:7.3f}")
        table[name] = {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "tokens_per_s": tps,
                       "tokens_per_cpu_s": tpc, "kvlab_speedup": ratio, "agreement_with_kvlab":
                       agree, **({"note": r["note"]} if "note" in r else {})}
    hf_best = max((v["tokens_per_s"], k) for k, v in table.items()
                  if k != "kvlab" and "error" not in v)
    kv_tps = table["kvlab"]["tokens_per_s"]
    mfu = kv["model_flops"] / kv["wall_s"] / (rate * 1e9)
    mfu_model = kv["model_flops"] / kv["model_time_s"] / (rate * 1e9)
    print(f"\nkvlab vs HF's best path ({hf_best[1]}): {kv_tps / hf_best[0]:.2f}x tokens/s "
          f"(target >= 3x)")
    print(f"matmul rate {rate:.1f} GFLOP/s | kvlab model FLOPs {kv['model_flops'] / 1e9:.1f} G "
          f"| MFU {mfu:.1%} of wall time, {mfu_model:.1%} of model time")
    at64 = steady["overhead_share"]
    print(f"kvlab time outside the model: {kv['overhead_share']:.1%} over the workload; "
          f"{at64:.1%} over {steady['steps']} steps with {args.requests} requests decoding "
          f"(target <= 10%)\n  per step (ms): " + ", ".join(
              f"{k.replace('_ms', '')} {v:.2f}" for k, v in steady["per_step_ms"].items()))
    print("kvlab step time split (s): " + ", ".join(
        f"{k} {v:.2f}" for k, v in kv["time_split_s"].items())
        + f" | prefix-cache hit rate {kv['prefix_hit_rate']:.1%}")
    cfg = json.loads((model_dir / "config.json").read_text())
    params = LLM_params(model_dir)
    mfu_linear = kv["linear_flops"] / kv["wall_s"] / (rate * 1e9)
    # per CPU-second (this process's CPU time, for kvlab and for the GEMM): less sensitive to
    # other processes taking the CPU away on a shared machine than the wall-clock figure
    mfu_linear_cpu = kv["linear_flops"] / kv["cpu_s"] / (rate_cpu * 1e9)
    hf_best_cpu = max(v["tokens_per_cpu_s"] for k, v in table.items()
                      if k != "kvlab" and "error" not in v and "note" not in v)
    speedup_cpu = table["kvlab"]["tokens_per_cpu_s"] / hf_best_cpu
    print(f"linear-layer MFU {mfu_linear:.1%} of the 1024^3 float32 GEMM rate, wall clock; "
          f"{mfu_linear_cpu:.1%} per CPU-second (GEMM {rate_cpu:.1f} GFLOP/CPU-s); kvlab vs "
          f"HF's best per CPU-second {speedup_cpu:.2f}x (torch threads "
          f"{torch.get_num_threads()}, {params / 1e6:.1f}M parameters)")
    # the bound: kvlab's linear layers alone, replayed with the run's shapes and weights
    floor = kv["linear_floor_s"]
    hf_best_wall = table[hf_best[1]]["wall_s"]
    ceiling = {"linear_floor_s": floor, "linear_share_of_kvlab": floor / kv["wall_s"],
               "speedup_ceiling_vs_hf_best": hf_best_wall / floor,
               "mfu_linear_ceiling": kv["linear_flops"] / floor / (rate * 1e9)}
    print(f"bound: the linear layers alone take {floor:.2f} s "
          f"({ceiling['linear_share_of_kvlab']:.0%} of kvlab's wall time) at "
          f"{ceiling['mfu_linear_ceiling']:.0%} of the 1024^3 rate, so "
          f"kvlab can be at most {ceiling['speedup_ceiling_vs_hf_best']:.2f}x HF's best here")
    # decode attention's own floor: its K/V reads at this core's streaming rate
    stream = stream_read_gbps()
    kv_floor = kv["paged_kv_bytes"] / (stream * 1e9)
    ceiling.update({"paged_kv_gb": kv["paged_kv_bytes"] / 1e9, "stream_read_gbps": stream,
                    "paged_kv_floor_s": kv_floor,
                    "share_of_linear_plus_kv_floor": (floor + kv_floor) / kv["wall_s"]})
    print(f"decode attention reads {kv['paged_kv_bytes'] / 1e9:.1f} GB of K/V: at this core's "
          f"streaming rate ({stream:.1f} GB/s) {kv_floor:.2f} s; the linear layers and these "
          f"reads alone are {ceiling['share_of_linear_plus_kv_floor']:.0%} of kvlab's wall time")
    result = {
        "benchmark": "engine_vs_hf", "model": model_name, "requests": len(workload),
        "prompt_tokens": sum(len(p) for p, _ in workload),
        "generated_tokens": kv["generated_tokens"], "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "paths": table,
        "kvlab_vs_hf_best": {"hf_path": hf_best[1], "speedup": kv_tps / hf_best[0]},
        "matmul_gflops": rate, "kvlab_model_gflop": kv["model_flops"] / 1e9,
        "mfu_wall": mfu, "mfu_model_time": mfu_model,
        "overhead_share": kv["overhead_share"], "overhead_share_at_64": at64,
        "steady_state_64": steady, "steps": kv["steps"], "repeats": args.repeats,
        "time_split_s": kv["time_split_s"], "prefix_hit_rate": kv["prefix_hit_rate"],
        "params": params, "hidden_size": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
        "kvlab_linear_gflop": kv["linear_flops"] / 1e9, "mfu_linear": mfu_linear,
        "matmul_gflops_per_cpu_s": rate_cpu, "mfu_linear_cpu": mfu_linear_cpu,
        "speedup_vs_hf_best_cpu": speedup_cpu, "ceiling": ceiling,
        "identical_greedy_vs_hf_best":
            table[hf_best[1]]["agreement_with_kvlab"]["exact_requests"],
    }
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kvlab-tiny")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each path (best kept)")
    ap.add_argument("--no-continuous", action="store_true", help="skip HF continuous batching")
    ap.add_argument("--sizes", default="4M,25M",
                    help=f"random Llama sizes to sweep, comma-separated from {list(SIZES)} "
                         "('' to skip)")
    ap.add_argument("--size-requests", type=int, default=64,
                    help="requests per workload in the size sweep")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model_dir = resolve_model_path(args.model)
        model_name = args.model
    except FileNotFoundError as err:
        print(f"note: {err}\n      using random weights with kvlab-tiny's shape instead")
        model_dir, model_name = random_tiny_checkpoint(), "random weights, kvlab-tiny shape"
    result = bench_model(model_dir, model_name, args)
    sizes = [x for x in args.sizes.split(",") if x]
    if sizes:
        result["sizes"] = {}
        sub = argparse.Namespace(**{**vars(args), "requests": args.size_requests,
                                    "repeats": max(1, args.repeats - 1)})
        for size in sizes:
            print(f"\n=== random Llama {size} ===")
            r = bench_model(random_checkpoint(size), f"random Llama {size}", sub)
            result["sizes"][size] = r
        print(f"\n{'size':6s} {'params':>8s} {'kvlab tok/s':>11s} {'x HF best':>9s} "
              f"{'(per CPU-s)':>11s} {'MFU lin':>8s} {'(CPU-s)':>8s} {'outside@64':>10s} "
              f"{'identical':>9s} {'ceiling x':>9s} {'MFU max':>8s}  (torch threads "
              f"{torch.get_num_threads()})")
        for size, r in result["sizes"].items():
            print(f"{size:6s} {r['params'] / 1e6:7.1f}M "
                  f"{r['paths']['kvlab']['tokens_per_s']:11.0f} "
                  f"{r['kvlab_vs_hf_best']['speedup']:9.2f} {r['speedup_vs_hf_best_cpu']:11.2f} "
                  f"{r['mfu_linear']:8.1%} {r['mfu_linear_cpu']:8.1%} "
                  f"{r['overhead_share_at_64']:10.1%} "
                  f"{r['identical_greedy_vs_hf_best']:9.0%} "
                  f"{r['ceiling']['speedup_ceiling_vs_hf_best']:9.2f} "
                  f"{r['ceiling']['mfu_linear_ceiling']:8.1%}")
        result["size_summary"] = {
            size: {"params": r["params"], "tokens_per_s": r["paths"]["kvlab"]["tokens_per_s"],
                   "speedup_vs_hf_best": r["kvlab_vs_hf_best"]["speedup"],
                   "hf_best_path": r["kvlab_vs_hf_best"]["hf_path"],
                   "mfu_linear": r["mfu_linear"], "mfu_linear_cpu": r["mfu_linear_cpu"],
                   "speedup_vs_hf_best_cpu": r["speedup_vs_hf_best_cpu"],
                   "overhead_share_at_64":
                   r["overhead_share_at_64"], "torch_threads": r["torch_threads"],
                   **r["ceiling"]}
            for size, r in result["sizes"].items()}
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    write_results("engine_vs_hf", result)
    return result


if __name__ == "__main__":
    main()
