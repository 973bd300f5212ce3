"""The chaos soak: many seeded chaos runs, the invariant set checked on every step.

Each run is :func:`kvlab.labs.chaos.soak.run_chaos` (one ``EngineCore`` over the production
scheduler with prefix caching, chunked prefill, ``n > 1``, draft-model or n-gram speculation,
random and mid-step aborts, and a seeded step-fault schedule: allocation refusal, KV
shrinkage, executor and sampler errors, late copies, abort storms, rejection at every
position, crashes recovered from the event log, corrupt and truncated logs). The soak is
longer than the CI sweep (``tests/test_chaos.py``): more seeds, 200 traffic steps per run, a
larger pool and batch.

Side by side in one run: the same seeds with the invariant set **off**, so the cost of
checking all nine invariants after every step is a measured ratio.

Reports steps, steps per second (checked and unchecked), faults injected by kind, invariant
checks, violations (a run that raises ``InvariantViolation`` counts one and the soak goes on),
leaked blocks, finished requests whose tokens differ from the same request run alone without
faults, recoveries and refused damaged logs.

Then the P/D soak (:func:`kvlab.labs.chaos.pd_soak.run_pd_chaos`, as many seeds, 80 traffic steps):
a producer and a consumer under every P/D transfer fault, step faults and aborts, invariant 8
reading an independent audit of every install.

Run: ``python benchmarks/bench_chaos.py [--seeds N]``. Writes ``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import Counter

from _results import write_results

from kvlab.labs.chaos.pd_soak import run_pd_chaos
from kvlab.labs.chaos.soak import ChaosConfig, run_chaos
from kvlab.labs.invariants.spec_invariants import InvariantViolation

METHODS = ("draft", "ngram")


def soak_config(check: bool = True) -> ChaosConfig:
    return ChaosConfig(steps=200, num_blocks=96, max_num_seqs=12, max_num_batched_tokens=48,
                       prefill_chunk=12, fault_rate=0.15, check_invariants=check)


def soak(seeds: range, check: bool) -> dict:
    totals: Counter = Counter()
    faults: Counter = Counter()
    violations: list[dict] = []
    t0 = time.perf_counter()
    for seed in seeds:
        for method in METHODS:
            try:
                r = run_chaos(seed, soak_config(check), method=method)
            except InvariantViolation as v:
                violations.append({"seed": seed, "method": method,
                                   "invariant": v.invariant.number, "message": str(v)})
                continue
            totals["runs"] += 1
            totals["steps"] += r.steps
            totals["checks"] += r.checks
            totals["leaked_blocks"] += r.leaked_blocks
            totals["mismatches"] += len(r.mismatches)
            totals["finished"] += len(r.finished)
            totals["recoveries"] += r.recoveries
            totals["refused_logs"] += r.refused_logs
            totals["drafted"] += r.drafted
            totals["accepted"] += r.accepted
            faults.update(r.faults)
    seconds = time.perf_counter() - t0
    return {"seeds": len(seeds), "runs": totals["runs"], "steps": totals["steps"],
            "seconds": round(seconds, 2),
            "steps_per_s": round(totals["steps"] / seconds, 1),
            "invariant_checks": totals["checks"],
            "violations": len(violations), "violation_details": violations[:10],
            "leaked_blocks": totals["leaked_blocks"], "mismatches": totals["mismatches"],
            "finished_requests": totals["finished"], "recoveries": totals["recoveries"],
            "refused_damaged_logs": totals["refused_logs"],
            "faults_by_kind": dict(faults.most_common()),
            "faults_total": sum(faults.values()),
            "draft_acceptance": round(totals["accepted"] / max(1, totals["drafted"]), 3)}


def pd_soak(seeds: range) -> dict:
    """P/D disaggregation under transfer faults, step faults and aborts
    (kvlab.labs.chaos.pd_soak)."""
    totals: Counter = Counter()
    transfer: Counter = Counter()
    step_faults: Counter = Counter()
    violations: list[dict] = []
    t0 = time.perf_counter()
    for seed in seeds:
        try:
            r = run_pd_chaos(seed, steps=80)
        except InvariantViolation as v:
            violations.append({"seed": seed, "invariant": v.invariant.number, "message": str(v)})
            continue
        totals.update(steps=r.steps, checks=r.checks, audited=r.installs_audited,
                      finished=r.finished, mismatches=len(r.mismatches),
                      wrong_kv_reads=r.wrong_kv_reads, leaked_blocks=r.leaked_blocks)
        transfer.update(r.transfer)
        step_faults.update(r.step_faults)
    seconds = time.perf_counter() - t0
    return {"seeds": len(seeds), "steps": totals["steps"], "seconds": round(seconds, 2),
            "steps_per_s": round(totals["steps"] / seconds, 1),
            "invariant_checks": totals["checks"], "installs_audited": totals["audited"],
            "violations": len(violations), "violation_details": violations[:10],
            "leaked_blocks": totals["leaked_blocks"], "mismatches": totals["mismatches"],
            "wrong_kv_reads": totals["wrong_kv_reads"], "finished_requests": totals["finished"],
            "transfer_decisions": dict(transfer.most_common()),
            "step_faults_by_kind": dict(step_faults.most_common())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=150)
    ap.add_argument("--baseline-seeds", type=int, default=40)
    args = ap.parse_args()
    checked = soak(range(args.seeds), check=True)
    print(f"checked:   {checked['steps']:,} steps in {checked['seconds']} s "
          f"({checked['steps_per_s']:,} steps/s), {checked['invariant_checks']:,} checks, "
          f"{checked['faults_total']:,} faults, {checked['violations']} violations, "
          f"{checked['leaked_blocks']} leaked blocks, {checked['mismatches']} mismatches")
    print("faults by kind:", checked["faults_by_kind"])
    base = soak(range(args.baseline_seeds), check=False)
    sub = soak(range(args.baseline_seeds), check=True)
    overhead = sub["seconds"] / base["seconds"]
    print(f"unchecked: {base['steps_per_s']:,} steps/s vs checked {sub['steps_per_s']:,} "
          f"steps/s on the same {args.baseline_seeds} seeds: checking costs {overhead:.2f}x")
    pd = pd_soak(range(args.seeds))
    print(f"P/D:       {pd['steps']:,} steps, {pd['installs_audited']} installs audited, "
          f"{pd['violations']} violations, {pd['mismatches']} mismatches, "
          f"{pd['wrong_kv_reads']} wrong KV reads, {pd['leaked_blocks']} leaked blocks")
    print("transfer decisions:", pd["transfer_decisions"])
    write_results("chaos", {
        "config": {**{k: v for k, v in vars(soak_config()).items()}, "methods": list(METHODS)},
        "soak": checked,
        "pd_soak": pd,
        "overhead": {"seeds": args.baseline_seeds, "unchecked_steps_per_s": base["steps_per_s"],
                     "checked_steps_per_s": sub["steps_per_s"],
                     "checked_over_unchecked_time": round(overhead, 2),
                     "unchecked_mismatches": base["mismatches"],
                     "unchecked_leaked_blocks": base["leaked_blocks"]},
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
    })


if __name__ == "__main__":
    main()
