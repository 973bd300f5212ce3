"""Logprobs and echo over HTTP, read with the real ``openai`` client: the values are the engine's
(equal to ``LLM.generate`` for the same greedy or seeded request), shaped as OpenAI's
completions and chat APIs define them, streamed per chunk; token bytes rebuild split characters;
bad values are a 400 naming the field and leave the server serving."""

from __future__ import annotations

import json

import httpx
import pytest
from test_detokenizer import byte_level_tokenizer
from test_serve_api import idle, sse, wait_until

from kvlab import LLM, SamplingParams
from kvlab.engine.detokenizer import REPLACEMENT
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.tokenizer import Tokenizer
from kvlab.entrypoints.async_engine import AsyncEngine
from kvlab.entrypoints.chat_template import conversation
from kvlab.entrypoints.openai_responses import LOGPROB_FLOOR, _byte_alphabet
from kvlab.entrypoints.serve import build_app, chat_template
from kvlab.entrypoints.uvicorn_server import ServerThread

openai = pytest.importorskip("openai")

MODEL = "kvlab-tiny"
PROMPT = "Trern Thyvet was a generous shepherd who"


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=128, max_num_seqs=16))
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        srv.engine = engine
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        yield srv


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=128)


def reference(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]


def piece(tok, token_id: int) -> str:
    """A whole token's name in logprobs: its text with special tokens kept (vLLM 0.32's
    ``convert_ids_list_to_tokens``, ``vllm/tokenizers/detokenizer_utils.py``)."""
    return tok.decode([token_id], skip_special_tokens=False)


def vllm_name(tok, token_id: int, before: list[int]) -> str:
    """vLLM 0.32's name for a token after ``before`` (``LogprobsProcessor._verify_tokens`` and
    ``_correct_decoded_token``, ``vllm/v1/engine/logprobs.py``): a text ending in U+FFFD is
    decoded again after 1..4 of the tokens before it; the first try that ends cleanly gives the
    text past the context's own complete characters, none gives ''."""
    text = piece(tok, token_id)
    if not text.endswith(REPLACEMENT):
        return text
    ctx_all = before[-4:]
    for n in range(1, len(ctx_all) + 1):
        ctx = ctx_all[-n:]
        full = tok.decode([*ctx, token_id])
        if full.endswith(REPLACEMENT):
            continue
        clean = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if tok.decode([ctx[j]]).endswith(REPLACEMENT):
                clean = j
            else:
                break
        prefix = tok.decode(ctx[:clean]) if clean else ""
        assert full.startswith(prefix)
        return full[len(prefix):]
    return ""


def complete_offsets(decode, ids) -> list[int]:
    """Where each token's text starts: the length of the text of the longest prefix before it
    that ends on a complete character."""
    out, last = [], 0
    for i in range(len(ids)):
        text = decode(ids[:i])
        if not text.endswith(REPLACEMENT):
            last = len(text)
        out.append(last)
    return out


# ---------------------------------------------------------------- /v1/completions

def test_completion_logprobs_are_the_engines_greedy_and_seeded(server, llm):
    tok = server.engine.tokenizer
    got = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    ref = reference(llm, PROMPT, max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    lp = got.choices[0].logprobs
    ids = ref.token_ids
    assert got.choices[0].text == ref.text
    assert lp.tokens == [piece(tok, t) for t in ids]
    assert lp.token_logprobs == [ref.logprobs[i][t] for i, t in enumerate(ids)]
    assert lp.top_logprobs == [{piece(tok, t): v for t, v in d.items()} for d in ref.logprobs]
    assert lp.text_offset == complete_offsets(tok.decode, ids)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3                     # greedy: the sampled token is the best one
        assert top[token] == value == max(top.values())
    # sampled with a seed: the same draws; logprobs=0 reports the sampled token alone
    got = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=1.0, seed=5, logprobs=0,
                                           extra_body={"ignore_eos": True})
    ref = reference(llm, PROMPT, max_tokens=12, temperature=1.0, seed=5, logprobs=0,
                    ignore_eos=True)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == ref.text
    assert lp.top_logprobs == [{piece(tok, t): d[t]} for t, d in zip(ref.token_ids,
                                                                         ref.logprobs,
                                                                         strict=True)]
    assert sum(lp.token_logprobs) == pytest.approx(ref.cumulative_logprob, abs=1e-4)


