"""Linear layers whose product runs through a *linear method* chosen at load (vLLM's
``quant_method`` pattern): :class:`Linear` is an ``nn.Linear`` that calls ``self.method``.

:class:`LinearMethod` is ``F.linear`` over the layer's weight. On the CPU the engine selects
:class:`OneDnnLinearMethod` (:func:`select_linear_method`): ``F.linear`` hands the BLAS each
weight in its plain row-major layout and the BLAS repacks it into its own blocked layout on
every call, which at the few rows of a decode step costs about as much as the product; the
oneDNN method reorders each weight once (``torch.ops.mkldnn._reorder_linear_weight``) and calls
``torch.ops.mkldnn._linear_pointwise`` with it. vLLM's CPU build does the same with its own op
(``dispatch_cpu_unquantized_gemm`` and ``create_onednn_mm`` in
``vllm/model_executor/layers/utils.py``, v0.32), for its ``lm_head`` too, tied or not
(``UnquantizedEmbeddingMethod.process_weights_after_loading``,
``vllm/model_executor/layers/vocab_parallel_embedding.py``); kvlab's tied head is the
embedding's weight run through the same method (``LlamaModel.logits``).
``benchmarks/bench_cpu_linear.py`` measures both methods at the engine's shapes.

The plain weights stay where they were (state dicts, weight hashes and quantization read them),
so a packed copy doubles the weight memory, and a weight changed in place afterwards is not seen
until the method processes the layer again. ``KVLAB_CPU_LINEAR=0`` (read when a method is
selected) keeps ``F.linear``; a layer oneDNN refuses keeps it too. The packed op computes the
same product in another summation order (``tests/test_cpu_linear.py`` bounds the difference).
Weight-only quantized layers are modules of their own (:mod:`kvlab.engine.quantization.linear`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "LinearMethod", "OneDnnLinearMethod", "select_linear_method"]


class LinearMethod:
    """``x @ W^T + b`` over ``layer.weight``: ``F.linear``, nothing to prepare."""

    name = "torch"

    def process_weights(self, layer: nn.Module) -> None:
        """Prepare ``layer`` (which has a ``weight``) after its weights are loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class OneDnnLinearMethod(LinearMethod):
    """oneDNN with the weight packed once into ``layer.packed_weight`` (float32, or bfloat16
    where the CPU supports it)."""

    name = "onednn"

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        """Whether this torch can pack linear weights of ``dtype`` for oneDNN on this CPU."""
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                 "_linear_pointwise")):
            return False
        if dtype == torch.bfloat16:
            return torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return dtype == torch.float32

    def process_weights(self, layer: nn.Module) -> None:
        """RuntimeError where oneDNN cannot take the weight (another device or dtype, or
        oneDNN refuses it): the layer is then left unchanged."""
        weight = layer.weight
        if weight.device.type != "cpu" or not self.available(weight.dtype):
            raise RuntimeError(f"oneDNN packs no {weight.dtype} weight on {weight.device}")
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, W=layer.packed_weight, B=None if bias is None else bias.detach(), attr="none",
            scalars=[], algorithm="")


class Linear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) whose product runs through
    ``method`` (default :class:`LinearMethod`); set it with :meth:`use_method`."""

    method: LinearMethod = LinearMethod()

    def use_method(self, method: LinearMethod) -> bool:
        """Process this layer for ``method`` and use it; False (unchanged) if ``method``
        refuses the layer."""
        try:
            method.process_weights(self)
        except RuntimeError:
            return False
        self.method = method
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


def select_linear_method(device: torch.device | str, dtype: torch.dtype) -> LinearMethod:
    """:class:`OneDnnLinearMethod` on a CPU that packs ``dtype`` (unless
    ``KVLAB_CPU_LINEAR=0``), else :class:`LinearMethod`."""
    if (torch.device(device).type == "cpu" and os.environ.get("KVLAB_CPU_LINEAR", "1") != "0"
            and OneDnnLinearMethod.available(dtype)):
        return OneDnnLinearMethod()
    return LinearMethod()
