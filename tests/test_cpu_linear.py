"""oneDNN linear layers with packed weights (kvlab.kernels.cpu_linear) against F.linear, and
the engine built with and without them."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvlab import LLM, SamplingParams
from kvlab.kernels import cpu_linear

needs_onednn = pytest.mark.skipif(not cpu_linear.available(torch.float32),
                                  reason="this torch has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 130])
def test_a_packed_linear_computes_f_linear(bias, rows):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias)
    plain = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(rows, 96)
    ref = F.linear(x, layer.weight, layer.bias).detach()
    assert cpu_linear.pack_linear(layer)
    assert isinstance(layer.forward, functools.partial)
    with torch.inference_mode():
        out = layer(x)
        batched = layer(x.view(1, rows, 96))
        strided = layer(x.t().contiguous().t())            # a non-contiguous input
    scale = ref.abs().max()
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5 * scale
    assert torch.equal(batched[0], out) and torch.equal(strided, out)
    # the plain weights stay: state dicts, hashes and quantization read them
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in plain.items())


@needs_onednn
def test_what_onednn_cannot_run_is_left_alone(monkeypatch):
    double = nn.Linear(8, 8).double()
    assert not cpu_linear.pack_linear(double) and "forward" not in vars(double)

    class Scaled(nn.Linear):                                # a subclass has its own forward
        pass

    model = nn.Sequential(nn.Linear(8, 8), Scaled(8, 8), nn.Linear(8, 4, bias=False))
    assert cpu_linear.pack_linears(model) == 2 and "forward" not in vars(model[1])
    assert cpu_linear.packed_linear(double.weight) is None
    assert cpu_linear.packed_linear(torch.ones(4, 4, device="meta")) is None
    monkeypatch.setenv("KVLAB_CPU_LINEAR", "0")
    fresh = nn.Sequential(nn.Linear(8, 8))
    assert cpu_linear.pack_linears(fresh) == 0 and "forward" not in vars(fresh[0])
    assert cpu_linear.packed_linear(fresh[0].weight) is None


def _logits_match_f_linear(model, weight, head):
    """``model.logits`` is ``head`` (bit for bit) and within float32 rounding of F.linear."""
    torch.manual_seed(0)
    for rows in (1, 2, 36):
        hidden = torch.randn(rows, model.cfg.hidden_size)
        with torch.inference_mode():
            got = model.logits(hidden)
            assert torch.equal(got, head(hidden))
        want = F.linear(hidden, weight)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_onednn
def test_the_logits_matmul_is_packed_tied_or_untied(tmp_path, monkeypatch):
    from kvlab.engine.hf_parity import save_random_hf_model

    tied = LLM("kvlab-tiny").engine.model                   # tied: the embedding's weight
    assert tied.lm_head is None and isinstance(tied.tied_head, functools.partial)
    _logits_match_f_linear(tied, tied.embed.weight, tied.tied_head)
    path = save_random_hf_model(tmp_path / "untied", tie_word_embeddings=False)
    untied = LLM(str(path)).engine.model                    # its own lm_head, an nn.Linear
    assert isinstance(untied.lm_head.forward, functools.partial) and untied.tied_head is None
    _logits_match_f_linear(untied, untied.lm_head.weight, untied.lm_head)
    monkeypatch.setenv("KVLAB_CPU_LINEAR", "0")
    plain = LLM("kvlab-tiny").engine.model
    assert plain.tied_head is None
    _logits_match_f_linear(plain, plain.embed.weight,
                           functools.partial(F.linear, weight=plain.embed.weight))


@needs_onednn
def test_the_engine_packs_its_layers_and_keeps_its_greedy_tokens(monkeypatch):
    prompts = [[5 + i, 17, 40 + 3 * i, 9] * (1 + i % 3) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    packed = LLM("kvlab-tiny")
    layer = packed.engine.model.layers[0]
    assert all(isinstance(m.forward, functools.partial)
               for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("KVLAB_CPU_LINEAR", "0")
    plain = LLM("kvlab-tiny")
    assert "forward" not in vars(plain.engine.model.layers[0].qkv)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
