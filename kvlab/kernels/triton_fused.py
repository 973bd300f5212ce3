"""Fused small ops of a decoder layer as Triton kernels (the CUDA path; one launch each where
torch launches several):

- :func:`rms_norm` (``weight * x / rms(x)``) and :func:`add_rms_norm` (the residual add and
  the norm of the sum in one pass: the sum is written back for the next residual), as vLLM's
  ``fused_add_rms_norm`` (``RMSNorm.forward_native`` in
  ``vllm/model_executor/layers/layernorm.py``, v0.32.0);
- :func:`silu_and_mul`: ``silu(gate) * up`` of the fused gate/up projection ``[N, 2I]``, as
  vLLM's ``SiluAndMul`` (``vllm/model_executor/layers/activation.py``);
- :func:`rope_`: RoPE in place on ``[N, heads, D]`` (half-split layout, as HF) with the step's
  ``cos, sin: [N, D // 2]``.

Each computes in float32 and rounds to the input dtype where the torch path
(:func:`kvlab.engine.ops.rms_norm`, :func:`~kvlab.engine.ops.apply_rope`, ``F.silu(g) *
u``) rounds, so in float32 they agree to a few ulps and in bfloat16 to one rounding (the sums'
order differs). One program per token row. They run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported): ``kvlab.labs.parity.fused`` checks
them there and on a GPU. As :class:`kvlab.engine.ops.TritonLayerOps` they are a decoder layer's
small ops (``add_rms_norm``'s contract: ``LayerOps.add_rms_norm`` in ``kvlab.engine.ops``).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["add_rms_norm", "rms_norm", "rope_", "silu_and_mul"]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, hidden,
                         eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < hidden
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
        if HAS_RES:   # the residual sum, rounded as torch's add, written back into x
            r = tl.load(res_ptr + row * stride_r + offs, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(x_ptr + row * stride_x + offs, x, mask=m)
        xf = x.to(tl.float32)
        normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = w * normed.to(dt).to(tl.float32)   # torch: weight * normed in the model dtype
        tl.store(out_ptr + row * stride_o + offs, y.to(dt), mask=m)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        dt = out_ptr.dtype.element_ty
        g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + cols, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=m)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_n, stride_h, stride_c, heads, half,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        dm = d < half
        m = (h < heads)[:, None] & dm[None, :]
        dt = x_ptr.dtype.element_ty
        c = tl.load(cos_ptr + row * stride_c + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + row * stride_c + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        p1 = x_ptr + row * stride_n + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + half, mask=m, other=0.0).to(tl.float32)
        # each product rounded to the model dtype, then the sum: as torch's x1 * c - x2 * s
        o1 = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
        o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
        tl.store(p1, o1.to(dt), mask=m)
        tl.store(p1 + half, o2.to(dt), mask=m)

    return triton, _rms_norm_kernel, _silu_mul_kernel, _rope_kernel


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: expected [N, hidden] with contiguous rows, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` of ``x: [N, hidden]`` (a new tensor in ``x``'s dtype)."""
    _rows(x, "rms_norm")
    _, norm, _, _ = _kernels()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        norm[(x.shape[0],)](x, x, weight, out, x.stride(0), x.stride(0), out.stride(0),
                            x.shape[1], float(eps), HAS_RES=False, BLOCK=_p2(x.shape[1]))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x += residual`` in place, then ``(rms_norm(x), x)``: the normed sum and the sum."""
    _rows(x, "add_rms_norm")
    _rows(residual, "add_rms_norm residual")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} "
                         f"does not match x {tuple(x.shape)} {x.dtype}")
    _, norm, _, _ = _kernels()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        norm[(x.shape[0],)](x, residual, weight, out, x.stride(0), residual.stride(0),
                            out.stride(0), x.shape[1], float(eps), HAS_RES=True,
                            BLOCK=_p2(x.shape[1]))
    return out, x


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` of ``x: [N, 2I]`` (a new ``[N, I]`` tensor)."""
    _rows(x, "silu_and_mul")
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: the last dimension must be even, got {x.shape[1]}")
    _, _, silu_mul, _ = _kernels()
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    block = min(block, _p2(inter))
    if n:
        silu_mul[(n, -(-inter // block))](x, out, x.stride(0), out.stride(0), inter,
                                          BLOCK=block)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [N, heads, D]`` in place by ``cos, sin: [N, D // 2]`` (half-split layout);
    returns ``x``. Rows may be strided (a view into a fused QKV output); ``D`` must be
    contiguous."""
    n, heads, dim = x.shape
    if x.stride(-1) != 1 or dim % 2 or cos.shape != (n, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope_: x {tuple(x.shape)} (strides {x.stride()}) and cos/sin "
                         f"{tuple(cos.shape)}/{tuple(sin.shape)} do not fit")
    cos, sin = cos.contiguous(), sin.contiguous()
    _, _, _, rope = _kernels()
    if n:
        rope[(n,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads, dim // 2,
                   BLOCK_H=_p2(heads), BLOCK_D=_p2(dim // 2))
    return x
