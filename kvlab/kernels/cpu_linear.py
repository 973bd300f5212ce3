"""Linear layers on oneDNN with weights packed once (the CPU's matmuls of a forward).

``torch.nn.functional.linear`` gives the BLAS each weight in its plain row-major layout, and
the BLAS repacks it into its own blocked layout on every call; at the few rows of a decode step
that repacking costs about as much as the product. :func:`pack_linears` reorders each
``nn.Linear`` weight of a model once into oneDNN's layout
(``torch.ops.mkldnn._reorder_linear_weight``) and binds it into the module's ``forward``, which
becomes ``torch.ops.mkldnn._linear_pointwise``: the call runs no Python of kvlab's. vLLM's CPU
build does the same with its own op (``dispatch_cpu_unquantized_gemm`` and ``create_onednn_mm``
in ``vllm/model_executor/layers/utils.py``, v0.32). ``benchmarks/bench_cpu_linear.py`` measures
both paths at the engine's shapes. The logits' matmul is packed too: an untied ``lm_head``
is an ``nn.Linear`` like the rest, and with tied embeddings the engine binds
:func:`packed_linear` of the embedding's weight as ``LlamaModel.tied_head`` (vLLM packs its
``lm_head`` too, tied or not: ``UnquantizedEmbeddingMethod.process_weights_after_loading`` in
``vllm/model_executor/layers/vocab_parallel_embedding.py``, v0.32).

The plain weights stay where they were (state dicts, weight hashes and quantization read them),
so the packed copy doubles the weight memory, and a weight changed in place afterwards is not
seen until :func:`pack_linears` runs again (a tied head: until ``tied_head`` is bound again).
``KVLAB_CPU_LINEAR=0`` (read when an engine is built) keeps ``F.linear``; a layer oneDNN
refuses keeps it too. The packed op computes the same product in another summation order
(``tests/test_cpu_linear.py`` bounds the difference).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["available", "pack_linear", "pack_linears", "packed_linear"]


def available(dtype: torch.dtype) -> bool:
    """Whether this torch can pack linear weights of ``dtype`` for oneDNN on this CPU."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                             "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> F.linear(x, weight, bias)`` on oneDNN with ``weight`` packed now, or None where
    that cannot run (not a CPU tensor, a dtype oneDNN lacks here, oneDNN refuses) or
    ``KVLAB_CPU_LINEAR=0``."""
    if (os.environ.get("KVLAB_CPU_LINEAR", "1") == "0" or weight.device.type != "cpu"
            or not available(weight.dtype)):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError:
        return None
    return functools.partial(torch.ops.mkldnn._linear_pointwise, W=packed,
                             B=None if bias is None else bias.detach(), attr="none",
                             scalars=[], algorithm="")


def pack_linear(layer: nn.Module) -> bool:
    """Point ``layer.forward`` at :func:`packed_linear` of its weight and bias; False (layer
    unchanged) where that cannot run or ``layer`` is not exactly an ``nn.Linear``. Call it
    again after the weight changes."""
    if type(layer) is not nn.Linear:
        return False
    forward = packed_linear(layer.weight, layer.bias)
    if forward is None:
        return False
    layer.forward = forward
    return True


def pack_linears(model: nn.Module) -> int:
    """:func:`pack_linear` every ``nn.Linear`` of ``model`` (unless ``KVLAB_CPU_LINEAR=0``);
    the number packed."""
    return sum(pack_linear(m) for m in model.modules())
