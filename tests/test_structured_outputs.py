"""Structured outputs: every output is in its language, unconstrained rows are untouched, greedy
output equals an independent slow reference, and grammar state survives preemption, n > 1 and
rollback. Bad patterns are refused at the boundary with the engine unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm import LLM
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.structured_outputs import (
    GrammarError,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_token_bitmask,
    choice_ebnf,
    unpack_bitmask,
)
from kvlab.labs.invariants import check_engine

jsonschema = pytest.importorskip("jsonschema")
regex = pytest.importorskip("regex")
pytest.importorskip("xgrammar")

MODEL = "kvlab-tiny"
EOS = 1
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "pet": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
          "required": ["name", "age", "pet", "tags"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
WORDS = r"(red|green|blue)( (red|green|blue)){0,3}\."
CHOICES = ["yes", "no", "not sure", 'say "hi"\\']
# nested parentheses around a number: not a regular language
PARENS = 'root ::= "(" inner ")"\ninner ::= [0-9] [0-9]? | "(" inner ")"'
PROMPTS = ["Once upon a time", "The cat sat", "Answer:", "In the town of", "1, 2, 3,",
           "She said"]


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, seed=0)


def _parens_ok(text: str) -> bool:
    """Independent recogniser of PARENS: k '(' , one or two digits, k ')' with k >= 1."""
    k = len(text) - len(text.lstrip("("))
    core = text[k:len(text) - k]
    return k >= 1 and text.endswith(")" * k) and core.isdigit() and 1 <= len(core) <= 2


def _in_language(spec: dict, text: str) -> bool:
    (kind, value), = spec.items()
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), value)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return regex.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    return _parens_ok(text)


SPECS = [{"json": PERSON}, {"regex": PHONE}, {"regex": WORDS}, {"choice": CHOICES},
         {"grammar": PARENS}]


# ---------------------------------------------------------------- the boundary
def test_params_shape_validated():
    ok = SamplingParams(structured_outputs={"json": json.dumps(PERSON)})
    assert ok.structured_outputs == StructuredOutputsParams(json=json.dumps(PERSON))
    assert SamplingParams(structured_outputs={"json": PERSON}) == ok  # dict == its JSON text
    assert list(json.loads(ok.structured_outputs.json)["properties"]) == list(
        PERSON["properties"])  # key order kept: it orders the output's fields
    hash(ok)  # frozen all the way down
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice \
        == ("a", "b")
    direct = StructuredOutputsParams(regex="a+")
    assert SamplingParams(structured_outputs=direct).structured_outputs is direct
    assert direct.kind == "regex" and direct.value == "a+"
    bad = [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
           ({"json_object": True}, "unsupported key"), ({"regex": ""}, "non-empty str"),
           ({"regex": 3}, "non-empty str"), ({"grammar": None}, "must not be None"),
           ({"choice": "ab"}, "list of str"), ({"choice": []}, "non-empty list"),
           ({"choice": ["a", 1]}, "non-empty list"), ({"json": "[1, 2]"}, "schema object"),
           ({"json": "{bad"}, "not valid JSON"), ({"json": {"x": {1, 2}}}, "JSON-serialisable"),
           ("regex", "must be a dict")]
    for value, words in bad:
        with pytest.raises(ValueError, match=words):
            SamplingParams(structured_outputs=value)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar="root ::= \"a\"")


@pytest.mark.parametrize("spec, words", [
    ({"regex": "[a-"}, "regex.*Unclosed"),
    ({"regex": "(ab"}, "regex.*parenthesis"),
    ({"json": {"type": "nope"}}, "json.*nope"),
    ({"grammar": "root ::= missing"}, "grammar.*missing"),
    ({"grammar": "start ::= \"a\""}, "grammar.*root"),
])
def test_bad_grammar_refused_with_engine_unchanged(llm, spec, words):
    engine = llm.engine
    before = (engine.kv.state_tuple(), engine.get_num_unfinished_requests(),
              engine.has_unfinished_requests())
    params = SamplingParams(max_tokens=5, structured_outputs=spec)
    with pytest.raises(GrammarError, match=words):
        engine.add_request("bad", "Hello", params)
    assert not engine.has_request("bad")
    # generate validates every prompt before queueing any: the good one never runs either
    good = SamplingParams(max_tokens=5, structured_outputs={"regex": "a+"})
    with pytest.raises(ValueError, match=words):
        llm.generate(["Hello", "World"], [good, params], use_tqdm=False)
    assert (engine.kv.state_tuple(), engine.get_num_unfinished_requests(),
            engine.has_unfinished_requests()) == before
    check_engine(engine)


def test_model_without_tokenizer_refuses_structured_outputs(tmp_path):
    pytest.importorskip("transformers")
    from kvlab.labs.parity.hf import save_random_hf_model

    model = save_random_hf_model(tmp_path / "m", "llama", seed=1)
    engine = LLMEngine(EngineArgs(model, num_blocks=32))
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("r", [3, 4, 5], SamplingParams(structured_outputs={"regex": "a"}))
    assert not engine.has_unfinished_requests()


# ---------------------------------------------------------------- the outputs
def test_every_output_is_in_its_language(llm):
    params, expected = [], []
    for i, spec in enumerate(SPECS):
        for seed in range(3):
            temp = 0.0 if seed == 0 else 1.0
            params.append(SamplingParams(max_tokens=64, temperature=temp, seed=100 * i + seed,
                                         structured_outputs=spec))
            expected.append(spec)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, spec in zip(outs, expected, strict=True):
        (c,) = out.outputs
        assert c.finish_reason == "stop", (spec, c.text)
        assert c.token_ids[-1] == EOS  # the grammar's end is the model's EOS
        assert _in_language(spec, c.text), (spec, c.text)
    check_engine(llm.engine)


def test_unconstrained_rows_get_identical_tokens(llm):
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=1.2, top_k=50, seed=6, ignore_eos=True,
                           logprobs=3)]
    alone = llm.generate(PROMPTS[:3], free, use_tqdm=False)
    constrained = [SamplingParams(max_tokens=24, temperature=1.0, seed=9 + i,
                                  structured_outputs=spec) for i, spec in enumerate(SPECS)]
    mixed = llm.generate(PROMPTS[:3] + PROMPTS[:len(SPECS)], free + constrained,
                         use_tqdm=False)
    for a, m in zip(alone, mixed[:3], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        # same tokens; log-probabilities equal up to batch-shape float rounding (a masked row
        # would differ by whole nats: its disallowed tokens are at -inf)
        for da, dm in zip(a.outputs[0].logprobs or [], m.outputs[0].logprobs or [],
                          strict=True):
            assert da.keys() == dm.keys()
            assert all(abs(da[t] - dm[t]) < 1e-4 for t in da)


# ---------------------------------------------------------------- the slow reference
def _reference_allowed(tok, prefix: list[int], spec: dict, vocab: int) -> list[int]:
    """Token t is allowed iff decode(prefix + [t]) is a prefix of a sentence (regex partial
    matching / choice prefixes); EOS iff decode(prefix) is a full sentence. Special tokens never
    carry text."""
    (kind, value), = spec.items()
    text = tok.decode(prefix)
    if kind == "regex":
        def viable(s):
            return regex.fullmatch(value, s, partial=True) is not None
        full = regex.fullmatch(value, text) is not None
    else:
        def viable(s):
            return any(c.startswith(s) for c in value)
        full = text in value
    special = set(tok.special_token_ids)
    allowed = [t for t in range(vocab) if t not in special
               and len(tok.decode([*prefix, t])) > len(text) and viable(tok.decode([*prefix, t]))]
    return sorted([*allowed, EOS]) if full else allowed


@pytest.mark.parametrize("spec", [{"regex": PHONE}, {"regex": WORDS}, {"choice": CHOICES},
                                  {"regex": r"[a-z]+ (is|was) \d+"}],
                         ids=["phone", "words", "choice", "sentence"])
def test_greedy_equals_slow_reference(spec):
    """Greedy constrained decoding == argmax over the model's raw next-token logprobs (from an
    unconstrained engine, one request per prefix) restricted to the reference's allowed set."""
    llm = LLM(MODEL, seed=0, enable_prefix_caching=False)
    tok, vocab = llm.tokenizer, llm.engine.config.vocab_size
    prompt = tok.encode("Once upon a time")
    got = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0,
                                                structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0].token_ids
    out: list[int] = []
    raw = SamplingParams(max_tokens=1, temperature=0, logprobs=vocab, ignore_eos=True)
    while len(out) < 30 and (not out or out[-1] != EOS):
        logprobs = llm.generate([prompt + out], raw, use_tqdm=False)[0].outputs[0].logprobs[0]
        allowed = _reference_allowed(tok, out, spec, vocab)
        assert allowed, f"reference: dead end after {out}"
        out.append(max(allowed, key=lambda t: logprobs[t]))
    assert got == out


