"""``python -m kvlab bench``: measure goodput of any OpenAI-compatible server.

Example, against a vLLM server (the same command works for kvlab's and SGLang's)::

    python -m kvlab bench --base-url http://localhost:8000 --model meta-llama/Llama-3.1-8B \\
        --num-prompts 500 --request-rate 4 --burstiness 1 \\
        --input-len lognormal:512,0.6 --output-len lognormal:128,0.6 \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --warmup-s 10 --result-json out.json

Arrivals are open-loop (Poisson, or gamma with ``--burstiness``). Lengths come from kvlab's
workload generators (``fixed:N``, ``uniform:LO,HI``, ``lognormal:MEDIAN,SIGMA``), from a JSONL
``--dataset``, or from vLLM's multi-tenant ``--dataset-name prefix_repetition`` (tenants that
share a long system prompt, in random order; the ``--prefix-repetition-*`` flags are vLLM's).
The summary table follows vLLM's ``benchmark_serving``; goodput, SLO attainment and failures
by kind follow :mod:`kvlab.labs.slo`. ``--result-json`` writes the report and every request's
record; ``--scrape-metrics`` adds the server's own ``/metrics`` deltas. Token
counts come from the server's ``usage`` (``stream_options.include_usage``). When more than half
the requests fail (client cancels aside) the exit status is 2 and the server's first error is
printed, with the flag that usually fixes it (``--text-prompts``, ``--no-ignore-eos``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

from kvlab.entrypoints.load_client import LoadConfig, plan_requests, prefix_repetition, run_load
from kvlab.entrypoints.prometheus import parse_metrics
from kvlab.labs.slo import SLO, GoodputReport, evaluate_slo

__all__ = ["failure_message", "format_summary", "length_dist", "main", "scrape_metrics"]


def length_dist(spec: str):
    """``N`` (as ``vllm bench serve --input-len N``: every request ``N`` tokens, the same as
    ``fixed:N``), ``fixed:N``, ``uniform:LO,HI`` or ``lognormal:MEDIAN,SIGMA`` -> a length
    distribution of :mod:`kvlab.sim.workload`. ValueError naming the spec otherwise."""
    from kvlab.sim import workload as w

    if spec.strip().isdigit():
        spec = f"fixed:{spec.strip()}"
    kind, _, args = spec.partition(":")
    try:
        nums = [float(x) for x in args.split(",")] if args else []
        if kind == "fixed" and len(nums) == 1:
            return w.fixed(int(nums[0]))
        if kind == "uniform" and len(nums) == 2:
            return w.uniform(int(nums[0]), int(nums[1]))
        if kind == "lognormal" and len(nums) == 2:
            return w.lognormal(nums[0], nums[1])
    except ValueError as err:
        raise ValueError(f"length spec {spec!r}: {err}") from None
    raise ValueError(f"length spec {spec!r}: expected N, fixed:N, uniform:LO,HI or "
                     "lognormal:MEDIAN,SIGMA")


def scrape_metrics(base_url: str) -> dict:
    """The server's ``/metrics`` as ``{name{labels}: value}`` ({} if it has none)."""
    import httpx

    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10)
        resp.raise_for_status()
        parsed = parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):
        return {}
    return {name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""):
            value for (name, labels), value in parsed.items()}


def _ms(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x * 1e3:.2f}"


