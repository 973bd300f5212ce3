"""Per-layer KV layouts read from a Hugging Face ``config.json``.

:func:`layout_from_hf_config` turns a checkpoint's configuration (a dict, or the path of a
``config.json`` or of the directory holding it) into a :class:`ModelLayout`: one
:class:`~kvlab.labs.capacity.layer_kv.LayerKV` per decoder layer, decided the way the family's
``transformers`` modeling code decides it (``transformers`` 5.25):

* ``llama``: every layer full.
* ``mistral``: every layer sliding when ``sliding_window`` is set (``MistralAttention`` passes
  the one ``config.sliding_window`` to every layer; ``layer_types`` is not read).
* ``qwen2``, ``qwen3``: ``layer_types`` when given, else layer ``i`` slides when
  ``use_sliding_window`` and ``i >= max_window_layers`` (``Qwen2Config``); the window exists
  only with ``use_sliding_window`` (the config sets ``sliding_window`` to None otherwise, and
  ``layer_types`` naming sliding layers without it is refused, as transformers refuses it).
* ``gemma3`` / ``gemma3_text``: ``layer_types`` when given, else five sliding layers then one
  full (``sliding_window_pattern``, default 6).
* ``gpt_oss``: ``layer_types`` when given, else sliding and full alternate.
* ``deepseek_v3`` (and ``deepseek_v2``, ``kimi_k2``): every layer MLA, one latent of
  ``kv_lora_rank + qk_rope_head_dim`` elements per token (the head size vLLM's
  ``ModelArchConfigConvertor`` gives an MLA model, with ``num_kv_heads`` 1).
* ``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``: ``layer_types`` when given, else three
  ``linear_attention`` layers then one ``full_attention`` (``full_attention_interval``, default
  4). A linear-attention (gated DeltaNet) layer keeps a convolution state of
  ``(2·Hk·dk + Hv·dv) × (kernel − 1)`` and an SSM state of ``Hv × dv × dk`` per request, the
  shapes of vLLM's ``MambaStateShapeCalculator.gated_delta_net_state_shape``; both in the
  checkpoint's dtype unless the config names ``mamba_ssm_dtype`` for the SSM part.

A family it does not know, or a field it needs and does not find, is a ``ValueError`` naming
it. The published configs of one model per family ship in ``configs/`` (:func:`shipped_config`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvlab.labs.capacity.layer_kv import KINDS, LayerKV, StatePart

__all__ = [
    "FAMILIES",
    "SHIPPED",
    "ModelLayout",
    "layout_from_hf_config",
    "load_hf_config",
    "shipped_config",
    "shipped_layout",
]

#: ``config.json`` files shipped with the planner (``configs/<name>.json``), by model name.
SHIPPED = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "qwen3-8b", "mistral-7b-v0.1",
           "gemma-3-27b-it", "gpt-oss-120b", "deepseek-v3", "qwen3-next-80b-a3b-instruct")

#: ``torch_dtype`` / ``dtype`` strings of a config -> the planner's dtype names.
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16",
                 "float": "fp32"}


@dataclass(frozen=True)
class ModelLayout:
    """A model's per-layer KV layout: what each decoder layer caches, in layer order."""

    name: str
    model_type: str
    layers: tuple[LayerKV, ...]
    max_position_embeddings: int
    source: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"{self.name}: a layout needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kind_counts(self) -> dict[str, int]:
        """Layers of each kind, in :data:`~kvlab.labs.capacity.layer_kv.KINDS` order."""
        counts = Counter(layer.kind for layer in self.layers)
        return {kind: counts[kind] for kind in KINDS if counts[kind]}

    def windows(self) -> set[int]:
        """The sliding windows the layout uses (empty if none)."""
        return {layer.window for layer in self.layers if layer.window is not None}

    def without_windows(self) -> ModelLayout:
        """The same model with every sliding layer keeping all tokens (what an engine without a
        window-aware cache manager stores; the attention compute is unchanged)."""
        full = tuple(LayerKV("full", layer.kv_heads, layer.head_dim, layer.head_dim_v)
                     if layer.kind == "sliding" else layer for layer in self.layers)
        return ModelLayout(self.name, self.model_type, full, self.max_position_embeddings,
                           self.source)


