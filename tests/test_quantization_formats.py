"""Group-quantization formats: error bounds, packing, bytes vs effective bits, kernels, KV."""

from __future__ import annotations

import pytest
import torch

from kvlab.core.kv_dtype import kv_bytes_per_token, kv_dtype_spec
from kvlab.engine.quantization import (
    KernelLog,
    QuantConfig,
    QuantizedLinear,
    dequantize,
    dequantize_kv,
    pack_int4,
    quantize,
    quantize_kv,
    unpack_int4,
)
from kvlab.engine.quantization.formats import integer_values
from kvlab.engine.quantization.linear import DEQUANT_KERNEL, INT4_KERNEL, INT8_KERNEL
from kvlab.reference import dequantize_groups, effective_bits, quantize_groups


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # StudentT samples from the global generator
    gauss = torch.randn(48, 256, generator=g)
    heavy = torch.distributions.StudentT(torch.tensor(1.5)).sample((48, 256))  # heavy tails
    outlier = torch.randn(48, 256, generator=g) * 0.02
    rows = torch.randint(0, 48, (40,), generator=g)
    outlier[rows, torch.randint(0, 256, (40,), generator=g)] = 30.0
    tiny = torch.randn(48, 256, generator=g) * 1e-6
    zeros = torch.zeros(48, 256)
    zeros[0, 5] = -2.0
    return {"gaussian": gauss, "student-t": heavy, "outliers": outlier, "tiny": tiny,
            "mostly-zero": zeros}


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("group", [16, 64, 256])
def test_error_bound_half_scale(bits, group, symmetric):
    """|x - deq(q(x))| <= s/2 per element, for the *stored* (fp16, rounded-up) scale."""
    torch.manual_seed(1)
    cfg = QuantConfig(bits=bits, group_size=group, symmetric=symmetric)
    for name, x in _tensors(bits * 7 + group).items():
        p = quantize(x, cfg)
        err = (x - dequantize(p)).abs().reshape(48, 256 // group, group)
        bound = p.scales.float()[..., None] / 2
        assert bool((err <= bound * (1 + 1e-6)).all()), (name, float((err - bound).max()))
        q = integer_values(p)
        if symmetric:
            assert int(q.abs().max()) <= 2 ** (bits - 1) - 1
        else:
            assert int(q.min()) >= -(2 ** bits - 1)


def test_matches_reference_rule7_on_exact_scales():
    """Where the group maxima make s exactly representable in fp16, q equals the spec's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=g)
    groups = x.view(8, 2, 32)
    idx = groups.abs().argmax(-1, keepdim=True)
    groups.scatter_(-1, idx, torch.sign(groups.gather(-1, idx)) * 7 * 2.0 ** -3)  # s = 1/8
    groups.clamp_(-7 / 8, 7 / 8)
    q_ref, s_ref = quantize_groups(x, bits=4, group_size=32)
    p = quantize(x, QuantConfig(bits=4, group_size=32))
    assert torch.equal(p.scales.float(), s_ref[..., 0])
    assert torch.equal(integer_values(p).reshape(8, 64).to(torch.int8), q_ref)
    assert torch.equal(dequantize(p), dequantize_groups(q_ref, s_ref, 32))


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(4)
    u = torch.randint(0, 16, (7, 10, 64), generator=g, dtype=torch.uint8)
    packed = pack_int4(u)
    assert packed.shape == (7, 10, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), u)
    assert int(packed[0, 0, 0]) == int(u[0, 0, 0]) | (int(u[0, 0, 1]) << 4)  # low nibble first
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(every)), every)  # every byte value survives
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_int4(torch.tensor([3, 16]))


@pytest.mark.parametrize(("bits", "group", "symmetric"),
                         [(8, 32, True), (8, 64, True), (4, 32, True), (4, 64, True),
                          (4, 128, True), (8, 64, False), (4, 64, False)])
def test_bytes_equal_effective_bits(bits, group, symmetric):
    """Measured bytes == effective_bits(...) x params / 8, exactly (8- and 4-bit payloads)."""
    cfg = QuantConfig(bits=bits, group_size=group, symmetric=symmetric)
    x = torch.randn(96, 512)
    p = quantize(x, cfg)
    expected = effective_bits(bits, group, scale_bits=16, zero_bits=cfg.zero_bits) * x.numel() / 8
    assert p.nbytes == expected
    assert cfg.storage_bits() == cfg.effective_bits()


def test_sub_nibble_bits_state_their_storage():
    cfg = QuantConfig(bits=3, group_size=64)
    p = quantize(torch.randn(16, 128), cfg)
    assert cfg.effective_bits() == 3 + 16 / 64
    assert p.nbytes * 8 / p.qweight.shape[0] / 128 == cfg.storage_bits() == 4 + 16 / 64


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"bits": 1}, "bits must be an int in 2..8"),
    ({"bits": 9}, "bits must be an int in 2..8"),
    ({"bits": 4.0}, "bits must be an int"),
    ({"group_size": 0}, "positive int"),
    ({"scale_dtype": "float32"}, "scale_dtype"),
    ({"kernel": "cutlass"}, "kernel"),
])
def test_bad_configs_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_non_dividing_group_refused():
    with pytest.raises(ValueError, match="does not divide the input dimension 192"):
        quantize(torch.randn(4, 192), QuantConfig(bits=4, group_size=128), "layers.0.qkv")


def test_unknown_kv_dtype_refused():
    for bad in ("fp16", "int4", None, 8):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            kv_dtype_spec(bad)


@pytest.mark.parametrize(("bits", "group", "kernel"), [
    (8, 192, INT8_KERNEL), (8, 64, DEQUANT_KERNEL), (4, 64, INT4_KERNEL), (4, 32, INT4_KERNEL),
    (4, 96, DEQUANT_KERNEL), (3, 64, DEQUANT_KERNEL)])
def test_packed_kernels_agree_with_dequantized_matmul(bits, group, kernel):
    """The torch low-bit kernels compute x @ deq(W)^T (exact to their contract up to fp32
    summation order) and the log records the kernel that ran."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(192, 64, bias=True)
    log = KernelLog()
    ql = QuantizedLinear.from_linear(lin, QuantConfig(bits=bits, group_size=group,
                                                      kernel="packed"), log)
    assert ql.kernel(torch.float32) == kernel
    x = torch.randn(9, 192)
    ref = x.double() @ ql.dequantized_weight(torch.float64).t() + lin.bias.double()
    y = ql(x)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert log.summary() == {f"{kernel} [float32]": 1}
    dq = QuantizedLinear.from_linear(lin, QuantConfig(bits=bits, group_size=group,
                                                      kernel="dequant"), log)
    assert dq.kernel(torch.float32) == dq.kernel(torch.bfloat16) == DEQUANT_KERNEL
    assert torch.allclose(dq(x), y, rtol=1e-5, atol=1e-5)


def test_quantized_linear_keeps_stored_dtypes_across_to():
    ql = QuantizedLinear.from_linear(torch.nn.Linear(64, 32), QuantConfig(4, 32), KernelLog())
    before = (ql.qweight.clone(), ql.scales.clone())
    ql.to(torch.bfloat16)
    assert ql.qweight.dtype == torch.uint8 and ql.scales.dtype == torch.float16
    assert torch.equal(ql.qweight, before[0]) and torch.equal(ql.scales, before[1])
    assert ql.bias.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_kv_quantization_error(name):
    spec = kv_dtype_spec(name)
    for label, x in _tensors(11).items():
        x = x.view(48, 8, 32)
        q, s = quantize_kv(x, spec)
        assert s.dtype == torch.float16 and s.shape == (48, 8)
        err = (x - dequantize_kv(q, s, spec, torch.float32)).abs()
        sf = s.float()[..., None]
        if name == "int8":
            bound = sf / 2
        else:  # e4m3: 3 mantissa bits (relative 2^-4); subnormal step 2^-9 below 2^-6
            bound = torch.maximum(x.abs() * 2.0 ** -4, sf * 2.0 ** -10)
        assert bool((err <= bound * (1 + 1e-5) + 1e-12).all()), (label, float((err - bound).max()))


def test_kv_bytes_per_token():
    # kvlab-tiny: 4 layers, 2 KV heads, head_dim 32
    assert kv_bytes_per_token(4, 2, 32, "auto", 4) == 2 * 4 * 2 * 32 * 4 == 2048
    assert kv_bytes_per_token(4, 2, 32, "auto", 2) == 1024
    assert kv_bytes_per_token(4, 2, 32, "int8") == 2 * 4 * 2 * (32 + 2) == 544
    assert kv_bytes_per_token(4, 2, 32, "fp8_e4m3") == 544
    spec = kv_dtype_spec("int8")
    assert spec.element_bytes(128, 2) == 1 + 2 / 128
    assert spec.schema() != kv_dtype_spec("fp8_e4m3").schema() != kv_dtype_spec("auto").schema()


def test_auto_policy_packed_only_for_half_precision():
    lin = torch.nn.Linear(192, 64)
    log = KernelLog()
    ql = QuantizedLinear.from_linear(lin, QuantConfig(4, 64), log)   # kernel="auto"
    assert ql.kernel(torch.float32) == DEQUANT_KERNEL
    assert ql.kernel(torch.bfloat16) == INT4_KERNEL
    assert ql.runtime_extra_bytes == 0          # the int4 layout is built on first use
    x = torch.randn(3, 192)
    y32 = ql(x)
    y16 = ql(x.bfloat16())
    assert ql.runtime_extra_bytes == 64 * 192 // 2
    assert log.summary() == {f"{DEQUANT_KERNEL} [float32]": 1, f"{INT4_KERNEL} [bfloat16]": 1}
    assert torch.allclose(y16.float(), y32, atol=0.05 * float(y32.abs().max()))


def test_kv_dtype_module_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, kvlab.core.kv_dtype, kvlab.labs.capacity; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
