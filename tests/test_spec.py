"""Every assert of shared/spec/inference-engine.zh.md, against kvlab, plus one test per error
branch of each listing that also checks the failed call left the object's state unchanged."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import kvlab
import kvlab.core
import kvlab.engine
import kvlab.reference
from kvlab import (
    ALLOWED,
    REQUIRED_KV_FIELDS,
    BlockAllocator,
    Phase,
    PrefixCache,
    Request,
    build_batch,
    dequantize_groups,
    effective_bits,
    goodput,
    kv_bytes,
    physical_slot,
    quantize_groups,
    speculative_step,
    validate_kv_descriptor,
)


def allocator_state(allocator: BlockAllocator):
    return list(allocator.refcount), set(allocator.free)


# ---- the document's own asserts, in its order -----------------------------------------------


def test_document_physical_slot_asserts():
    assert physical_slot([9, 2], 4, 5) == 9
    with pytest.raises(ValueError):
        physical_slot([-1], 4, 0)


def test_document_block_allocator_asserts():
    allocator = BlockAllocator(4)
    parent = [allocator.allocate(), allocator.allocate()]
    child = allocator.share(parent)
    child, copied = allocator.cow(child, 1)
    assert copied == (parent[1], child[1])
    assert allocator.refcount[parent[0]] == 2
    allocator.release(parent)
    allocator.release(child)
    assert len(allocator.free) == 4
    full = BlockAllocator(1)
    shared = full.share([full.allocate()])
    with pytest.raises(MemoryError):
        full.cow(shared, 0)
    assert full.refcount[shared[0]] == 2
    probe = BlockAllocator(2)
    live = probe.allocate()
    free_block = next(iter(probe.free))
    before = list(probe.refcount)
    for operation in (probe.share, probe.release):
        with pytest.raises(ValueError):
            operation([live, free_block])
        assert probe.refcount == before


def test_document_build_batch_asserts():
    decode = Request("d0", 0, phase=Phase.DECODE)
    prefill = Request("p0", 3, phase=Phase.PREFILL)
    batch = build_batch([prefill, decode], 3, 2, 2)
    assert [request_id for request_id, _, _ in batch] == ["d0", "p0"]
    with pytest.raises(ValueError):
        build_batch([decode, decode], 3, 2, 2)


def test_document_quantization_asserts():
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    q, scale = quantize_groups(x, bits=4, group_size=16)
    x_hat = dequantize_groups(q, scale, 16)
    assert q.dtype == torch.int8 and x_hat.shape == x.shape
    assert effective_bits(4, 16) == 5
    for bits, group_size in ((1, 16), (9, 16), (4, 0)):
        with pytest.raises(ValueError):
            quantize_groups(x, bits, group_size)


def test_document_speculative_step_asserts():
    p, q = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])
    token, accepted = speculative_step(p, q, 0)
    assert (token, accepted) == (1, False)
    for bad in ((p, q, -1), (p, q, 1), (p, torch.tensor([0.2, 0.2]), 0)):
        with pytest.raises(ValueError):
            speculative_step(*bad)


# ---- kv_bytes ---------------------------------------------------------------------------------


def test_kv_bytes_formula_on_llama3_8b():
    # 32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB per token, 1 GiB for 8192 tokens.
    assert kv_bytes(32, 1, 1, 8, 128, 2) == 131072
    assert kv_bytes(32, 1, 8192, 8, 128, 2) == 2**30
    assert kv_bytes(1, 1, 1, 1, 1, 0.5) == 1.0


@pytest.mark.parametrize("position", range(6))
def test_kv_bytes_rejects_each_non_positive_dimension(position):
    values = [32, 1, 8, 8, 128, 2]
    for bad in (0, -1):
        values[position] = bad
        with pytest.raises(ValueError, match="positive"):
            kv_bytes(*values)


# ---- physical_slot ----------------------------------------------------------------------------


def test_physical_slot_maps_every_position_of_a_table():
    table, q = [7, 0, 3], 4
    slots = [physical_slot(table, q, t) for t in range(12)]
    assert slots == [28, 29, 30, 31, 0, 1, 2, 3, 12, 13, 14, 15]


@pytest.mark.parametrize("block_size,token_pos", [(0, 0), (-4, 1), (4, -1)])
def test_physical_slot_rejects_bad_size_or_position(block_size, token_pos):
    table = [1, 2]
    with pytest.raises(ValueError, match="invalid block size or token position"):
        physical_slot(table, block_size, token_pos)
    assert table == [1, 2]


def test_physical_slot_rejects_unallocated_logical_block():
    with pytest.raises(IndexError, match="not allocated"):
        physical_slot([9, 2], 4, 8)


def test_physical_slot_rejects_negative_physical_block():
    with pytest.raises(ValueError, match="non-negative"):
        physical_slot([3, -2], 4, 5)


# ---- BlockAllocator: each error branch leaves state unchanged ---------------------------------


def test_allocator_needs_blocks():
    for blocks in (0, -3):
        with pytest.raises(ValueError, match="needs physical blocks"):
            BlockAllocator(blocks)


def test_allocate_exhausted_leaves_state():
    allocator = BlockAllocator(2)
    allocator.allocate()
    allocator.allocate()
    before = allocator_state(allocator)
    with pytest.raises(MemoryError, match="exhausted"):
        allocator.allocate()
    assert allocator_state(allocator) == before


@pytest.mark.parametrize("method", ["share", "release"])
def test_share_release_reject_duplicates(method):
    allocator = BlockAllocator(3)
    block = allocator.allocate()
    before = allocator_state(allocator)
    with pytest.raises(ValueError, match="duplicate"):
        getattr(allocator, method)([block, block])
    assert allocator_state(allocator) == before


@pytest.mark.parametrize("method", ["share", "release"])
@pytest.mark.parametrize("bad", [-1, 3, 99])
def test_share_release_reject_out_of_range(method, bad):
    allocator = BlockAllocator(3)
    block = allocator.allocate()
    before = allocator_state(allocator)
    with pytest.raises(IndexError, match="out of range"):
        getattr(allocator, method)([block, bad])
    assert allocator_state(allocator) == before


@pytest.mark.parametrize(
    "method,message", [("share", "share a free"), ("release", "release a free")]
)
def test_share_release_reject_free_blocks(method, message):
    allocator = BlockAllocator(3)
    live = allocator.allocate()
    free_block = min(allocator.free)
    before = allocator_state(allocator)
    with pytest.raises(ValueError, match=message):
        getattr(allocator, method)([live, free_block])
    assert allocator_state(allocator) == before


def test_share_returns_a_copy_and_counts_owners():
    allocator = BlockAllocator(3)
    table = (allocator.allocate(), allocator.allocate())
    shared = allocator.share(table)
    assert shared == list(table) and shared is not table
    assert all(allocator.refcount[b] == 2 for b in table)


@pytest.mark.parametrize("logical", [-1, 2, 5])
def test_cow_rejects_logical_block_out_of_range(logical):
    allocator = BlockAllocator(3)
    table = [allocator.allocate(), allocator.allocate()]
    before = allocator_state(allocator)
    with pytest.raises(IndexError, match="logical block is out of range"):
        allocator.cow(table, logical)
    assert allocator_state(allocator) == before


@pytest.mark.parametrize("physical", ["free", -1, 7])
def test_cow_rejects_invalid_physical_block(physical):
    allocator = BlockAllocator(3)
    live = allocator.allocate()
    bad = min(allocator.free) if physical == "free" else physical
    before = allocator_state(allocator)
    with pytest.raises(ValueError, match="invalid block"):
        allocator.cow([live, bad], 1)
    assert allocator_state(allocator) == before


def test_cow_of_exclusive_block_is_a_no_op():
    allocator = BlockAllocator(2)
    table = [allocator.allocate()]
    before = allocator_state(allocator)
    new_table, copied = allocator.cow(table, 0)
    assert (new_table, copied) == (table, None)
    assert allocator_state(allocator) == before


def test_cow_does_not_mutate_the_callers_table():
    allocator = BlockAllocator(3)
    parent = [allocator.allocate()]
    child = allocator.share(parent)
    new_child, (old, new) = allocator.cow(child, 0)
    assert child == parent == [old] and new_child == [new]
    assert allocator.refcount[old] == 1 and allocator.refcount[new] == 1


# ---- PrefixCache ------------------------------------------------------------------------------


def test_prefix_cache_longest_match_and_scope_isolation():
    cache = PrefixCache()
    scope = ("model@v1", "tok@v1", "bf16", "tenant-a")
    cache.put(scope, [1, 2], [10])
    cache.put(scope, [1, 2, 3, 4], [10, 11])
    assert cache.longest(scope, [1, 2, 3, 4, 5]) == (4, (10, 11))
    assert cache.longest(scope, [1, 2, 3]) == (2, (10,))
    assert cache.longest(scope, [2, 1]) == (0, ())
    other_domain = ("model@v1", "tok@v1", "bf16", "tenant-b")
    assert cache.longest(other_domain, [1, 2, 3, 4]) == (0, ())
    cache.put(scope, [1, 2], [42])  # same key: the newer table replaces the old one
    assert cache.longest(scope, [1, 2, 9]) == (2, (42,))


# ---- Request state machine ----------------------------------------------------------------------


def test_allowed_transitions_and_idempotent_terminals():
    request = Request("r", 4)
    for target in (Phase.PREFILL, Phase.DECODE, Phase.FINISHED, Phase.FINISHED):
        request.transition(target)
    assert request.phase is Phase.FINISHED
    cancelled = Request("c", 1)
    cancelled.transition(Phase.CANCELLED)
    cancelled.transition(Phase.CANCELLED)
    assert cancelled.phase is Phase.CANCELLED


def test_every_illegal_transition_raises_and_changes_nothing():
    for source in Phase:
        for target in Phase:
            legal = target in ALLOWED.get(source, set())
            idempotent = source == target and target in {Phase.FINISHED, Phase.CANCELLED}
            request = Request("r", 2, generated=1, phase=source)
            if legal or idempotent:
                request.transition(target)
                assert request.phase is target
            else:
                before = copy.deepcopy(request)
                with pytest.raises(ValueError, match="illegal transition"):
                    request.transition(target)
                assert request == before


# ---- build_batch ------------------------------------------------------------------------------


@pytest.mark.parametrize("budgets", [(0, 1, 1), (1, 0, 1), (1, 1, 0), (-1, 2, 2)])
def test_build_batch_rejects_non_positive_budgets(budgets):
    requests = [Request("p", 3)]
    before = copy.deepcopy(requests)
    with pytest.raises(ValueError, match="budgets must be positive"):
        build_batch(requests, *budgets)
    assert requests == before


def test_build_batch_duplicate_ids_leave_requests_unchanged():
    requests = [Request("x", 3), Request("x", 1, phase=Phase.DECODE)]
    before = copy.deepcopy(requests)
    with pytest.raises(ValueError, match="unique"):
        build_batch(requests, 8, 8, 8)
    assert requests == before


def test_build_batch_decode_first_then_chunked_prefill_within_budgets():
    requests = [
        Request("p0", 10, phase=Phase.WAITING),
        Request("d0", 0, phase=Phase.DECODE),
        Request("p1", 2, phase=Phase.PREFILL),
        Request("d1", 0, phase=Phase.DECODE),
        Request("f", 0, phase=Phase.FINISHED),
    ]
    batch = build_batch(requests, token_budget=8, max_sequences=4, prefill_chunk=4)
    assert batch == [
        ("d0", Phase.DECODE, 1),
        ("d1", Phase.DECODE, 1),
        ("p0", Phase.WAITING, 4),
        ("p1", Phase.PREFILL, 2),
    ]
    assert build_batch(requests, token_budget=3, max_sequences=4, prefill_chunk=4) == [
        ("d0", Phase.DECODE, 1),
        ("d1", Phase.DECODE, 1),
        ("p0", Phase.WAITING, 1),
    ]
    assert len(build_batch(requests, 100, 1, 4)) == 1


# ---- quantisation -----------------------------------------------------------------------------


def test_quantize_groups_formula_and_error_bound():
    torch.manual_seed(1)
    x = torch.randn(4, 128)
    for bits in range(2, 9):
        q, scale = quantize_groups(x, bits=bits, group_size=32)
        qmax = 2 ** (bits - 1) - 1
        groups = x.reshape(4, 4, 32)
        assert torch.equal(scale, groups.abs().amax(-1, keepdim=True) / qmax)
        assert int(q.abs().max()) == qmax  # the largest magnitude of each group hits qmax
        error = (dequantize_groups(q, scale, 32) - x).reshape(4, 4, 32).abs()
        assert torch.all(error <= scale / 2 + 1e-6)  # round-to-nearest: half a step at most


def test_quantize_groups_zero_group_is_exact():
    q, scale = quantize_groups(torch.zeros(2, 8), bits=4, group_size=4)
    assert torch.equal(q, torch.zeros(2, 8, dtype=torch.int8))
    assert torch.all(scale == 1e-12)


def test_quantize_groups_rejects_scalars_and_non_divisible_groups():
    with pytest.raises(ValueError):
        quantize_groups(torch.tensor(1.0))
    x = torch.randn(2, 10)
    before = x.clone()
    with pytest.raises(ValueError, match="non-divisible"):
        quantize_groups(x, bits=4, group_size=4)
    assert torch.equal(x, before)


def test_effective_bits_counts_scale_and_zero_point():
    assert effective_bits(4, 128) == 4.125
    assert effective_bits(4, 32, scale_bits=16, zero_bits=16) == 5
    assert effective_bits(8, 1, scale_bits=32) == 40


# ---- speculative_step -------------------------------------------------------------------------


def test_speculative_step_rejects_shape_mismatch_and_empty():
    with pytest.raises(ValueError, match="share one token space"):
        speculative_step(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0, 0.0]), 0)
    with pytest.raises(ValueError, match="share one token space"):
        speculative_step(torch.ones(2, 2) / 4, torch.ones(2, 2) / 4, 0)
    with pytest.raises(ValueError, match="share one token space"):
        speculative_step(torch.tensor([]), torch.tensor([]), 0)


def test_speculative_step_rejects_non_int_proposal():
    p = torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match="index the shared vocabulary"):
        speculative_step(p, p, 1.0)
    with pytest.raises(ValueError, match="index the shared vocabulary"):
        speculative_step(p, p, 2)


def test_speculative_step_rejects_nan_and_negative_probabilities():
    good = torch.tensor([0.5, 0.5])
    for bad in (torch.tensor([float("nan"), 1.0]), torch.tensor([1.5, -0.5])):
        with pytest.raises(ValueError, match="finite and non-negative"):
            speculative_step(bad, good, 0)
        with pytest.raises(ValueError, match="finite and non-negative"):
            speculative_step(good, bad, 0)


def test_speculative_step_identical_distributions_always_accept():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    for proposal in (0, 1, 1, 0):
        assert speculative_step(p, p.clone(), proposal, generator) == (proposal, True)
    assert not torch.equal(generator.get_state(), state)  # each step consumed its uniform draw


def test_speculative_step_rejects_empty_residual(monkeypatch):
    # p <= q everywhere (equal within allclose's tolerance): a rejection leaves no residual mass.
    # Force the rejection branch with a uniform draw of 1.0, which no acceptance can beat.
    p = torch.tensor([0.5 - 1e-9, 0.5], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor(1.0))
    with pytest.raises(ValueError, match="no residual mass"):
        speculative_step(p, q, 0)


def test_speculative_step_output_is_distributed_as_p():
    # Chi-square goodness of fit, 20k draws, V=4, 3 dof: critical value 16.27 at alpha = 0.001.
    # With this sample size a total-variation error of 0.02 would give chi2 ≈ 60, so the test
    # has power ≈ 1 against any bias of that size while a correct sampler fails 1 time in 1000.
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    generator = torch.Generator().manual_seed(1234)
    draws = 20000
    counts = torch.zeros(4, dtype=torch.float64)
    proposals = torch.multinomial(q, draws, replacement=True, generator=generator)
    for proposal in proposals.tolist():
        token, _ = speculative_step(p, q, proposal, generator)
        counts[token] += 1
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, chi2


def test_speculative_step_acceptance_rate_is_one_minus_tv_distance():
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    generator = torch.Generator().manual_seed(7)
    draws = 20000
    proposals = torch.multinomial(q, draws, replacement=True, generator=generator).tolist()
    accepted = sum(speculative_step(p, q, x, generator)[1] for x in proposals)
    expected = float(torch.minimum(p, q).sum())  # 1 - TV(p, q) = 0.6
    # Binomial std at n=20000, rate 0.6: 0.0035; 5 sigma = 0.0173.
    assert abs(accepted / draws - expected) < 0.0173


# ---- P/D descriptor ---------------------------------------------------------------------------


def _descriptor(**override):
    base = {
        "request_id": "r1", "model_version": "m@1", "token_ids_hash": "abc", "layers": 2,
        "kv_heads": 2, "head_dim": 64, "dtype": "bf16", "layout": "NHD", "rope": "theta=1e4",
        "security_domain": "tenant-a",
    }
    base.update(override)
    return base


def test_validate_kv_descriptor_accepts_and_returns_request_id():
    descriptor = _descriptor()
    assert set(descriptor) == REQUIRED_KV_FIELDS
    expected = {k: v for k, v in descriptor.items() if k != "request_id"}
    assert validate_kv_descriptor(descriptor, expected) == "r1"


@pytest.mark.parametrize("field", sorted(REQUIRED_KV_FIELDS))
def test_validate_kv_descriptor_names_each_missing_field(field):
    descriptor = _descriptor()
    del descriptor[field]
    snapshot = dict(descriptor)
    with pytest.raises(ValueError, match=f"missing KV fields: \\['{field}'\\]"):
        validate_kv_descriptor(descriptor, {})
    assert descriptor == snapshot


@pytest.mark.parametrize("field", sorted(REQUIRED_KV_FIELDS - {"request_id"}))
def test_validate_kv_descriptor_names_each_mismatch(field):
    descriptor = _descriptor()
    expected = dict(_descriptor(**{field: "other"}))
    with pytest.raises(ValueError, match=f"incompatible KV descriptor: .*'{field}'"):
        validate_kv_descriptor(descriptor, expected)


# ---- goodput ----------------------------------------------------------------------------------


def test_goodput_counts_only_requests_meeting_every_slo():
    slo = {"ttft": 0.5, "tpot": 0.05, "e2e": 5.0}
    ok = {"status": "finished", "quality_ok": True, "ttft": 0.2, "tpot": 0.04, "e2e": 3.0}
    records = [
        ok,
        dict(ok, ttft=0.5),                       # on the bound counts
        dict(ok, ttft=0.6),
        dict(ok, tpot=0.06),
        dict(ok, e2e=5.1),
        dict(ok, quality_ok=False),
        dict(ok, status="cancelled"),
    ]
    assert goodput(records, 10, slo) == 0.2
    assert goodput([], 1, slo) == 0.0


@pytest.mark.parametrize("window", [0, -1.0])
def test_goodput_rejects_non_positive_window(window):
    with pytest.raises(ValueError, match="window must be positive"):
        goodput([], window, {"ttft": 1, "tpot": 1, "e2e": 1})


# ---- public surface ---------------------------------------------------------------------------


# public name -> the module of kvlab.reference that holds its listing
_REFERENCE = {
    "kv_bytes": "rule01_capacity", "physical_slot": "rule02_paging",
    "BlockAllocator": "rule03_refcount", "PrefixCache": "rule04_prefix",
    "Phase": "rule05_request", "ALLOWED": "rule05_request", "Request": "rule05_request",
    "build_batch": "rule06_batching", "quantize_groups": "rule07_quantization",
    "dequantize_groups": "rule07_quantization", "effective_bits": "rule07_quantization",
    "speculative_step": "rule08_speculative", "REQUIRED_KV_FIELDS": "rule09_disagg",
    "validate_kv_descriptor": "rule09_disagg", "goodput": "rule10_goodput",
}
_TORCH = {"quantize_groups", "dequantize_groups", "speculative_step"}


def test_reference_names_are_public():
    """``kvlab.X`` is the very object of the spec's listing in ``kvlab.reference``, not a copy or
    a wrapper: torch-free names also through ``kvlab.core``, torch ones through ``kvlab.engine``."""
    assert set(_REFERENCE) == set(kvlab.reference.__all__)
    for name, module in _REFERENCE.items():
        listing = getattr(importlib.import_module(f"kvlab.reference.{module}"), name)
        assert getattr(kvlab, name) is getattr(kvlab.reference, name) is listing, name
        assert name in kvlab.__all__, name
        other = kvlab.engine if name in _TORCH else kvlab.core
        assert getattr(other, name) is listing, name
        assert name in other.__all__, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvlab.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvlab.reference.nope  # noqa: B018


def test_reference_modules_name_their_rule():
    """One module per spec rule, its docstring opening with that rule's number."""
    for module in set(_REFERENCE.values()):
        rule = int(module[4:6])
        doc = importlib.import_module(f"kvlab.reference.{module}").__doc__
        assert doc.startswith(f"Spec rule {rule} — "), module
