"""benchmarks/_vs_vllm_profile.py makes the compiled ops visible to torch.profiler: the runner's
attention ops and the ops table bound into every decoder layer run inside ``kvlab::<op>``
ranges within the block, and everything is restored after it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.llm import LLM
from kvlab.kernels import cpu

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_compiled_ops_run_in_named_ranges_and_are_restored():
    spec = importlib.util.spec_from_file_location("_vs_vllm_profile",
                                                  BENCHMARKS / "_vs_vllm_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # no prefix caching: the same prompt again is computed, not looked up
    llm = LLM(Path(__file__).resolve().parents[1] / "kvlab" / "models" / "kvlab-tiny",
              enable_prefix_caching=False)
    chosen = llm.engine.executor.kernels
    params = SamplingParams(max_tokens=3, temperature=0)
    want = llm.generate([[5, 6, 7] * 30], params, use_tqdm=False)[0].outputs[0].token_ids
    with module.compiled_ops_visible(llm), torch.profiler.profile() as prof:
        got = llm.generate([[5, 6, 7] * 30], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    names = {e.key for e in prof.key_averages() if e.key.startswith("kvlab::")}
    if cpu.available():   # the compiled build: its ops, named
        assert {"kvlab::rms_norm", "kvlab::rope_", "kvlab::silu_and_mul",
                "kvlab::chunk_attention", "kvlab::decode_attention"} <= names
    assert llm.engine.executor.kernels is chosen
