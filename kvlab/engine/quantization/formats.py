"""Group-quantized weight formats: the config, quantize / dequantize, and int4 packing.

Symmetric (spec rule 7): per group of ``g`` consecutive values of a row,
``s = max|x| / qmax`` with ``qmax = 2^(b-1) - 1`` and ``q = clamp(round(x / s), -qmax, qmax)``.
Zero-point (asymmetric) variant: ``s = (max(x, 0) - min(x, 0)) / (2^b - 1)``,
``z = round(-min / s)`` and ``q = clamp(round(x / s) + z, 0, 2^b - 1)``; ``x ≈ (q - z) · s``.

Scales are stored in fp16 or bf16 and are **rounded up** to that dtype before ``q`` is computed,
so ``|x / s| <= qmax`` still holds and the bound ``|x - deq(q(x))| <= s / 2`` is exact for the
stored ``s`` (a round-to-nearest scale could be a hair too small and clip the largest value).

Storage (:class:`PackedWeight`): ``b = 8`` symmetric keeps int8 ``[N, K]``; ``b <= 4`` packs two
values per byte into uint8 ``[N, K/2]`` as offset-binary nibbles (``q + 2^(b-1)``, or ``q`` for
zero-point), element ``2j`` in the low nibble and ``2j + 1`` in the high one; ``5 <= b <= 7``
and zero-point int8 use one uint8/int8 per value. Zero points are uint8, one per group.
Bytes: ``N·K·payload + N·(K/g)·(scale + zero)``, which equals ``effective_bits · N·K / 8``
exactly whenever the payload is 8 or 4 bits (``b = 2, 3`` still spend a nibble: stated in
:meth:`QuantConfig.storage_bits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.reference.rule07_quantization import effective_bits

__all__ = ["PackedWeight", "QuantConfig", "dequantize", "pack_int4", "quantize", "unpack_int4"]

_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
KERNELS = ("auto", "dequant", "packed")


@dataclass(frozen=True)
class QuantConfig:
    """A weight quantization format. ``kernel``: ``"dequant"`` (always dequantize per group),
    ``"packed"`` (a verified packed torch kernel wherever its contract fits) or ``"auto"``
    (packed for half-precision activations, dequant for float32: see :mod:`.linear`)."""

    bits: int = 8
    group_size: int = 64
    symmetric: bool = True
    scale_dtype: str = "float16"
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"quantization bits must be an int in 2..8, got {self.bits!r}")
        if (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                or self.group_size <= 0):
            raise ValueError(f"quantization_group_size must be a positive int, "
                             f"got {self.group_size!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be a bool, got {self.symmetric!r}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {sorted(_SCALE_DTYPES)}, "
                             f"got {self.scale_dtype!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    @property
    def zero_bits(self) -> int:
        """Bits stored per group for the zero point (uint8), 0 when symmetric."""
        return 0 if self.symmetric else 8

    def payload_bits(self) -> int:
        """Bits the packed payload spends per weight (a nibble for b <= 4, a byte otherwise)."""
        return 4 if self.bits <= 4 else 8

    def storage_bits(self) -> float:
        """Stored bits per weight, scales and zero points included (what bytes measure)."""
        return effective_bits(self.payload_bits(), self.group_size, 16, self.zero_bits)

    def effective_bits(self) -> float:
        """Spec rule 7's count: ``bits + (scale_bits + zero_bits) / group_size``."""
        return effective_bits(self.bits, self.group_size, 16, self.zero_bits)

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """ValueError naming ``name`` unless a ``[N, K]`` weight can take this format."""
        if len(shape) != 2:
            raise ValueError(f"{name}: only 2-D weights are group-quantized, got {shape}")
        k = shape[1]
        if k % self.group_size:
            raise ValueError(f"quantization_group_size={self.group_size} does not divide the "
                             f"input dimension {k} of {name} (shape {tuple(shape)})")
        if self.payload_bits() == 4 and k % 2:
            raise ValueError(f"{name}: int4 packing needs an even input dimension, got {k}")

    def to_json(self) -> dict:
        """The ``quantization_config`` written to ``config.json``."""
        return {"quant_method": "kvlab-group", "bits": self.bits, "group_size": self.group_size,
                "symmetric": self.symmetric, "scale_dtype": self.scale_dtype,
                "zero_point_dtype": None if self.symmetric else "uint8",
                "packing": "int4-nibbles-low-first" if self.payload_bits() == 4 else "byte"}

    @classmethod
    def from_json(cls, data: object) -> QuantConfig:
        if not isinstance(data, dict) or data.get("quant_method") != "kvlab-group":
            raise ValueError(f"quantization_config must have quant_method 'kvlab-group', "
                             f"got {data!r}")
        try:
            return cls(bits=data["bits"], group_size=data["group_size"],
                       symmetric=data["symmetric"], scale_dtype=data["scale_dtype"])
        except KeyError as err:
            raise ValueError(f"quantization_config lacks {err}") from None


