"""A small catalogue of real model shapes and GPUs, the inputs of every capacity calculation.

Model shapes are copied from each model's Hugging Face ``config.json`` (URL in ``source``);
``params`` is the published parameter count and :func:`dense_param_count` recomputes it from
the shape, so the two checking each other guards against a mistyped field (tests do this).

GPU figures come from NVIDIA's datasheets (URL in ``source``). HBM capacities are binary: an
"80GB" H100 carries 80 GiB (80 * 2**30 bytes) of HBM3, and the "GB" of a memory label means
GiB. CUDA reports a little less than the physical size, because the driver and firmware keep
some for themselves: 79.11 GiB on an H100 80GB, 139.81 GiB on an H200. That observed total is
recorded as ``cuda_total_bytes``, and capacity plans use it by default, as vLLM does.
``memory_bytes`` is the label's number read as *decimal* gigabytes (``80 * 10**9`` bytes =
74.5 GiB): a lower bound, kept because planners that misread the label use it (and for GPUs
without an observed total), not the physical size. Peak tensor throughput is the *dense* BF16
figure (datasheets often print the 2:4-sparse figure, twice as large); bandwidth is HBM
bandwidth in bytes per second (decimal: 3.35 TB/s = 3.35 * 10**12 B/s).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30
TB = 10**12


#: Bytes per element of the KV (or weight) storage formats the planner knows.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}

def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` (see :data:`DTYPE_BYTES`); ValueError names unknown ones."""
    try:
        return DTYPE_BYTES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"kv_dtype/weight dtype {dtype!r} unknown; use one of "
                         f"{sorted(DTYPE_BYTES)}") from None



@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer that matters for KV memory and weight memory.

    Attributes:
        name: human-readable model name.
        layers: number of transformer blocks (``num_hidden_layers``).
        hidden: residual width (``hidden_size``).
        heads: query heads per layer (``num_attention_heads``).
        kv_heads: key/value heads per layer (``num_key_value_heads``); ``kv_heads < heads`` is
            grouped-query attention (GQA), ``kv_heads == 1`` multi-query attention (MQA).
        head_dim: dimension of one head (``hidden // heads`` for every model here).
        intermediate: MLP width (``intermediate_size``) of the gated (SwiGLU) MLP.
        vocab: vocabulary size (rows of the embedding matrix).
        params: published parameter count.
        max_position_embeddings: the context length the config declares.
        tie_word_embeddings: whether the LM head reuses the embedding matrix.
        qkv_bias: whether q/k/v projections carry a bias (Qwen2 does).
        sliding_window: attention window in tokens, or ``None`` for full attention.
        source: URL of the Hugging Face ``config.json`` the numbers come from.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                      "vocab", "params", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelShape.{field} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelShape.kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError("ModelShape.sliding_window must be positive or None")

    @property
    def gqa_group(self) -> int:
        """Query heads that share one KV head (1 = MHA, ``heads`` = MQA)."""
        return self.heads // self.kv_heads

    def weight_bytes(self, dtype: str = "bf16") -> float:
        """Bytes of all weights stored in ``dtype`` (``params × element bytes``, no overheads)."""
        return self.params * dtype_bytes(dtype)


def dense_param_count(model: ModelShape) -> int:
    """Parameters of a Llama/Mistral/Qwen2-style dense decoder, computed from its shape.

    Per layer: q and o projections ``hidden × heads·head_dim``, k and v projections
    ``hidden × kv_heads·head_dim`` (plus biases when ``qkv_bias``), a gated MLP of three
    ``hidden × intermediate`` matrices, and two RMSNorm weight vectors. Plus the embedding,
    the LM head unless tied, and the final norm.
    """
    q = model.heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    attn = 2 * model.hidden * q + 2 * model.hidden * kv
    if model.qkv_bias:
        attn += q + 2 * kv
    mlp = 3 * model.hidden * model.intermediate
    per_layer = attn + mlp + 2 * model.hidden
    embed = model.vocab * model.hidden
    head = 0 if model.tie_word_embeddings else embed
    return model.layers * per_layer + embed + head + model.hidden


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator as its datasheet describes it.

    Attributes:
        name: product name.
        memory_bytes: the datasheet label's number read as decimal GB (a lower bound on
            the physical HBM, which is binary: "80GB" is 80 GiB).
        memory_label: how the datasheet writes it (e.g. ``"80GB HBM3"``).
        bf16_tflops: peak dense BF16 tensor-core throughput, in 10**12 FLOP/s.
        hbm_bandwidth: peak HBM bandwidth in bytes per second.
        source: URL of the datasheet.
        cuda_total_bytes: the total memory CUDA reports (``cudaMemGetInfo``, i.e.
            ``torch.cuda.mem_get_info()[1]``), which is what vLLM multiplies by
            ``gpu_memory_utilization``; ``None`` where the catalogue has no observed value.
    """

    name: str
    memory_bytes: int
    memory_label: str
    bf16_tflops: float
    hbm_bandwidth: float
    source: str
    cuda_total_bytes: int | None = None

    @property
    def memory_gib(self) -> float:
        """Memory in binary gibibytes (2**30 bytes)."""
        return self.memory_bytes / GiB

    @property
    def engine_memory_bytes(self) -> int:
        """The total an engine sizes its cache from: CUDA's reported total when recorded,
        else the datasheet figure."""
        return self.memory_bytes if self.cuda_total_bytes is None else self.cuda_total_bytes

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the BF16 roofline turns from bandwidth- to compute-bound."""
        return self.bf16_tflops * TB / self.hbm_bandwidth


