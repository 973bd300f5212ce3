"""``python -m kvlab``: a short demo of the engine on the shipped model, with a summary.

Generates continuations for two waves of prompts (the second wave asks questions that open with
the corpus' system prompt, which the first wave left in the prefix cache), prints a few of them
and a summary: requests, tokens, tokens/s, prefix-cache hit rate, steps and the share of step
time spent outside the model.

``python -m kvlab serve ...`` and ``python -m kvlab bench ...`` run the OpenAI-compatible server
and the load client, ``python -m kvlab cluster ...`` replicas behind vLLM's router
(:mod:`kvlab.entrypoints`).
"""

from __future__ import annotations

import argparse
import sys
import time

from kvlab.labs.invariants import check_engine


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("serve", "bench", "cluster"):   # subcommands (kvlab.entrypoints)
        from importlib import import_module

        return import_module(f"kvlab.entrypoints.{argv[0]}").main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m kvlab", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kvlab-tiny", help="shipped model name or HF directory")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default=None, help="cpu (default) or cuda")
    ap.add_argument("--show", type=int, default=3, help="how many generations to print")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the shipped model's matmuls are too small "
                         "to gain from more, and busy threads stall each other; 0 = torch default)")
    ap.add_argument("--quantization", choices=("none", "int8", "int4"), default=None,
                    help="quantize the linear weights at load and print the five-fact "
                         "quantization report (spec rule 7) after the demo")
    ap.add_argument("--group-size", type=int, default=64, help="weights per quantization scale")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8_e4m3"))
    args = ap.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1:
        ap.error("--requests and --max-tokens must be >= 1")

    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM
    from kvlab.models.corpus import sample_prompts, shared_prefix_prompts

    try:
        quant = None if args.quantization in (None, "none") else args.quantization
        llm = LLM(args.model, device=args.device, quantization=quant,
                  quantization_group_size=args.group_size, kv_cache_dtype=args.kv_cache_dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"kvlab: cannot load model {args.model!r}: {err}", file=sys.stderr)
        return 1
    if llm.tokenizer is None:
        print("kvlab: the model has no tokenizer.json; the demo needs text prompts",
              file=sys.stderr)
        return 1
    # two waves: story/encyclopedia openings plus questions, then more questions, which find
    # the shared system prompt in the prefix cache
    first = (args.requests + 1) // 2
    quarter = first // 2
    waves = [sample_prompts(0, first - quarter) + shared_prefix_prompts(0, quarter),
             shared_prefix_prompts(1, args.requests - first)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    start = time.perf_counter()
    outputs = [out for wave in waves if wave for out in llm.generate(wave, params)]
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats
    for out in outputs[:: max(1, len(outputs) // max(args.show, 1))][: args.show]:
        prompt = out.prompt if len(out.prompt) < 90 else "..." + out.prompt[-87:]
        print(f"--- {out.request_id} ({out.outputs[0].finish_reason})\n{prompt!s}"
              f"\u2192{out.outputs[0].text}")
    cfg = llm.engine.config
    print(
        f"\nmodel {args.model}: {cfg.architecture}, {cfg.num_layers} layers, "
        f"{cfg.num_params / 1e6:.2f} M parameters, on {llm.engine.device}\n"
        f"requests {len(outputs)} | prompt tokens {stats.prompt_tokens} | generated tokens "
        f"{stats.generated_tokens} | {stats.generated_tokens / elapsed:.0f} tokens/s "
        f"({elapsed:.2f} s)\n"
        f"prefix-cache hit rate {stats.prefix_hit_rate:.1%} of prompt tokens | steps "
        f"{stats.steps} | time outside the model {stats.overhead_share:.1%}"
    )
    if args.quantization is not None or args.kv_cache_dtype != "auto":
        print(f"\nquantization report (spec rule 7)\n{llm.quantization_report()}")
    check_engine(llm.engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
