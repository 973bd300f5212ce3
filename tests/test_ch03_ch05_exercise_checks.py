"""The exercise checks chapters 3 to 5 grade with since the issue-22 audit: chapter 3's admission
rule for forked samples, chapter 5's crash test on the scripted run, and the clear errors the
numeric and order checks of chapters 3 and 4 give for answers of the wrong type."""

from __future__ import annotations

import pytest

from kvlab.exercises import ch03, ch04, ch05
from kvlab.exercises._common import NotYetAnswered
from kvlab.labs.recovery import recover
from kvlab.labs.recovery.event_log import EventLog


def _rule(num_blocks, block_size, prompt_tokens, output_tokens):
    shared = prompt_tokens // block_size
    own = -(-(prompt_tokens + output_tokens) // block_size) - shared
    return max(0, (num_blocks - shared) // own)


def test_sample_rule_cases_match_the_engine():
    cases = ch03.sample_rule_cases()
    assert cases[0] == ch03.SAMPLES_DESIGN and len(cases) == 24
    assert any(c["prompt_tokens"] % c["block_size"] == 0 for c in cases)   # no copy at all
    assert any(c["prompt_tokens"] % c["block_size"] for c in cases)        # copy-on-write
    for case in cases:                     # the closed form is the engine's truth on every case
        n = _rule(**case)
        assert (n == 0 or ch03.samples_fit(n, **case)) and not ch03.samples_fit(n + 1, **case)
    assert {_rule(**c) for c in cases} >= {0, 1}   # some pools hold none or a single sample


def test_check_sample_rule_messages():
    assert "Correct on 24" in ch03.check_sample_rule(_rule)

    def whole_prompt_shared(num_blocks, block_size, prompt_tokens, output_tokens):
        shared = -(-prompt_tokens // block_size)            # counts the partial block once
        own = max(1, -(-(prompt_tokens + output_tokens) // block_size) - shared)
        return max(0, (num_blocks - shared) // own)

    def no_sharing(num_blocks, block_size, prompt_tokens, output_tokens):
        return num_blocks // -(-(prompt_tokens + output_tokens) // block_size)

    # a rule that admits too many and one that admits too few get the same kind of verdict:
    # the case and what to revisit, never the n, nor which way it is off
    for wrong in (whole_prompt_shared, no_sharing):
        with pytest.raises(AssertionError, match="is not the largest that runs") as err:
            ch03.check_sample_rule(wrong)
        message = str(err.value)
        assert "n = " not in message and "too" not in message and "cautious" not in message
    # a constant right on the chapter's pool fails on another pool, naming no pool
    with pytest.raises(AssertionError, match="on every pool") as err:
        ch03.check_sample_rule(lambda **case: 6)
    assert "prompt" not in str(err.value).split(":")[0] and "blocks of" not in str(err.value)
    with pytest.raises(AssertionError, match="whole number"):
        ch03.check_sample_rule(lambda **case: 6.0)
    with pytest.raises(AssertionError, match="pass a function"):
        ch03.check_sample_rule(6)
    with pytest.raises(NotYetAnswered):
        ch03.check_sample_rule(...)


def _held_blocks(prompt_tokens, output_tokens, block_size):
    full = prompt_tokens // block_size
    per_sample = [-(-(prompt_tokens + out) // block_size) for out in output_tokens]
    copies = len(output_tokens) - 1 if prompt_tokens % block_size else 0
    return full + sum(n - full for n in per_sample), sum(per_sample), copies


def test_check_sampling_blocks_runs_hidden_requests():
    import random

    rng = random.Random(3)
    for case in [ch03.SAMPLING] + [ch03._draw_sampling(rng) for _ in range(60)]:
        assert _held_blocks(**case) == ch03._sampling_blocks(**case), case
    assert _held_blocks(**ch03.SAMPLING) == (67, 247, 4)
    assert "Correct on 17" in ch03.check_sampling_blocks(_held_blocks)
    # the printed triple alone, or sharing the partial block too: one verdict, no case
    for wrong in (lambda **case: (67, 247, 4),
                  lambda prompt_tokens, output_tokens, block_size: (
                      *_held_blocks(prompt_tokens, output_tokens, block_size)[:2],
                      len(output_tokens) - 1)):
        with pytest.raises(AssertionError, match="not right on every request") as err:
            ch03.check_sampling_blocks(wrong)
        assert "730" not in str(err.value) and "67" not in str(err.value)
    with pytest.raises(AssertionError, match="pass a function"):
        ch03.check_sampling_blocks(67)


def test_numeric_and_order_checks_refuse_wrong_types():
    with pytest.raises(AssertionError, match="whole numbers"):
        ch03.check_sampling_blocks(lambda **case: (67, "247", 4))
    with pytest.raises(AssertionError, match="whole number"):
        ch04.check_conversation_hit(63.0, 48, "c")
    with pytest.raises(AssertionError, match="list of request ids"):
        ch04.check_request_order("g0q0")
    with pytest.raises(AssertionError, match="list of request ids"):
        ch04.check_request_order(12)
    with pytest.raises(AssertionError, match="list of statuses"):
        ch05.check_abort_prediction("waiting", "abort", 0, 3, 9)


def test_scripted_run_crash_test():
    full = EventLog()
    ch05.scripted_run(full)
    # the crash points at which recovery finishes one request and resumes another: after
    # q3's last record (q0, q2 still decoding), and after q0's (q2 still decoding)
    good = []
    for k in range(len(full.events)):
        events, kv = ch05.crash_scenario(k)
        _, report = recover(events, kv, ch05.SCRIPTED.scheduler)
        if report.finished and report.resumed:
            good.append(k)
    assert good == [36, 40, 41]
    last = {e.request_id: e.index for e in full.events if e.kind == "progress"}
    assert last["q3"] == 35 and last["q0"] == 39
    # crash_scenario keeps its default crash point and its one orphan
    events, kv = ch05.crash_scenario()
    assert len(events) == 37 and kv.has("q3")
