"""Capacity planner and catalogue: exact values, TP rules, the memory identity, bad input."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from kvlab.labs.capacity import (
    DTYPE_BYTES,
    CapacityPlan,
    kv_element_bytes,
    kv_heads_per_rank,
    plan_capacity,
)
from kvlab.reference import kv_bytes
from kvlab.sim.catalog import (
    GB,
    GPUS,
    MODELS,
    GiB,
    ModelShape,
    dense_param_count,
    get_gpu,
    get_model,
)

LLAMA8 = get_model("Llama-3-8B")
LLAMA70 = get_model("Llama-3-70B")
H100 = get_gpu("H100-80GB SXM")


def test_kv_bytes_llama3_8b_one_sequence_8k_is_one_gib():
    # 2 (K,V) x 32 layers x 8192 tokens x 8 KV heads x 128 dims x 2 bytes
    assert kv_bytes(32, 1, 8192, 8, 128, 2) == 2 * 32 * 8192 * 8 * 128 * 2 == 1_073_741_824 == GiB


@pytest.mark.parametrize(("name", "per_token"), [
    ("Llama-3-8B", 131_072),        # 128 KiB
    ("Llama-3-70B", 327_680),       # 320 KiB
    ("Llama-3.1-405B", 516_096),    # 504 KiB
    ("Qwen2.5-7B", 57_344),         # 56 KiB
    ("Mistral-7B-v0.1", 131_072),
])
def test_per_token_bytes_bf16(name, per_token):
    m = get_model(name)
    assert kv_bytes(m.layers, 1, 1, m.kv_heads, m.head_dim, 2) == per_token
    plan = plan_capacity(m, 10**15, context_len=1)
    assert plan.kv_bytes_per_token == per_token


@pytest.mark.parametrize("name", sorted(MODELS))
def test_catalogue_shape_reproduces_published_params(name):
    m = MODELS[name]
    assert dense_param_count(m) == m.params
    assert m.head_dim * m.heads == m.hidden
    assert m.source.startswith("https://huggingface.co/")


def test_catalogue_known_values():
    assert (LLAMA8.layers, LLAMA8.heads, LLAMA8.kv_heads, LLAMA8.head_dim, LLAMA8.hidden) == (
        32, 32, 8, 128, 4096)
    assert (LLAMA70.layers, LLAMA70.heads, LLAMA70.kv_heads, LLAMA70.hidden) == (80, 64, 8, 8192)
    qwen = get_model("Qwen2.5-7B")
    assert (qwen.layers, qwen.heads, qwen.kv_heads, qwen.hidden, qwen.gqa_group) == (
        28, 28, 4, 3584, 7)
    assert get_model("Mistral-7B-v0.1").sliding_window == 4096
    assert LLAMA8.weight_bytes("bf16") == 2 * 8_030_261_248


def test_gpu_catalogue_units():
    assert H100.memory_bytes == 80 * GB
    assert math.isclose(H100.memory_gib, 74.505805969, rel_tol=1e-9)
    assert get_gpu("H200-141GB SXM").memory_bytes == 141 * GB
    assert get_gpu("A100-80GB SXM").bf16_tflops == 312.0
    for g in GPUS.values():
        assert g.source.startswith("https://www.nvidia.com/")
        assert 100 < g.ridge_flops_per_byte < 400


def test_unknown_catalogue_names():
    with pytest.raises(KeyError, match="Llama-3-8B"):
        get_model("llama")
    with pytest.raises(KeyError, match="H100"):
        get_gpu("V100")


def test_model_shape_validation_names_field():
    fields = {f.name: getattr(LLAMA8, f.name) for f in dataclasses.fields(LLAMA8)}
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape(**{**fields, "kv_heads": 0})
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape(**{**fields, "kv_heads": 5})      # 32 % 5 != 0
    with pytest.raises(ValueError, match="layers"):
        ModelShape(**{**fields, "layers": 2.0})


def test_element_bytes_with_scale_overhead():
    assert DTYPE_BYTES["int4"] == 0.5 and DTYPE_BYTES["fp8"] == 1.0
    assert kv_element_bytes("int4", scale_group=32) == 0.5 + 2 / 32
    assert kv_element_bytes("int8", scale_group=64, scale_bytes=4) == 1 + 4 / 64
    assert kv_element_bytes("bf16") == 2
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_element_bytes("fp6")
    with pytest.raises(ValueError, match="scale_group"):
        kv_element_bytes("int4", scale_group=0)


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1), (64, 1)])
def test_kv_heads_per_rank_sharded_and_replicated(tp, heads):
    assert kv_heads_per_rank(8, tp) == heads
    assert kv_heads_per_rank(8, tp, sharded=False) == 8


def test_kv_heads_per_rank_uneven_rounds_up():
    assert kv_heads_per_rank(4, 3) == 2
    with pytest.raises(ValueError, match="tp"):
        kv_heads_per_rank(8, 0)


def test_tp_divides_kv_only_while_sharded():
    base = plan_capacity(LLAMA70, H100, tp=1)
    for tp in (2, 4, 8):
        plan = plan_capacity(LLAMA70, H100, tp=tp)
        assert plan.kv_bytes_per_token * tp == base.kv_bytes_per_token
        assert plan.weight_bytes * tp == base.weight_bytes
    tp8 = plan_capacity(LLAMA70, H100, tp=8)
    tp16 = plan_capacity(LLAMA70, H100, tp=16)
    assert tp16.kv_heads_per_rank == tp8.kv_heads_per_rank == 1
    assert tp16.kv_bytes_per_token == tp8.kv_bytes_per_token   # replicated: no further saving
    assert tp16.weight_bytes * 2 == tp8.weight_bytes            # weights still split
    rep = plan_capacity(LLAMA70, H100, tp=8, kv_sharded=False)
    assert rep.kv_bytes_per_token == base.kv_bytes_per_token


def test_llama3_8b_h100_worked_example():
    # datasheet: 80e9 x 0.9 - 16,060,522,496 (bf16 weights) - 4 GiB reserve = 51,644,510,208 B
    plan = plan_capacity(LLAMA8, H100, context_len=32768, reserve_bytes=4 * GiB,
                         total_memory="datasheet")
    assert plan.kv_budget_bytes == 72e9 - 16_060_522_496 - 4 * GiB
    assert plan.block_bytes == 2 * 2**20                  # 16 tokens x 128 KiB
    assert plan.num_blocks == 51_644_510_208 // 2_097_152 == 24_626
    assert plan.token_capacity == 24_626 * 16
    assert plan.blocks_per_request == 2048
    assert plan.max_requests == 12
    fp8 = plan_capacity(LLAMA8, H100, context_len=32768, reserve_bytes=4 * GiB, kv_dtype="fp8",
                        total_memory="datasheet")
    assert fp8.num_blocks == 51_644_510_208 // 1_048_576
    assert fp8.max_requests == 24


def test_llama3_8b_h100_as_vllm_sizes_it():
    # vLLM multiplies CUDA's reported total (79.11 GiB on an H100 80GB) by the utilisation
    assert H100.cuda_total_bytes == round(79.11 * GiB) == H100.engine_memory_bytes
    plan = plan_capacity(LLAMA8, H100, context_len=32768, reserve_bytes=4 * GiB)
    assert plan.gpu_memory_bytes == H100.cuda_total_bytes
    budget = 0.9 * round(79.11 * GiB) - 16_060_522_496 - 4 * GiB
    assert plan.num_blocks == int(budget // 2_097_152)
    assert plan.max_requests == 13
    fp8 = plan_capacity(LLAMA8, H100, context_len=32768, reserve_bytes=4 * GiB, kv_dtype="fp8")
    assert fp8.max_requests == 26
    # the H200's CUDA total (139.81 GiB) is recorded too; a GPU without one falls back to
    # its label read as decimal GB
    h200 = get_gpu("H200-141GB SXM")
    assert h200.cuda_total_bytes == round(139.81 * GiB) == h200.engine_memory_bytes
    assert plan_capacity(LLAMA8, h200, context_len=32768,
                         reserve_bytes=4 * GiB).max_requests == 26
    assert plan_capacity(LLAMA8, h200, context_len=32768, reserve_bytes=4 * GiB,
                         kv_dtype="fp8").max_requests == 53
    a100 = get_gpu("A100-80GB SXM")
    assert a100.cuda_total_bytes is None and a100.engine_memory_bytes == 80 * GB
    with pytest.raises(ValueError, match="total_memory"):
        plan_capacity(LLAMA8, H100, total_memory="nvidia-smi")


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_memory_identity(name, tp):
    plan = plan_capacity(MODELS[name], get_gpu("H200-141GB SXM"), tp=tp, reserve_bytes=3 * GiB)
    total = (plan.weight_bytes + plan.reserve_bytes + plan.kv_cache_bytes + plan.leftover_bytes
             + plan.headroom_bytes)
    assert math.isclose(total, plan.gpu_memory_bytes, rel_tol=1e-12)
    if plan.fits:
        assert 0 <= plan.leftover_bytes < plan.block_bytes
        assert math.isclose(sum(plan.breakdown().values()), plan.gpu_memory_bytes,
                            rel_tol=1e-12)
        assert plan.max_requests * plan.blocks_per_request <= plan.num_blocks
        assert (plan.max_requests + 1) * plan.blocks_per_request > plan.num_blocks


def test_does_not_fit_is_reported_not_raised():
    plan = plan_capacity(LLAMA70, H100)          # 141 GB of bf16 weights on one 80 GB GPU
    assert not plan.fits and plan.num_blocks == 0 and plan.max_requests == 0
    assert plan.leftover_bytes < 0
    assert "does not fit" in plan.summary()


def test_summary_is_readable():
    text = plan_capacity(LLAMA8, H100, context_len=32768, reserve_bytes=4 * GiB,
                         total_memory="datasheet").summary()
    assert "Llama-3-8B on H100-80GB SXM" in text
    assert "24,626 blocks" in text and "max concurrent requests at 32,768 tokens: 12" in text


def test_plan_is_frozen():
    plan = plan_capacity(LLAMA8, H100)
    assert isinstance(plan, CapacityPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_blocks = 1


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"tp": 0}, "tp"),
    ({"tp": 1.5}, "tp"),
    ({"block_size": 0}, "block_size"),
    ({"context_len": -1}, "context_len"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
    ({"reserve_bytes": -1}, "reserve_bytes"),
    ({"reserve_bytes": float("nan")}, "reserve_bytes"),
    ({"weight_bytes": -5}, "weight_bytes"),
    ({"kv_dtype": "fp4"}, "kv_dtype"),
    ({"weight_dtype": "q2"}, "dtype"),
    ({"scale_group": -3}, "scale_group"),
])
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        plan_capacity(LLAMA8, H100, **kwargs)


def test_bad_gpu_and_model():
    with pytest.raises(ValueError, match="gpu memory"):
        plan_capacity(LLAMA8, 0)
    with pytest.raises(ValueError, match="model"):
        plan_capacity("Llama-3-8B", H100)


def test_explicit_weight_bytes_and_raw_memory():
    plan = plan_capacity(LLAMA8, 100 * GiB, weight_bytes=10 * GiB, gpu_memory_utilization=1.0,
                         block_size=1, context_len=1)
    assert plan.gpu == "GPU"
    assert plan.num_blocks == (90 * GiB) // plan.kv_bytes_per_token


def test_core_does_not_import_torch():
    code = ("import sys, kvlab.labs.capacity, kvlab.sim.catalog, kvlab.labs.paging, "
            "kvlab.labs.fragmentation; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- figures (headless) --------------------------------------------------------------------


def _figure_module():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab.viz import capacity

    return capacity


def test_capacity_figure_segments_and_curve():
    viz = _figure_module()
    import matplotlib.pyplot as plt

    plan = plan_capacity(LLAMA8, H100, context_len=32768, reserve_bytes=4 * GiB,
                         total_memory="datasheet")
    fig = viz.capacity_figure(plan)
    ax, ax2 = fig.axes
    parts = {k: v for k, v in plan.breakdown().items() if v > 0}
    assert len(ax.patches) == len(parts)              # one bar segment per non-zero part
    widths = [p.get_width() for p in ax.patches]
    assert math.isclose(sum(widths), plan.gpu_memory_bytes / GiB, rel_tol=1e-9)
    labels = ax.get_legend_handles_labels()[1]
    assert any(lab.startswith("KV cache: 48.1 GiB") for lab in labels)
    assert "24,626 blocks" in ax.get_title(loc="left")
    x, y = ax2.lines[0].get_data()
    assert dict(zip(x.tolist(), y.tolist(), strict=True))[32768] == plan.max_requests == 12
    plt.close(fig)


def test_capacity_figure_when_weights_do_not_fit():
    viz = _figure_module()
    import matplotlib.pyplot as plt

    fig = viz.capacity_figure(plan_capacity(LLAMA70, H100))
    ax = fig.axes[0]
    assert "does not fit" in ax.get_title(loc="left")
    assert [lab.split(":")[0] for lab in ax.get_legend_handles_labels()[1]] == [
        "weights", "kept back (1 - utilization)"]
    assert fig.axes[1].lines[0].get_xdata().size == 0  # no context length fits
    plt.close(fig)


def test_capacity_explorer_replans_on_change(capsys):
    """Headless, the widget's output area prints to stdout: one figure + plan summary per draw."""
    viz = _figure_module()
    box = viz.capacity_explorer()
    assert len(box.children) == 3
    model, tp = box.children[0].children[0], box.children[1].children[0]
    capsys.readouterr()
    model.value = "Llama-3-70B"                      # does not fit one H100: a re-plan
    tp.value = 8                                     # ... and another, sharded 8 ways
    captions = capsys.readouterr().out.split("Figure(")[1:]
    assert len(captions) == 2
    assert "TP=1" in captions[0] and "does not fit" in captions[0]
    plan = plan_capacity(LLAMA70, H100, context_len=8192, tp=8, gpu_memory_utilization=0.9,
                         reserve_bytes=4 * GiB)      # the explorer's default reserve
    assert plan.kv_heads_per_rank == 1               # 8 KV heads over 8 ranks
    budget = 0.9 * H100.cuda_total_bytes - 70_553_706_496 * 2 / 8 - 4 * GiB
    assert plan.num_blocks == int(budget // (16 * 40 * 1024))
    shown = captions[1]
    assert "Llama-3-70B on H100-80GB SXM (TP=8)" in shown
    assert "(1 KV heads/rank)" in shown and f"{plan.num_blocks:,} blocks" in shown
    assert shown.rstrip().endswith(plan.summary().rstrip())


# --- exercises -----------------------------------------------------------------------------


#: What no ch01 check may say: the direction of an error.
DIRECTION_WORDS = ("too high", "too low", "too many", "too few", "closer", "higher", "lower")


def _verdict(check, *args) -> str:
    with pytest.raises(AssertionError) as err:
        check(*args)
    message = str(err.value)
    assert not any(word in message.lower() for word in DIRECTION_WORDS), message
    return message


def _per_rank(layers, kv_heads, head_dim, element_bytes, tp):
    heads = max(1, -(-kv_heads // tp))
    return heads, kv_bytes(layers, 1, 1, heads, head_dim, element_bytes)


def test_chapter1_exercise_checks():
    from kvlab.exercises._common import NotYetAnswered
    from kvlab.exercises.ch01 import (
        check_kv_bytes_per_token,
        check_mixed_pool,
        check_tp_kv_per_rank,
    )

    # Llama 3.1 405B, int4 + one fp16 scale per 64: 2 x 126 x 8 x 128 x (0.5 + 2/64) bytes
    truth = 2 * 126 * 8 * 128 * 0.53125
    assert truth == 137_088
    assert "137,088" in check_kv_bytes_per_token(0.53125, 137_088)
    assert "137,088" in check_kv_bytes_per_token(17 / 32, 137_088.0)
    for element in (0.5, 0.5625, 2 / 64, 0.625):          # the element size first
        message = _verdict(check_kv_bytes_per_token, element, 137_088)
        assert "per element" in message and "137" not in message
    for wrong in (truth / 2, 2 * 126 * 8 * 128 * 0.5, truth * 16, truth + 1):
        message = _verdict(check_kv_bytes_per_token, 0.53125, wrong)
        assert "element size is right" in message and "137" not in message
    # Qwen2.5-7B on an H100 (79.11 GiB x 0.9 - 2 x 7,615,616,512 - 4 GiB), fp8 KV, pairs of a
    # 32k and an 8k request: 2,048 + 512 whole blocks a pair
    budget = 0.9 * round(79.11 * GiB) - 2 * 7_615_616_512 - 4 * GiB
    blocks = int(budget // (2 * 28 * 16 * 4 * 128))
    pairs, idle = divmod(blocks, 2048 + 512)
    assert (pairs, idle) == (48, 1202)
    assert "48 pairs" in check_mixed_pool(blocks, pairs, idle)
    for wrong in ((blocks - 1, pairs, idle - 1), (blocks, pairs + 1, idle - 2560),
                  (blocks, 2 * pairs, idle), (blocks // 2, pairs // 2, idle)):
        message = _verdict(check_mixed_pool, *wrong)       # one verdict for all three
        assert "not all right" in message and "48" not in message and "1,202" not in message
    # a per-rank rule: right, one that forgets replication, one that splits heads
    assert "2 and 1 KV heads" in check_tp_kv_per_rank(_per_rank)
    for wrong in (lambda L, h, d, e, tp: (h / tp, kv_bytes(L, 1, 1, h, d, e) / tp),
                  lambda L, h, d, e, tp: (h // tp or 1, kv_bytes(L, 1, 1, h // tp or 1, d, 2)),
                  lambda L, h, d, e, tp: _per_rank(L, h, d, e, tp) if tp <= 8 else (1, 0)):
        message = _verdict(check_tp_kv_per_rank, wrong)
        assert "not right on every shape" in message and "14,336" not in message
    with pytest.raises(NotYetAnswered):
        check_mixed_pool(..., 24, 1)
    with pytest.raises(AssertionError, match="whole number"):
        check_mixed_pool(1.5, 2, 3)
    with pytest.raises(AssertionError, match="a number"):
        check_kv_bytes_per_token(0.53125, "137088")
    with pytest.raises(AssertionError, match="pass a function"):
        check_tp_kv_per_rank((28_672, 14_336))


def test_chapter1_suspect_capacity_debug_check():
    from kvlab.exercises.ch01 import (
        SUSPECT_FIX_CASES,
        check_suspect_counterexample,
        suspect_max_requests,
    )

    # the suspect agrees with plan_capacity whenever the context is a multiple of the block size
    for name in ("Llama-3-8B", "Llama-3-70B", "Qwen2.5-7B"):
        for tp in (1, 4, 16):
            for ctx in (4096, 8192, 32768):
                plan = plan_capacity(MODELS[name], H100, tp=tp, context_len=ctx,
                                     reserve_bytes=4 * GiB)
                assert suspect_max_requests(MODELS[name], H100, tp=tp,
                                            context_len=ctx) == plan.max_requests
    # ... and the hidden cases would catch it: some of them are off the block size
    assert any(suspect_max_requests(get_model(c["model"]), get_gpu(c["gpu"]),
                                    kv_dtype=c["kv_dtype"], context_len=c["context_len"],
                                    tp=c["tp"])
               != plan_capacity(get_model(c["model"]), get_gpu(c["gpu"]),
                                kv_dtype=c["kv_dtype"], context_len=c["context_len"],
                                tp=c["tp"], reserve_bytes=4 * GiB).max_requests
               for c in SUSPECT_FIX_CASES)

    def fixed(model, gpu, *, kv_dtype="bf16", context_len=8192, tp=1, block_size=16,
              gpu_memory_utilization=0.9, reserve_bytes=4 * GiB):
        return plan_capacity(model, gpu, kv_dtype=kv_dtype, context_len=context_len, tp=tp,
                             block_size=block_size, reserve_bytes=reserve_bytes,
                             gpu_memory_utilization=gpu_memory_utilization).max_requests

    case = {"model": "Llama-3-8B", "gpu": "H100-80GB SXM", "kv_dtype": "bf16",
            "context_len": 1000, "tp": 1}
    plan = plan_capacity(LLAMA8, H100, context_len=1000, reserve_bytes=4 * GiB)
    assert plan.max_requests == plan.num_blocks // 63            # 1000 tokens need 63 blocks
    message = check_suspect_counterexample(case, fixed)
    assert message.startswith("Correct") and f"where {plan.max_requests} fit" in message
    for word in ("block", "round", "whole", "ceil"):              # the bug stays unnamed
        assert word not in message.lower()
    message = _verdict(check_suspect_counterexample, {**case, "context_len": 1024}, fixed)
    assert "does not show" in message and "block" not in message
    # the suspect itself, handed back as the repair, fails on a hidden case
    message = _verdict(check_suspect_counterexample, case, suspect_max_requests)
    assert "disagrees with plan_capacity" in message
    with pytest.raises(AssertionError, match="repaired estimate as a function"):
        check_suspect_counterexample(case, 3)
    with pytest.raises(AssertionError, match="exactly the keys"):
        check_suspect_counterexample({"model": "Llama-3-8B"}, fixed)
    with pytest.raises(AssertionError, match="not valid"):
        check_suspect_counterexample({**case, "gpu": "B200"}, fixed)


def test_chapter1_kv_overtakes_weights_check():
    from kvlab.exercises.ch01 import check_kv_overtakes_weights
    from kvlab.sim.costmodel import RooflineCostModel

    cm = RooflineCostModel.named("Llama-3-8B", "H100-80GB SXM")
    per_request = 4097 * 128 * 1024                 # 4,096 positions read, one written
    assert cm.cost([(1, 4095, True)]).bytes - cm.weight_bytes == per_request
    truth = next(b for b in range(1, 200)
                 if cm.cost([(1, 4095, True)] * b).bytes >= 2 * cm.weight_bytes)
    assert truth == 30                  # 16.06e9 / (4097 x 128 KiB) = 29.9

    def overtake(model, context_len, extra=1, shift=0):
        m = get_model(model)
        per = kv_bytes(m.layers, 1, context_len + extra, m.kv_heads, m.head_dim, 2)
        return per, -(-int(m.weight_bytes("bf16")) // per) + shift

    message = check_kv_overtakes_weights(overtake)
    assert "Correct" in message and "from batch 30" in message
    # the printed case alone, an off-by-one in either number: one verdict, no case named
    for wrong in (lambda model, context_len: (per_request, truth),
                  lambda model, context_len: overtake(model, context_len, extra=0),
                  lambda model, context_len: overtake(model, context_len, shift=1)):
        message = _verdict(check_kv_overtakes_weights, wrong)
        assert "not right on every case" in message and "4,096" not in message
    with pytest.raises(AssertionError, match="pass a function"):
        check_kv_overtakes_weights(30)


def test_chapter1_tp_design_check():
    from kvlab.exercises.ch01 import KV_CHOICES, TP_CHOICES, check_tp_design

    # the truth computed independently: TP=4 holds 40 x 16k only with a 1-byte (or smaller) KV
    assert plan_capacity(LLAMA70, H100, tp=4, context_len=16384,
                         reserve_bytes=4 * GiB).max_requests < 40
    assert plan_capacity(LLAMA70, H100, tp=4, kv_dtype="fp8", context_len=16384,
                         reserve_bytes=4 * GiB).max_requests >= 40

    def rule(model, gpu, context_len, min_requests, reserve_bytes, order=KV_CHOICES):
        for tp in TP_CHOICES:
            for kv_dtype in order:
                if plan_capacity(get_model(model), get_gpu(gpu), tp=tp, kv_dtype=kv_dtype,
                                 context_len=context_len,
                                 reserve_bytes=reserve_bytes).max_requests >= min_requests:
                    return tp, kv_dtype
        return None

    message = check_tp_design(rule)
    assert message.startswith("Correct on") and "TP=4" in message
    # a rule that passes the printed case only, or prefers the smallest cache, or never
    # gives up, fails on requirements drawn at the call: one verdict, no case named
    wrong_rules = (lambda **c: (4, "fp8"),
                   lambda **c: rule(**c, order=tuple(reversed(KV_CHOICES))),
                   lambda **c: rule(**c) or (16, "int4"))
    for wrong in wrong_rules:
        message = _verdict(check_tp_design, wrong)
        assert "not the one asked for on every requirement" in message
        assert "Llama" not in message and "H100" not in message
    message = _verdict(check_tp_design, lambda **c: (3, "bf16"))
    assert "return a pair" in message
    with pytest.raises(AssertionError, match="pass a function"):
        check_tp_design((4, "fp8"))
