"""Model configuration: the few numbers a Llama-family decoder needs, read from ``config.json``.

:class:`ModelConfig` is parsed from a Hugging Face ``config.json`` (``LlamaForCausalLM`` and
``Qwen2ForCausalLM``; both the ``rope_parameters`` spelling of transformers 5 and the older
``rope_theta`` + ``rope_scaling`` spelling). Parsing validates every field it uses and raises
:class:`ConfigError` naming the field, so a bad checkpoint fails before any tensor is allocated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SUPPORTED_ARCHITECTURES", "ConfigError", "ModelConfig", "RopeConfig"]

# architecture name -> (model_type, QKV projections carry a bias by construction)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", True),
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class ConfigError(ValueError):
    """A model configuration is missing a field, has a bad value or names an unsupported model."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    ``rope_type``: ``default`` (plain RoPE), ``linear`` (positions divided by ``factor``),
    ``dynamic`` (NTK-aware base scaling; kvlab fixes the base at the scaled context length
    ``factor * max_position_embeddings`` so that cached keys never change — vLLM does the
    same, transformers recomputes the base from the current length) or ``llama3``
    (frequency-dependent smoothing of Llama 3.1 with ``low_freq_factor``, ``high_freq_factor``
    and ``original_max_position_embeddings``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def as_tuple(self) -> tuple:
        """Hashable form, part of the prefix-cache scope."""
        return tuple(asdict(self).items())


def _req(d: Mapping[str, Any], key: str, kind: type | tuple, *, positive: bool = True) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json: missing required field {key!r}")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"config.json: field {key!r} must be {kind}, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"config.json: field {key!r} must be > 0, got {value!r}")
    return value


def _parse_rope(d: Mapping[str, Any]) -> RopeConfig:
    params = d.get("rope_parameters")
    if params is None:  # transformers 4 spelling
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json: rope parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    factor = float(params.get("factor", 1.0))
    if rope_type != "default" and not (math.isfinite(factor) and factor >= 1.0):
        raise ConfigError(f"config.json: rope factor must be >= 1, got {factor!r}")
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    orig = params.get("original_max_position_embeddings")
    if rope_type == "llama3":
        if orig is None or not isinstance(orig, int) or orig <= 0:
            raise ConfigError("config.json: llama3 rope needs original_max_position_embeddings > 0")
        if not high > low > 0:
            raise ConfigError(
                "config.json: llama3 rope needs high_freq_factor > low_freq_factor > 0")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor if rope_type != "default" else 1.0,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=orig,
    )


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (all sizes in elements; ``head_dim`` per head)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (the scheduler takes one; the others go to stop ids)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        layer = attn + 3 * h * i + 2 * h
        return self.num_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies over all layers (spec rule 1 with B=T=1)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict; :class:`ConfigError` names the bad field."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {t: a for a, (t, _) in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(d.get("model_type")) if not archs else None
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or d.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type, qkv_bias = SUPPORTED_ARCHITECTURES[arch]
        hidden = _req(d, "hidden_size", int)
        heads = _req(d, "num_attention_heads", int)
        kv_heads = d.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(
                f"config.json: num_key_value_heads={kv_heads!r} must divide "
                f"num_attention_heads={heads}"
            )
        head_dim = d.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ConfigError(
                f"config.json: head_dim must be a positive even int, got {head_dim!r}")
        if d.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"config.json: hidden_size {hidden} not divisible by heads {heads}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: unsupported hidden_act {act!r}; only 'silu'")
        if d.get("use_sliding_window"):
            raise ConfigError("config.json: sliding-window attention is not supported")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError("config.json: pretraining_tp != 1 is not supported")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and e >= 0 for e in eos_ids):
            raise ConfigError(f"config.json: bad eos_token_id {eos!r}")
        eps = d.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or not eps > 0:
            raise ConfigError(f"config.json: rms_norm_eps must be > 0, got {eps!r}")
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=_req(d, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_req(d, "intermediate_size", int),
            num_layers=_req(d, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            max_position_embeddings=_req(d, "max_position_embeddings", int),
            rope=_parse_rope(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias and not qkv_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json``."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        try:
            data = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{file}: malformed JSON ({err})") from None
        return cls.from_dict(data)