def test_streamed_completion_logprobs_add_up_to_the_answer(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 3,
            "n": 2, "logprobs": 2, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        chunks = sse(resp)
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert all(c["logprobs"] is not None for c in mine)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == choice["logprobs"][key], key
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert len(choice["logprobs"]["tokens"]) == 16
    assert plain["usage"]["completion_tokens"] == 32


def test_echo_prepends_the_prompt(server, llm):
    tok = server.engine.tokenizer
    ref = reference(llm, PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    got = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                           temperature=0, echo=True, n=2,
                                           extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [PROMPT + ref.text] * 2
    assert got.usage.completion_tokens == 16
    ids = tok.encode(PROMPT)
    got = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                           temperature=0, echo=True,
                                           extra_body={"ignore_eos": True})
    assert got.choices[0].text == tok.decode(ids) + ref.text
    parts = list(server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                  temperature=0, echo=True, stream=True,
                                                  extra_body={"ignore_eos": True}))
    assert parts[0].choices[0].text.startswith(PROMPT)
    assert "".join(p.choices[0].text for p in parts) == PROMPT + ref.text
    # stop strings cut the generated text only
    stop = ref.text[3:6]
    got = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                           temperature=0, echo=True, stop=stop,
                                           extra_body={"ignore_eos": True})
    assert got.choices[0].text == PROMPT + ref.text[:ref.text.find(stop)]


# ---------------------------------------------------------------- /v1/chat/completions

MESSAGES = [{"role": "user", "content": "tell me about the river"}]


def test_chat_logprobs_are_the_engines(server, llm):
    tok = server.engine.tokenizer
    got = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    text = chat_template(server.engine).render(conversation(MESSAGES)[0])
    ref = reference(llm, tok.encode(text, add_special_tokens=False), max_tokens=10,
                    temperature=0, logprobs=2, ignore_eos=True)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == ref.text
    assert [e.token for e in content] == [tok.decode([t]) for t in ref.token_ids]
    assert [e.logprob for e in content] == [d[t] for t, d in zip(ref.token_ids, ref.logprobs,
                                                                  strict=True)]
    assert b"".join(bytes(e.bytes) for e in content).decode() == ref.text
    for e, d in zip(content, ref.logprobs, strict=True):
        best = sorted(d.items(), key=lambda kv: -kv[1])[:2]
        assert [(t.token, t.logprob) for t in e.top_logprobs] == \
            [(tok.decode([i]), v) for i, v in best]
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert e.top_logprobs[0].bytes == e.bytes
    # logprobs=true alone: the sampled token's entry, no alternatives
    got = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                temperature=0, logprobs=True)
    assert [e.top_logprobs for e in got.choices[0].logprobs.content] == [[]] * 4
    # top_logprobs=0 without logprobs is "off" (vLLM): no logprobs object
    got = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                temperature=0, top_logprobs=0)
    assert got.choices[0].logprobs is None


def test_streamed_chat_logprobs_add_up_to_the_answer(server):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0,
          "seed": 11, "logprobs": True, "top_logprobs": 3}
    plain = server.client.chat.completions.create(**kw).choices[0]
    parts = list(server.client.chat.completions.create(**kw, stream=True))
    streamed = [e for p in parts if p.choices and p.choices[0].logprobs
                for e in p.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump()
                                                  for e in plain.logprobs.content]
    assert "".join(p.choices[0].delta.content or "" for p in parts) == plain.message.content


# ---------------------------------------------------------------- bytes of split characters

@pytest.fixture(scope="module")
def bytes_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    byte_level_tokenizer(1024).save(str(path))
    tok = Tokenizer(path)
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=256, tokenizer=tok))
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        srv.tok = tok
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        yield srv


def test_byte_alphabet_is_gpt2s():
    from tokenizers import pre_tokenizers

    table = _byte_alphabet()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))


