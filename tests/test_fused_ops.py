"""A decoder layer's ops tables (kvlab.engine.fused_ops): the engine binds one per model, and
the fused Triton ops (kvlab.kernels.triton_fused: RMSNorm with residual add, SiLU-and-mul,
RoPE) equal the torch path on CPU under Triton's interpreter, and an engine with them bound
generates kvlab-tiny's greedy tokens unchanged.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, so the cases run in one
subprocess (``python -m kvlab.engine.fused_parity``) and this module reads its JSON. The
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
    return run_interpreted("kvlab.engine.fused_parity")


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
    from kvlab.engine import fused_parity
    from kvlab.engine.model import apply_rope, rms_norm
    from kvlab.kernels import triton_fused

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
    from kvlab.engine.fused_ops import compiled_cpu_ops
    from kvlab.engine.model import TorchOps, rms_norm

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 48, generator=gen), torch.randn(48, generator=gen)
    for ops in (TorchOps, compiled_cpu_ops(torch.float32)):
        if ops is None:    # the compiled CPU build is missing here
            continue
        y = torch.randn(5, 48, generator=gen)
        want_sum = y + x
        normed, total = ops.add_rms_norm(y, x, w, 1e-5)
        assert total is y and torch.equal(total, want_sum)
        assert torch.equal(normed, ops.rms_norm(want_sum, w, 1e-5))
    assert torch.equal(TorchOps.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


def test_the_engine_binds_one_ops_table_per_model(monkeypatch):
    """On the CPU in float32 the layers get the compiled build's ops (TorchOps with its three)
    where it built, else torch's; bind_fused_ops puts the Triton table in (unless
    KVLAB_FUSED_OPS=0) and unbind_fused_ops takes every layer back to TorchOps."""
    from kvlab.engine.checkpoint import load_checkpoint
    from kvlab.engine.fused_ops import (
        TritonOps,
        bind_fused_ops,
        bind_layer_ops,
        unbind_fused_ops,
    )
    from kvlab.engine.model import DecoderLayer, TorchOps
    from kvlab.kernels import cpu as cpu_kernels
    from kvlab.kernels import triton as triton_kernels

    model = load_checkpoint("kvlab-tiny").model
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    assert all(layer.ops is TorchOps for layer in layers)   # unbound: torch's
    ops = bind_layer_ops(model)
    assert all(layer.ops is ops for layer in layers) and issubclass(ops, TorchOps)
    if cpu_kernels.available():
        built = cpu_kernels.FUSED_OPS[torch.float32]
        assert (ops.rms_norm, ops.rope_, ops.silu_and_mul) == (
            built.rms_norm, built.rope_, built.silu_and_mul)
        assert ops.add_rms_norm.__func__ is TorchOps.add_rms_norm.__func__
    else:
        assert ops is TorchOps
    assert bind_layer_ops(load_checkpoint("kvlab-tiny", dtype=torch.float64).model) is TorchOps
    monkeypatch.setenv("KVLAB_FUSED_OPS", "0")
    assert bind_fused_ops(model) == 0 and all(layer.ops is ops for layer in layers)
    monkeypatch.delenv("KVLAB_FUSED_OPS")
    if triton_kernels.available():
        assert bind_fused_ops(model) == len(layers) == 4
        assert all(layer.ops is TritonOps for layer in layers)
    unbind_fused_ops(model)
    assert all(layer.ops is TorchOps for layer in layers)
