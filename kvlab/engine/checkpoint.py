"""Load a local Hugging Face checkpoint (``config.json`` + ``*.safetensors``) as a model.

Supported layout: one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(any other ``*.safetensors`` files are read when there is no index). Tensor names follow
``LlamaForCausalLM`` (Mistral's and Qwen2's are the same, Qwen3 adds Q/K norms); Q/K/V and
gate/up are fused on load. Every tensor is checked (missing, unexpected, wrong shape) before the
model is touched, and the error names the tensor. Nothing here touches the network. A shipped
model name resolves through :func:`kvlab.models.shipped_model_path`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvlab.engine.config import ConfigError, ModelConfig, parse_token_ids
from kvlab.engine.model import LlamaModel

__all__ = ["CheckpointError", "LoadedCheckpoint", "load_checkpoint", "resolve_model_path"]


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config (missing, unexpected or misshaped)."""


@dataclass
class LoadedCheckpoint:
    """A model ready to run, with what identifies it (for prefix-cache scopes)."""

    path: Path
    config: ModelConfig
    model: LlamaModel
    weights_hash: str          # sha256 over config.json and the safetensors files
    generation_eos: tuple[int, ...]  # eos ids from generation_config.json (may be empty)


def tokenizer_hash(file: Path) -> str:
    """sha256 of a ``tokenizer.json`` and the ``tokenizer_config.json`` beside it (chat template
    and special-token settings): what identifies a tokenizer in prefix-cache scopes."""
    data = file.read_bytes()
    template = file.with_name("tokenizer_config.json")
    if template.is_file():
        data += template.read_bytes()
    return hashlib.sha256(data).hexdigest()


def resolve_model_path(model: str | os.PathLike[str]) -> Path:
    """A local directory, or a shipped model name; FileNotFoundError names what was tried.

    ``model`` must be a non-blank str or a path object: ``""`` would otherwise mean the current
    directory (``Path("")`` is ``Path(".")``), so it raises ValueError instead (TypeError for
    other types). Pass ``"."`` to mean the current directory.
    """
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a str or a path, got {type(model).__name__}")
    if isinstance(model, str) and not model.strip():
        raise ValueError(f"model must be a shipped model name or a model directory, got "
                         f"{model!r} (pass '.' for the current directory)")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from kvlab.models import shipped_model_path
    except ImportError:  # models package not available
        shipped_model_path = None
    if shipped_model_path is not None and isinstance(model, str) and "/" not in model:
        try:
            found = Path(shipped_model_path(model))
        except (KeyError, ValueError, FileNotFoundError) as err:
            raise FileNotFoundError(
                f"unknown model {model!r}: not a local directory and not a shipped model ({err})"
            ) from None
        if found.is_dir():
            return found
    raise FileNotFoundError(
        f"unknown model {str(model)!r}: not a local directory in Hugging Face layout and not a "
        "shipped model name (kvlab never downloads from a hub)"
    )


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: malformed index ({err!r})") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists missing shard(s): {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {str(path)!r}")
    return files


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _hf_name_map(cfg: ModelConfig) -> dict[str, list[str]]:
    """kvlab parameter name -> HF tensor names concatenated (dim 0) to form it."""
    m: dict[str, list[str]] = {"embed.weight": ["model.embed_tokens.weight"],
                               "norm": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        m[dst + "input_norm"] = [src + "input_layernorm.weight"]
        m[dst + "post_norm"] = [src + "post_attention_layernorm.weight"]
        m[dst + "qkv.weight"] = [attn + f"{p}_proj.weight" for p in "qkv"]
        m[dst + "o.weight"] = [attn + "o_proj.weight"]
        m[dst + "gate_up.weight"] = [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"]
        m[dst + "down.weight"] = [src + "mlp.down_proj.weight"]
        if cfg.qk_norm:
            m[dst + "q_norm"] = [attn + "q_norm.weight"]
            m[dst + "k_norm"] = [attn + "k_norm.weight"]
        if cfg.qkv_bias:
            m[dst + "qkv.bias"] = [attn + f"{p}_proj.bias" for p in "qkv"]
        if cfg.o_bias:
            m[dst + "o.bias"] = [attn + "o_proj.bias"]
        if cfg.mlp_bias:
            m[dst + "gate_up.bias"] = [src + "mlp.gate_proj.bias", src + "mlp.up_proj.bias"]
            m[dst + "down.bias"] = [src + "mlp.down_proj.bias"]
    return m


def _generation_eos(path: Path, vocab_size: int) -> tuple[int, ...]:
    """End-of-sequence ids of ``path/generation_config.json`` (absent file or field: ``()``)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file}: malformed JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return parse_token_ids(data, "eos_token_id", vocab_size, source=str(file))


def load_checkpoint(
    model: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LoadedCheckpoint:
    """Load ``model`` (directory or shipped name) as a :class:`LlamaModel` in ``dtype`` on
    ``device``. Raises FileNotFoundError, :class:`ConfigError` (a bad ``config.json`` or
    ``generation_config.json``, naming the file and the field), :class:`CheckpointError`, or
    ValueError / TypeError for a blank or non-path ``model`` (see :func:`resolve_model_path`).
    """
    path = resolve_model_path(model)
    cfg = ModelConfig.from_dir(path)
    gen_eos = _generation_eos(path, cfg.vocab_size)
    files = _weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                    tensors[name] = fh.get_tensor(name)
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {f}: {err}") from None
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        tensors.pop("lm_head.weight")  # some exports store the tied copy too
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaModel(cfg).state_dict().items()}
    name_map = _hf_name_map(cfg)
    needed = {n for names in name_map.values() for n in names}
    missing = sorted(needed - tensors.keys())
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing tensor(s) {missing[:5]}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(k for k in tensors.keys() - needed if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointError(f"checkpoint {str(path)!r} has unexpected tensor(s) {unexpected[:5]}")
    state: dict[str, torch.Tensor] = {}
    for dst, srcs in name_map.items():
        parts = [tensors[s] for s in srcs]
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(value.shape) != shapes[dst]:
            raise CheckpointError(
                f"tensor(s) {srcs} have shape {tuple(value.shape)}, config implies {shapes[dst]}")
        state[dst] = value.to(dtype)
    assert state.keys() == shapes.keys(), "name map out of sync with the model"
    with torch.device("meta"):
        net = LlamaModel(cfg)
    net.load_state_dict(state, strict=False, assign=True)  # inv_freq is computed, not loaded
    # RoPE frequencies stay float32 whatever the weights' dtype
    net.inv_freq = cfg.rope.inv_freq(cfg.head_dim, cfg.max_position_embeddings)
    net = net.to(device).eval()
    return LoadedCheckpoint(
        path=path, config=cfg, model=net,
        weights_hash=_hash_files([path / "config.json", *files]), generation_eos=gen_eos)
