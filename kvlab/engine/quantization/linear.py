"""Weight-only quantized linear layers (W8A16 / W4A16 style) and the log of kernels that ran.

:class:`QuantizedLinear` holds a :class:`~.formats.PackedWeight` as buffers (``qweight``,
``scales``, ``zeros``) and computes ``y = x · deq(W)^T + b`` with activations in ``x``'s dtype.
Which kernel runs depends on the config's ``kernel`` and the activation dtype, per call:
``"dequant"`` always dequantizes; ``"packed"`` uses a packed torch kernel wherever its contract
fits; ``"auto"`` (default) uses the packed kernel only for half-precision activations. Measured
on CPU (``benchmarks/bench_quantization.py``, torch 2.13, a 4096x4096 layer): with bf16
activations the packed kernels run at 0.6-1.5x the speed of a bf16 GEMM while dequantizing a
bf16 weight per call is 40-70x slower; with fp32 activations they are 10-50x *slower* than an
fp32 GEMM, and dequantize + fp32 GEMM wins. The packed kernels:

- ``aten._weight_int8pack_mm``: int8 symmetric with **one group per row** (``g = K``), the
  kernel's contract (int8 ``[N, K]`` times a per-output-channel scale). Exact to it: the scale
  multiplies the integer dot product instead of each weight (fp rounding differs, ~1e-6 rel).
- ``aten._weight_int4pack_mm_for_cpu``: 4-bit symmetric on CPU with ``g`` in 32/64/128/256 and
  ``N`` a multiple of 16; the kernel dequantizes ``(u - 8) · s + zero`` per group, which with
  ``zero = 0`` is exactly our format. It needs its own packed layout (same byte count), kept as
  a runtime buffer beside the checkpoint layout.
- otherwise ``dequant``: the packed weight is dequantized per group to the activation dtype and
  ``aten.linear`` runs (a float GEMM: storing 4 bits is not computing in 4 bits).

Every forward records its kernel in a :class:`KernelLog`; the quantization report reads it, so
it states what *ran*, not what was configured.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.engine.quantization.formats import (
    PackedWeight,
    QuantConfig,
    dequantize,
    integer_values,
    quantize,
)

__all__ = ["KernelLog", "QuantizedLinear", "kernel_for"]

INT8_KERNEL = "aten._weight_int8pack_mm"
INT4_KERNEL = "aten._weight_int4pack_mm_for_cpu"
DEQUANT_KERNEL = "dequantize-per-group + aten.linear"


class KernelLog:
    """Counts ``(kernel, activation dtype)`` of every linear forward that ran."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()

    def record(self, kernel: str, dtype: torch.dtype) -> None:
        self.calls[(kernel, str(dtype).replace("torch.", ""))] += 1

    def summary(self) -> dict[str, int]:
        return {f"{k} [{d}]": n for (k, d), n in sorted(self.calls.items())}


def kernel_for(config: QuantConfig, shape: tuple[int, int], device: torch.device,
               activation: torch.dtype = torch.float32) -> str:
    """The kernel a ``[N, K]`` weight runs with ``activation`` inputs (module docstring)."""
    n, k = shape
    if (config.kernel == "dequant" or not config.symmetric
            or (config.kernel == "auto" and activation == torch.float32)):
        return DEQUANT_KERNEL
    if config.bits == 8 and config.group_size == k and device.type == "cpu":
        return INT8_KERNEL
    if (config.bits == 4 and device.type == "cpu" and config.group_size in (32, 64, 128, 256)
            and n % 16 == 0 and k % config.group_size == 0):
        return INT4_KERNEL
    return DEQUANT_KERNEL


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored group-quantized (see the module docstring)."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, log: KernelLog):
        super().__init__()
        self.config = packed.config
        self.out_features, self.in_features = packed.shape
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        self.log = log
        self._int4: torch.Tensor | None = None   # the int4 kernel's layout, built on first use

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, log: KernelLog,
                    name: str = "weight") -> QuantizedLinear:
        return cls(quantize(linear.weight, config, name), linear.bias, log)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.config, (self.out_features, self.in_features), self.qweight,
                            self.scales, self.zeros)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the checkpoint-format weight (payload + scales + zero points)."""
        return self.packed.nbytes

    @property
    def runtime_extra_bytes(self) -> int:
        """Bytes of kernel-specific copies held besides the stored format (int4 layout)."""
        t = self._int4
        return 0 if t is None else t.numel() * t.element_size()

    def _prepare_int4(self) -> None:
        u = (integer_values(self.packed) + 8).reshape(self.out_features, self.in_features)
        self._int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 1)

    def _apply(self, fn, recurse: bool = True):
        """Moves keep the stored dtypes: ``model.to(dtype)`` must not cast the int payload's
        fp16 scales (their exact values are the format)."""
        saved = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        if self._int4 is not None and self._int4.device != self.qweight.device:
            self._int4 = None  # rebuilt on the new device at the next int4 call
        return self

    def kernel(self, activation: torch.dtype = torch.float32) -> str:
        """The kernel a forward with ``activation`` inputs runs."""
        return kernel_for(self.config, (self.out_features, self.in_features),
                          self.qweight.device, activation)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.packed, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        kernel = self.kernel(x.dtype)
        if kernel == INT8_KERNEL:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight,
                                                   self.scales.reshape(-1).to(x.dtype))
        elif kernel == INT4_KERNEL:
            if self._int4 is None:
                self._prepare_int4()
            sz = torch.stack((self.scales.t().to(x.dtype),
                              torch.zeros_like(self.scales.t(), dtype=x.dtype)), -1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._int4,
                                                           self.config.group_size,
                                                           sz.contiguous())
        else:
            y = F.linear(x2, self.dequantized_weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        self.log.record(kernel, x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        c = self.config
        return (f"in={self.in_features}, out={self.out_features}, int{c.bits}, g={c.group_size}, "
                f"{'sym' if c.symmetric else 'zero-point'}, kernel={c.kernel}")
