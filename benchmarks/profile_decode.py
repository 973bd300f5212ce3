"""Profile kvlab's decode step with 64 requests running (torch.profiler + cProfile).

Sets up ``--requests`` sequences (random prompts of ``--prompt`` tokens), steps until every one
of them is decoding, then profiles ``--steps`` decode steps: torch.profiler's operator table
(with input shapes) and cProfile's Python functions by cumulative time, plus the engine's own
per-step split (scheduler, metadata, model, sampling). For finding what to optimise; it writes
no JSON and asserts nothing.

Run: ``python benchmarks/profile_decode.py --model kvlab-tiny`` or ``--size 25M``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_engine_vs_hf import all_decoding, steady_engine  # noqa: E402


def decoding_engine(model, requests: int, prompt: int, output: int, seed: int = 0):
    """An engine whose ``requests`` sequences have all finished prefill."""
    eng = steady_engine(model, requests, prompt, output, seed)
    while True:
        eng.step(only_finished=True)
        if all_decoding(eng, requests):
            return eng


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kvlab-tiny")
    ap.add_argument("--size", default="", help="a random Llama of bench_engine_vs_hf.SIZES")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model
    if args.size:
        from bench_engine_vs_hf import random_checkpoint
        model = random_checkpoint(args.size)
    eng = decoding_engine(model, args.requests, args.prompt, output=args.steps * 3 + 10)
    for _ in range(3):
        eng.step(only_finished=True)
    st = eng.stats
    fields = ("step_time_s", "model_time_s", "schedule_time_s", "prepare_time_s",
              "sample_time_s")
    before = {f: getattr(st, f) for f in fields}
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(args.steps):
            eng.step(only_finished=True)
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    before = {f: getattr(st, f) for f in fields}
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        eng.step(only_finished=True)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.rows)
    print(s.getvalue())
    before = {f: getattr(st, f) for f in fields}
    for _ in range(args.steps):
        eng.step(only_finished=True)
    print("per decode step (ms, unprofiled): " + ", ".join(
        f"{f.replace('_time_s', '')} {1e3 * (getattr(st, f) - before[f]) / args.steps:.2f}"
        for f in fields))


if __name__ == "__main__":
    main()
