"""The reader's path: the modules a default ``LLM.generate`` runs, in the order chapter 7 walks
them, which is the order the data takes as traced (each module entered from one before it;
DESIGN.md's list of the path is a summary, not this order); no lab module is on it; and the two
CPU attention backends run the same modules but their own. (How many modules and lines the
path has is reported, never bounded: a module holds one thing, whatever its length.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: The reading order, as chapter 7 gives it and the trace checks: a walk of the request's data
#: from the front end down to the KV blocks, then through the step's forward to its outputs.
#: The attention backend is the compiled CPU one here (the torch one when it cannot run).
READING_ORDER = (
    "engine/llm.py",
    "core/sampling_params.py",
    "engine/llm_engine.py",
    "engine/tokenizer.py",
    "core/engine_core.py",
    "core/scheduler.py",
    "core/request.py",
    "core/baseline_scheduler.py",
    "core/kv_cache_manager.py",
    "core/radix_cache.py",
    "core/block_pool.py",
    "core/step_records.py",
    "engine/model_runner.py",
    "engine/input_batch.py",
    "engine/attention_metadata.py",
    "engine/model.py",
    "engine/linear.py",
    "engine/ops.py",
    "engine/attention.py",
    "engine/kv_cache.py",
    "engine/attention_cpu.py",
    "engine/sampler.py",
    "engine/outputs.py",
)

#: Where the modules a default generate must never enter live.
LABS = ("labs/", "viz/", "exercises/", "sim/", "disagg/", "entrypoints/", "reference/")

TRACE = """
import json, os, sys
import kvlab
from kvlab import LLM, SamplingParams

root = os.path.dirname(kvlab.__file__)
llm = LLM("kvlab-tiny")
order, edges = {}, set()

def trace(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(root):
        callee = os.path.relpath(frame.f_code.co_filename, root)
        order.setdefault(callee, len(order))
        back = frame.f_back     # the nearest kvlab caller (past decorators such as torch's)
        while back is not None and not back.f_code.co_filename.startswith(root):
            back = back.f_back
        if back is not None:
            edges.add((os.path.relpath(back.f_code.co_filename, root), callee))

sys.settrace(trace)
outs = llm.generate(["Trern Thyvet was a generous shepherd who lived in", "The river"],
                    SamplingParams(max_tokens=16, temperature=0.8, seed=1), use_tqdm=False)
sys.settrace(None)
assert len(outs) == 2 and all(o.finished and o.outputs[0].token_ids for o in outs)
print(json.dumps({"modules": sorted(order, key=order.get), "edges": sorted(edges),
                  "attention": type(llm.engine.executor.kernels.attention).__name__}))
"""


def _trace(cpu_attention: str) -> dict:
    env = {**__import__("os").environ, "KVLAB_CPU_ATTENTION": cpu_attention}
    done = subprocess.run([sys.executable, "-c", TRACE], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled() -> dict:
    return _trace("1")


def test_the_reading_order_is_the_order_the_data_takes(compiled):
    if compiled["attention"] != "CpuAttention":
        pytest.skip("the CPU attention kernel did not build here")
    modules, edges = compiled["modules"], {tuple(e) for e in compiled["edges"]}
    print(f"{len(modules)} modules on the default path")
    assert set(modules) == set(READING_ORDER), (
        sorted(set(modules) - set(READING_ORDER)), sorted(set(READING_ORDER) - set(modules)))
    # each module is entered from one that comes before it in the order (the first two are
    # what the reader calls: LLM.generate and SamplingParams)
    for i, module in enumerate(READING_ORDER[2:], start=2):
        callers = {a for a, b in edges if b == module}
        assert callers & set(READING_ORDER[:i]), (module, sorted(callers))


def test_no_lab_module_runs_on_a_default_generate(compiled):
    assert not [m for m in compiled["modules"] if m.startswith(LABS)]


def test_either_attention_backend_runs_the_same_modules_but_its_own(compiled):
    torch_path = _trace("0")
    assert torch_path["attention"] == "TorchAttention"
    if compiled["attention"] != "CpuAttention":
        pytest.skip("the CPU attention kernel did not build here")
    ours, theirs = set(compiled["modules"]), set(torch_path["modules"])
    assert ours - theirs == {"engine/attention_cpu.py"}
    assert theirs - ours == {"engine/attention_torch.py"}
