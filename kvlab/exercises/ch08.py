"""Chapter 8 exercises: the error bound, a group size under a budget, a KV capacity gain, and
an open-ended format design.

Each check computes the truth with :mod:`kvlab` and raises ``AssertionError`` saying what is
wrong (too high, too low, which budget breaks) without printing the expected value.
"""

from __future__ import annotations

import math

from kvlab.core.kv_dtype import kv_bytes_per_token
from kvlab.reference import effective_bits

from ._common import require_answer

#: Exercise 1: one group of 4-bit symmetric weights whose largest magnitude is this.
BOUND_BITS, BOUND_ABSMAX = 4, 0.42

#: Exercise 2: group sizes to choose from, and the error budget (relative RMS error).
GROUP_CHOICES = (8, 16, 32, 64, 128, 256)
ERROR_BUDGET = 0.10

#: Exercise 3: kvlab-tiny's KV shape and the memory budget.
CAPACITY_SHAPE = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32}
CAPACITY_MEMORY = 8 * 2**20
CAPACITY_BLOCK = 16

#: Exercise 4: the bits budget of the open-ended design.
DESIGN_BITS_BUDGET = 4.3


def _close(a: float, b: float, rel: float = 1e-3) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def check_error_bound(answer) -> str:
    """``answer``: the largest possible ``|x - deq(q(x))|`` in a group of
    :data:`BOUND_BITS`-bit symmetric weights whose largest magnitude is :data:`BOUND_ABSMAX`
    (ignore the rounding of the scale to fp16)."""
    require_answer(answer, "the worst-case error (a number)")
    truth = BOUND_ABSMAX / (2 ** (BOUND_BITS - 1) - 1) / 2
    got = float(answer)
    if _close(got, truth):
        return "Correct: half a grid step, s/2."
    if _close(got, BOUND_ABSMAX / (2 ** BOUND_BITS - 1) / 2) or _close(got, truth * 7 / 8):
        raise AssertionError("the symmetric grid has 2^(b-1) - 1 steps on each side of zero, "
                             "not 2^b - 1 steps across")
    if _close(got, 2 * truth):
        raise AssertionError("that is a whole grid step s; rounding to the nearest level "
                             "is off by at most half of it")
    raise AssertionError(f"too {'high' if got > truth else 'low'}: derive s from the group's "
                         "largest magnitude, then bound the rounding error")


def outlier_weights(seed: int = 0):
    """The matrix of exercises 2 and 4: 64 x 512 N(0, 0.02) weights, 8 outlier input columns
    scaled by 30 (the pattern LLM.int8() found in activations and AWQ in salient channels)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 512, generator=g) * 0.02
    cols = torch.randperm(512, generator=g)[:8]
    w[:, cols] *= 30
    return w


def relative_error(w, bits: int, group_size: int, symmetric: bool = True) -> float:
    """Relative RMS error ``||W - deq(q(W))|| / ||W||`` of a format on ``w``."""
    from kvlab.engine.quantization import QuantConfig, dequantize, quantize

    cfg = QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric)
    err = w - dequantize(quantize(w, cfg))
    return float(err.norm() / w.norm())


def check_group_size(answer) -> str:
    """``answer``: the group size from :data:`GROUP_CHOICES` with the *fewest effective bits*
    for which int4 symmetric quantization of :func:`outlier_weights` stays within
    :data:`ERROR_BUDGET` relative RMS error."""
    require_answer(answer, "a group size")
    g = int(answer)
    if g not in GROUP_CHOICES:
        raise AssertionError(f"choose one of {GROUP_CHOICES}")
    w = outlier_weights()
    err = relative_error(w, 4, g)
    if err > ERROR_BUDGET:
        raise AssertionError(f"group {g} misses the budget: relative error {err:.4f} > "
                             f"{ERROR_BUDGET}; smaller groups isolate the outliers")
    larger = [h for h in GROUP_CHOICES if h > g and relative_error(w, 4, h) <= ERROR_BUDGET]
    if larger:
        raise AssertionError(f"group {g} meets the budget (error {err:.4f}), but a larger group "
                             "does too, with fewer effective bits")
    return f"Correct: group {g}, {effective_bits(4, g):.4g} effective bits, error {err:.4f}."


def check_capacity_gain(blocks_auto, blocks_int8) -> str:
    """``blocks_auto``, ``blocks_int8``: KV blocks of :data:`CAPACITY_BLOCK` tokens that
    :data:`CAPACITY_MEMORY` bytes hold for kvlab-tiny (:data:`CAPACITY_SHAPE`) with float32 KV
    and with int8 KV (one fp16 scale per token and KV head)."""
    require_answer(blocks_auto, "blocks with float32 KV")
    require_answer(blocks_int8, "blocks with int8 KV")
    want_auto = CAPACITY_MEMORY // (kv_bytes_per_token(**CAPACITY_SHAPE, model_dtype_bytes=4)
                                    * CAPACITY_BLOCK)
    want_int8 = CAPACITY_MEMORY // (kv_bytes_per_token(**CAPACITY_SHAPE, kv_cache_dtype="int8")
                                    * CAPACITY_BLOCK)
    problems = []
    for label, got, want in (("float32", blocks_auto, want_auto), ("int8", blocks_int8,
                                                                    want_int8)):
        if int(got) != want:
            problems.append(f"{label}: {int(got)} is too {'high' if int(got) > want else 'low'}")
    if int(blocks_int8) == CAPACITY_MEMORY // (2 * 4 * 2 * 32 * CAPACITY_BLOCK):
        problems.append("int8: the scales take bytes too (2 per token, KV head, K and V)")
    if problems:
        raise AssertionError("; ".join(problems) + " (K and V, every layer and KV head; "
                             "whole blocks only)")
    return (f"Correct: {want_auto} vs {want_int8} blocks, a gain of "
            f"{want_int8 / want_auto:.2f}x, not 4x.")


def check_format_design(bits, group_size, symmetric=True) -> str:
    """Open-ended: a format (``bits``, ``group_size``, ``symmetric``) for
    :func:`outlier_weights` within :data:`DESIGN_BITS_BUDGET` effective bits (fp16 scales,
    uint8 zero points) whose relative error beats int4 symmetric with group 64."""
    require_answer(bits, "bits")
    require_answer(group_size, "group_size")
    bits, group_size = int(bits), int(group_size)
    zero = 0 if symmetric else 8
    eff = effective_bits(bits, group_size, 16, zero)
    if eff > DESIGN_BITS_BUDGET:
        raise AssertionError(f"{eff:.4g} effective bits exceeds the budget of "
                             f"{DESIGN_BITS_BUDGET}")
    w = outlier_weights()
    try:
        err = relative_error(w, bits, group_size, bool(symmetric))
    except ValueError as e:
        raise AssertionError(f"not a valid format for a 64 x 512 matrix: {e}") from None
    base = relative_error(w, 4, 64)
    if err >= base:
        raise AssertionError(f"relative error {err:.4f} does not beat int4 g=64 symmetric "
                             f"({base:.4f}): spend the bits where the outliers are")
    return (f"Meets the brief: {eff:.4g} bits, relative error {err:.4f} vs {base:.4f} for "
            "int4 g=64.")