@dataclass
class PackedWeight:
    """A stored quantized ``[N, K]`` weight: ``qweight`` (int8 ``[N, K]`` or uint8 ``[N, K]`` /
    ``[N, K/2]``), ``scales`` ``[N, K/g]`` and ``zeros`` (uint8 ``[N, K/g]``, or None)."""

    config: QuantConfig
    shape: tuple[int, int]
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Values ``0..15`` ``[..., K]`` (K even) -> uint8 ``[..., K/2]``, element 2j in the low
    nibble."""
    if u.shape[-1] % 2:
        raise ValueError(f"pack_int4: last dimension must be even, got {u.shape[-1]}")
    if u.numel() and (int(u.min()) < 0 or int(u.max()) > 15):
        raise ValueError("pack_int4: values must lie in 0..15")
    u = u.to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[..., K/2]`` -> uint8 ``[..., K]`` in ``0..15``."""
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _round_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` (float32, > 0) in ``dtype``, rounded up so that ``stored >= scale``."""
    s = scale.to(dtype)
    low = s.float() < scale
    return torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)


def quantize(w: torch.Tensor, config: QuantConfig, name: str = "weight") -> PackedWeight:
    """Group-quantize a ``[N, K]`` float weight into its packed storage (see module doc)."""
    config.check_shape(name, tuple(w.shape))
    n, k = w.shape
    g = config.group_size
    groups = w.detach().float().reshape(n, k // g, g)
    tiny = torch.finfo(config.torch_scale_dtype).tiny
    if config.symmetric:
        qmax = 2 ** (config.bits - 1) - 1
        scale = _round_up((groups.abs().amax(-1) / qmax).clamp_min(tiny),
                          config.torch_scale_dtype)
        q = (groups / scale.float()[..., None]).round().clamp(-qmax, qmax)
        zeros = None
        if config.payload_bits() == 4:
            qweight = pack_int4((q + 2 ** (config.bits - 1)).reshape(n, k))
        elif config.bits == 8:
            qweight = q.to(torch.int8).reshape(n, k)
        else:
            qweight = (q + 2 ** (config.bits - 1)).to(torch.uint8).reshape(n, k)
    else:
        levels = 2 ** config.bits - 1
        lo = groups.amin(-1).clamp_max(0)
        hi = groups.amax(-1).clamp_min(0)
        scale = _round_up(((hi - lo) / levels).clamp_min(tiny), config.torch_scale_dtype)
        zero = (-lo / scale.float()).round().clamp(0, levels)
        q = ((groups / scale.float()[..., None]).round() + zero[..., None]).clamp(0, levels)
        zeros = zero.to(torch.uint8)
        u = q.to(torch.uint8).reshape(n, k)
        qweight = pack_int4(u) if config.payload_bits() == 4 else u
    return PackedWeight(config, (n, k), qweight.contiguous(), scale.contiguous(),
                        None if zeros is None else zeros.contiguous())


def integer_values(p: PackedWeight) -> torch.Tensor:
    """The signed integer grid values ``q - offset`` (or ``q - z``) as float32 ``[N, K/g, g]``."""
    cfg = p.config
    n, k = p.shape
    raw = unpack_int4(p.qweight) if cfg.payload_bits() == 4 else p.qweight
    q = raw.reshape(n, k // cfg.group_size, cfg.group_size).float()
    if cfg.symmetric:
        return q if cfg.bits == 8 and cfg.payload_bits() == 8 else q - 2 ** (cfg.bits - 1)
    return q - p.zeros.float()[..., None]  # type: ignore[union-attr]


def dequantize(p: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight the format represents: ``(q - offset or z) · s``, in ``dtype``
    (computed in float32, rounded once)."""
    q = integer_values(p)
    return (q * p.scales.float()[..., None]).reshape(p.shape).to(dtype)
