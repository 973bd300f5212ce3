"""Chapter 7 exercise checks accept the right answers and reject wrong ones."""

from __future__ import annotations

import random

import pytest

from kvlab.exercises import _common, ch07
from kvlab.exercises._common import NotYetAnswered


def forget_predictions() -> None:
    """A new reader: no prediction recorded, in memory or beside the notebook (tests/conftest.py
    points the record's file at the test's own folder)."""
    _common._PREDICTIONS.clear()
    if _common._PREDICTION_FILE is not None:
        _common._PREDICTION_FILE.unlink(missing_ok=True)


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
    from kvlab.labs.parity.hf import save_random_hf_model

    path = save_random_hf_model(tmp_path / "m", "llama")  # 2 layers, 2 KV heads, head_dim 16
    assert "Correct" in ch07.check_kv_bytes_per_token(2 * 2 * 2 * 16 * 4, model=str(path))
    messages = set()
    for wrong in (2 * 2 * 4 * 16 * 4, 2 * 2 * 1 * 16 * 4):     # one too high, one too low
        with pytest.raises(AssertionError, match="not the KV bytes per token") as err:
            ch07.check_kv_bytes_per_token(wrong, model=str(path))
        assert str(2 * 2 * 2 * 16 * 4) not in str(err.value)
        messages.add(str(err.value).replace(repr(wrong), "X"))
    assert len(messages) == 1, "the feedback does not say which way an answer is off"


def test_suspect_rule_check():
    import torch

    from kvlab.engine.attention_cpu import CpuAttention
    from kvlab.engine.attention_torch import TorchAttention

    def same(backend, start, n):
        return torch.allclose(
            ch07._attention_outputs(ch07._engine_attention_step, backend, start, n),
            ch07._attention_outputs(ch07.suspect_attention_step, backend, start, n))

    # the truth, independently: on the torch backend only a fresh prompt of several tokens
    # attends the K/V it was handed; a one-token chunk is a paged row and a chunk behind a
    # prefix reads its own K/V through its table
    torch_backend = TorchAttention()
    assert all(same(torch_backend, 0, n) for n in (2, 7, 30))
    assert not any(same(torch_backend, start, n) for start, n in ((0, 1), (3, 1), (5, 4),
                                                                 (9, 20)))
    cpu = CpuAttention.create(torch.float32)
    if cpu is not None:   # the compiled backend reads every chunk from the cache
        assert not any(same(cpu, start, n) for start, n in ((0, 1), (0, 7), (5, 4), (9, 20)))

    def right(start, n, backend):
        return backend == "cpu" or not (start == 0 and n > 1)

    assert "Correct" in ch07.check_suspect_rule(right)
    wrong = (lambda s, n, b: n == 1,                      # only decodes
             lambda s, n, b: not (s == 0 and n > 1),      # the torch rule on both backends
             lambda s, n, b: True)                        # everything
    messages = set()
    for fn in wrong:
        if fn is wrong[1] and cpu is None:
            continue
        with pytest.raises(AssertionError, match="wrong for at least one of") as err:
            ch07.check_suspect_rule(fn)
        messages.add(str(err.value).split(" of the ")[0])
        for word in ("fresh", "start_pos", "before", "order", "True", "False", "torch"):
            assert word not in str(err.value)             # the rule, bug and chunk unnamed
    assert len(messages) == 1                             # one verdict, whatever is wrong


def test_suspect_rule_check_cannot_be_searched():
    # the module holds no table of the truth and no public helper that runs it
    assert not hasattr(ch07, "suspect_differs") and not hasattr(ch07, "SUSPECT_CHUNKS")
    # every chunk is asked before the one verdict (logging the last call and flipping it
    # learns nothing), and each call draws new chunks
    import torch

    from kvlab.engine.attention_cpu import CpuAttention

    backends = 1 + (CpuAttention.create(torch.float32) is not None)
    calls = []

    def wrong_first(start, n, backend):
        calls.append((start, n, backend))
        rule = backend == "cpu" or not (start == 0 and n > 1)
        return rule if len(calls) > 1 else not rule

    drawn = []
    for _ in range(2):
        calls.clear()
        with pytest.raises(AssertionError, match="wrong for at least one of"):
            ch07.check_suspect_rule(wrong_first)
        drawn.append(list(calls))
    per_backend = len(ch07._hidden_chunks(random.Random(0)))
    assert [len(c) for c in drawn] == [backends * per_backend] * 2
    assert drawn[0] != drawn[1]
    # every kind of chunk is drawn each time
    chunks = ch07._hidden_chunks(random.Random(1))
    assert (0, 1) in chunks
    assert any(s == 0 and n > 1 for s, n in chunks)
    assert any(s > 0 and n == 1 for s, n in chunks)
    assert any(s > 0 and 1 < n <= 16 for s, n in chunks)
    assert any(s > 0 and n > 16 for s, n in chunks)
    with pytest.raises(AssertionError, match="True or False"):
        ch07.check_suspect_rule(lambda s, n, b: "yes")
    with pytest.raises(AssertionError, match="raised"):
        ch07.check_suspect_rule(lambda s, n, b: 1 / 0)
    with pytest.raises(NotYetAnswered):
        ch07.check_suspect_rule(...)


