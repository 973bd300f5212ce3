"""Chapter 1 figures: where one GPU's memory goes, and how many requests its KV pool holds.

``capacity_figure(plan)`` is pure (a :class:`~kvlab.labs.capacity.CapacityPlan` in, a new
Figure out); ``capacity_explorer()`` is the ipywidgets wrapper that re-plans on every change.
"""

from __future__ import annotations

import numpy as np

from kvlab.labs.capacity import DTYPE_BYTES, CapacityPlan, GiB, plan_capacity
from kvlab.sim.catalog import GPUS, MODELS, get_gpu, get_model
from kvlab.viz._widgets import figure_widget
from kvlab.viz.style import (
    BLOCK_STATE_COLORS,
    INK,
    MUTED,
    PHASE_COLORS,
    PHONE,
    REQUEST_PALETTE,
    layout,
    phone_aware,
)

#: Colour of each memory use in :func:`capacity_figure` (taken from the book's palette).
MEMORY_COLORS: dict[str, str] = {
    "weights": REQUEST_PALETTE[7],
    "reserve": PHASE_COLORS["prefill"],
    "kv_cache": BLOCK_STATE_COLORS["exclusive"],
    "leftover": BLOCK_STATE_COLORS["cached"],
    "headroom": BLOCK_STATE_COLORS["free"],
}
MEMORY_LABELS: dict[str, str] = {
    "weights": "weights",
    "reserve": "activations/workspace",
    "kv_cache": "KV cache",
    "leftover": "leftover (< 1 block)",
    "headroom": "kept back (1 - utilization)",
}

#: Context lengths on the x axis of the lower panel (tokens).
CONTEXTS = tuple(2**k for k in range(9, 18))     # 512 .. 131072


def max_requests_curve(plan: CapacityPlan, contexts=CONTEXTS) -> np.ndarray:
    """Requests of each context length that the plan's KV pool holds at once (whole blocks)."""
    blocks = -(-np.asarray(contexts, dtype=np.int64) // plan.block_size)
    return plan.num_blocks // blocks


@phone_aware
def capacity_figure(plan: CapacityPlan, contexts=CONTEXTS):
    """Top: one GPU's memory split by use (GiB). Bottom: max concurrent requests vs context.

    Pure: a new Figure with two axes (stacked, memory above, in a phone's layout). The left
    axis holds one horizontal bar segment per non-zero part of
    :meth:`CapacityPlan.breakdown` (labelled for the legend); a plan that does not fit
    shows the weights and reserve overflowing the GPU, marked by a vertical line at the GPU's
    capacity. The right axis plots :func:`max_requests_curve` on a log-2 x axis
    and marks the plan's own ``context_len``.
    """
    import matplotlib.pyplot as plt

    phone = layout().phone
    if phone:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(PHONE.width_in, 6.4),
                                      gridspec_kw={"height_ratios": [0.6, 1.0]})
    else:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.0, 3.6),
                                      gridspec_kw={"width_ratios": [1.5, 1.0]})
    left = 0.0
    for part, value in plan.breakdown().items():
        if value <= 0:
            continue
        width = value / GiB
        ax.barh(0, width, left=left, height=0.55, color=MEMORY_COLORS[part], edgecolor=INK,
                linewidth=0.6, label=f"{MEMORY_LABELS[part]}: {width:.1f} GiB")
        if width > 0.12 * plan.gpu_memory_bytes / GiB:
            ax.text(left + width / 2, 0, f"{width:.1f}", ha="center", va="center",
                    fontsize=9, color="white" if part in ("weights", "kv_cache") else INK)
        left += width
    capacity = plan.gpu_memory_bytes / GiB
    ax.axvline(capacity, color=INK, linewidth=1.0, linestyle="--")
    ax.set_xlim(0, max(left, capacity) * 1.02)
    ax.set_yticks([])
    ax.set_xlabel("GiB per GPU")
    status = (f"{plan.num_blocks:,} blocks = {plan.token_capacity:,} tokens" if plan.fits
              else f"does not fit: short by {-plan.kv_budget_bytes / GiB:.1f} GiB")
    where = f"{plan.model} on {plan.gpu}," + ("\n" if phone else " ")
    ax.set_title(f"{where}TP={plan.tp}, KV {plan.kv_dtype}\n{status}", loc="left", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 if phone else -0.28),
              ncol=1 if phone else 2, fontsize=8)

    counts = max_requests_curve(plan, contexts)
    positive = counts > 0
    ax2.plot(np.asarray(contexts)[positive], counts[positive], marker="o",
             color=MEMORY_COLORS["kv_cache"], label="max requests")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlim(min(contexts) / 1.3, max(contexts) * 1.3)
    ax2.set_ylim(0.7, max(2.0, float(counts.max()) * 1.5))
    ax2.set_xticks([2**k for k in (9, 11, 13, 15, 17)],
                   ["512", "2k", "8k", "32k", "128k"])
    ax2.axvline(plan.context_len, color=MUTED, linestyle=":")
    ax2.annotate(f"{plan.max_requests:,} at {plan.context_len:,}",
                 xy=(plan.context_len, max(plan.max_requests, 0.8)), xytext=(6, 8),
                 textcoords="offset points", fontsize=9)
    ax2.set_xlabel("context length (tokens)")
    ax2.set_ylabel("concurrent requests")
    ax2.set_title("requests that fit at once", loc="left", fontsize=10)
    fig.tight_layout(pad=0.4, h_pad=0.6)
    return fig


