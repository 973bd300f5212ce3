"""A Llama-family decoder over a paged KV cache (RoPE variants, GQA, SwiGLU, tied embeddings,
QKV bias, Qwen3's Q/K norms, sliding-window layers); Q/K/V and gate/up are fused, so a layer is
four matmuls over the step's flat batch.
Its linear layers run through the linear method chosen at load (:mod:`kvlab.engine.linear`),
its attention and small ops through the :class:`~kvlab.engine.ops.Kernels` each forward is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvlab.engine.attention_metadata import AttentionMetadata
from kvlab.engine.config import ModelConfig
from kvlab.engine.kv_cache import KVLayer
from kvlab.engine.linear import Linear, LinearMethod
from kvlab.engine.ops import Kernels, rms_norm

__all__ = ["DecoderLayer", "LlamaModel"]


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals; fused QKV and gate/up weights.
    ``window``: the keys its queries see (0: all before them; ``W``: the last ``W``)."""

    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.window = window
        self.input_norm = nn.Parameter(torch.ones(h))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.qkv = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(self.q_size, h, bias=cfg.o_bias)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.cfg = cfg

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer,
                meta: AttentionMetadata, kernels: Kernels) -> torch.Tensor:
        cfg, n, ops = self.cfg, x.shape[0], kernels.ops
        hs = ops.rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv(hs)
        # rotate Q and K heads together: one RoPE call for both
        qk = qkv[:, :self.q_size + self.kv_size].view(n, cfg.num_heads + cfg.num_kv_heads,
                                                      cfg.head_dim)
        if cfg.qk_norm:   # Qwen3: RMSNorm over each head's dims, before RoPE
            qk = torch.cat([ops.rms_norm(t.reshape(-1, cfg.head_dim), w, cfg.rms_norm_eps)
                            .view(n, -1, cfg.head_dim) for t, w in
                            ((qk[:, :cfg.num_heads], self.q_norm),
                             (qk[:, cfg.num_heads:], self.k_norm))], dim=1)
        q, k = ops.rope_(qk, cos, sin).split((cfg.num_heads, cfg.num_kv_heads), dim=1)
        v = qkv[:, self.q_size + self.kv_size:].reshape(n, cfg.num_kv_heads, cfg.head_dim)
        attn = kernels.attention.forward(q, k, v, kv, meta, cfg.head_dim ** -0.5, self.window)
        hs, x = ops.add_rms_norm(self.o(attn.reshape(n, self.q_size)), x, self.post_norm,
                                 cfg.rms_norm_eps)
        return self.down(ops.silu_and_mul(self.gate_up(hs))).add_(x)


class LlamaModel(nn.Module):
    """The decoder; parameters start as zeros/ones until weights are loaded. With tied
    embeddings ``lm_head`` is None and the logits use the embedding's weight through
    ``tied_method`` (see :meth:`use_linear_method`)."""

    tied_method: LinearMethod = LinearMethod()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # zeros, not a random init: on the meta device normal_ would import torch._dynamo (~3 s)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.layer_windows)
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
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

    def use_linear_method(self, method: LinearMethod) -> int:
        """Run every :class:`~kvlab.engine.linear.Linear` of the model (and a tied head) through
        ``method`` (the engine chooses it at load); the number of layers that took it (a layer
        the method refuses keeps its own)."""
        layers = [m for m in self.modules() if isinstance(m, Linear)]
        used = sum(layer.use_method(method) for layer in layers)
        if self.lm_head is None:
            try:
                method.process_weights(self.embed)
                self.tied_method = method
                used += 1
            except RuntimeError:
                pass
        return used

    def forward(self, meta: AttentionMetadata, kv_layers: Sequence[KVLayer], kernels: Kernels,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run the flat batch with ``kernels``; return final-normed hidden states
        ``[len(rows), hidden]`` of ``rows`` (all rows when None). Writes the batch's K/V into
        ``kv_layers`` (one per decoder layer)."""
        x = self.embed(meta.input_ids)
        cos, sin = self.rope_cos_sin(meta.positions, meta.max_position)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_layers, strict=True)):
            x = layer(x, cos, sin, kv, meta.for_layer(i), kernels)
        if rows is not None:
            x = x[rows]
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[M, V]`` (float32) of hidden states ``[M, hidden]``: ``lm_head``,
        or with tied embeddings the embedding's weight through ``tied_method``."""
        if self.lm_head is not None:
            out = self.lm_head(hidden)
        else:
            out = self.tied_method.apply(self.embed, hidden)
        return out.float()   # (a no-op in float32)
