"""Chapter 7 exercise checks accept the right answers and reject wrong ones."""

from __future__ import annotations

import pytest

from kvlab.exercises import ch07
from kvlab.exercises._common import NotYetAnswered


def _slots(table, start, n, bs):
    return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


def _top_p(probs, top_p):
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def test_slot_mapping_check():
    assert "Correct" in ch07.check_slot_mapping(_slots)
    with pytest.raises(AssertionError, match="expected"):
        ch07.check_slot_mapping(lambda t, s, n, bs: [t[p // bs] + p % bs for p in range(s, s + n)])
    with pytest.raises(NotYetAnswered):
        ch07.check_slot_mapping(...)


def test_top_p_check():
    assert "Correct" in ch07.check_top_p(_top_p)
    with pytest.raises(AssertionError, match="expected"):
        ch07.check_top_p(lambda probs, p: {max(range(len(probs)), key=probs.__getitem__)})


def test_logprob_letter():
    assert "Correct" in ch07.check_logprob_temperature("b")
    with pytest.raises(AssertionError):
        ch07.check_logprob_temperature("a")


def test_kv_bytes_per_token_on_a_local_model(tmp_path):
    pytest.importorskip("transformers")
    from kvlab.engine.hf_parity import save_random_hf_model

    path = save_random_hf_model(tmp_path / "m", "llama")  # 2 layers, 2 KV heads, head_dim 16
    assert "Correct" in ch07.check_kv_bytes_per_token(2 * 2 * 2 * 16 * 4, model=str(path))
    with pytest.raises(AssertionError, match="KV heads"):
        ch07.check_kv_bytes_per_token(2 * 2 * 4 * 16 * 4, model=str(path))
