"""What one layer keeps in the KV cache: spec rule 1, stated per layer.

Rule 1 (``M_KV = 2 · L · B · T · A_kv · D · s``) assumes every layer stores the same thing for
every token. Models of 2026 do not: a layer may keep

* ``full``: K and V of every token (``A_kv`` heads of ``D`` elements each, twice);
* ``sliding``: the same, but only for the last ``W`` tokens, the window a query sees (itself
  included: Hugging Face's ``sliding_window_overlay`` lets query ``i`` see key ``j`` when
  ``i - W < j <= i``, and vLLM's ``SlidingWindowManager.get_num_skipped_tokens`` frees what
  falls before it);
* ``mla``: one compressed latent per token (DeepSeek's multi-head latent attention: rank
  ``kv_lora_rank`` plus a ``qk_rope_head_dim``-wide RoPE key, no separate V, no heads);
* ``state``: no per-token cache at all, but a fixed-size recurrent state per request (a
  linear-attention or Mamba layer: a convolution window and an SSM matrix).

:class:`LayerKV` describes one layer; :func:`kv_bytes_by_layer` is the per-layer rule: a layer's
bytes for one request are the tokens it keeps times its width times the element size, plus its
state. The production planner built on it is :mod:`kvlab.labs.capacity.hybrid_plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.sim.catalog import dtype_bytes

__all__ = ["KINDS", "LayerKV", "StatePart", "kv_bytes_by_layer"]

#: The kinds of layer the planner knows, in the order figures list them.
KINDS = ("full", "sliding", "mla", "state")


@dataclass(frozen=True)
class StatePart:
    """One tensor of a recurrent layer's per-request state (unsharded shape).

    ``dtype`` is the part's storage format (a :data:`~kvlab.sim.catalog.DTYPE_BYTES` key);
    ``tp_dim`` is the dimension tensor parallelism splits (vLLM's gated-DeltaNet shapes split the
    convolution channels and the value heads, ``MambaStateShapeCalculator``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    tp_dim: int = 0

    def __post_init__(self) -> None:
        if not self.shape or any(not isinstance(n, int) or n <= 0 for n in self.shape):
            raise ValueError(f"state part {self.name!r}: shape must be positive ints, "
                             f"got {self.shape!r}")
        if not 0 <= self.tp_dim < len(self.shape):
            raise ValueError(f"state part {self.name!r}: tp_dim {self.tp_dim} is not a "
                             f"dimension of {self.shape}")
        dtype_bytes(self.dtype)   # names an unknown dtype

    def nbytes(self, tp: int = 1) -> int:
        """Bytes of this part on one of ``tp`` ranks (``ValueError`` if ``tp`` does not divide
        the split dimension: a rank cannot hold part of a head)."""
        split = self.shape[self.tp_dim]
        if split % tp:
            raise ValueError(f"state part {self.name!r}: tp={tp} does not divide dimension "
                             f"{self.tp_dim} ({split})")
        elements = math.prod(self.shape) // tp
        return int(elements * dtype_bytes(self.dtype))


@dataclass(frozen=True)
class LayerKV:
    """What one layer caches (see the module docstring for the kinds).

    ``kv_heads`` × (``head_dim`` + ``head_dim_v``) elements per token for ``full`` and
    ``sliding`` layers (K and V widths may differ); ``head_dim`` elements per token for ``mla``
    (the latent, ``head_dim_v`` is 0); ``window`` tokens kept by a ``sliding`` layer; ``state``
    parts for a ``state`` layer, which keeps no tokens.
    """

    kind: str
    kv_heads: int = 0
    head_dim: int = 0
    head_dim_v: int = 0
    window: int | None = None
    state: tuple[StatePart, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "state":
            if not self.state or self.kv_heads or self.head_dim or self.window is not None:
                raise ValueError("a state layer has state parts and no heads, width or window")
            return
        if self.state:
            raise ValueError(f"a {self.kind} layer has no recurrent state")
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LayerKV.{name} must be a positive int, got {value!r}")
        if self.kind == "mla" and (self.kv_heads != 1 or self.head_dim_v):
            raise ValueError("an MLA layer caches one latent per token: kv_heads=1, "
                             "head_dim_v=0")
        if self.kind != "mla" and self.head_dim_v <= 0:
            raise ValueError(f"a {self.kind} layer needs head_dim_v > 0 (the V width)")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError("a sliding layer, and only a sliding layer, has a window")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ValueError(f"window must be a positive int, got {self.window!r}")

    def tokens_kept(self, tokens: int) -> int:
        """Tokens whose K/V (or latent) this layer keeps for a request of ``tokens`` tokens."""
        if self.kind == "state":
            return 0
        if self.kind == "sliding":
            return min(tokens, self.window)
        return tokens

    def elements_per_token(self) -> int:
        """Cached elements per kept token (all heads; 0 for a state layer)."""
        if self.kind == "state":
            return 0
        return self.kv_heads * (self.head_dim + self.head_dim_v)

    def state_bytes(self, tp: int = 1) -> int:
        """Bytes of one request's recurrent state on one of ``tp`` ranks (0 for attention)."""
        return sum(part.nbytes(tp) for part in self.state)


def kv_bytes_by_layer(layers, tokens, element_bytes):
    """Bytes each layer keeps for one request of ``tokens`` tokens (the per-layer listing).

    Spec rule 1 per layer: ``tokens kept × elements per token × element_bytes``, plus the
    layer's fixed recurrent state. For ``L`` identical full layers the sum is rule 1's
    ``2 · L · T · A_kv · D · s``.
    """
    if tokens <= 0 or element_bytes <= 0:
        raise ValueError("tokens and element_bytes must be positive")
    return [layer.tokens_kept(tokens) * layer.elements_per_token() * element_bytes
            + layer.state_bytes() for layer in layers]
