"""What group quantization costs in quality: a sweep over bits x group size, with confidence
intervals, on three metrics beside perplexity.

On the shipped ``kvlab-tiny`` (float32 activations, CPU), through the public API only
(``LLM(..., quantization=QuantConfig(...))``, ``SamplingParams(logprobs=...)``):

* **teacher-forced metrics** on held-out corpus text (documents 1,000,000+, never trained on):
  for every position of every document, the full next-token distribution of the quantized
  model and of fp32 (``logprobs`` = the whole vocabulary, one request per prefix; the prefix
  cache makes the prefixes cheap). From them: the perplexity ratio, the mean KL divergence
  ``KL(p_fp32 || p_quant)`` in nats per token, and top-1 agreement (same argmax);
* **greedy agreement**: per prompt, the share of 32 greedy tokens generated before the first
  token that differs from fp32's (the definition of ``tests/test_quantization_engine.py``).

Formats: bits 2, 3, 4, 8 x group size 16, 32, 64 (symmetric; 128 does not divide the model's
192-wide layers), zero-point variants at g = 64, and int8 / fp8 e4m3 KV caches.

Confidence intervals are 95% percentile bootstraps over the *units that are independent*:
documents for the teacher-forced metrics (tokens within a document are not), prompts for
greedy agreement; 2,000 resamples, seeded, paired (every format is scored on the same
resampled documents as fp32). Rounding to nearest is deterministic, so the intervals measure
the evaluation sample, not randomness in the quantizer.

Run: ``python benchmarks/bench_quantization_quality.py`` (about 5-10 minutes on one core).
Writes ``benchmarks/results/quantization_quality.json``.
"""

from __future__ import annotations

import math
import platform
import random
import time
from collections.abc import Callable, Sequence

NUM_DOCS = 20            # held-out documents (teacher-forced metrics)
DOC_TOKENS = 129         # tokens per document (128 predicted positions)
NUM_PROMPTS = 32         # greedy prompts
GREEDY_TOKENS = 32
BOOTSTRAP = 2000
SEED = 0
BITS = (2, 3, 4, 8)
GROUPS = (16, 32, 64)


def kl_and_top1(ref_rows, rows) -> tuple[float, int]:
    """``(sum over positions of KL(ref || row), positions whose argmax agrees)`` for two
    ``[positions, vocab]`` tensors of log-probabilities (each row a full distribution)."""
    if ref_rows.shape != rows.shape or ref_rows.dim() != 2:
        raise ValueError(f"rows of shape {tuple(ref_rows.shape)} and {tuple(rows.shape)}: "
                         "need two equal [positions, vocab] tensors")
    ref, other = ref_rows.double(), rows.double()
    kl = float((ref.exp() * (ref - other)).sum())
    same = int((ref.argmax(-1) == other.argmax(-1)).sum())
    return kl, same


