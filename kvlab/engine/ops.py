"""The kernels a forward runs besides its matmuls, chosen once per engine for its device and
dtype (:func:`select_kernels`): the attention backend and a decoder layer's small ops.

:class:`LayerOps` holds the small ops' definitions in torch; :class:`CpuLayerOps` (the compiled
CPU build's float32 RMSNorm, RoPE and SiLU-and-mul, one pass each) and :class:`TritonLayerOps`
(CUDA: the norms with the residual add fused, four kernels where torch launches a dozen) keep
the same contracts. ``KVLAB_CPU_ATTENTION=0`` keeps the torch attention and ops on the CPU,
``KVLAB_FUSED_OPS=0`` the torch ops on CUDA; the environment is read when the kernels are
selected. Each table is tested against :class:`LayerOps` (``tests/test_cpu_kernels.py``,
``tests/test_fused_ops.py``), each backend against the torch one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.engine.attention import AttentionBackend
from kvlab.engine.attention_cpu import CpuAttention
from kvlab.engine.attention_torch import TorchAttention
from kvlab.engine.attention_triton import TritonAttention
from kvlab.kernels import cpu, triton, triton_fused

__all__ = ["CpuLayerOps", "Kernels", "LayerOps", "TritonLayerOps", "apply_rope", "rms_norm",
           "select_kernels", "silu_and_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` computed in float32, returned in ``x``'s dtype."""
    if x.dtype == torch.float32:  # (torch's fused rms_norm is slower on CPU at these sizes)
        return weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [N, heads, D]`` by ``cos, sin: [N, D // 2]`` (half-split layout, as HF)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up = [gate | up]: [N, 2I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)   # in place: one buffer fewer


class LayerOps:
    """A decoder layer's small ops, in torch: the definitions. ``rope_`` may rotate in place
    (callers use its result); ``add_rms_norm(y, x, w, eps)`` is ``(rms_norm(y + x), y + x)``
    with the sum written into ``y``."""

    name = "torch"

    def __eq__(self, other: object) -> bool:   # the same kind over the same ops
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def add_rms_norm(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        x = y.add_(x)
        return self.rms_norm(x, weight, eps), x


class CpuLayerOps(LayerOps):
    """The compiled CPU build's float32 ops (the residual add stays torch's)."""

    name = "cpu"

    def __init__(self, build: Any) -> None:
        self._build = build

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._build.rms_norm(x, weight, eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._build.rope_(x, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._build.silu_and_mul(gate_up)


class TritonLayerOps(LayerOps):
    """All four ops as Triton kernels (CUDA; CPU tensors need ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return triton_fused.rms_norm(x, weight, eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return triton_fused.rope_(x, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_fused.silu_and_mul(gate_up)

    def add_rms_norm(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fused.add_rms_norm(y, x, weight, eps)


@dataclass(frozen=True)
class Kernels:
    """What one engine's forwards run: the attention backend and the layer ops."""

    attention: AttentionBackend
    ops: LayerOps

    @classmethod
    def torch(cls) -> Kernels:
        """The definitions: torch attention and torch ops (any device and dtype)."""
        return cls(TorchAttention(), LayerOps())


def select_kernels(device: torch.device | str, dtype: torch.dtype) -> Kernels:
    """The kernels for ``device`` and ``dtype``: on the CPU the compiled build (its attention
    for float32, bfloat16 and float16, its small ops for float32); on CUDA Triton's decode
    kernel and fused ops; the torch definitions wherever those cannot run."""
    device = torch.device(device)
    if device.type == "cuda":
        if not triton.available():
            return Kernels.torch()
        fused = os.environ.get("KVLAB_FUSED_OPS", "1") != "0"
        return Kernels(TritonAttention(), TritonLayerOps() if fused else LayerOps())
    attention = CpuAttention.create(dtype) if device.type == "cpu" else None
    if attention is None:
        return Kernels.torch()
    build = cpu.compiled()
    ops = CpuLayerOps(build) if dtype == torch.float32 else LayerOps()
    return Kernels(attention, ops)
