"""Linear methods (kvlab.engine.linear): oneDNN with packed weights against F.linear, the method
chosen at load for every linear layer and the tied head, and the engine built with and without
it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab import LLM, SamplingParams
from kvlab.engine.linear import Linear, LinearMethod, OneDnnLinearMethod, select_linear_method

needs_onednn = pytest.mark.skipif(not OneDnnLinearMethod.available(torch.float32),
                                  reason="this torch has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 130])
def test_a_packed_linear_computes_f_linear(bias, rows):
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias)
    plain = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(rows, 96)
    ref = F.linear(x, layer.weight, layer.bias).detach()
    assert layer.use_method(OneDnnLinearMethod())
    assert isinstance(layer.method, OneDnnLinearMethod) and "forward" not in vars(layer)
    with torch.inference_mode():
        out = layer(x)
        batched = layer(x.view(1, rows, 96))
        strided = layer(x.t().contiguous().t())            # a non-contiguous input
    scale = ref.abs().max()
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5 * scale
    assert torch.equal(batched[0], out) and torch.equal(strided, out)
    # the plain weights stay: state dicts, hashes and quantization read them
    assert layer.state_dict().keys() == plain.keys()
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in plain.items())


@needs_onednn
def test_what_onednn_cannot_run_is_left_alone(monkeypatch):
    double = Linear(8, 8).double()
    assert not double.use_method(OneDnnLinearMethod())
    assert type(double.method) is LinearMethod               # unchanged: F.linear
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(double(x), F.linear(x, double.weight, double.bias))
    assert isinstance(select_linear_method("cpu", torch.float32), OneDnnLinearMethod)
    assert type(select_linear_method("cpu", torch.float64)) is LinearMethod
    assert type(select_linear_method("meta", torch.float32)) is LinearMethod
    monkeypatch.setenv("KVLAB_CPU_LINEAR", "0")
    assert type(select_linear_method("cpu", torch.float32)) is LinearMethod


def _logits_match_f_linear(model, weight):
    """``model.logits`` within float32 rounding of F.linear over ``weight``."""
    torch.manual_seed(0)
    for rows in (1, 2, 36):
        hidden = torch.randn(rows, model.cfg.hidden_size)
        with torch.inference_mode():
            got = model.logits(hidden)
        want = F.linear(hidden, weight)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_onednn
def test_the_logits_matmul_is_packed_tied_or_untied(tmp_path, monkeypatch):
    from kvlab.labs.parity.hf import save_random_hf_model

    tied = LLM("kvlab-tiny").engine.model                   # tied: the embedding's weight
    assert tied.lm_head is None and isinstance(tied.tied_method, OneDnnLinearMethod)
    assert tied.embed.packed_weight is not None
    _logits_match_f_linear(tied, tied.embed.weight)
    path = save_random_hf_model(tmp_path / "untied", tie_word_embeddings=False)
    untied = LLM(str(path)).engine.model                    # its own lm_head, a Linear
    assert isinstance(untied.lm_head.method, OneDnnLinearMethod)
    assert type(untied.tied_method) is LinearMethod         # (no tied head to run)
    _logits_match_f_linear(untied, untied.lm_head.weight)
    monkeypatch.setenv("KVLAB_CPU_LINEAR", "0")
    plain = LLM("kvlab-tiny").engine.model
    assert type(plain.tied_method) is LinearMethod
    with torch.inference_mode():
        hidden = torch.randn(3, plain.cfg.hidden_size)
        assert torch.equal(plain.logits(hidden), F.linear(hidden, plain.embed.weight))


@needs_onednn
def test_the_engine_packs_its_layers_and_keeps_its_greedy_tokens(monkeypatch):
    prompts = [[5 + i, 17, 40 + 3 * i, 9] * (1 + i % 3) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    packed = LLM("kvlab-tiny")
    layer = packed.engine.model.layers[0]
    assert all(isinstance(m.method, OneDnnLinearMethod)
               for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("KVLAB_CPU_LINEAR", "0")
    plain = LLM("kvlab-tiny")
    assert type(plain.engine.model.layers[0].qkv.method) is LinearMethod
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