def test_token_bytes_and_offsets_across_split_characters(bytes_server):
    """Byte-level tokens end inside CJK characters and emoji: each is named as vLLM 0.32 names
    it (the token completing a character reads the character, the others ''), their bytes are
    the real ones (joined they are the answer's UTF-8), and a token's text_offset is where its
    character starts."""
    tok = bytes_server.tok
    prompt = tok.encode("the river 中文😀")
    ref = LLMEngine(EngineArgs(MODEL, max_model_len=256, tokenizer=tok))
    seeds = range(6)
    want = {}
    for s in seeds:       # one at a time, as the server runs them: the same batch shapes
        ref.add_request(f"r{s}", prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=s,
                                                        logprobs=1, ignore_eos=True))
        while ref.has_unfinished_requests():
            want.update({int(o.request_id[1:]): o.outputs[0] for o in ref.step() if o.finished})
    split = 0
    for s in seeds:
        comp = bytes_server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=s, logprobs=1,
            extra_body={"ignore_eos": True})
        lp, ids = comp.choices[0].logprobs, want[s].token_ids
        assert comp.choices[0].text == want[s].text
        assert lp.token_logprobs == [d[t] for t, d in zip(ids, want[s].logprobs, strict=True)]
        assert lp.tokens == [vllm_name(tok, t, ids[:j]) for j, t in enumerate(ids)]
        split += sum(not name and piece(tok, t).endswith(REPLACEMENT)
                     for name, t in zip(lp.tokens, ids, strict=True))
        assert lp.text_offset == complete_offsets(tok.decode, ids)
        got = bytes_server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "中文😀 the river"}],
            max_tokens=24, temperature=1.0, seed=s, logprobs=True, top_logprobs=2,
            extra_body={"ignore_eos": True})
        content = got.choices[0].logprobs.content
        # special tokens are named (and their bytes spelled) as '<|eos|>', as in vLLM; the
        # content skips them (skip_special_tokens)
        raw = b"".join(bytes(e.bytes) for e in content if e.token not in ("<|bos|>", "<|eos|>"))
        assert raw.decode("utf-8", errors="replace") == got.choices[0].message.content
        for e in content:
            if e.token == "":                     # part of a character: its real bytes
                assert e.bytes and e.bytes != list(REPLACEMENT.encode())
                split += 1
    assert split >= 10                           # the runs did split characters


# ---------------------------------------------------------------- masked tokens, bad input

def test_masked_tokens_report_openais_floor_not_infinity(server):
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 4, "temperature": 0,
            "logprobs": 20, "guided_choice": ["yes", "no"]}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and "Infinity" not in resp.text and "NaN" not in resp.text

    def strict(name):
        raise ValueError(f"not JSON: {name}")

    data = json.loads(resp.text, parse_constant=strict)
    tops = data["choices"][0]["logprobs"]["top_logprobs"]
    assert data["choices"][0]["text"] in ("yes", "no")
    assert min(v for d in tops for v in d.values()) == LOGPROB_FLOOR


BAD = [
    ("/v1/completions", {"logprobs": 21}, "logprobs", "invalid_value"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "invalid_value"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "invalid_value"),
    ("/v1/completions", {"logprobs": 2.5}, "logprobs", "invalid_value"),
    ("/v1/completions", {"echo": "yes"}, "echo", "invalid_type"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "invalid_value"),  # only with echo
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "invalid_type"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {"echo": True}, "echo", "unsupported_parameter"),
]


