"""Speculative decoding on CPU with the shipped pair: off vs draft model vs n-gram, k in 1,2,4,8.

For each method and ``k`` (and speculation off), at batch 1 (requests one after another) and
batch 16 (all at once), greedy decoding of the same prompts (so every configuration generates
the same tokens, and the comparison is of time only): tokens/s, mean per-request latency,
acceptance per draft position, the measured mean accepted length per verification against
Leviathan et al. (2023)'s ``(1 - a^(k+1)) / (1 - a)``, and the measured speedup against their
model ``(1 - a^(k+1)) / ((1 - a)(c k + 1))`` with ``c`` the measured cost of one draft forward
relative to one target forward (this engine runs ``k + 1`` draft forwards per step, the last
only writing the final draft's KV, so the model is also given with ``c (k + 1)``).

``a`` is estimated from the counts by maximum likelihood under the paper's i.i.d. model: each
verification shows ``m`` accepted drafts, then a rejection unless ``m = k`` (censored), so
``a = sum(m) / (sum(m) + rejections)``.

Run: ``python benchmarks/bench_speculative.py`` (about 2-3 minutes on a quiet 2-core CPU;
one torch thread). Writes ``benchmarks/results/speculative.json``.
"""

from __future__ import annotations

import platform
import time

import torch
from _results import write_results

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.llm import LLM

KS = (1, 2, 4, 8)
MAX_TOKENS = 48
PROMPTS = ["The town of Harrow is", "Once upon a time, the river", "Question: where does",
           "In the Vale, the people of", "A storm came to the town of", "Her friend said that",
           "The festival of lanterns in", "The town of Ashford has a", "He lives in the town",
           "The river runs from", "Question: who is the", "Once upon a time, a baker",
           "The town of Millbrook was founded", "Their pet was a", "In the north of the Vale",
           "The market of"]
BATCH1_PROMPTS = PROMPTS[:3]