def capacity_explorer(model: str = "Llama-3-8B", gpu: str = "H100-80GB SXM"):
    """Sliders for model, GPU, KV dtype, context, TP, utilisation and reserve -> live figure.

    A thin ipywidgets wrapper: every change calls :func:`plan_capacity` and redraws
    :func:`capacity_figure`, printing :meth:`CapacityPlan.summary` beneath it.
    """
    import ipywidgets as w

    controls = {
        "model": w.Dropdown(options=sorted(MODELS), value=model, description="model"),
        "gpu": w.Dropdown(options=sorted(GPUS), value=gpu, description="GPU"),
        "kv_dtype": w.Dropdown(options=[d for d in DTYPE_BYTES if d != "fp32"], value="bf16",
                               description="KV dtype"),
        "context_len": w.SelectionSlider(options=list(CONTEXTS), value=8192,
                                         description="context"),
        "tp": w.SelectionSlider(options=[1, 2, 4, 8, 16], value=1, description="TP"),
        "gpu_memory_utilization": w.FloatSlider(value=0.9, min=0.5, max=1.0, step=0.01,
                                                description="utilization"),
        "reserve_gib": w.FloatSlider(value=4.0, min=0.0, max=16.0, step=0.5,
                                     description="reserve GiB"),
    }

    def plan(model, gpu, kv_dtype, context_len, tp, gpu_memory_utilization,
             reserve_gib) -> CapacityPlan:
        return plan_capacity(
            get_model(model), get_gpu(gpu), kv_dtype=kv_dtype, context_len=context_len, tp=tp,
            gpu_memory_utilization=gpu_memory_utilization, reserve_bytes=reserve_gib * GiB,
        )

    row = list(controls.values())
    return figure_widget(controls, lambda **v: capacity_figure(plan(**v)),
                         caption=lambda **v: plan(**v).summary(),
                         header=[w.HBox(row[:4]), w.HBox(row[4:])],
                         what="capacity explorer (model, GPU, KV dtype, context, TP, reserve)",
                         kernel_free=lambda: capacity_kernel_free(model, gpu))


#: The kernel-free explorer's grid: 2 models x 2 GPUs x 2 KV dtypes x 4 TP degrees = 32 frames.
KERNEL_FREE_GRID = {
    "model": ("Llama-3-8B", "Llama-3-70B"),
    "gpu": ("H100-80GB SXM", "H200-141GB SXM"),
    "kv_dtype": ("bf16", "fp8"),
    "tp": (1, 2, 4, 8),
}


def capacity_kernel_free(model: str = "Llama-3-8B", gpu: str = "H100-80GB SXM", *,
                         context_len: int = 8192, gpu_memory_utilization: float = 0.9,
                         reserve_gib: float = 4.0):
    """The explorer without a kernel: :data:`KERNEL_FREE_GRID` precomputed (the other controls
    fixed at the explorer's defaults), each frame with its plan summary beneath."""
    from kvlab.viz.kernel_free import dropdown, slider, static_widget

    def plan(model, gpu, kv_dtype, tp) -> CapacityPlan:
        return plan_capacity(get_model(model), get_gpu(gpu), kv_dtype=kv_dtype,
                             context_len=context_len, tp=tp,
                             gpu_memory_utilization=gpu_memory_utilization,
                             reserve_bytes=reserve_gib * GiB)

    grid = KERNEL_FREE_GRID
    return static_widget(
        lambda **v: capacity_figure(plan(**v)),
        {"model": dropdown(grid["model"]), "gpu": dropdown(grid["gpu"], label="GPU"),
         "kv_dtype": dropdown(grid["kv_dtype"], label="KV dtype"),
         "tp": slider(grid["tp"], label="TP")},
        default={"model": model, "gpu": gpu, "kv_dtype": "bf16", "tp": 1},
        caption=lambda **v: plan(**v).summary(),
        title=f"capacity explorer ({context_len:,}-token context, utilization "
              f"{gpu_memory_utilization}, {reserve_gib:g} GiB reserve)",
    )
