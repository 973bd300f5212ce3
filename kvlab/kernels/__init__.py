"""Compiled kernels beside the engine's torch code, each tested against it.

- :mod:`kvlab.kernels.cpu`: a C++ build (paged attention of decode rows and of chunks, and a
  decoder layer's small float32 ops), compiled on first use.
- :mod:`kvlab.kernels.triton`: Triton kernels for CUDA (paged decode attention, the KV store).
- :mod:`kvlab.kernels.triton_fused`: Triton versions of a layer's small ops.

They import torch and nothing else of kvlab. The engine reaches them through its kernel seam:
the attention backends (:mod:`kvlab.engine.attention`) and the layer ops
(:mod:`kvlab.engine.ops`), chosen once per engine.
"""
