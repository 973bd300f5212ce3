"""The ops tables a decoder layer runs besides torch's, bound into a model at engine build.

A :class:`~kvlab.engine.model.DecoderLayer` calls its small ops through ``self.ops``:
:class:`~kvlab.engine.model.TorchOps` (the definitions) unless :func:`bind_layer_ops` binds
another table, a subclass that swaps in compiled ops with the same contracts:

- on the CPU in float32, :func:`compiled_cpu_ops`: the compiled build's RMSNorm, RoPE (in
  place) and SiLU-and-mul (:data:`kvlab.kernels.cpu.FUSED_OPS`, one pass each); the residual
  add before the second norm stays torch's. ``KVLAB_CPU_ATTENTION=0`` keeps the torch ops.
- on CUDA, :class:`TritonOps`: the kernels of :mod:`kvlab.kernels.triton_fused`, the residual
  add fused into the post-attention norm. Each torch elementwise op is a kernel launch (a
  bfloat16 norm is eight, RoPE seven); with the fused ones a layer launches 13 kernels, about
  a third of the torch ops' count (the H200 profile before them: 688 launches per step of 24
  layers). ``KVLAB_FUSED_OPS=0`` keeps the torch ops.

The environment is read when an engine is built. There is one forward, so what is checked is
each table against :class:`~kvlab.engine.model.TorchOps`: ``kvlab.engine.fused_parity`` for the
Triton kernels (``tests/test_fused_ops.py``), ``tests/test_cpu_kernels.py`` for the compiled
ones.
"""

from __future__ import annotations

import os

import torch

from kvlab.kernels import cpu as cpu_kernels
from kvlab.kernels import triton as triton_kernels
from kvlab.kernels import triton_fused as tf

from .model import DecoderLayer, LlamaModel, TorchOps

__all__ = ["TritonOps", "bind_fused_ops", "bind_layer_ops", "compiled_cpu_ops",
           "unbind_fused_ops"]


class TritonOps(TorchOps):
    """All four ops as Triton kernels (CUDA; CPU tensors need ``TRITON_INTERPRET=1``)."""

    rms_norm, add_rms_norm, rope_, silu_and_mul = map(
        staticmethod, (tf.rms_norm, tf.add_rms_norm, tf.rope_, tf.silu_and_mul))


def compiled_cpu_ops(dtype: torch.dtype) -> type[TorchOps] | None:
    """:class:`TorchOps` with the compiled CPU build's ``rms_norm``, ``rope_`` and
    ``silu_and_mul`` for ``dtype`` (float32), or None where there is none (another dtype,
    ``KVLAB_CPU_ATTENTION=0``, the build failed)."""
    built = None
    if dtype in cpu_kernels.DTYPES and cpu_kernels.available():   # (builds it on first use)
        built = cpu_kernels.FUSED_OPS.get(dtype)
    if built is None:
        return None
    return type("CompiledCpuOps", (TorchOps,), {
        op: staticmethod(getattr(built, op)) for op in ("rms_norm", "rope_", "silu_and_mul")})


def _bind(model: LlamaModel, ops: type[TorchOps]) -> int:
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.ops = ops
    return len(layers)


def bind_layer_ops(model: LlamaModel) -> type[TorchOps]:
    """Bind the ops for ``model``'s device and dtype into its decoder layers (the engine build
    calls it): :class:`TritonOps` on CUDA (:func:`bind_fused_ops`), the compiled ones on the
    CPU, else :class:`TorchOps`; returns the table bound."""
    device = model.device.type
    if device == "cuda" and bind_fused_ops(model):
        return TritonOps
    ops = (compiled_cpu_ops(model.dtype) if device == "cpu" else None) or TorchOps
    _bind(model, ops)
    return ops


def bind_fused_ops(model: LlamaModel) -> int:
    """Bind :class:`TritonOps` into every decoder layer of ``model`` (unless
    ``KVLAB_FUSED_OPS=0`` or Triton is missing); the number of layers bound. The engine binds
    them for CUDA models only; on CPU tensors the kernels need ``TRITON_INTERPRET=1``."""
    if os.environ.get("KVLAB_FUSED_OPS", "1") == "0" or not triton_kernels.available():
        return 0
    return _bind(model, TritonOps)


def unbind_fused_ops(model: LlamaModel) -> None:
    """Back to :class:`TorchOps` (the torch ops) in every decoder layer."""
    _bind(model, TorchOps)
