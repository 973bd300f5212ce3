"""A decoder layer's small ops (kvlab.engine.ops): the engine selects one table with its
kernels, and the fused Triton ops (kvlab.kernels.triton_fused: RMSNorm with residual add,
SiLU-and-mul,
RoPE) equal the torch path on CPU under Triton's interpreter, and an engine running them
generates kvlab-tiny's greedy tokens unchanged.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, so the cases run in one
subprocess (``python -m kvlab.labs.parity.fused``) and this module reads its JSON. The
interpreter rounds float32 to bfloat16 toward zero (a GPU rounds to nearest even), so in
bfloat16 the kernels lie within two roundings (2 * 2**-7 of the magnitude) of the torch path
here; ``benchmarks/gpu_check.py`` checks them on a GPU with the tighter bound."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from triton_interpret import run_interpreted

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install -e '.[dev]' installs it; CI does)")

OPS = ("rms_norm", "add_rms_norm.sum", "add_rms_norm", "silu_and_mul", "rope")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted("kvlab.labs.parity.fused")


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_fused_kernels_match_torch_in_float32(results, op):
    r = results["ops_float32"][op]
    assert r["rel_vs_torch"] < 1e-6, r
    if op in ("add_rms_norm.sum", "rope"):   # one rounding per element, as torch: exact
        assert r["vs_torch"] == 0.0, r


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_fused_kernels_match_torch_in_bfloat16(results, op):
    r = results["ops_bfloat16"][op]
    assert r["rel_vs_float32"] < 2 * 2 ** -7, r
    assert r["rel_vs_torch"] < 2 * 2 ** -7 + 2 ** -8, r


@needs_triton
def test_rope_leaves_the_rest_of_the_qkv_row_alone(results):
    assert results["ops_float32"]["rope"]["untouched_tail_exact"]
    assert results["ops_bfloat16"]["rope"]["untouched_tail_exact"]


@needs_triton
def test_engine_with_fused_ops_generates_the_same_tokens(results):
    r = results["engine"]
    assert r["layers_bound"] == 4 and r["tokens"] > 0
    assert r["tokens_identical"], r
    assert r["max_logprob_diff"] < 1e-4, r


def test_parity_harness_detects_a_wrong_kernel(monkeypatch):
    """The comparison can fail: with torch stand-ins for the kernels (no Triton needed), a
    SiLU-and-mul that swaps gate and up is caught and the others pass."""
    from kvlab.engine.ops import apply_rope, rms_norm
    from kvlab.kernels import triton_fused
    from kvlab.labs.parity import fused as fused_parity

    def add_rms_norm(x, res, w, eps):
        x.add_(res)
        return rms_norm(x, w, eps), x

    def rope_(x, cos, sin):
        x.copy_(apply_rope(x, cos, sin))
        return x

    def swapped(x):
        g, u = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(u) * g

    monkeypatch.setattr(triton_fused, "rms_norm", rms_norm)
    monkeypatch.setattr(triton_fused, "add_rms_norm", add_rms_norm)
    monkeypatch.setattr(triton_fused, "rope_", rope_)
    monkeypatch.setattr(triton_fused, "silu_and_mul", swapped)
    r = fused_parity.compare_ops("cpu", torch.float32)
    assert r["silu_and_mul"]["rel_vs_torch"] > 0.1
    assert all(r[op]["vs_torch"] == 0.0 for op in OPS if op != "silu_and_mul")


def test_fused_ops_refuse_bad_shapes():
    from kvlab.kernels import triton_fused

    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="last dimension must be even"):
        triton_fused.silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_fused.rms_norm(x.t(), torch.ones(3), 1e-5)
    with pytest.raises(ValueError, match="does not match"):
        triton_fused.add_rms_norm(x, torch.zeros(3, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        triton_fused.rope_(torch.zeros(2, 3, 8), torch.zeros(2, 3), torch.zeros(2, 3))


def test_add_rms_norm_is_the_residual_add_then_the_norm():
    # the definition every table keeps: the layer's former ``x = o(attn).add_(x)`` then
    # ``rms_norm(x)``, bit for bit, the sum written into the first argument
    from kvlab.engine.ops import CpuLayerOps, LayerOps, rms_norm
    from kvlab.kernels import cpu as cpu_kernels

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 48, generator=gen), torch.randn(48, generator=gen)
    build = cpu_kernels.compiled()
    tables = [LayerOps()] + ([CpuLayerOps(build)] if build is not None else [])
    for ops in tables:
        y = torch.randn(5, 48, generator=gen)
        want_sum = y + x
        normed, total = ops.add_rms_norm(y, x, w, 1e-5)
        assert total is y and torch.equal(total, want_sum)
        assert torch.equal(normed, ops.rms_norm(want_sum, w, 1e-5))
    assert torch.equal(LayerOps().rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


def test_the_engine_selects_one_kernel_set_for_its_device_and_dtype(monkeypatch):
    """On the CPU in float32: the compiled attention and the compiled build's three ops where
    it built, else the torch definitions; float64 always the definitions; on CUDA Triton's
    attention and ops (``KVLAB_FUSED_OPS=0``: the torch ops). The engine's runner holds the
    selection, and every forward runs it."""
    from kvlab.engine.attention_cpu import CpuAttention
    from kvlab.engine.attention_torch import TorchAttention
    from kvlab.engine.attention_triton import TritonAttention
    from kvlab.engine.llm import LLM
    from kvlab.engine.ops import CpuLayerOps, Kernels, LayerOps, TritonLayerOps, select_kernels
    from kvlab.kernels import cpu as cpu_kernels
    from kvlab.kernels import triton as triton_kernels

    chosen = select_kernels("cpu", torch.float32)
    if cpu_kernels.available():
        assert isinstance(chosen.attention, CpuAttention)
        assert isinstance(chosen.ops, CpuLayerOps)
    else:
        assert chosen == Kernels.torch()
    assert type(LLM("kvlab-tiny").engine.executor.kernels.ops) is type(chosen.ops)
    assert select_kernels("cpu", torch.float64) == Kernels(TorchAttention(), LayerOps())
    bf16 = select_kernels("cpu", torch.bfloat16)
    assert type(bf16.ops) is LayerOps     # the compiled small ops are float32 only
    monkeypatch.setenv("KVLAB_CPU_ATTENTION", "0")
    assert select_kernels("cpu", torch.float32) == Kernels.torch()
    monkeypatch.delenv("KVLAB_CPU_ATTENTION")
    if triton_kernels.available():
        cuda = select_kernels("cuda", torch.bfloat16)
        assert isinstance(cuda.attention, TritonAttention)
        assert isinstance(cuda.ops, TritonLayerOps)
        monkeypatch.setenv("KVLAB_FUSED_OPS", "0")
        assert type(select_kernels("cuda", torch.bfloat16).ops) is LayerOps
