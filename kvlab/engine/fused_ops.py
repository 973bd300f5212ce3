"""The decoder layers' small ops fused into Triton kernels, bound at engine build on CUDA.

:func:`bind_fused_ops` points each :class:`~kvlab.engine.model.DecoderLayer`'s ``forward`` at
:func:`fused_layer_forward`, the same computation with three fused kernels of
:mod:`kvlab.kernels.triton_fused`: RMSNorm (the post-attention one with the residual add),
RoPE in place on the fused QKV output, SiLU-and-mul. Each torch elementwise op is a kernel
launch (a bfloat16 norm is eight, RoPE seven); with the fused ones a layer launches 13
kernels, about a third of the torch ops' count (the H200 profile before them: 688 launches per
step of 24 layers). The binding is per module, as :mod:`kvlab.kernels.cpu_linear` binds its packed
linears, so ``model.py`` stays the one listing of the layer; the two must compute the same
thing, which ``kvlab.engine.fused_parity`` checks (``tests/test_fused_ops.py``).

``KVLAB_FUSED_OPS=0`` (read when an engine is built) keeps the torch ops.
"""

from __future__ import annotations

import functools
import os

import torch

from kvlab.kernels import triton as triton_kernels
from kvlab.kernels import triton_fused as tf

from .attention import AttentionMetadata, paged_attention, write_kv
from .model import DecoderLayer, LlamaModel

__all__ = ["bind_fused_ops", "fused_layer_forward", "unbind_fused_ops"]


def fused_layer_forward(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata
                        ) -> torch.Tensor:
    """:meth:`DecoderLayer.forward <kvlab.engine.model.DecoderLayer.forward>` with fused
    kernels (same arguments, same result up to rounding order)."""
    cfg = layer.cfg
    n = x.shape[0]
    hs = tf.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    qkv = layer.qkv(hs)
    qk = qkv[:, :layer.q_size + layer.kv_size].view(n, cfg.num_heads + cfg.num_kv_heads,
                                                    cfg.head_dim)
    q, k = tf.rope_(qk, cos, sin).split((cfg.num_heads, cfg.num_kv_heads), dim=1)
    v = qkv[:, layer.q_size + layer.kv_size:].reshape(n, cfg.num_kv_heads, cfg.head_dim)
    if isinstance(k_cache, torch.Tensor):
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, cfg.head_dim ** -0.5)
    else:  # a quantized KV layer stores and reads
        attn = k_cache.write_and_attend(q, k, v, meta, cfg.head_dim ** -0.5)
    hs, x = tf.add_rms_norm(layer.o(attn.reshape(n, layer.q_size)), x, layer.post_norm,
                            cfg.rms_norm_eps)
    return layer.down(tf.silu_and_mul(layer.gate_up(hs))).add_(x)


def bind_fused_ops(model: LlamaModel) -> int:
    """Bind :func:`fused_layer_forward` into every decoder layer of ``model`` (unless
    ``KVLAB_FUSED_OPS=0`` or Triton is missing); the number of layers bound. The engine calls
    it for CUDA models only; on CPU tensors the kernels need ``TRITON_INTERPRET=1``."""
    if os.environ.get("KVLAB_FUSED_OPS", "1") == "0" or not triton_kernels.available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.forward = functools.partial(fused_layer_forward, layer)
    return len(layers)


def unbind_fused_ops(model: LlamaModel) -> None:
    """Back to the class's ``forward`` (the torch ops) in every decoder layer."""
    for m in model.modules():
        if isinstance(m, DecoderLayer):
            m.__dict__.pop("forward", None)