def agreement_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens of ``a`` and ``b`` before their first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def bootstrap_ci(units: Sequence, statistic: Callable[[Sequence], float],
                 resamples: int = BOOTSTRAP, seed: int = SEED, level: float = 0.95
                 ) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over ``units`` resampled with
    replacement (``resamples`` times, seeded)."""
    if not units:
        raise ValueError("bootstrap_ci: no units")
    rng = random.Random(seed)
    n = len(units)
    stats = sorted(statistic([units[rng.randrange(n)] for _ in range(n)])
                   for _ in range(resamples))
    lo = stats[math.floor((1 - level) / 2 * (resamples - 1))]
    hi = stats[math.ceil((1 + level) / 2 * (resamples - 1))]
    return lo, hi


def _configs() -> dict[str, dict]:
    from kvlab.engine.quantization import QuantConfig

    out: dict[str, dict] = {"fp32": {}}
    for b in BITS:
        for g in GROUPS:
            out[f"int{b} g{g}"] = {"quantization": QuantConfig(b, g)}
    for b in BITS:
        out[f"int{b} g64 zp"] = {"quantization": QuantConfig(b, 64, symmetric=False)}
    out["kv int8"] = {"kv_cache_dtype": "int8"}
    out["kv fp8_e4m3"] = {"kv_cache_dtype": "fp8_e4m3"}
    return out


def _score(llm, docs: list[list[int]], prompts: list[str], vocab: int):
    """Per document: (NLL sum, positions, rows of full log-probabilities); greedy outputs."""
    import torch

    from kvlab import SamplingParams

    prefixes = [d[:i + 1] for d in docs for i in range(len(d) - 1)]
    out = llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0, logprobs=vocab),
                       use_tqdm=False)
    per_doc, k = [], 0
    for d in docs:
        rows = torch.empty(len(d) - 1, vocab, dtype=torch.float64)
        for i in range(len(d) - 1):
            lp = out[k].outputs[0].logprobs[0]
            k += 1
            if len(lp) != vocab:
                raise RuntimeError(f"expected {vocab} log-probabilities, got {len(lp)}")
            rows[i, list(lp.keys())] = torch.tensor(list(lp.values()), dtype=torch.float64)
        nll = -float(rows.gather(1, torch.tensor(d[1:])[:, None]).sum())
        per_doc.append((nll, len(d) - 1, rows))
    greedy = llm.generate(prompts, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0,
                                                  ignore_eos=True), use_tqdm=False)
    return per_doc, [o.outputs[0].token_ids for o in greedy]


def main() -> None:
    import torch
    from _results import write_results

    from kvlab import LLM
    from kvlab.labs.perplexity import heldout_token_ids
    from kvlab.models.corpus import sample_prompts

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    engine_kw = {"num_blocks": 2048, "max_num_seqs": 256, "max_num_batched_tokens": 4096}
    base = LLM("kvlab-tiny", **engine_kw)
    vocab = base.engine.config.vocab_size
    docs = heldout_token_ids(base.tokenizer, NUM_DOCS, DOC_TOKENS)
    prompts = sample_prompts(1, NUM_PROMPTS)
    ref_docs, ref_greedy = _score(base, docs, prompts, vocab)
    del base
    rows = []
    for name, kw in _configs().items():
        t = time.perf_counter()
        llm = LLM("kvlab-tiny", **engine_kw, **kw)
        per_doc, greedy = _score(llm, docs, prompts, vocab)
        rep = llm.quantization_report()
        units = []                   # per document: (nll, nll_fp32, n, kl, top1)
        for (nll, n, r), (nll32, _, r32) in zip(per_doc, ref_docs, strict=True):
            kl, same = kl_and_top1(r32, r)
            units.append((nll, nll32, n, kl, same))
        agree = [agreement_prefix(g, g32) / GREEDY_TOKENS
                 for g, g32 in zip(greedy, ref_greedy, strict=True)]

        def ppl_ratio(us):
            return math.exp((sum(u[0] for u in us) - sum(u[1] for u in us))
                            / sum(u[2] for u in us))

        def mean_kl(us):
            return sum(u[3] for u in us) / sum(u[2] for u in us)

        def top1(us):
            return sum(u[4] for u in us) / sum(u[2] for u in us)

        def mean(xs):
            return sum(xs) / len(xs)

        row = {"config": name, "bits": getattr(kw.get("quantization"), "bits", None),
               "group_size": getattr(kw.get("quantization"), "group_size", None),
               "symmetric": getattr(kw.get("quantization"), "symmetric", None),
               "kv_cache_dtype": kw.get("kv_cache_dtype", "auto"),
               "effective_bits": rep.effective_bits, "measured_bits": rep.measured_bits,
               "perplexity": math.exp(sum(u[0] for u in units) / sum(u[2] for u in units))}
        for key, fn, data in (("ppl_ratio", ppl_ratio, units), ("kl_nats", mean_kl, units),
                              ("top1_agreement", top1, units),
                              ("greedy_agreement", mean, agree)):
            lo, hi = bootstrap_ci(data, fn)
            row[key] = fn(data)
            row[f"{key}_ci95"] = [lo, hi]
        row["greedy_identical_prompts"] = sum(a == 1.0 for a in agree)
        rows.append(row)
        print(f"{name:>14}: ppl x{row['ppl_ratio']:.4f} KL {row['kl_nats']:.4f} "
              f"top1 {row['top1_agreement']:.3f} greedy {row['greedy_agreement']:.3f} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    write_results("quantization_quality", {
        "benchmark": "quality vs bits and group size: perplexity, KL, top-1 and greedy "
                     "agreement with 95% bootstrap intervals",
        "model": "kvlab-tiny", "activations": "float32",
        "heldout_documents": len(docs), "predicted_tokens": sum(len(d) - 1 for d in docs),
        "greedy_prompts": NUM_PROMPTS, "greedy_tokens": GREEDY_TOKENS,
        "bootstrap_resamples": BOOTSTRAP, "ci_level": 0.95,
        "kl": "KL(p_fp32 || p_quant), nats per predicted token, full vocabulary",
        "greedy_agreement": "share of greedy tokens before the first difference from fp32",
        "rows": rows, "platform": platform.platform(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "wall_s": round(time.perf_counter() - t0, 1),
    })


if __name__ == "__main__":
    main()
