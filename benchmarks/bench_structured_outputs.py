"""What structured outputs cost: compiling a grammar, masking a batch, and end to end.

Side by side in one run, on the shipped ``kvlab-tiny`` (1,024-token vocabulary), one torch
thread:

1. **compile**: time to compile each kind (regex, JSON schema, choice, EBNF) against the
   vocabulary on a cache miss, and to fetch it on a hit;
2. **mask**: for a batch of 16 rows, ``apply_token_bitmask`` (fill 16 bitmask rows from their
   grammar states + one masking call) beside the sampler's own time on the same logits;
3. **end to end**: 16 requests x 48 tokens, greedy, through ``LLM.generate``: unconstrained vs
   every request under a regex, for three regexes of different shape (every run generates
   exactly the same number of tokens). Reported: tokens/s of each,
   the ratios, and the share of step time spent sampling (which includes filling the masks,
   masking and advancing the grammars).

Each timing keeps its fastest of ``--repeats`` runs (the machine is shared).
Run: ``python benchmarks/bench_structured_outputs.py`` (writes
benchmarks/results/structured_outputs.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

from kvlab.core.sampling_params import SamplingParams  # noqa: E402
from kvlab.engine.llm import LLM  # noqa: E402
from kvlab.engine.sampler import SamplerState, sample  # noqa: E402
from kvlab.engine.structured_outputs import (  # noqa: E402
    GrammarCompiler,
    StructuredOutputsParams,
    apply_token_bitmask,
)

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["name", "age", "tags"]}
KINDS = {
    "regex": StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
    "json": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "choice": StructuredOutputsParams(choice=("positive", "negative", "neutral")),
    "grammar": StructuredOutputsParams(
        grammar='root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'),
}
# Three languages: a starred character class (it may end anywhere, but greedy decoding of this
# workload never picks EOS within 48 tokens; asserted), and two counted repetitions that cannot
# end within 48 tokens (a token is at most ~8 characters). xgrammar expands a count into a long
# chain of rules, which makes accepting and masking slower.
LONG = {"regex_star": r"[a-z ]*", "regex_min400": r"[a-z ]{400,}",
        "regex_words60": r"([a-z]+ ){60}"}


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_compile(llm: LLM, repeats: int) -> dict:
    engine = llm.engine
    out = {}
    for kind, spec in KINDS.items():
        def cold(spec=spec):
            GrammarCompiler(engine.tokenizer, engine.config.vocab_size,
                            engine.eos_token_ids).compile(spec)
        compiler = GrammarCompiler(engine.tokenizer, engine.config.vocab_size,
                                   engine.eos_token_ids)
        compiler.compile(spec)
        miss = best(cold, repeats)
        hit = best(lambda c=compiler, s=spec: c.compile(s), repeats)
        out[kind] = {"miss_ms": round(miss * 1e3, 3), "hit_us": round(hit * 1e6, 2)}
        print(f"compile {kind:8s} miss {miss * 1e3:7.2f} ms   hit {hit * 1e6:6.1f} us")
    return out


def bench_mask(llm: LLM, repeats: int, rows: int = 16) -> dict:
    compiler = llm.engine.structured_outputs.compiler
    vocab = llm.engine.config.vocab_size
    states = [compiler.new_state(KINDS["json"]) for _ in range(rows)]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    samplers = [SamplerState.create(SamplingParams(temperature=0.8, top_p=0.9), i)
                for i in range(rows)]
    mask_s = best(lambda: apply_token_bitmask(logits.clone(), list(range(rows)), states),
                  repeats * 20)
    sample_s = best(lambda: sample(logits.clone(), samplers), repeats * 20)
    print(f"mask {rows} rows: {mask_s * 1e6:.0f} us ({mask_s / rows * 1e6:.1f} us/row); "
          f"sampler on the same logits: {sample_s * 1e6:.0f} us")
    return {"rows": rows, "mask_us": round(mask_s * 1e6, 1),
            "mask_us_per_row": round(mask_s / rows * 1e6, 2),
            "sampler_us": round(sample_s * 1e6, 1),
            "mask_over_sampler": round(mask_s / sample_s, 3)}


def bench_end_to_end(llm: LLM, repeats: int, n: int = 16, tokens: int = 48) -> dict:
    prompts = [f"Story {i}: once upon a time" for i in range(n)]
    runs = {"unconstrained": SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)}
    runs.update({name: SamplingParams(max_tokens=tokens, temperature=0,
                                      structured_outputs={"regex": rx})
                 for name, rx in LONG.items()})
    out = {}
    for name, params in runs.items():
        llm.generate(prompts[:2], params, use_tqdm=False)    # warm up (and compile)
        best_s, share = float("inf"), 0.0
        for _ in range(repeats):
            stats = llm.engine.stats
            before = (stats.sample_time_s, stats.step_time_s, stats.generated_tokens)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            made = stats.generated_tokens - before[2]
            assert made == n * tokens and all(len(o.outputs[0].token_ids) == tokens for o in outs)
            if wall < best_s:
                best_s = wall
                share = (stats.sample_time_s - before[0]) / (stats.step_time_s - before[1])
        out[name] = {"tokens_per_s": round(n * tokens / best_s, 1),
                     "sample_share_of_step": round(share, 4)}
        print(f"{name:14s} {n * tokens / best_s:8.1f} tok/s   sampling {share:.1%} of step time")
    base = out["unconstrained"]["tokens_per_s"]
    for name, rx in LONG.items():
        out[name]["regex"] = rx
        out[name]["throughput_vs_unconstrained"] = round(out[name]["tokens_per_s"] / base, 3)
        print(f"{name} / unconstrained throughput: "
              f"{out[name]['throughput_vs_unconstrained']:.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM("kvlab-tiny", seed=0)
    result = {"benchmark": "structured_outputs", "model": "kvlab-tiny",
              "vocab_size": llm.engine.config.vocab_size, "torch_threads": torch.get_num_threads(),
              "compile": bench_compile(llm, args.repeats),
              "mask": bench_mask(llm, args.repeats),
              "end_to_end": bench_end_to_end(llm, args.repeats)}
    write_results("structured_outputs", result)


if __name__ == "__main__":
    main()