@pytest.mark.parametrize(("route", "extra", "param", "code"), BAD)
def test_bad_logprobs_and_echo_are_400s_naming_the_field(server, route, extra, param, code):
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"messages": MESSAGES} if route.endswith("chat/completions") else
                {"prompt": "hi"})
    resp = httpx.post(server.url + route, json={**base, **extra}, timeout=60)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == code
    assert param in err["message"]
    wait_until(lambda: idle(server.engine))       # nothing reached the engine or stayed there
    ok = httpx.post(server.url + route, json={**base, "logprobs": True if "chat" in route
                                              else 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"] is not None


# ---------------------------------------------------------------- several tokens per step

def test_speculative_steps_deliver_one_entry_per_token(llm):
    """n-gram speculation hands the server several tokens per step: each still gets its own
    logprob entry, the values are the speculative engine's, the tokens are greedy's."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=128, speculative_config=spec))
    prompt = "the river and the town and the river and the town and the"
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "logprobs": 1, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as resp:
            chunks = [c["choices"][0] for c in sse(resp)]
        plain = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    assert max(len(c["logprobs"]["tokens"]) for c in chunks) > 1     # several per step
    lp = plain["choices"][0]["logprobs"]
    assert [x for c in chunks for x in c["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    ref_spec = LLM(MODEL, max_model_len=128, speculative_config=spec)
    want = reference(ref_spec, prompt, max_tokens=24, temperature=0, logprobs=1,
                     ignore_eos=True)
    greedy = reference(llm, prompt, max_tokens=24, temperature=0, ignore_eos=True)
    assert plain["choices"][0]["text"] == want.text == greedy.text
    assert lp["token_logprobs"] == [d[t] for t, d in zip(want.token_ids, want.logprobs,
                                                         strict=True)]


def test_logprobs_and_stop_need_a_tokenizer(tmp_path):
    """A checkpoint without tokenizer.json takes token-id prompts; logprobs cannot name
    tokens there and stop strings cannot be found: 400s naming the field."""
    import shutil
    from pathlib import Path

    import kvlab.models

    src = Path(kvlab.models.__file__).parent / MODEL
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f, tmp_path / f.name)
    engine = LLMEngine(EngineArgs(str(tmp_path), max_model_len=64))
    assert engine.tokenizer is None
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        for extra, param in (({"logprobs": 2}, "logprobs"), ({"stop": "x"}, "stop")):
            resp = httpx.post(srv.url + "/v1/completions", json={
                "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, **extra}, timeout=60)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param
        ok = httpx.post(srv.url + "/v1/completions", json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- echo + logprobs (lm-eval's)
def _prompt_reference(llm, prompt: str, k: int):
    """The offline prompt entries and the greedy first token of ``prompt``."""
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=k,
                                                prompt_logprobs=k), use_tqdm=False)[0]
    return out.prompt_token_ids, out.prompt_logprobs, out.outputs[0]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(server, llm, max_tokens):
    """OpenAI's completion logprobs over prompt (first token null) and generated tokens; the
    values are LLM.generate's prompt_logprobs; max_tokens 0 answers the prompt alone."""
    k = 2
    ids, plp, gen = _prompt_reference(llm, PROMPT, k)
    names = server.engine.tokenizer
    resp = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                            temperature=0, echo=True, logprobs=k)
    c = resp.choices[0]
    lp = c.logprobs
    total = ids + (gen.token_ids if max_tokens else [])
    # the BOS reads '<|bos|>', as vLLM names an echoed prompt's first token
    # (CompletionServing._create_completion_logprobs: tokenizer.decode(token_id))
    assert lp.tokens == [piece(names, t) for t in total] and lp.tokens[0] == "<|bos|>"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(plp[j][ids[j]], abs=1e-6)
        assert lp.top_logprobs[j] == pytest.approx(
            {piece(names, t): v for t, v in plp[j].items()}, abs=1e-6)
    if max_tokens:
        assert lp.token_logprobs[-1] == pytest.approx(gen.logprobs[0][gen.token_ids[0]],
                                                      abs=1e-6)
        assert c.text == PROMPT + gen.text
        assert resp.usage.completion_tokens == 1
    else:
        assert c.text == PROMPT and resp.usage.completion_tokens == 0
    text = names.decode(ids)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(text.startswith(names.decode(ids[:j])) for j in range(len(ids)))
    # lm-eval's sum over a continuation = the offline sum
    assert sum(lp.token_logprobs[3:len(ids)]) == pytest.approx(
        sum(plp[j][ids[j]] for j in range(3, len(ids))), abs=1e-5)
    wait_until(lambda: idle(server.engine))


def test_echo_with_logprobs_streams_the_prompt_entries_first(server, llm):
    ids, plp, _ = _prompt_reference(llm, PROMPT, 1)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "echo": True, "logprobs": 1, "stream": True}) as resp:
        chunks = [c for c in sse(resp) if c.get("choices")]
    got = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert got[0] is None and len(got) == len(ids) + 3
    assert got[1:len(ids)] == pytest.approx([plp[j][ids[j]] for j in range(1, len(ids))],
                                            abs=1e-6)