_HF = "https://huggingface.co/{}/blob/main/config.json"

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("Llama-3-8B", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                   intermediate=14336, vocab=128256, params=8_030_261_248,
                   max_position_embeddings=8192,
                   source=_HF.format("meta-llama/Meta-Llama-3-8B")),
        ModelShape("Llama-3-70B", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                   intermediate=28672, vocab=128256, params=70_553_706_496,
                   max_position_embeddings=8192,
                   source=_HF.format("meta-llama/Meta-Llama-3-70B")),
        ModelShape("Llama-3.1-405B", layers=126, hidden=16384, heads=128, kv_heads=8,
                   head_dim=128, intermediate=53248, vocab=128256, params=405_853_388_800,
                   max_position_embeddings=131072,
                   source=_HF.format("meta-llama/Llama-3.1-405B")),
        ModelShape("Qwen2.5-7B", layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128,
                   intermediate=18944, vocab=152064, params=7_615_616_512,
                   max_position_embeddings=131072, qkv_bias=True,
                   source=_HF.format("Qwen/Qwen2.5-7B")),
        ModelShape("Mistral-7B-v0.1", layers=32, hidden=4096, heads=32, kv_heads=8,
                   head_dim=128, intermediate=14336, vocab=32000, params=7_241_732_096,
                   max_position_embeddings=32768, sliding_window=4096,
                   source=_HF.format("mistralai/Mistral-7B-v0.1")),
    )
}

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("A100-80GB SXM", memory_bytes=80 * GB, memory_label="80GB HBM2e",
                bf16_tflops=312.0, hbm_bandwidth=2039 * GB,
                source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/"
                       "pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
        GPUSpec("H100-80GB SXM", memory_bytes=80 * GB, memory_label="80GB HBM3",
                bf16_tflops=989.5, hbm_bandwidth=3350 * GB,
                source="https://www.nvidia.com/en-us/data-center/h100/",
                # vLLM v1 logs "total_gpu_memory (79.11GiB)" on an H100 80GB HBM3: CUDA's
                # total, below nvidia-smi's 81,559 MiB (79.65 GiB) and above the 74.5 GiB
                # of the decimal 80 GB.
                cuda_total_bytes=round(79.11 * GiB)),
        GPUSpec("H200-141GB SXM", memory_bytes=141 * GB, memory_label="141GB HBM3e",
                bf16_tflops=989.5, hbm_bandwidth=4800 * GB,
                source="https://www.nvidia.com/en-us/data-center/h200/",
                # CUDA's total on an H200: "GPU 0 has a total capacity of 139.81 GiB" in
                # PyTorch's out-of-memory message; TensorRT-LLM logs "device total memory
                # 139.81 GiB".
                cuda_total_bytes=round(139.81 * GiB)),
    )
}


def get_model(name: str) -> ModelShape:
    """The catalogue entry ``name``; KeyError lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None


def get_gpu(name: str) -> GPUSpec:
    """The catalogue entry ``name``; KeyError lists the known names."""
    try:
        return GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; known: {sorted(GPUS)}") from None
