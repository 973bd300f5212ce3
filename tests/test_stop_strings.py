"""SamplingParams.stop in the offline engine (kvlab.engine.stop_strings): the text ends before
the first stop string, the tokens through the one that completed it, finish_reason "stop",
stop_reason the string, the sample's KV freed at the match; samples of n > 1 stop on their
own; bad values name the field."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.invariants import check_engine

PROMPT = "Trern Thyvet was a generous shepherd who lived in"


@pytest.fixture(scope="module")
def llm():
    return LLM("kvlab-tiny")


def _one(llm, **kw):
    return llm.generate(PROMPT, SamplingParams(max_tokens=40, **kw), use_tqdm=False)[0]


def _cut_tokens(llm, tokens, text_end):
    """How many of ``tokens`` it takes for the decoded text to reach ``text_end`` characters."""
    for k in range(1, len(tokens) + 1):
        if len(llm.tokenizer.decode(tokens[:k])) >= text_end:
            return k
    raise AssertionError("the text never reaches the match")


def test_greedy_text_ends_before_the_first_stop_string(llm):
    full = _one(llm, temperature=0).outputs[0]
    pieces = [llm.tokenizer.decode(full.token_ids[:k]) for k in range(len(full.token_ids) + 1)]
    # a stop string that spans a token boundary: the last 2 characters of one token's text
    # and the first of the next
    k = next(k for k in range(3, len(pieces) - 1)
             if len(pieces[k]) - len(pieces[k - 1]) >= 2 and len(pieces[k + 1]) > len(pieces[k]))
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k])]
    at = full.text.find(stop)
    assert at >= 0
    out = _one(llm, temperature=0, stop=[stop, "never appears here"]).outputs[0]
    assert out.text == full.text[:at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    n = _cut_tokens(llm, full.token_ids, at + len(stop))
    assert out.token_ids == full.token_ids[:n] and n < len(full.token_ids)


def test_a_stop_string_that_never_matches_changes_nothing(llm):
    full = _one(llm, temperature=0).outputs[0]
    out = _one(llm, temperature=0, stop="\x00never\x00").outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == \
        (full.text, full.token_ids, "length", None)


def test_each_of_n_samples_stops_on_its_own(llm):
    params = dict(temperature=1.0, seed=11, n=4)
    full = _one(llm, **params)
    stop = "e"
    got = _one(llm, stop=stop, **params)
    assert len(got.outputs) == 4 and got.finished
    for want, out in zip(full.outputs, got.outputs, strict=True):
        at = want.text.find(stop)
        if at < 0:
            assert (out.text, out.finish_reason, out.stop_reason) == (want.text, "length", None)
        else:
            assert (out.text, out.finish_reason, out.stop_reason) == (want.text[:at], "stop", stop)
            n = _cut_tokens(llm, want.token_ids, at + len(stop))
            assert out.token_ids == want.token_ids[:n]
    assert sum(o.finish_reason == "stop" for o in got.outputs) >= 2   # the test sees both kinds


def test_the_matched_sample_leaves_the_engine_at_once(llm):
    engine = LLMEngine(EngineArgs("kvlab-tiny"))
    full = _one(llm, temperature=0).outputs[0]
    stop = full.text[10:13]
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=40, temperature=0, stop=stop))
    engine.add_request("long", PROMPT, SamplingParams(max_tokens=40, temperature=0))
    ended = None
    while ended is None:
        for out in engine.step():
            if out.request_id == "s" and out.finished:
                ended = out
    # the step that matched ended it: its KV is free while the other request still runs
    assert engine.scheduler.find_request("s") is None
    assert engine.has_unfinished_requests() and not engine.has_request("s")
    assert ended.outputs[0].finish_reason == "stop" and ended.outputs[0].text == full.text[:10]
    check_engine(engine)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_allocatable() == engine.kv.num_blocks


def test_a_stop_token_id_is_the_stop_reason(llm):
    full = _one(llm, temperature=0).outputs[0]
    token = full.token_ids[5]
    out = _one(llm, temperature=0, stop_token_ids=[token]).outputs[0]
    assert out.token_ids[-1] == token and out.finish_reason == "stop"
    assert out.stop_reason == token


@pytest.mark.parametrize("bad", [5, [""], ["a", 3], b"x", {"a": 1}])
def test_bad_stop_values_name_the_field(bad):
    with pytest.raises(ValueError, match=r"SamplingParams\.stop"):
        SamplingParams(stop=bad)


def test_stop_is_stored_as_a_tuple():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == () and SamplingParams().stop == ()


def test_stop_strings_are_refused_with_delta_outputs(llm):
    """A DELTA output's text is its new tokens' alone, so the engine cannot cut it at a stop
    string: such a request is refused, naming both needs (the server matches stop strings on
    its own incremental text instead)."""
    from kvlab.core.sampling_params import RequestOutputKind

    with pytest.raises(ValueError, match="needs a tokenizer and CUMULATIVE outputs"):
        llm.engine.validate_request(PROMPT, SamplingParams(
            stop="x", output_kind=RequestOutputKind.DELTA))
    llm.engine.validate_request(PROMPT, SamplingParams(stop="x"))     # CUMULATIVE: accepted