def format_summary(rep: GoodputReport, duration: float, prompt_tokens: int) -> str:
    """vLLM ``benchmark_serving``-style table, plus goodput and failures by kind."""
    rows = [("Successful requests:", rep.finished),
            ("Benchmark duration (s):", f"{duration:.2f}"),
            ("Measured window (s):", f"{rep.window_s:.2f}"),
            ("Total input tokens:", prompt_tokens),
            ("Total generated tokens:", rep.output_tokens),
            ("Request throughput (req/s):", f"{rep.throughput:.2f}"),
            ("Output token throughput (tok/s):", f"{rep.token_throughput:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    for key, title in names.items():
        lat = rep.latency[key]
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        lines.append(f"{'Mean ' + key.upper() + ' (ms):':<40}{_ms(lat['mean']):<10}")
        for q in ("p50", "p90", "p99"):
            label = "Median" if q == "p50" else q.upper()
            lines.append(f"{label + ' ' + key.upper() + ' (ms):':<40}{_ms(lat[q]):<10}")
    slo = rep.slo
    lines.append("{s:{c}^50}".format(s=" Goodput ", c="-"))
    bounds = " ".join(f"{k}={'-' if v is None else _ms(v)}"
                      for k, v in (("ttft", slo.ttft), ("tpot", slo.tpot), ("e2e", slo.e2e)))
    lines.append(f"{'SLO (ms):':<40}{bounds}")
    lines.append(f"{'Request goodput (req/s):':<40}{rep.goodput:<10.2f}")
    lines.append(f"{'SLO attainment:':<40}{rep.attainment:<10.1%}")
    lines.append(f"{'Failed quality check:':<40}{rep.quality_failed:<10}")
    lines.append("{s:{c}^50}".format(s=" Failures by kind ", c="-"))
    for kind, n in rep.failures.items():
        lines.append(f"{kind + ':':<40}{n:<10}")
    lines.append(f"(percentiles: {rep.percentile_method}; warm-up {rep.warmup_s:g} s excluded)")
    lines.append("=" * 50)
    return "\n".join(lines)


def _quality(spec: str | None):
    if spec is None:
        return None
    if spec == "nonempty":
        return lambda prompt, text: bool(text.strip())
    mod, _, fn = spec.partition(":")
    if not fn:
        raise ValueError(f"--quality-check {spec!r}: expected 'nonempty' or module:function")
    return getattr(importlib.import_module(mod), fn)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvlab bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="the model name the server expects")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: 1 = Poisson, <1 burstier")
    ap.add_argument("--input-len", default="uniform:32,128",
                    help="prompt length: N, fixed:N, uniform:LO,HI or lognormal:MEDIAN,SIGMA")
    ap.add_argument("--output-len", default="uniform:16,64",
                    help="output length, in the same forms as --input-len")
    ap.add_argument("--dataset", default=None,
                    help="JSONL rows {prompt, output_len} or {prompt_len, output_len}")
    ap.add_argument("--dataset-name", choices=("random", "prefix_repetition"), default="random",
                    help="prefix_repetition: vLLM's multi-tenant shared-prefix workload (text)")
    ap.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    ap.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    ap.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    ap.add_argument("--prefix-repetition-output-len", type=int, default=128)
    ap.add_argument("--text-prompts", action="store_true",
                    help="send words instead of token ids (needed for --endpoint chat)")
    ap.add_argument("--token-range", default="3,1024", help="LO,HI of random prompt token ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--no-ignore-eos", action="store_true",
                    help="do not send ignore_eos (servers without vLLM's extension)")
    ap.add_argument("--abandon-fraction", type=float, default=0.0,
                    help="share of requests the client drops mid-stream (counted as cancels)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--slo-e2e-ms", type=float, default=None)
    ap.add_argument("--quality-check", default=None, help="'nonempty' or module:function")
    ap.add_argument("--warmup-s", type=float, default=0.0,
                    help="requests arriving in the first seconds are not measured")
    ap.add_argument("--percentile-method", choices=("linear", "nearest"), default="linear")
    ap.add_argument("--scrape-metrics", action="store_true",
                    help="read the server's /metrics before and after; report the deltas")
    ap.add_argument("--result-json", default=None)
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        if a.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        lo, hi = (int(x) for x in a.token_range.split(","))
        dataset = None
        if a.dataset_name == "prefix_repetition":
            dataset = prefix_repetition(
                a.num_prompts, a.prefix_repetition_prefix_len, a.prefix_repetition_suffix_len,
                a.prefix_repetition_num_prefixes, a.prefix_repetition_output_len, seed=a.seed)
        elif a.dataset:
            dataset = [json.loads(line) for line in Path(a.dataset).read_text().splitlines()
                       if line.strip()]
        plan = plan_requests(a.num_prompts, a.request_rate, length_dist(a.input_len),
                             length_dist(a.output_len), seed=a.seed, burstiness=a.burstiness,
                             token_range=(lo, hi), text=a.text_prompts or a.endpoint == "chat",
                             dataset=dataset)
        ms = [None if v is None else v / 1e3 for v in (a.slo_ttft_ms, a.slo_tpot_ms,
                                                         a.slo_e2e_ms)]
        slo = SLO(*ms)
        cfg = LoadConfig(a.base_url.rstrip("/"), a.model, endpoint=a.endpoint,
                         request_timeout=a.request_timeout, max_concurrency=a.max_concurrency,
                         ignore_eos=not a.no_ignore_eos, abandon_fraction=a.abandon_fraction,
                         quality_check=_quality(a.quality_check), progress=not a.no_progress,
                         seed=a.seed)
    except (ValueError, OSError, ImportError, AttributeError) as err:
        ap.error(str(err))
    before = scrape_metrics(cfg.base_url) if a.scrape_metrics else {}
    records, duration = run_load(cfg, plan)
    after = scrape_metrics(cfg.base_url) if a.scrape_metrics else {}
    try:
        rep = evaluate_slo(records, slo, warmup_s=a.warmup_s,
                           percentile_method=a.percentile_method)
    except ValueError as err:
        print(f"kvlab bench: nothing to measure: {err}", file=sys.stderr)
        return 1
    prompt_tokens = sum(r.prompt_tokens for r in records if r.finished)
    print(format_summary(rep, duration, prompt_tokens))
    failed = [r for r in records if not r.finished and r.status != "cancelled"]
    if a.result_json:
        out = {"config": {k: v for k, v in vars(a).items()}, "duration_s": duration,
               "report": rep.as_dict(),
               "server_metrics_delta": {k: after[k] - before.get(k, 0.0) for k in after},
               "requests": [r.__dict__ | {"itl": list(r.itl)} for r in records]}
        Path(a.result_json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {a.result_json}")
    if 2 * len(failed) > len(records):
        print(failure_message(failed, len(records), a), file=sys.stderr)
        return 2
    return 0


def failure_message(failed: list, total: int, a: argparse.Namespace) -> str:
    """Why most requests failed: the count, the server's first error, and the flag that
    usually helps against a server that is not vLLM-compatible."""
    first = next((r.error for r in failed if r.error), "no error message")
    lines = [f"kvlab bench: {len(failed)} of {total} requests failed; the first error: {first}"]
    low = first.lower()
    if not (a.text_prompts or a.endpoint == "chat") and ("token" in low or "prompt" in low):
        lines.append("  hint: the server may refuse token-id prompts; try --text-prompts")
    if not a.no_ignore_eos and "ignore_eos" in low:
        lines.append("  hint: the server does not know vLLM's ignore_eos; try --no-ignore-eos")
    return "\n".join(lines)
