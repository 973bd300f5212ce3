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
    with pytest.raises(AssertionError, match="is wrong") as err:
        ch07.check_slot_mapping(lambda t, s, n, bs: [t[p // bs] + p % bs for p in range(s, s + n)])
    assert "expected" not in str(err.value)
    with pytest.raises(NotYetAnswered):
        ch07.check_slot_mapping(...)


def test_top_p_check():
    assert "Correct" in ch07.check_top_p(_top_p)
    with pytest.raises(AssertionError, match="too few tokens") as err:
        ch07.check_top_p(lambda probs, p: {max(range(len(probs)), key=probs.__getitem__)})
    assert "expected" not in str(err.value)
    with pytest.raises(AssertionError, match="too many tokens"):
        ch07.check_top_p(lambda probs, p: set(range(len(probs))))


def test_logprob_letter():
    assert "Correct" in ch07.check_logprob_temperature("b")
    for wrong in ("a", "c", "d", " C "):
        with pytest.raises(AssertionError, match="Not") as err:
            ch07.check_logprob_temperature(wrong)
        message = str(err.value).lower()   # says why the choice fails, never which is right
        assert "(b)" not in message and "raw" not in message and "log_softmax" not in message
    with pytest.raises(AssertionError, match="one letter"):
        ch07.check_logprob_temperature("e")


def test_top_p_messages_give_the_direction_not_the_method():
    with pytest.raises(AssertionError) as err:
        ch07.check_top_p(lambda probs, p: set(range(len(probs))))
    assert "sort" not in str(err.value).lower() and "mass" not in str(err.value).lower()


def test_kv_bytes_per_token_on_a_local_model(tmp_path):
    pytest.importorskip("transformers")
    from kvlab.engine.hf_parity import save_random_hf_model

    path = save_random_hf_model(tmp_path / "m", "llama")  # 2 layers, 2 KV heads, head_dim 16
    assert "Correct" in ch07.check_kv_bytes_per_token(2 * 2 * 2 * 16 * 4, model=str(path))
    with pytest.raises(AssertionError, match="too high") as err:
        ch07.check_kv_bytes_per_token(2 * 2 * 4 * 16 * 4, model=str(path))
    assert str(2 * 2 * 2 * 16 * 4) not in str(err.value)


def test_late_write_chunk_check():
    import torch

    # the truth, independently: the orders agree exactly when the chunk is a fresh prefill
    for start, n in ((0, 1), (0, 2), (0, 7), (3, 1), (3, 4), (12, 1)):
        same = torch.allclose(ch07._attention_outputs(ch07.correct_attention_step, start, n),
                              ch07._attention_outputs(ch07.suspect_attention_step, start, n))
        assert same == (start == 0 and n > 1), (start, n)
    assert "Correct" in ch07.check_late_write_chunk(9, 1)
    assert "Correct" in ch07.check_late_write_chunk(4, 3)
    with pytest.raises(AssertionError, match="same output") as err:
        ch07.check_late_write_chunk(0, 6)
    assert "decode" not in str(err.value) and "start 0" not in str(err.value)
    with pytest.raises(AssertionError, match="whole number"):
        ch07.check_late_write_chunk(1.5, 2)
    with pytest.raises(NotYetAnswered):
        ch07.check_late_write_chunk(..., 2)


def test_preemption_design_check():
    ok = {"block_size": 4, "num_blocks": 30, "max_num_batched_tokens": 64, "scheduler": "baseline"}
    tokens, preemptions = ch07._preempt_run(**ok)
    roomy, none = ch07._preempt_run(16, 256, 512, "production")
    assert preemptions > 0 and none == 0 and tokens == roomy
    assert "Correct" in ch07.check_preemption_design(ok)
    with pytest.raises(AssertionError, match="nothing was preempted"):
        ch07.check_preemption_design({**ok, "scheduler": "production"})   # reserves: never
    with pytest.raises(AssertionError, match="refused"):
        ch07.check_preemption_design({**ok, "num_blocks": 4})
    with pytest.raises(AssertionError, match="exactly the keys"):
        ch07.check_preemption_design({"block_size": 4})
    with pytest.raises(AssertionError, match="scheduler must be"):
        ch07.check_preemption_design({**ok, "scheduler": "fifo"})
