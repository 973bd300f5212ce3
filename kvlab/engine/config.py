"""Model configuration: the few numbers a Llama-family decoder needs, read from ``config.json``.

:class:`ModelConfig` is parsed from a Hugging Face ``config.json`` (``LlamaForCausalLM`` and
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``MinistralForCausalLM``; both
the ``rope_parameters``
spelling of transformers 5 and the older ``rope_theta`` + ``rope_scaling`` spelling), with the
sliding windows of the layers that have one, read as transformers reads them (see
:func:`_layer_types`). Parsing validates every field it uses and raises
:class:`ConfigError` naming the file and the field, so a bad checkpoint fails before any tensor
is allocated. JSON is not trusted: ``"false"`` is not a boolean, ``NaN`` and ``Infinity`` (which
Python's json module accepts) are not sizes or epsilons, ``64.0`` is not an int.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlab.core.checks import is_int
from kvlab.core.sampling_params import is_real

__all__ = ["FULL", "SLIDING", "SUPPORTED_ARCHITECTURES", "ConfigError", "ModelConfig",
           "RopeConfig", "parse_token_ids"]

# architecture name -> (model_type, QKV projections carry a bias by construction)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "MinistralForCausalLM": ("ministral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    "Qwen3ForCausalLM": ("qwen3", False),
}
#: the two layer types of transformers' ``layer_types``
FULL, SLIDING = "full_attention", "sliding_attention"
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

    def inv_freq(self, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
        """Inverse frequencies ``[head_dim // 2]`` (float32) for this scaling (``linear``
        divides the positions instead: :meth:`kvlab.engine.model.LlamaModel.rope_cos_sin`)."""
        base = self.theta
        if self.rope_type == "dynamic":
            # NTK-aware base, fixed at the scaled context length (cached K stays valid).
            scaled_len = self.factor * max_position_embeddings
            ratio = self.factor * scaled_len / max_position_embeddings - (self.factor - 1)
            base = base * ratio ** (head_dim / (head_dim - 2))
        # on the CPU whatever the default device (a meta-device model would run this through
        # torch's reference decompositions, which import torch._dynamo: seconds at start-up)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        inv = 1.0 / (base ** (exponents / head_dim))
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv


_MISSING = object()


class _Fields:
    """Typed reads of one JSON object; every error names the file and the field.

    A field that is absent or ``null`` takes its ``default``; without one it is required.
    ``prefix`` names a nested object (``"rope_scaling."``).
    """

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: field {self.prefix + key!r} {problem}")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.source}: missing required field {self.prefix + key!r}")
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        """An int (not a bool, not a float) >= ``minimum``."""
        value = self.get(key, default)
        if not (is_int(value) and value >= minimum):
            raise self.error(key, f"must be an int >= {minimum}, got {value!r}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        """A finite number > 0 (JSON ``NaN`` and ``Infinity`` are refused)."""
        value = self.get(key, default)
        if not (is_real(value) and value > 0):
            raise self.error(key, f"must be a finite number > 0, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        """A JSON boolean (the string ``"false"`` is refused, not read as true)."""
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def token_id(self, key: str, vocab_size: int) -> int | None:
        """One token id in ``0 .. vocab_size - 1``; absent: None."""
        value = self.get(key, None)
        if value is not None and not (is_int(value) and 0 <= value < vocab_size):
            raise self.error(key, f"must be a token id in 0..{vocab_size - 1} "
                                  f"(vocab_size {vocab_size}), got {value!r}")
        return value

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        """A token id or a list of them, each in ``0 .. vocab_size - 1``; absent: ``()``."""
        value = self.get(key, None)
        ids = () if value is None else tuple(value) if isinstance(value, list) else (value,)
        if not all(is_int(t) and 0 <= t < vocab_size for t in ids):
            raise self.error(key, f"must be a token id or a list of token ids in "
                                  f"0..{vocab_size - 1} (vocab_size {vocab_size}), got {value!r}")
        return ids


def parse_token_ids(data: Mapping[str, Any], key: str, vocab_size: int,
                    source: str) -> tuple[int, ...]:
    """``data[key]`` as token ids (one id or a list; absent or null: ``()``), each an int in
    ``0 .. vocab_size - 1``; :class:`ConfigError` names ``source`` and ``key`` otherwise."""
    return _Fields(data, source).token_ids(key, vocab_size)


def _parse_rope(d: Mapping[str, Any], source: str, head_dim: int) -> RopeConfig:
    top = _Fields(d, source)
    params = d.get("rope_parameters")
    where = "rope_parameters"
    if params is None:  # transformers 4 spelling: rope_theta + rope_scaling
        where = "rope_scaling"
        params = d.get("rope_scaling")
        if params is None:
            params = {}
    if not isinstance(params, Mapping):
        raise top.error(where, f"must be an object, got {params!r}")
    f = _Fields(params, source, prefix=where + ".")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise f.error("rope_type", f"names unsupported rope_type {rope_type!r}; supported: "
                                   f"{', '.join(ROPE_TYPES)}")
    theta = (f.number("rope_theta") if params.get("rope_theta") is not None
             else top.number("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = f.number("factor")
    if factor < 1:
        raise f.error("factor", f"must be >= 1, got {factor!r}")
    if rope_type == "dynamic" and head_dim <= 2:
        raise top.error("head_dim", f"must be > 2 for dynamic RoPE, got {head_dim}")
    if rope_type != "llama3":
        return RopeConfig(theta=theta, rope_type=rope_type, factor=factor)
    low, high = f.number("low_freq_factor"), f.number("high_freq_factor")
    if not high > low:
        raise f.error("high_freq_factor", f"must exceed low_freq_factor {low}, got {high}")
    original = f.integer("original_max_position_embeddings")
    return RopeConfig(theta=theta, rope_type=rope_type, factor=factor, low_freq_factor=low,
                      high_freq_factor=high, original_max_position_embeddings=original)


def _layer_types(d: Mapping[str, Any], f: _Fields, model_type: str, num_layers: int
                 ) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers 5 resolves them (``(None, ())`` when
    no layer slides). A sliding layer's query at position ``i`` sees keys ``i - W + 1 .. i``.

    * Mistral (``MistralConfig``): ``sliding_window`` (4096 when absent, none when null) applies
      to **every** layer; ``layer_types`` is ignored, as transformers ignores it.
    * Ministral (``MinistralConfig``): the same window, on the layers an explicit
      ``layer_types`` names ``"sliding_attention"`` (every layer when it is absent).
    * Qwen2 / Qwen3 (``Qwen2Config.__post_init__``): the window exists only with
      ``use_sliding_window``; then an explicit ``layer_types`` says which layers slide, else the
      layers from ``max_window_layers`` (default 28) on. A ``"sliding_attention"`` layer
      without a window is refused (transformers fails at the first forward).
    * Llama: no window; ``layer_types`` may only list full layers.
    """
    if model_type == "llama":
        if f.flag("use_sliding_window", False):
            raise f.error("use_sliding_window", "is true: Llama has no sliding-window layers")
        layer_types = f.get("layer_types", [])
        if not isinstance(layer_types, list) or any(t != FULL for t in layer_types):
            raise f.error("layer_types", f"must list only {FULL!r} layers for Llama, got "
                                         f"{layer_types!r}")
        return None, ()
    window = (4096 if "sliding_window" not in d else None if d["sliding_window"] is None
              else f.integer("sliding_window"))
    if model_type == "mistral":
        return (None, ()) if window is None else (window, (SLIDING,) * num_layers)
    if model_type != "ministral" and not f.flag("use_sliding_window", False):
        window = None
    explicit = d.get("layer_types")
    if explicit is None and model_type == "ministral":
        types = (SLIDING if window is not None else FULL,) * num_layers
    elif explicit is None:
        first = f.integer("max_window_layers", 28, minimum=0)
        types = tuple(SLIDING if window is not None and i >= first else FULL
                      for i in range(num_layers))
    else:
        if not (isinstance(explicit, list) and len(explicit) == num_layers
                and all(t in (FULL, SLIDING) for t in explicit)):
            raise f.error("layer_types", f"must list {num_layers} layer types, each {FULL!r} "
                                         f"or {SLIDING!r}, got {explicit!r}")
        types = tuple(explicit)
        if SLIDING in types and window is None:
            raise f.error("layer_types", "names sliding_attention layers but the model has no "
                                         "window (use_sliding_window false or sliding_window "
                                         "null)")
    return (window, types) if SLIDING in types else (None, ())


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
    qk_norm: bool = False                  # Qwen3: RMSNorm over each Q and K head before RoPE
    sliding_window: int | None = None      # None: no layer slides
    layer_types: tuple[str, ...] = ()      # per layer FULL or SLIDING; () when none slides

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, the keys a query sees: 0 for every earlier position (full attention),
        ``W`` for the last ``W`` positions, itself included (a sliding window)."""
        if not self.layer_types:
            return (0,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING else 0 for t in self.layer_types)

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

    def flops_per_token(self, context_len: int, *, with_lm_head: bool = True) -> float:
        """Forward FLOPs of one token attending to ``context_len`` positions: 2 per weight of
        every matmul (the embedding lookup is free) plus ``4 * layers * heads * head_dim *
        context_len`` for QK^T and PV. Norms, RoPE and activations are ignored."""
        head = self.vocab_size * self.hidden_size
        matmul = self.num_params - self.hidden_size * (2 * self.num_layers + 1)
        matmul -= 0 if self.tie_word_embeddings else head   # the embedding table
        if not with_lm_head:
            matmul -= head
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * context_len
        return float(2 * matmul + attn)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict; :class:`ConfigError` names ``source`` (the file)
        and the bad field.

        Rules: sizes are ints (not bools or floats) > 0; ``rms_norm_eps`` and the RoPE numbers
        are finite and > 0; flags are JSON booleans; ``hidden_size`` is divisible by
        ``num_attention_heads`` unless ``head_dim`` is given, ``head_dim`` is even and
        ``num_key_value_heads`` divides ``num_attention_heads``; the windows follow
        :func:`_layer_types`; ``bos_token_id``,
        ``eos_token_id`` (one id or a list) and ``pad_token_id`` lie in ``0 .. vocab_size - 1``.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source} must hold a JSON object, got {type(d).__name__}")
        f = _Fields(d, source)
        archs = f.get("architectures", [])
        if isinstance(archs, str):
            archs = [archs]
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise f.error("architectures", f"must be a list of names, got {archs!r}")
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and archs:
            raise f.error("architectures", f"names unsupported architecture {archs!r}; "
                                           f"supported: {supported}")
        if arch is None:  # no architectures: fall back on model_type
            by_type = {t: a for a, (t, _) in SUPPORTED_ARCHITECTURES.items()}
            model_type = f.get("model_type")
            arch = by_type.get(model_type) if isinstance(model_type, str) else None
            if arch is None:
                raise f.error("model_type", f"names unsupported architecture {model_type!r}; "
                                            f"supported: {supported}")
        model_type, qkv_bias = SUPPORTED_ARCHITECTURES[arch]
        vocab = f.integer("vocab_size")
        hidden = f.integer("hidden_size")
        heads = f.integer("num_attention_heads")
        kv_heads = f.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise f.error("num_key_value_heads",
                          f"must divide num_attention_heads={heads}, got {kv_heads}")
        if d.get("head_dim") is not None:
            head_dim = f.integer("head_dim")
        elif model_type == "qwen3":   # Qwen3Config's default, not hidden / heads
            head_dim = 128
        elif hidden % heads:
            raise f.error("hidden_size", f"must be divisible by num_attention_heads={heads} "
                                         f"when head_dim is not given, got {hidden}")
        else:
            head_dim = hidden // heads
        if head_dim % 2:
            raise f.error("head_dim", f"must be even (RoPE rotates pairs), got {head_dim}")
        act = f.get("hidden_act", "silu")
        if act != "silu":
            raise f.error("hidden_act", f"names unsupported activation {act!r}; only 'silu'")
        num_layers = f.integer("num_hidden_layers")
        window, layer_types = _layer_types(d, f, model_type, num_layers)
        if f.integer("pretraining_tp", 1) != 1:
            raise f.error("pretraining_tp", f"must be 1, got {d['pretraining_tp']!r}")
        f.token_id("pad_token_id", vocab)  # unused by kvlab, but a wrong one means a bad file
        attention_bias = f.flag("attention_bias", False)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            max_position_embeddings=f.integer("max_position_embeddings"),
            rope=_parse_rope(d, source, head_dim),
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias and not qkv_bias,
            mlp_bias=f.flag("mlp_bias", False),
            bos_token_id=f.token_id("bos_token_id", vocab),
            eos_token_ids=f.token_ids("eos_token_id", vocab),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            layer_types=layer_types,
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
        return cls.from_dict(data, source=str(file))
