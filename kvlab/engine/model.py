"""A Llama-family decoder over a paged KV cache (RoPE variants, GQA, SwiGLU, tied embeddings,
QKV bias); Q/K/V and gate/up are fused, so a layer is four matmuls over the step's flat batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention, write_kv
from .config import ModelConfig

__all__ = ["LlamaModel", "TorchOps", "apply_rope", "rms_norm", "silu_and_mul"]


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


class TorchOps:
    """A layer's small ops in torch, the definitions (:mod:`kvlab.engine.fused_ops` binds others):
    ``add_rms_norm(y, x, w, eps)`` is ``(rms_norm(y + x), y + x)``, the sum written into ``y``."""

    rms_norm, rope_, silu_and_mul = map(staticmethod, (rms_norm, apply_rope, silu_and_mul))

    @classmethod
    def add_rms_norm(cls, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        x = y.add_(x)
        return cls.rms_norm(x, w, eps), x


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals; fused QKV and gate/up weights."""
    ops: type[TorchOps] = TorchOps   # the small ops it calls (bound per model by the engine)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.cfg = cfg

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        cfg, n, ops = self.cfg, x.shape[0], self.ops
        hs = ops.rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv(hs)
        # rotate Q and K heads together: one RoPE call for both
        qk = qkv[:, :self.q_size + self.kv_size].view(n, cfg.num_heads + cfg.num_kv_heads,
                                                      cfg.head_dim)
        q, k = ops.rope_(qk, cos, sin).split((cfg.num_heads, cfg.num_kv_heads), dim=1)
        v = qkv[:, self.q_size + self.kv_size:].reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if isinstance(k_cache, torch.Tensor):
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, cfg.head_dim ** -0.5)
        else:  # a quantized KV layer (kvlab.engine.quantization.kv_cache) stores and reads
            attn = k_cache.write_and_attend(q, k, v, meta, cfg.head_dim ** -0.5)
        hs, x = ops.add_rms_norm(self.o(attn.reshape(n, self.q_size)), x, self.post_norm,
                                 cfg.rms_norm_eps)
        return self.down(ops.silu_and_mul(self.gate_up(hs))).add_(x)


class LlamaModel(nn.Module):
    """The decoder; parameters start as zeros/ones until weights are loaded."""
    tied_head: Callable[[torch.Tensor], torch.Tensor] | None = None   # (see logits)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # zeros, not a random init: on the meta device normal_ would import torch._dynamo (~3 s)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer(
            "inv_freq", cfg.rope.inv_freq(cfg.head_dim, cfg.max_position_embeddings),
            persistent=False)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def _rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.float()
        if self.cfg.rope.rope_type == "linear":
            pos = pos / self.cfg.rope.factor
        freqs = pos[:, None] * self.inv_freq.to(pos.device)[None, :]
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    def prepare_rope(self, max_positions: int) -> None:
        """Tabulate cos/sin for positions ``0 .. max_positions-1`` (looked up, not recomputed,
        by every later step; the values equal the on-the-fly computation)."""
        pos = torch.arange(max_positions, device=self.device)
        self._rope_cos, self._rope_sin = self._rope_angles(pos)

    def rope_cos_sin(self, positions: torch.Tensor, max_position: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin: [N, D // 2]`` in the model dtype for integer ``positions: [N]``.
        ``max_position`` (the largest position, when the caller knows it) enables the table."""
        table = getattr(self, "_rope_cos", None)
        if table is not None and max_position is not None and max_position < table.shape[0]:
            return (self._rope_cos.index_select(0, positions),
                    self._rope_sin.index_select(0, positions))
        return self._rope_angles(positions)

    def forward(
        self, meta: AttentionMetadata, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the flat batch; return final-normed hidden states ``[len(rows), hidden]`` of
        ``rows`` (all rows when None). Writes the batch's K/V into ``kv_caches`` (per layer)."""
        x = self.embed(meta.input_ids)
        cos, sin = self.rope_cos_sin(meta.positions, meta.max_position)
        for layer, (kc, vc) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kc, vc, meta)
        if rows is not None:
            x = x[rows]
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[M, V]`` (float32) of hidden states ``[M, hidden]``: ``lm_head``,
        or if tied ``tied_head`` where the engine bound one (cpu_linear), else the embedding's."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        out = F.linear(hidden, self.embed.weight) if head is None else head(hidden)
        return out.float()   # (a no-op in float32)
