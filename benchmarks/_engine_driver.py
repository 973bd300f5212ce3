"""One engine (kvlab or vLLM) in its own process, driven by ``bench_vs_vllm.py`` over stdin.

Run as ``python _engine_driver.py --engine kvlab|vllm --model DIR --workloads FILE --threads N``
(kvlab: ``--async-scheduling`` for overlap scheduling; ``--cores`` the CPUs the process may use,
by default the first N, for both engines) with the interpreter of that engine's virtual
environment (this file imports nothing of kvlab at module level, so vLLM's environment can run
it). It builds the engine, warms it up on the head of every ``warmup-*`` workload (vLLM compiles
its model there), prints ``READY {json}`` (with the ``async_scheduling`` the engine actually
runs with), then for each line ``NAME`` read from stdin, runs workload ``NAME`` once through the
engine's offline ``generate`` (greedy, ``ignore_eos``) and prints ``RESULT {json}``: wall and
process-CPU seconds, generated tokens, every request's token ids (and kvlab's time by phase).
``quit`` or end of input ends it. Other output (vLLM's logs) never starts with those two words.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _kvlab(model: str, threads: int, async_scheduling: bool = False):
    import torch

    torch.set_num_threads(threads)
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    llm = LLM(model, async_scheduling=async_scheduling)

    def generate(workload):
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                  for _, n in workload]
        outs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def phases():
        st = llm.engine.stats
        return {"step": st.step_time_s, "schedule": st.schedule_time_s,
                "metadata": st.prepare_time_s, "forward": st.model_time_s,
                "sampling": st.sample_time_s}

    return generate, phases, llm.engine.args.async_scheduling


def _vllm(model: str, threads: int, async_scheduling: bool = False):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", seed=0)

    def generate(workload):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                  for _, n in workload]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in workload]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    # its default (None) resolves to True in vllm/config/vllm.py, then the CPU platform turns it
    # off ("async scheduling is not required on CPU", vllm/platforms/cpu.py): report the result
    return generate, None, llm.llm_engine.vllm_config.scheduler_config.async_scheduling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("kvlab", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--cores", type=int, default=None,
                    help="the number of CPUs the process may use (default: --threads)")
    args = ap.parse_args()
    if args.threads < 1 or (args.cores is not None and args.cores < 1):
        raise SystemExit("--threads and --cores must be >= 1")
    if args.async_scheduling and args.engine != "kvlab":
        raise SystemExit("--async-scheduling: kvlab only (vLLM's CPU build turns it off)")
    with open(args.workloads) as f:
        workloads = {k: [(list(p), int(n)) for p, n in v] for k, v in json.load(f).items()}
    # Both engines on the first --threads CPUs (kvlab's overlap: one more, for its host
    # thread). vLLM binds its OpenMP threads only in its multiprocess executor
    # (vllm/utils/ompmultiprocessing.py); in-process its main thread would float over every
    # CPU, which on a loaded machine favours it in wall-clock time.
    os.sched_setaffinity(0, set(range(min(args.cores or args.threads, os.cpu_count()))))
    t0, c0 = time.perf_counter(), time.process_time()
    generate, phases, overlap = (_kvlab if args.engine == "kvlab" else _vllm)(
        args.model, args.threads, args.async_scheduling)
    built = time.perf_counter() - t0, time.process_time() - c0
    for name, w in workloads.items():   # warm-up: the head of each warmup-*, short outputs
        if name.startswith("warmup-"):
            generate([(p, min(n, 8)) for p, n in w[:8]])
    ready = {"build_s": built[0], "build_cpu_s": built[1],
             "startup_s": time.perf_counter() - t0, "startup_cpu_s": time.process_time() - c0,
             "async_scheduling": overlap, "cpus": sorted(os.sched_getaffinity(0))}
    print("READY " + json.dumps(ready), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name in ("", "quit"):
            break
        before = phases() if phases else None
        t0, c0 = time.perf_counter(), time.process_time()
        outputs = generate(workloads[name])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        result = {"wall_s": wall, "cpu_s": cpu, "outputs": outputs,
                  "generated_tokens": sum(len(o) for o in outputs),
                  "load_1min": os.getloadavg()[0]}
        if phases:
            after = phases()
            result["phases_s"] = {k: after[k] - before[k] for k in after}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
