"""vLLM's own answer for the layout planner's parity test (tests/test_kv_layouts.py).

Run with vLLM's interpreter (``.venv-vllm/bin/python tests/vllm_layout_parity.py < cases.json``):
for each case (a list of layers, a block size, a dtype, a TP size) it builds vLLM 0.32's KV
cache specs (``FullAttentionSpec``, ``SlidingWindowSpec``, ``MLAAttentionSpec``, ``MambaSpec``
with the gated-DeltaNet state shapes of ``MambaStateShapeCalculator``), unifies their pages
(``unify_kv_cache_spec_page_size``), groups them (``_get_kv_cache_groups_uniform_page_size``)
and asks each sliding-window group how many blocks it admits a request with. It also evaluates
``VllmConfig.max_concurrent_batches`` and ``max_in_flight_tokens`` on the scheduler settings
given (``"in_flight"``). Prints JSON.
"""
import json
import sys
from types import SimpleNamespace

import torch
from vllm.config.vllm import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.core.kv_cache_utils import (
    _get_kv_cache_groups_uniform_page_size,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

DT = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


def spec(layer, block, dtype, tp, padded):
    if layer["kind"] == "full":
        return FullAttentionSpec(block_size=block, num_kv_heads=max(1, layer["kv_heads"] // tp),
                                 head_size=layer["head_dim"], dtype=DT[dtype])
    if layer["kind"] == "sliding":
        return SlidingWindowSpec(block_size=block, num_kv_heads=max(1, layer["kv_heads"] // tp),
                                 head_size=layer["head_dim"], dtype=DT[dtype],
                                 sliding_window=layer["window"])
    if layer["kind"] == "mla":
        return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=layer["head_dim"],
                                dtype=DT[dtype])
    g = layer["gdn"]
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, g["hk"], g["hv"], g["dk"], g["dv"], g["kernel"])
    return MambaSpec(block_size=block, shapes=tuple(shapes),
                     dtypes=(DT[g["conv"]], DT[g["ssm"]]), page_size_padded=padded)


def in_flight(batched, async_scheduling, pp, v2_runner):
    """vLLM's own properties, evaluated on just the settings they read."""
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling,
                                         max_num_batched_tokens=batched),
        use_v2_model_runner=v2_runner)
    config.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(config)
    return [config.max_concurrent_batches, VllmConfig.max_in_flight_tokens.fget(config)]


request = json.loads(sys.stdin.read())
out = []
for case in request["layouts"]:
    specs = {f"layer.{i}": spec(layer, case["block"], case["dtype"], case["tp"], case["padded"])
             for i, layer in enumerate(case["layers"])}
    raw = [s.page_size_bytes if not isinstance(s, MambaSpec) else
           MambaSpec(block_size=s.block_size, shapes=s.shapes, dtypes=s.dtypes).page_size_bytes
           for s in specs.values()]
    unified = unify_kv_cache_spec_page_size(specs)
    groups = _get_kv_cache_groups_uniform_page_size(unified)
    group_rows = [[sorted(int(n.split(".")[1]) for n in g.layer_names),
                   type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size,
                   g.kv_cache_spec.page_size_bytes] for g in groups]
    windows = {}
    for g in groups:
        if isinstance(g.kv_cache_spec, SlidingWindowSpec):
            windows[str(g.kv_cache_spec.sliding_window)] = [
                g.kv_cache_spec.max_admission_blocks_per_request(c, t)
                for c, t in case["admissions"]]
    out.append({"raw_pages": raw, "groups": group_rows, "admission": windows})
print(json.dumps({"layouts": out,
                  "in_flight": [in_flight(*args) for args in request["in_flight"]]}))
