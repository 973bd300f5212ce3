"""Chapter 8 exercises: two error bounds, a prediction derived from the sweep (then compared
with the engines), a colleague's round trip, an open-ended format design, and the report fact
behind a slowdown.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it with :mod:`kvlab`, the greedy shares by running both engines);
the debug and design checks run the reader's code or format. Each raises ``AssertionError``
naming what is wrong and the idea to revisit (which budget breaks, why a chosen option fails),
never the direction of a number's error, the expected value, the right option or the method.
"""

from __future__ import annotations

import math

from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed
from kvlab.reference import effective_bits

#: Exercise 1: one group of 4-bit weights spanning [ZP_MIN, ZP_MAX] (largest magnitude ZP_MAX).
BOUND_BITS, ZP_MIN, ZP_MAX = 4, -0.12, 0.42

#: Exercise 2: int4 g64 weights against fp32, greedy. The chapter's sweep ran
#: ``sample_prompts(1, 32)`` for 32 tokens; the prediction is for ``sample_prompts(1,
#: GREEDY_PROMPTS)`` (the sweep's prompts are their first half) over ``GREEDY_TOKENS`` tokens.
GREEDY_PROMPTS, GREEDY_TOKENS, SWEEP_TOKENS = 64, 64, 32
#: The per-token chance passes within this relative tolerance (the approximation
#: ``-ln(share) / tokens`` of the exact chance is within 1 % of it here); the prediction must
#: follow from the reader's own chance to within ``GREEDY_CONSISTENCY`` points.
GREEDY_CHANCE_RTOL, GREEDY_CONSISTENCY = 0.02, 1.0

#: Exercise 4: the bits budget of the open-ended design, and the relative error its ordinary
#: columns must reach (int4 g=64 symmetric leaves about 0.73; no group format within the
#: budget gets below about 0.48 on this matrix).
DESIGN_BITS_BUDGET = 4.3
DESIGN_BULK_TARGET = 0.30

#: Exercise 5: the five facts of the report.
REPORT_FACTS = ("checkpoint_bits", "runtime_weight_format", "activation_dtype",
                "accumulator_dtype", "kernels_executed")


def check_error_bounds(symmetric_error, zero_point_error) -> str:
    """Exercise 1: the largest possible ``|x - deq(q(x))|`` in a group of :data:`BOUND_BITS`-bit
    weights spanning ``[ZP_MIN, ZP_MAX]``, quantized symmetrically and with a zero point
    (ignore the rounding of the scale to fp16)."""
    require_answer(symmetric_error, "the symmetric worst-case error (a number)")
    require_answer(zero_point_error, "the zero-point worst-case error (a number)")
    for label, value in (("symmetric", symmetric_error), ("zero-point", zero_point_error)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise AssertionError(f"give the {label} error as a number, got {value!r}")
    revisit = {"symmetric": "revisit what sets a symmetric group's scale (which of its values, "
                            "and how many codes lie above zero)",
               "zero_point": "revisit what sets the scale once a zero point shifts the codes "
                             "(which span of values, and how many codes cover it)"}
    problems = []
    for label, key, got in (("symmetric", "symmetric", float(symmetric_error)),
                            ("zero-point", "zero_point", float(zero_point_error))):
        truth = sealed(f"ch08.error_bounds.{key}").value()
        if abs(got - truth) > 1e-3 * abs(truth) + 1e-12:     # the idea, never the direction
            problems.append(f"{label}: not the worst case; {revisit[key]}")
    if problems:
        raise AssertionError("; ".join(problems))
    return ("Correct: both are half a grid step; the zero point buys a finer grid when the "
            "group is lopsided.")


def outlier_weights(seed: int = 0):
    """A 64 x 512 matrix of N(0, 0.02) weights whose 8 input columns
    :func:`outlier_columns` are scaled by 30 (the pattern LLM.int8() found in activations and
    AWQ in the weight channels that meet large activations)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 512, generator=g) * 0.02
    cols = torch.randperm(512, generator=g)[:8]
    w[:, cols] *= 30
    return w


def outlier_columns(seed: int = 0) -> list[int]:
    """The 8 outlier columns of :func:`outlier_weights` (same seed), ascending."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.randn(64, 512, generator=g)
    return sorted(int(c) for c in torch.randperm(512, generator=g)[:8])


def relative_error(w, bits: int, group_size: int, symmetric: bool = True,
                   columns=None) -> float:
    """Relative RMS error ``||W - deq(q(W))|| / ||W||`` of a format on ``w``, over all of it
    or only over the input ``columns`` given (a list of indices)."""
    from kvlab.engine.quantization import QuantConfig, dequantize, quantize

    cfg = QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric)
    err = w - dequantize(quantize(w, cfg))
    if columns is not None:
        err, w = err[:, list(columns)], w[:, list(columns)]
    return float(err.norm() / w.norm())


def bulk_columns(seed: int = 0) -> list[int]:
    """The 504 ordinary columns of :func:`outlier_weights`."""
    out = set(outlier_columns(seed))
    return [c for c in range(512) if c not in out]