def load_hf_config(config: Mapping | str | Path) -> dict:
    """``config`` as a dict: a mapping is copied; a path names a ``config.json`` file or the
    directory holding one. ``ValueError`` names what is missing or malformed."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise ValueError(f"config must be a dict or a path, got {type(config).__name__}")
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def shipped_config(name: str) -> dict:
    """The published ``config.json`` of shipped model ``name`` (see :data:`SHIPPED`)."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped config {name!r}; shipped: {list(SHIPPED)}")
    text = resources.files(__package__).joinpath("configs", f"{name}.json").read_text()
    return json.loads(text)


def shipped_layout(name: str) -> ModelLayout:
    """:func:`layout_from_hf_config` of shipped model ``name``."""
    return layout_from_hf_config(shipped_config(name), name=name)


def _need(cfg: Mapping, field: str, model_type: str):
    value = cfg.get(field)
    if value is None:
        raise ValueError(f"{model_type} config has no {field!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{model_type} config: {field} must be a positive int, got {value!r}")
    return value


def _head_dim(cfg: Mapping, model_type: str) -> int:
    if cfg.get("head_dim") is not None:
        return _need(cfg, "head_dim", model_type)
    hidden = _need(cfg, "hidden_size", model_type)
    heads = _need(cfg, "num_attention_heads", model_type)
    if hidden % heads:
        raise ValueError(f"{model_type} config: hidden_size {hidden} is not a multiple of "
                         f"num_attention_heads {heads} and no head_dim is given")
    return hidden // heads


def _kv_heads(cfg: Mapping, model_type: str) -> int:
    if cfg.get("num_key_value_heads") is None:
        return _need(cfg, "num_attention_heads", model_type)
    return _need(cfg, "num_key_value_heads", model_type)


def _layer_types(cfg: Mapping, model_type: str, default: list[str], allowed: set[str]):
    n = _need(cfg, "num_hidden_layers", model_type)
    types = cfg.get("layer_types")
    if types is None:
        types = default
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"{model_type} config: layer_types must list {n} layer types, "
                         f"got {types!r}")
    unknown = set(types) - allowed
    if unknown:
        raise ValueError(f"{model_type} config: unknown layer types {sorted(unknown)}; "
                         f"expected {sorted(allowed)}")
    return types


def _window(cfg: Mapping, model_type: str) -> int:
    return _need(cfg, "sliding_window", model_type)


def _attention_layers(cfg, model_type, types) -> tuple[LayerKV, ...]:
    heads, dim = _kv_heads(cfg, model_type), _head_dim(cfg, model_type)
    window = None
    if "sliding_attention" in types:
        window = _window(cfg, model_type)
    return tuple(LayerKV("sliding", heads, dim, dim, window=window)
                 if kind == "sliding_attention" else LayerKV("full", heads, dim, dim)
                 for kind in types)


def _llama(cfg, model_type):
    n = _need(cfg, "num_hidden_layers", model_type)
    return _attention_layers(cfg, model_type, ["full_attention"] * n)


def _mistral(cfg, model_type):
    n = _need(cfg, "num_hidden_layers", model_type)
    kind = "full_attention" if cfg.get("sliding_window") is None else "sliding_attention"
    return _attention_layers(cfg, model_type, [kind] * n)


def _qwen(cfg, model_type):
    n = _need(cfg, "num_hidden_layers", model_type)
    uses_window = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
    first = cfg.get("max_window_layers", 28) if uses_window else n
    default = ["sliding_attention" if uses_window and i >= first else "full_attention"
               for i in range(n)]
    types = _layer_types(cfg, model_type, default, {"full_attention", "sliding_attention"})
    if not uses_window and "sliding_attention" in types:
        # Qwen2Config drops the window without use_sliding_window; transformers then raises
        # "Could not find a `sliding_window`" when it builds the sliding layers' mask
        raise ValueError(f"{model_type} config: layer_types names sliding_attention layers "
                         "but use_sliding_window is false or sliding_window is unset")
    return _attention_layers(cfg, model_type, types)


def _gemma3(cfg, model_type):
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} config: use_bidirectional_attention is not supported")
    n = _need(cfg, "num_hidden_layers", model_type)
    pattern = cfg.get("sliding_window_pattern", 6)
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    types = _layer_types(cfg, model_type, default, {"full_attention", "sliding_attention"})
    return _attention_layers(cfg, model_type, types)