def test_grammar_mask_equals_reference_mask_along_a_path(llm):
    """The engine's allowed sets equal the independent reference at every step of an output."""
    spec = {"regex": WORDS}
    tok, vocab = llm.tokenizer, llm.engine.config.vocab_size
    out = llm.generate(["Colors:"], SamplingParams(max_tokens=40, temperature=1.0, seed=2,
                                                   structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0].token_ids
    state = llm.engine.structured_outputs.compiler.new_state(StructuredOutputsParams(**spec))
    for i, t in enumerate(out):
        assert state.allowed_token_ids() == _reference_allowed(tok, list(out[:i]), spec, vocab)
        assert state.accept_token(t)
    assert state.is_terminated()


def test_vocabulary_bytes_match_the_tokenizer(llm):
    """xgrammar's view of each token (byte-level decoding, special tokens empty) is the text
    kvlab's tokenizer decodes it to."""
    info = llm.engine.structured_outputs.compiler.info
    tok = llm.tokenizer
    special = set(tok.special_token_ids)
    assert special == {0, 1} and info.stop_token_ids == [EOS]
    checked = 0
    for i, raw in enumerate(info.decoded_vocab):
        if i in special:
            assert raw == b""
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue   # a partial UTF-8 sequence: the tokenizer prints U+FFFD for it
        assert text == tok.decode([i]), i
        checked += 1
    assert checked > 700


def test_choice_ebnf_escapes():
    assert choice_ebnf(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\x0af"'


# ---------------------------------------------------------------- preemption, n > 1, ignore_eos
def test_preemption_keeps_grammar_state():
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=40 + i,
                             structured_outputs=SPECS[i % len(SPECS)]) for i in range(6)]
    ample = LLM(MODEL, block_size=4, num_blocks=256, enable_prefix_caching=False)
    ref = ample.generate(PROMPTS, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in ref) == 0
    engine = LLMEngine(EngineArgs(MODEL, block_size=4, num_blocks=24, enable_prefix_caching=False))
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(only_finished=True):
            done[out.request_id] = out
        check_engine(engine)   # grammar states == output tokens after every step
    tight = [done[f"r{i}"] for i in range(6)]
    assert sum(o.metrics.num_preemptions for o in tight) > 0   # the pressure is real
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in ref]
    for i, o in enumerate(tight):
        assert o.outputs[0].finish_reason == "stop"
        assert _in_language(SPECS[i % len(SPECS)], o.outputs[0].text)