def check_greedy_prediction(leave_chance, prediction) -> str:
    """Exercise 2, two linked answers. ``leave_chance``: the chance per token that an int4 g64
    continuation leaves fp32's greedy path, if that chance is the same at every token, as the
    chapter's sweep (:data:`SWEEP_TOKENS` tokens) implies; ``prediction``: the share in
    percent of :data:`GREEDY_PROMPTS` continuations of :data:`GREEDY_TOKENS` tokens that then
    stay identical. The chance must be the sweep's (within :data:`GREEDY_CHANCE_RTOL`) and the
    prediction must follow from it; then the check shows what the engines measured (sealed: the
    instructor edition runs both). The pair is graded together and once: the first wrong pair
    is recorded (:func:`~kvlab.exercises._common.earlier_prediction`), and a later answer is not
    graded."""
    require_answer(leave_chance, "the per-token chance of leaving fp32's path (0 to 1)")
    require_answer(prediction, "a share in percent (0-100)")
    if isinstance(leave_chance, bool) or not isinstance(leave_chance, (int, float)) \
            or not 0 < leave_chance < 1:
        raise AssertionError(f"give the per-token chance as a number between 0 and 1, got "
                             f"{leave_chance!r}")
    if isinstance(prediction, bool) or not isinstance(prediction, (int, float)) \
            or not 0 <= prediction <= 100:
        raise AssertionError(f"give a share in percent between 0 and 100, got {prediction!r}")
    truth = sealed("ch08.greedy_leave_chance").value()
    implied = 100 * (1 - leave_chance) ** GREEDY_TOKENS
    right = abs(leave_chance - truth) <= GREEDY_CHANCE_RTOL * truth \
        and abs(prediction - implied) <= GREEDY_CONSISTENCY
    first = earlier_prediction("ch08.greedy_prediction",
                               [round(float(leave_chance), 6), round(float(prediction), 2)],
                               right)
    if first is not None:
        return graded_once(first)
    if not right:                # one message whichever of the two is wrong
        raise AssertionError("the pair is not right: revisit what a continuation must do at "
                             "each of its tokens to count as identical, which of the sweep's "
                             "numbers counts those, and what staying on fp32's path for every "
                             f"one of {GREEDY_TOKENS} tokens then requires")
    n = round(sealed("ch08.greedy_identical").value())
    n32 = round(sealed("ch08.greedy_identical_first_32").value())
    return (f"Right: your per-token chance predicts {prediction:.0f}%. The engines measure "
            f"{n} of the {GREEDY_PROMPTS} continuations identical over {GREEDY_TOKENS} tokens "
            f"({100 * n / GREEDY_PROMPTS:.0f}%), and {n32} of the {GREEDY_PROMPTS} "
            f"({100 * n32 / GREEDY_PROMPTS:.0f}%) identical over their first {SWEEP_TOKENS} "
            "tokens. Explain the gap in the answer cell.")


def colleague_roundtrip(w, bits: int = 4, group_size: int = 64):
    """A colleague's round trip of a ``[rows, cols]`` weight (exercise 3): symmetric
    quantization per group of ``group_size`` along each row, ``bits``-bit codes (offset
    binary, as stored), then back to floats."""
    import torch

    rows, cols = w.shape
    g = w.reshape(rows, cols // group_size, group_size)
    qmax = 2 ** (bits - 1)
    s = g.abs().amax(-1, keepdim=True) / qmax
    q = torch.round(g / s)
    codes = (q + 2 ** (bits - 1)).to(torch.int64) % 2 ** bits        # what is stored
    return ((codes - 2 ** (bits - 1)) * s).reshape(rows, cols)


def _roundtrip_cases():
    import torch

    gen = torch.Generator().manual_seed(3)
    for bits, group in ((4, 64), (3, 32), (8, 64), (4, 16)):
        w = torch.randn(16, 128, generator=gen) * 0.02
        yield bits, group, w
    w = torch.randn(16, 128, generator=gen) * 0.02
    w[:, 5] = 0.5                                   # a positive outlier in every row
    yield 4, 64, w


def check_fixed_roundtrip(fn) -> str:
    """Exercise 3: ``fn(w, bits, group_size)`` -> the dequantized weight, with
    :func:`colleague_roundtrip`'s contract. It passes when, on five matrices, every element is
    within half a grid step (``s = max|x| / (2^(b-1) - 1)`` per group, up to fp16 rounding of
    ``s``) and every group holds at most ``2^b - 1`` distinct values."""
    import torch

    require_answer(fn, "your round-trip function (w, bits, group_size) -> tensor")
    if not callable(fn):
        raise AssertionError("pass a function (w, bits, group_size) -> tensor")
    for n, (bits, group, w) in enumerate(_roundtrip_cases()):
        got = fn(w.clone(), bits, group)
        if not isinstance(got, torch.Tensor) or got.shape != w.shape:
            raise AssertionError(f"case {n}: return a tensor of shape {tuple(w.shape)}")
        got = got.float()
        gw, gq = (t.reshape(w.shape[0], -1, group) for t in (w, got))
        s = gw.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
        bad = (gw - gq).abs() > s / 2 * (1 + 2e-3) + 1e-9
        if bool(bad.any()):
            r, j, i = (int(v) for v in bad.nonzero()[0])
            raise AssertionError(f"case {n} (int{bits}, g{group}): element ({r}, "
                                 f"{j * group + i}) is off by more than half a grid step")
        levels = max(len(torch.unique(row)) for row in gq.reshape(-1, group))
        if levels > 2 ** bits - 1:
            raise AssertionError(f"case {n}: a group holds {levels} distinct values; "
                                 f"{bits}-bit symmetric codes allow {2 ** bits - 1}")
    return "Fixed: within half a grid step everywhere, and representable in the codes."


def format_error(w, bits: int, group_size: int, symmetric: bool = True, fp16_columns=(),
                 columns=None) -> float:
    """Like :func:`relative_error`, for a format that may store some input columns apart in
    fp16 (``fp16_columns``): those are taken out of the groups (zero in the grouped payload,
    so they set no scale) and read back from their fp16 copy."""
    import torch

    from kvlab.engine.quantization import QuantConfig, dequantize, quantize

    kept = list(fp16_columns)
    grouped = w.clone()
    grouped[:, kept] = 0
    cfg = QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric)
    back = dequantize(quantize(grouped, cfg))
    back[:, kept] = w[:, kept].to(torch.float16).float()
    err = w - back
    if columns is not None:
        err, w = err[:, list(columns)], w[:, list(columns)]
    return float(err.norm() / w.norm())


