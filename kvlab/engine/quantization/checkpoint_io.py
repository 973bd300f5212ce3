"""Save and load pre-quantized checkpoints (kvlab's own safetensors layout).

A quantized model directory holds

- ``config.json``: the source model's config plus ``"quantization_config"``
  (:meth:`~.formats.QuantConfig.to_json`: ``quant_method="kvlab-group"``, ``bits``,
  ``group_size``, ``symmetric``, ``scale_dtype``, ``zero_point_dtype``, ``packing``);
- ``model.safetensors``: tensors under kvlab's module names. Every decoder linear
  ``layers.{i}.{qkv,o,gate_up,down}`` is stored as ``.qweight`` (int8 ``[N, K]`` for 8-bit
  symmetric; uint8 ``[N, K/2]`` two-per-byte nibbles, low first, for <= 4 bits; uint8
  ``[N, K]`` otherwise), ``.scales`` (``[N, K/g]`` fp16/bf16), ``.zeros`` (uint8 ``[N, K/g]``,
  zero-point variant only) and ``.bias`` when the layer has one. Everything else
  (``embed.weight``, ``norm``, ``layers.{i}.input_norm``/``post_norm``, an untied
  ``lm_head.weight``) is stored unquantized in the model dtype it was saved from. The header
  metadata says ``{"format": "kvlab-group-v1"}``.
- the tokenizer and generation config files, copied.

Loading rebuilds the same tensors bit for bit (the test saves, loads and compares every byte).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kvlab.engine.checkpoint import CheckpointError, LoadedCheckpoint
from kvlab.engine.config import ConfigError, ModelConfig, parse_token_ids
from kvlab.engine.model import LlamaModel
from kvlab.engine.quantization.formats import PackedWeight, QuantConfig
from kvlab.engine.quantization.linear import KernelLog, QuantizedLinear

__all__ = ["FORMAT", "is_quantized_dir", "load_quantized", "quantized_linear_names",
           "save_quantized"]

FORMAT = "kvlab-group-v1"
_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def quantized_linear_names(model: LlamaModel) -> list[str]:
    """The module names that weight quantization replaces: every ``nn.Linear`` of the decoder
    layers (an untied ``lm_head`` stays in the model dtype, as GPTQ/AWQ checkpoints keep it)."""
    return [name for name, mod in model.named_modules()
            if isinstance(mod, (nn.Linear, QuantizedLinear)) and name.startswith("layers.")]


def quantization_config_of(path: Path) -> QuantConfig | None:
    """The ``quantization_config`` of ``path/config.json``, or None when it has none."""
    file = path / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # the ordinary loader reports the malformed file
    if not isinstance(data, dict) or "quantization_config" not in data:
        return None
    try:
        return QuantConfig.from_json(data["quantization_config"])
    except ValueError as err:
        raise ConfigError(f"{file}: {err}") from None


def is_quantized_dir(path: Path) -> bool:
    return quantization_config_of(path) is not None


def save_quantized(ckpt: LoadedCheckpoint, out_dir: str | Path) -> Path:
    """Write ``ckpt`` (whose model holds :class:`QuantizedLinear` layers) to ``out_dir``."""
    model = ckpt.model
    names = quantized_linear_names(model)
    mods = [model.get_submodule(n) for n in names]
    if not mods or not all(isinstance(m, QuantizedLinear) for m in mods):
        raise ValueError("save_quantized: the model is not weight-quantized "
                         "(construct the engine with quantization='int8' or 'int4')")
    config = mods[0].config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": FORMAT})
    data = json.loads((ckpt.path / "config.json").read_text())
    data["quantization_config"] = config.to_json()
    data["torch_dtype"] = str(model.dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    for name in _COPIED:
        if (ckpt.path / name).is_file() and (ckpt.path / name).resolve() != (out / name).resolve():
            shutil.copyfile(ckpt.path / name, out / name)
    return out


def _expected(cfg: QuantConfig, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    payload = torch.int8 if cfg.bits == 8 and cfg.symmetric else torch.uint8
    width = k // 2 if cfg.payload_bits() == 4 else k
    shapes = {"qweight": ((n, width), payload),
              "scales": ((n, k // cfg.group_size), cfg.torch_scale_dtype)}
    if not cfg.symmetric:
        shapes["zeros"] = ((n, k // cfg.group_size), torch.uint8)
    return shapes


def load_quantized(path: Path, *, dtype: torch.dtype, device: torch.device,
                   log: KernelLog) -> tuple[LoadedCheckpoint, QuantConfig]:
    """Load a directory written by :func:`save_quantized`. CheckpointError names a missing,
    unexpected or misshaped tensor; nothing is built before every tensor is checked."""
    qcfg = quantization_config_of(path)
    if qcfg is None:
        raise CheckpointError(f"{path} has no quantization_config in config.json")
    cfg = ModelConfig.from_dir(path)
    file = path / "model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"no model.safetensors in {str(path)!r}")
    try:
        with safe_open(str(file), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read {file}: {err}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    with torch.device("meta"):
        net = LlamaModel(cfg)
    expected: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    linears = quantized_linear_names(net)
    for name in linears:
        n, k = net.get_submodule(name).weight.shape
        qcfg.check_shape(name, (n, k))
        for key, spec in _expected(qcfg, n, k).items():
            expected[f"{name}.{key}"] = spec
        if net.get_submodule(name).bias is not None:
            expected[f"{name}.bias"] = (tuple(net.get_submodule(name).bias.shape), None)
    for key, value in net.state_dict().items():
        if not any(key.startswith(f"{name}.") for name in linears):
            expected[key] = (tuple(value.shape), None)
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(f"{file}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, (shape, want) in expected.items():
        t = tensors[key]
        if tuple(t.shape) != shape or (want is not None and t.dtype != want):
            raise CheckpointError(f"{file}: tensor {key} is {tuple(t.shape)} {t.dtype}, "
                                  f"expected {shape} {want or 'float'}")
    plain = {k: v.to(dtype) for k, v in tensors.items()
             if not any(k.startswith(f"{name}.") for name in linears)}
    net.load_state_dict(plain, strict=False, assign=True)
    for name in linears:
        n, k = net.get_submodule(name).weight.shape
        packed = PackedWeight(qcfg, (n, k), tensors[f"{name}.qweight"], tensors[f"{name}.scales"],
                              tensors.get(f"{name}.zeros"))
        bias = tensors.get(f"{name}.bias")
        net.set_submodule(name, QuantizedLinear(packed, None if bias is None else bias.to(dtype),
                                                log))
    net.inv_freq = cfg.rope.inv_freq(cfg.head_dim, cfg.max_position_embeddings)
    net = net.to(device).eval()
    h = hashlib.sha256()
    for f in (path / "config.json", file):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    gen_eos: tuple[int, ...] = ()
    gen = path / "generation_config.json"
    if gen.is_file():
        gen_eos = parse_token_ids(json.loads(gen.read_text()), "eos_token_id", cfg.vocab_size,
                                  source=str(gen))
    return LoadedCheckpoint(path=path, config=cfg, model=net, weights_hash=h.hexdigest(),
                            generation_eos=gen_eos), qcfg