def leviathan_length(a: float, k: int) -> float:
    """Expected tokens per verification with i.i.d. acceptance ``a``: (1 - a^(k+1)) / (1 - a)."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def alpha_mle(history, k: int) -> float:
    """Maximum-likelihood acceptance rate from per-verification accepted counts (censored at k)."""
    accepted = sum(r.num_accepted for r in history)
    rejections = sum(1 for r in history if r.num_accepted < r.num_draft_tokens)
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def run(spec: dict | None, k: int, batch: int) -> dict:
    cfg = None if spec is None else {**spec, "num_speculative_tokens": k}
    llm = LLM("kvlab-tiny", num_blocks=1024, max_num_seqs=16, speculative_config=cfg, seed=0)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)     # warm up
    if llm.engine.speculator is not None:
        llm.engine.speculator.metrics.reset()                                 # fresh counters
    steps0 = llm.engine.stats.steps
    latencies, tokens = [], 0
    t0 = time.perf_counter()
    groups = [[p] for p in BATCH1_PROMPTS] if batch == 1 else [PROMPTS[:batch]]
    outs_all = []
    for group in groups:
        outs = llm.generate(group, sp, use_tqdm=False)
        outs_all.extend(outs)
        for o in outs:
            latencies.append(o.metrics.finished_time - o.metrics.arrival_time)
            tokens += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    row = {"method": "off" if spec is None else spec["method"], "k": k if spec else 0,
           "batch": batch, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
           "mean_latency_s": sum(latencies) / len(latencies),
           "steps": llm.engine.stats.steps - steps0,
           "outputs": [o.outputs[0].token_ids for o in outs_all]}
    spec_obj = llm.engine.speculator
    if spec_obj is not None:
        m = spec_obj.metrics
        hist = [r for r in m.history if r.num_draft_tokens]
        a = alpha_mle(hist, k)
        per_pos = [c / m.num_drafts if m.num_drafts else 0.0 for c in m.accepted_per_pos]
        cond = [per_pos[0]] + [per_pos[i] / per_pos[i - 1] if per_pos[i - 1] else 0.0
                               for i in range(1, k)]
        full_k = [r for r in hist if r.num_draft_tokens == k]
        steps = row["steps"]
        row.update({
            **m.as_dict(),
            "alpha_mle": a,
            "accepted_rate_per_pos": per_pos,            # P(position i accepted)
            "conditional_alpha_per_pos": cond,           # P(i accepted | 0..i-1 accepted)
            "mean_accepted_length": m.mean_accepted_length,
            "mean_accepted_length_full_k": (1 + sum(r.num_accepted for r in full_k)
                                            / len(full_k)) if full_k else None,
            "leviathan_expected_length": leviathan_length(a, k),
            "alpha_first_pos": per_pos[0],
            "leviathan_expected_length_first_pos": leviathan_length(per_pos[0], k),
            "mean_draft_tokens_per_verification": (m.num_draft_tokens / m.num_drafts
                                                   if m.num_drafts else 0.0),
            "draft_s_per_step": m.draft_time_s / steps,
            "target_s_per_step": m.target_time_s / steps,
        })
    return row


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    draft = {"method": "draft_model", "model": "kvlab-tiny-draft"}
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    rows = []
    for batch in (1, 16):
        base = run(None, 0, batch)
        rows.append(base)
        # cost of one plain target forward (a decode step) and of one draft forward
        for spec in (draft, ngram):
            for k in KS:
                row = run(spec, k, batch)
                assert row["outputs"] == base["outputs"], "speculation changed greedy output"
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
                target_step = base["seconds"] / base["steps"]
                c = row["draft_s_per_step"] / (k + 1) / target_step
                row["draft_target_cost_ratio_c"] = c
                a = row["alpha_mle"]
                row["leviathan_speedup_ck"] = leviathan_length(a, k) / (c * k + 1)
                row["leviathan_speedup_c_k_plus_1"] = leviathan_length(a, k) / (c * (k + 1) + 1)
                row["verify_cost_vs_decode"] = row["target_s_per_step"] / target_step
                rows.append(row)
                print(f"batch {batch:2d} {row['method']:11s} k={k}: {row['tokens_per_s']:7.1f} "
                      f"tok/s  speedup {row['speedup']:.2f} "
                      f"(model {row['leviathan_speedup_ck']:.2f})  a={a:.2f}  "
                      f"len {row['mean_accepted_length']:.2f} vs "
                      f"{row['leviathan_expected_length']:.2f}  c={c:.2f}  "
                      f"verify/decode {row['verify_cost_vs_decode']:.2f}")
        print(f"batch {batch:2d} off: {base['tokens_per_s']:7.1f} tok/s")
    for r in rows:
        r.pop("outputs")
    write_results("speculative", {
        "benchmark": "speculative decoding: off vs draft model vs n-gram (greedy, CPU)",
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor()},
        "max_tokens": MAX_TOKENS, "prompts_batch1": len(BATCH1_PROMPTS), "prompts_batch16": 16,
        "rows": rows,
        "notes": [
            "Greedy: every configuration generates the same tokens (asserted), so only time "
            "differs.",
            "Leviathan et al. assume verifying k+1 tokens costs one target forward (memory-"
            "bound GPU); on a CPU with a 1.8M-parameter target, a (k+1)-token verification "
            "costs more than a decode step: verify_cost_vs_decode measures it, and the model's "
            "speedup over-predicts by about that factor.",
            "They assume i.i.d. acceptance with one rate a; conditional_alpha_per_pos shows "
            "acceptance is not constant across positions, so measured lengths deviate.",
            "n-gram proposals are often shorter than k (no match): mean_draft_tokens_per_"
            "verification < k, and the formula with k over-predicts their accepted length.",
            "At batch 16 a step's fixed Python overhead is shared, so the draft's relative "
            "cost c and the speedup differ from batch 1.",
        ],
    })


if __name__ == "__main__":
    main()