def _gpt_oss(cfg, model_type):
    n = _need(cfg, "num_hidden_layers", model_type)
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    types = _layer_types(cfg, model_type, default, {"full_attention", "sliding_attention"})
    return _attention_layers(cfg, model_type, types)


def _mla(cfg, model_type):
    n = _need(cfg, "num_hidden_layers", model_type)
    latent = _need(cfg, "kv_lora_rank", model_type) + _need(cfg, "qk_rope_head_dim", model_type)
    return (LayerKV("mla", 1, latent),) * n


def _model_dtype(cfg, model_type) -> str:
    name = cfg.get("dtype", cfg.get("torch_dtype", "bfloat16"))
    if name not in _TORCH_DTYPES:
        raise ValueError(f"{model_type} config: unknown dtype {name!r}")
    return _TORCH_DTYPES[name]


def _gated_deltanet(cfg, model_type):
    n = _need(cfg, "num_hidden_layers", model_type)
    interval = cfg.get("full_attention_interval", 4)
    default = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    types = _layer_types(cfg, model_type, default, {"full_attention", "linear_attention"})
    hk, hv = (_need(cfg, f, model_type) for f in ("linear_num_key_heads",
                                                 "linear_num_value_heads"))
    dk, dv = (_need(cfg, f, model_type) for f in ("linear_key_head_dim",
                                                 "linear_value_head_dim"))
    kernel = _need(cfg, "linear_conv_kernel_dim", model_type)
    conv_dtype = _model_dtype(cfg, model_type)
    ssm_dtype = conv_dtype
    if cfg.get("mamba_ssm_dtype") is not None:
        ssm_dtype = _TORCH_DTYPES.get(cfg["mamba_ssm_dtype"])
        if ssm_dtype is None:
            raise ValueError(f"{model_type} config: unknown mamba_ssm_dtype "
                             f"{cfg['mamba_ssm_dtype']!r}")
    state = LayerKV("state", state=(
        StatePart("conv", (2 * hk * dk + hv * dv, kernel - 1), conv_dtype, tp_dim=0),
        StatePart("ssm", (hv, dv, dk), ssm_dtype, tp_dim=0)))
    heads, dim = _kv_heads(cfg, model_type), _head_dim(cfg, model_type)
    full = LayerKV("full", heads, dim, dim)
    return tuple(full if kind == "full_attention" else state for kind in types)


#: ``model_type`` -> the function that lays out its layers.
FAMILIES = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen, "qwen3": _qwen,
    "gemma3": _gemma3, "gemma3_text": _gemma3, "gpt_oss": _gpt_oss,
    "deepseek_v2": _mla, "deepseek_v3": _mla, "kimi_k2": _mla,
    "qwen3_next": _gated_deltanet, "qwen3_5": _gated_deltanet, "qwen3_5_moe": _gated_deltanet,
}

#: ``max_position_embeddings`` of configs that leave it to their class (``Gemma3TextConfig``).
_DEFAULT_MAX_POSITIONS = {"gemma3": 131_072, "gemma3_text": 131_072}

#: Multimodal wrappers whose decoder lives in ``text_config``.
_WRAPPERS = {"gemma3", "qwen3_5", "qwen3_5_moe"}


def layout_from_hf_config(config: Mapping | str | Path, *, name: str | None = None
                          ) -> ModelLayout:
    """The per-layer KV layout of the model ``config`` describes (see the module docstring).

    ``name`` defaults to the config's ``_name_or_path``, else its first architecture.
    """
    cfg = load_hf_config(config)
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{sorted(FAMILIES)}")
    if model_type in _WRAPPERS and isinstance(cfg.get("text_config"), Mapping):
        text = {**cfg["text_config"]}
        text.setdefault("dtype", cfg.get("dtype", cfg.get("torch_dtype", "bfloat16")))
        cfg = text
    layers = FAMILIES[model_type](cfg, model_type)
    label = name or cfg.get("_name_or_path") or (load_hf_config(config).get("architectures")
                                                 or [model_type])[0]
    max_pos = cfg.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS.get(model_type, 0)
    source = str(config) if isinstance(config, (str, Path)) else ""
    return ModelLayout(label, model_type, layers, int(max_pos), source)
