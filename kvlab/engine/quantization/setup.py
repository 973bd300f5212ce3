"""The engine's quantization settings: validated at the boundary, applied at load.

:class:`EngineQuantization` is what :class:`~kvlab.engine.llm_engine.LLMEngine` holds for
``quantization=``, ``quantization_group_size=`` and ``kv_cache_dtype=``. It

1. validates the arguments before anything is loaded (:meth:`EngineQuantization.resolve`),
2. loads the checkpoint, pre-quantized or not (:meth:`load`), and quantizes its decoder
   linears in place, every shape checked before the first layer is replaced (:meth:`apply`),
3. sizes and builds the KV cache in the chosen KV dtype (:meth:`kv_bytes_per_token`,
   :meth:`make_kv_cache`), and
4. names what the prefix-cache scope must include (:meth:`scope_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kvlab.core.kv_dtype import KVDtypeSpec, kv_bytes_per_token, kv_dtype_spec
from kvlab.engine.checkpoint import LoadedCheckpoint, load_checkpoint, resolve_model_path
from kvlab.engine.config import ModelConfig
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.quantization.checkpoint_io import (
    load_quantized,
    quantization_config_of,
    quantized_linear_names,
)
from kvlab.engine.quantization.formats import QuantConfig
from kvlab.engine.quantization.kv_cache import QuantizedPagedKVCache
from kvlab.engine.quantization.linear import KernelLog, QuantizedLinear

__all__ = ["EngineQuantization"]

_METHODS = {"int8": 8, "int4": 4}
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass
class EngineQuantization:
    """Resolved weight and KV quantization of one engine (see the module docstring)."""

    weights: QuantConfig | None
    kv: KVDtypeSpec
    log: KernelLog = field(default_factory=KernelLog)
    source: str = "none"                 # none | quantized at load | pre-quantized checkpoint
    checkpoint_dtype: str = "unknown"    # dtype of the weights on disk
    _cast_to: torch.dtype | None = field(default=None, init=False, repr=False)  # model dtype

    @classmethod
    def resolve(cls, quantization: object = None, group_size: object = 64,
                kv_cache_dtype: object = "auto") -> EngineQuantization:
        """Validate the arguments (ValueError / TypeError naming the bad one)."""
        spec = kv_dtype_spec(kv_cache_dtype)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"quantization_group_size must be a positive int, got {group_size!r}")
        if quantization is None:
            return cls(None, spec)
        if isinstance(quantization, QuantConfig):
            return cls(quantization, spec)
        if not isinstance(quantization, str) or quantization not in _METHODS:
            raise ValueError(f"quantization must be None, 'int8', 'int4' or a QuantConfig, "
                             f"got {quantization!r}")
        return cls(QuantConfig(bits=_METHODS[quantization], group_size=group_size), spec)

    # ------------------------------------------------------------------ weights
    def load(self, model: str | Path, *, dtype: torch.dtype,
             device: torch.device) -> LoadedCheckpoint:
        """Load ``model``; a directory with a ``quantization_config`` loads pre-quantized (a
        different requested format is refused: re-quantizing a quantized model compounds
        error). A model to be quantized at load is read in float32, so the scales come from
        the checkpoint's values and not from a copy already rounded to ``dtype``; :meth:`apply`
        casts the rest to ``dtype`` afterwards."""
        path = resolve_model_path(model)
        stored = quantization_config_of(path)
        if stored is None:
            read_as = torch.float32 if self.weights is not None else dtype
            ckpt = load_checkpoint(path, dtype=read_as, device=device)
            self.checkpoint_dtype = _disk_dtype(path)
            self._cast_to = dtype
            return ckpt
        if self.weights is not None and (self.weights.bits, self.weights.group_size,
                                         self.weights.symmetric) != (
                stored.bits, stored.group_size, stored.symmetric):
            raise ValueError(f"{path} is already quantized as {stored.to_json()}; "
                             f"quantization={self.weights.to_json()} would re-quantize it "
                             "(pass quantization=None to use it as stored)")
        ckpt, stored = load_quantized(path, dtype=dtype, device=device, log=self.log)
        self.weights, self.source = stored, "pre-quantized checkpoint"
        self.checkpoint_dtype = f"int{stored.bits}"
        return ckpt

    def apply(self, ckpt: LoadedCheckpoint) -> None:
        """Quantize ``ckpt.model``'s decoder linears in place (when asked and not already),
        Checks every layer first: a group size
        that does not divide some layer raises ValueError with the model untouched. A
        :class:`LoadedCheckpoint` quantized by an earlier engine is used as it is (its layers
        then log into this engine's report); asking for another format is refused."""
        model = ckpt.model
        names = quantized_linear_names(model)
        already = [n for n in names if isinstance(model.get_submodule(n), QuantizedLinear)]
        if already:
            have = model.get_submodule(already[0]).config
            if self.weights is not None and (self.weights.bits, self.weights.group_size,
                                             self.weights.symmetric) != (
                    have.bits, have.group_size, have.symmetric):
                raise ValueError(f"the model is already quantized as {have.to_json()}; "
                                 f"quantization={self.weights.to_json()} would re-quantize it")
            if self.source == "none":
                self.source = "quantized earlier (in memory)"
                self.weights = have
                self.checkpoint_dtype = _disk_dtype(ckpt.path)
            for n in already:
                model.get_submodule(n).log = self.log
            return
        if self.checkpoint_dtype == "unknown":
            self.checkpoint_dtype = _disk_dtype(ckpt.path)
        if self.weights is None:   # plain nn.Linear layers: nothing to install, no hooks
            return
        cfg = self.weights
        for n in names:
            cfg.check_shape(n, tuple(model.get_submodule(n).weight.shape))
        for n in names:
            model.set_submodule(n, QuantizedLinear.from_linear(model.get_submodule(n), cfg,
                                                               self.log, n))
        self.source = "quantized at load"
        if self._cast_to is not None and model.dtype != self._cast_to:
            model.to(self._cast_to)   # QuantizedLinear keeps its int payload and fp16 scales
            mc = ckpt.config
            model.inv_freq = mc.rope.inv_freq(mc.head_dim,
                                              mc.max_position_embeddings).to(model.device)

    # ------------------------------------------------------------------ KV cache
    def kv_bytes_per_token(self, cfg: ModelConfig, itemsize: int) -> int:
        """Bytes one token's KV takes (all layers, K and V, scales included)."""
        return kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv.name,
                                  itemsize)

    def make_kv_cache(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device
                      ) -> PagedKVCache | QuantizedPagedKVCache:
        if not self.kv.quantized:
            return PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                cfg.head_dim, dtype=dtype, device=device)
        return QuantizedPagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                     cfg.head_dim, self.kv, dtype=dtype, device=device)

    def scope_fields(self, model_dtype: torch.dtype) -> dict[str, str]:
        """``kv_dtype`` and ``quant_schema`` of the prefix-cache scope (spec rule 4): KV written
        under one schema never matches a request under another."""
        kv = str(model_dtype).replace("torch.", "") if not self.kv.quantized else self.kv.name
        w = "none"
        if self.weights is not None:
            c = self.weights
            w = (f"w=int{c.bits};g={c.group_size};{'sym' if c.symmetric else 'zp'};"
                 f"scale={c.scale_dtype}")
        return {"kv_dtype": kv, "quant_schema": f"weights[{w}];kv[{self.kv.schema()}]"}


def _disk_dtype(path: Path) -> str:
    """The dtype of the first linear weight stored in ``path``'s safetensors (header only)."""
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118
                    if name.endswith("proj.weight") or name.endswith(".weight"):
                        raw = str(fh.get_slice(name).get_dtype())
                        return _ST_DTYPES.get(raw, raw.lower())
        except Exception:  # the loader already read these files
            continue
    return "unknown"