def design_bits(bits: int, group_size: int, symmetric: bool, num_fp16_columns: int,
                in_features: int = 512) -> float:
    """Effective bits of an exercise-4 format: the grouped payload with its fp16 scales (and
    uint8 zero points) over every column, plus 16 bits per weight of the columns kept in fp16
    (their indices, a few bytes per matrix, aside)."""
    zero = 0 if symmetric else 8
    return effective_bits(bits, group_size, 16, zero) + 16 * num_fp16_columns / in_features


def check_format_design(bits, group_size, symmetric=True, fp16_columns=()) -> str:
    """Exercise 4, open-ended: a format for :func:`outlier_weights` within
    :data:`DESIGN_BITS_BUDGET` effective bits (:func:`design_bits`) that keeps the relative
    error of the *ordinary* columns (:func:`bulk_columns`) at or below
    :data:`DESIGN_BULK_TARGET`. A format is ``bits``, ``group_size``, ``symmetric`` and
    optionally ``fp16_columns``, input columns stored apart in fp16 (:func:`format_error`).
    The outlier columns' error is reported beside it."""
    require_answer(bits, "bits")
    require_answer(group_size, "group_size")
    for name, value in (("bits", bits), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise AssertionError(f"{name} must be a positive whole number, got {value!r}")
    if not isinstance(symmetric, bool):
        raise AssertionError(f"symmetric must be True or False, got {symmetric!r}")
    w = outlier_weights()
    try:
        kept = [int(c) for c in fp16_columns]
    except (TypeError, ValueError):
        raise AssertionError("fp16_columns: give input column indices (ints)") from None
    if len(set(kept)) != len(kept) or any(not 0 <= c < w.shape[1] for c in kept):
        raise AssertionError(f"fp16_columns: distinct column indices in 0..{w.shape[1] - 1}")
    eff = design_bits(bits, group_size, symmetric, len(kept), w.shape[1])
    if eff > DESIGN_BITS_BUDGET:
        raise AssertionError(f"{eff:.4g} effective bits exceeds the budget of "
                             f"{DESIGN_BITS_BUDGET}")
    bulk, outl = bulk_columns(), outlier_columns()
    try:
        err = format_error(w, bits, group_size, symmetric, kept, bulk)
    except ValueError as e:
        raise AssertionError(f"not a valid format for a 64 x 512 matrix: {e}") from None
    out_err = format_error(w, bits, group_size, symmetric, kept, outl)
    if err > DESIGN_BULK_TARGET:
        raise AssertionError(f"the ordinary columns keep a relative error of {err:.3f}, above "
                             f"the target of {DESIGN_BULK_TARGET}; outlier columns "
                             f"{out_err:.3f} ({eff:.4g} bits)")
    return (f"Meets the brief: {eff:.4g} bits, ordinary columns {err:.3f} (int4 g=64 "
            f"symmetric: {relative_error(w, 4, 64, True, bulk):.3f}); outlier columns "
            f"{out_err:.3f}.")


def check_report_fact(answer) -> str:
    """Exercise 5: which field of ``QuantizationReport`` (one of :data:`REPORT_FACTS`) tells
    you why an int4 model with float32 activations decodes many times slower than fp32?"""
    require_answer(answer, "one of " + ", ".join(repr(f) for f in REPORT_FACTS))
    if answer not in REPORT_FACTS:
        raise AssertionError(f"answer one of {REPORT_FACTS}, got {answer!r}")
    truth = sealed("ch08.report_fact")     # each field's verdict is sealed under it
    if not truth.is_answer(answer):
        raise AssertionError(truth.note(answer))
    return truth.note(answer)
