"""The fused Triton ops vs the torch path (used by tests under ``TRITON_INTERPRET=1`` on CPU,
and by ``benchmarks/gpu_check.py`` on a GPU).

:func:`compare_ops` runs each kernel of :mod:`kvlab.kernels.triton_fused` and its definition in
:mod:`kvlab.engine.ops` (``LayerOps``) on the same random inputs (odd sizes, strided rows,
float32 and bfloat16) and reports the largest differences; :func:`compare_engine` generates
greedily with kvlab-tiny twice, its runner's kernels given the torch ops and then the Triton
ones (``TritonLayerOps``), and reports whether the tokens agree and the largest
log-probability difference. Run
``TRITON_INTERPRET=1 python -m kvlab.labs.parity.fused`` to print both as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from kvlab.engine.ops import LayerOps, TritonLayerOps, apply_rope, rms_norm
from kvlab.kernels import triton_fused as tf

__all__ = ["compare_engine", "compare_ops"]

#: (rows, hidden, heads, head_dim, intermediate): a decode batch and a prefill-sized one, with
#: sizes that are not powers of two
SHAPES = ((3, 48, 5, 24, 80), (37, 192, 8, 32, 512))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def compare_ops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> dict:
    """Max abs differences kernel vs torch path per op, and vs a float32 reference of the same
    rounded inputs (which bounds both), over :data:`SHAPES`; ``rel_*``: the same divided by the
    reference's largest magnitude (bfloat16 has 8 significant bits: a rounding is <= 2**-8 of
    it; Triton's interpreter rounds toward zero, the GPU to nearest even)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)

    out: dict[str, dict[str, float]] = {}

    def record(name: str, got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> None:
        scale = float(ref.abs().max())
        r = out.setdefault(name, {"vs_torch": 0.0, "vs_float32": 0.0, "rel_vs_torch": 0.0,
                                  "rel_vs_float32": 0.0})
        for key, other in (("vs_torch", want), ("vs_float32", ref)):
            d = _diff(got, other)
            r[key], r["rel_" + key] = max(r[key], d), max(r["rel_" + key], d / scale)

    for n, hidden, heads, dim, inter in SHAPES:
        x, res, w = rand(n, hidden, scale=3.0), rand(n, hidden), rand(hidden)
        eps = 1e-5
        record("rms_norm", tf.rms_norm(x, w, eps), rms_norm(x, w, eps),
               rms_norm(x.float(), w.float(), eps))
        want_norm, want_sum = LayerOps().add_rms_norm(x.clone(), res, w, eps)
        got_norm, got_sum = tf.add_rms_norm(x.clone(), res, w, eps)
        record("add_rms_norm.sum", got_sum, want_sum, x.float() + res.float())
        record("add_rms_norm", got_norm, want_norm,
               rms_norm(x.float() + res.float(), w.float(), eps))
        gu = rand(n, 2 * inter, scale=2.0)
        g, u = gu.chunk(2, dim=-1)
        record("silu_and_mul", tf.silu_and_mul(gu), F.silu(g) * u, F.silu(g.float()) * u.float())
        # RoPE on the Q/K heads of a fused QKV row (strided view), as the layer applies it
        qkv = rand(n, (heads + 2) * dim + 2 * dim)
        qk = qkv[:, :(heads + 2) * dim].view(n, heads + 2, dim)
        angles = torch.rand(n, dim // 2, generator=gen).to(device) * 40.0
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        want = apply_rope(qk, cos, sin)
        ref = apply_rope(qk.float(), cos.float(), sin.float())
        tail = qkv[:, (heads + 2) * dim:].clone()
        record("rope", tf.rope_(qk, cos, sin), want, ref)
        out["rope"]["untouched_tail_exact"] = bool(torch.equal(qkv[:, (heads + 2) * dim:], tail))
    return out


def compare_engine(device: str = "cpu", max_tokens: int = 12) -> dict:
    """kvlab-tiny generating greedily (prefill and decode steps, batch of 3) with the torch ops
    and with the Triton ones: whether every token agrees and the largest log-probability
    difference."""
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    # float32, eager (a captured graph would replay whichever ops it recorded), torch ops first
    llm = LLM("kvlab-tiny", device=device, dtype=torch.float32, enforce_eager=True)
    runner = llm.engine.executor
    chosen = runner.kernels
    prompts = ["Trern Thyvet was a generous shepherd who lived in", "The river", "Once"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3, ignore_eos=True)
    try:
        runner.kernels = dataclasses.replace(chosen, ops=LayerOps())
        plain = llm.generate(prompts, params, use_tqdm=False)
        runner.kernels = dataclasses.replace(chosen, ops=TritonLayerOps())
        fused = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.kernels = chosen
    bound = len(llm.engine.model.layers)
    worst, same = 0.0, True
    for a, b in zip(plain, fused, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        same = same and ca.token_ids == cb.token_ids
        for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
            worst = max([worst, *(abs(v - lb[t]) for t, v in la.items() if t in lb)])
    return {"layers_bound": bound, "tokens_identical": same, "max_logprob_diff": worst,
            "tokens": sum(len(o.outputs[0].token_ids) for o in plain)}


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(json.dumps({"ops_float32": compare_ops(device, torch.float32),
                      "ops_bfloat16": compare_ops(device, torch.bfloat16),
                      "engine": compare_engine(device)}))


if __name__ == "__main__":
    main()