def test_suspect_step_docstring_does_not_name_the_bug():
    doc = ch07.suspect_attention_step.__doc__.lower()
    assert not [w for w in ("order", "write", "late", "before") if w in doc]


def test_attention_intensity_check():
    assert "Correct" in ch07.check_attention_intensity(
        lambda layers, heads, kv_heads, dim, nbytes, ctx: 2 * heads / (kv_heads * nbytes))
    wrong = (lambda layers, heads, kv, dim, nbytes, ctx: heads / (kv * nbytes),
             lambda layers, heads, kv, dim, nbytes, ctx: 2 * heads / nbytes)
    for fn in wrong:
        with pytest.raises(AssertionError, match="not the engine's accounting") as err:
            ch07.check_attention_intensity(fn)
        for word in ("too high", "too low", "heads per"):   # no direction, no formula
            assert word not in str(err.value)
    with pytest.raises(AssertionError, match="raised"):
        ch07.check_attention_intensity(lambda *a: 1 / 0)
    with pytest.raises(AssertionError, match="a number"):
        ch07.check_attention_intensity(lambda *a: "1.5")
    with pytest.raises(NotYetAnswered):
        ch07.check_attention_intensity(...)


def test_attention_intensity_truth_is_the_engine_accounting():
    # kvlab-tiny: 6 query heads over 2 KV heads in float32 is the chapter's printed 1.5
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import seal_answers

    intensity = seal_answers.load_answers().attention_intensity   # the instructor edition
    assert intensity(4, 6, 2, 32, 4, 256) == pytest.approx(1.5)


def test_paged_rows_check():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import seal_answers

    # the layout that gives the answer is built in the instructor edition (course/answers.py)
    meta = seal_answers.load_answers()._rows_step_metadata()
    names = list(ch07.ROWS_STEP)
    rows, dense = meta.paged_rows.numel(), {names[s] for s in meta.dense}
    # independently, from the rule: one-token chunks, and short chunks behind a prefix
    from kvlab.engine.attention_cpu import CpuAttention

    PAGED_MAX_TOKENS = CpuAttention.paged_max_tokens

    paged = {c for c, (p, n) in ch07.ROWS_STEP.items()
             if n == 1 or (p > 0 and n <= PAGED_MAX_TOKENS)}
    assert dense == set(names) - paged
    assert rows == sum(ch07.ROWS_STEP[c][1] for c in paged)
    assert "Correct" in ch07.check_paged_rows(rows, dense)
    assert "Correct" in ch07.check_paged_rows(rows, "".join(sorted(dense)))
    messages = set()
    for wrong_rows, wrong_dense in ((rows + 1, dense), (rows, dense | {"A"}),
                                    (2, {"B", "C", "D"})):
        forget_predictions()
        with pytest.raises(AssertionError, match="not how the runner lays out") as err:
            ch07.check_paged_rows(wrong_rows, wrong_dense)
        assert str(rows) not in str(err.value)
        messages.add(str(err.value))
    assert len(messages) == 1       # one verdict: which half is wrong is not said
    # graded once: after a wrong prediction, the right answer is not graded
    assert "not right" in ch07.check_paged_rows(rows, dense)
    assert "not right" in ch07.check_paged_rows(rows - 1, dense)
    forget_predictions()
    with pytest.raises(AssertionError, match="chunks are"):
        ch07.check_paged_rows(rows, {"Z"})
    with pytest.raises(AssertionError, match="whole number"):
        ch07.check_paged_rows("14", dense)
    with pytest.raises(NotYetAnswered):
        ch07.check_paged_rows(..., dense)


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