def test_n_samples_have_independent_grammar_states(llm):
    spec = {"regex": WORDS}
    many = llm.generate(["Colors:"], SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=7,
                                                    structured_outputs=spec),
                        use_tqdm=False)[0]
    singles = llm.generate(["Colors:"] * 4, [SamplingParams(
        max_tokens=40, temperature=1.0, seed=7 + i, structured_outputs=spec) for i in range(4)],
        use_tqdm=False)
    assert [c.token_ids for c in many.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({c.text for c in many.outputs}) > 1
    assert all(_in_language(spec, c.text) and c.finish_reason == "stop" for c in many.outputs)


def test_grammar_end_stops_even_with_ignore_eos(llm):
    (c,) = llm.generate(["Pick:"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                  structured_outputs={"choice": ["ok", "fine"]}),
                        use_tqdm=False)[0].outputs
    assert c.finish_reason == "stop" and c.text in ("ok", "fine")


def test_compiled_grammars_are_cached(llm):
    compiler = llm.engine.structured_outputs.compiler
    spec = {"regex": r"cache[0-9]test"}
    before = compiler.compilations
    llm.generate(["a", "b"], SamplingParams(n=3, max_tokens=8, structured_outputs=spec),
                 use_tqdm=False)
    llm.generate(["c"], SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)
    assert compiler.compilations == before + 1


def test_invariant_catches_a_desynchronised_grammar(llm):
    engine = llm.engine
    engine.add_request("desync", "Hi", SamplingParams(max_tokens=8, structured_outputs={
        "regex": "[a-z]+"}))
    engine.step()
    state = engine.executor.requests["desync"].grammar
    assert state.accept_token(state.allowed_token_ids()[-1])
    with pytest.raises(AssertionError, match="grammar state"):
        check_engine(engine)
    state.rollback(1)
    check_engine(engine)
    engine.abort_request("desync")


# ---------------------------------------------------------------- the state object
def test_rollback_then_reaccept_gives_the_same_state(llm):
    compiler = llm.engine.structured_outputs.compiler
    spec = StructuredOutputsParams(json=json.dumps(PERSON))
    tokens = llm.generate(["Person:"], SamplingParams(max_tokens=64, temperature=1.0, seed=3,
                                                      structured_outputs=spec),
                          use_tqdm=False)[0].outputs[0].token_ids
    state = compiler.new_state(spec)
    masks = [state.allowed_token_ids()]
    for t in tokens:
        assert state.accept_token(t)
        masks.append(state.allowed_token_ids())
    assert state.is_terminated() and masks[-1] == []
    n = len(tokens)
    for k in (1, 2, 5, n // 2, n):
        state.rollback(k)
        assert state.num_accepted == n - k
        assert state.allowed_token_ids() == masks[n - k]
        assert not state.is_terminated()
        for t in tokens[n - k:]:
            assert state.accept_token(t)
        assert state.accepted_token_ids == tuple(tokens) and state.is_terminated()
    # refused tokens and bad rollbacks change nothing
    state.rollback(n - 3)
    disallowed = next(t for t in range(1024) if t not in masks[3])
    assert not state.accept_token(disallowed) and not state.accept_token(5000)
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ValueError, match="rollback"):
            state.rollback(bad)
    assert state.accepted_token_ids == tuple(tokens[:3])
    assert state.allowed_token_ids() == masks[3]
    # rebuild replays; a clone is independent
    other = compiler.new_state(spec)
    other.rebuild(tokens[:3])
    assert other.allowed_token_ids() == masks[3]
    twin = other.clone()
    assert twin.accept_token(tokens[3]) and other.num_accepted == 3
    with pytest.raises(ValueError, match="position 1"):
        other.rebuild([tokens[0], disallowed])
    assert other.accepted_token_ids == tuple(tokens[:3])


def test_batched_mask_touches_only_grammar_rows(llm):
    compiler = llm.engine.structured_outputs.compiler
    states = [compiler.new_state(StructuredOutputsParams(regex=PHONE)),
              compiler.new_state(StructuredOutputsParams(choice=tuple(CHOICES)))]
    assert states[1].accept_token(llm.tokenizer.encode("n", add_special_tokens=False)[0])
    logits = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_token_bitmask(logits, [3, 1], states)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, state in ((3, states[0]), (1, states[1])):
        allowed = torch.zeros(1024, dtype=torch.bool)
        allowed[state.allowed_token_ids()] = True
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert torch.isneginf(logits[row][~allowed]).all()
    mask = allocate_bitmask(1, 1024)
    states[1].fill_bitmask(mask, 0)
    assert unpack_bitmask(mask, 1024)[0].nonzero()[:, 0].tolist() == states[1].allowed_token_ids()
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(logits, [0], states)


def test_random_accept_rollback_sequences_match_replay(llm):
    """Property: after any sequence of accepts (allowed or not) and rollbacks, the state equals
    a fresh state that replayed the surviving tokens (same allowed set, same termination)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    compiler = llm.engine.structured_outputs.compiler
    spec = StructuredOutputsParams(regex=WORDS)
    ops = st.lists(st.one_of(st.tuples(st.just("allowed"), st.integers(0, 10**6)),
                             st.tuples(st.just("any"), st.integers(0, 1023)),
                             st.tuples(st.just("rollback"), st.integers(0, 6))), max_size=30)

    @settings(max_examples=40, deadline=None, database=None)
    @given(ops)
    def run(script):
        state, kept = compiler.new_state(spec), []
        for op, arg in script:
            if op == "rollback":
                k = min(arg, len(kept))
                state.rollback(k)
                del kept[len(kept) - k:]
            else:
                allowed = state.allowed_token_ids()
                token = allowed[arg % len(allowed)] if op == "allowed" and allowed else arg
                if state.accept_token(token):
                    kept.append(token)
                else:
                    assert token not in allowed
            replay = compiler.new_state(spec)
            replay.rebuild(kept)
            assert state.accepted_token_ids == tuple(kept)
            assert state.allowed_token_ids() == replay.allowed_token_ids()
            assert state.is_terminated() == replay.is_terminated()

    run()
