"""Attention kernels beside the engine's torch path, each tested against it.

- :mod:`kvlab.kernels.cpu`: a compiled C++ paged decode-attention kernel (built on first use).
- :mod:`kvlab.kernels.triton`: Triton kernels for CUDA (paged decode attention, the KV store).

They import torch and nothing of kvlab's engine: :mod:`kvlab.engine.attention` chooses them.
"""
