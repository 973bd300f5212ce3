"""The server as OpenAI and vLLM clients use it: streamed text equal to the answer (byte-level
tokens that split characters), stop strings, n > 1 and prompt arrays, chat content forms,
structured outputs, the real ``openai`` client; tokenization off the event loop; slow readers
aborted with bounded memory."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest
from test_detokenizer import byte_level_tokenizer

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.detokenizer import REPLACEMENT
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.tokenizer import Tokenizer
from kvlab.entrypoints.async_engine import AsyncEngine
from kvlab.entrypoints.prometheus import parse_metrics
from kvlab.entrypoints.serve import build_app
from kvlab.entrypoints.uvicorn_server import ServerThread
from kvlab.labs.invariants import check_engine

MODEL = "kvlab-tiny"


def idle(engine: LLMEngine) -> bool:
    with engine.core.lock:
        return (not engine.has_unfinished_requests() and not engine.kv.requests()
                and engine.kv.num_allocatable_blocks() == engine.num_blocks)


def wait_until(cond, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def sse(resp: httpx.Response) -> list[dict]:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:") and "[DONE]" not in line:
            out.append(json.loads(line[5:]))
    return out


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    byte_level_tokenizer(1024).save(str(path))    # kvlab-tiny's vocabulary size
    return Tokenizer(path)


@pytest.fixture(scope="module")
def bytes_server(byte_tok):
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=256, max_num_seqs=16, tokenizer=byte_tok))
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=128, max_num_seqs=16))
    with ServerThread(build_app(AsyncEngine(engine, model_name=MODEL), MODEL)) as srv:
        srv.engine = engine
        yield srv


# ---------------------------------------------------------------- streamed text

def test_streams_equal_the_answer_when_tokens_split_characters(bytes_server, byte_tok):
    """Sampled byte-level tokens end inside CJK characters and emoji all the time: the stream
    must hold those back, never send U+FFFD for them, never resend, and add up to the text."""
    seeds = range(16)
    prompt = byte_tok.encode("the river 中文😀")
    ref = LLMEngine(EngineArgs(MODEL, max_model_len=256, tokenizer=byte_tok))
    for s in seeds:
        ref.add_request(f"r{s}", prompt, SamplingParams(max_tokens=32, temperature=1.0, seed=s,
                                                        ignore_eos=True))
    want = {}
    while ref.has_unfinished_requests():
        for out in ref.step():
            if out.finished:
                want[int(out.request_id[1:])] = out.outputs[0]
    splits = sum(byte_tok.decode(c.token_ids[:i]).endswith(REPLACEMENT)
                 for c in want.values() for i in range(1, len(c.token_ids)))
    assert splits >= 20                        # the streams below do cross split characters
    for s in seeds:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 1.0,
                "seed": s, "ignore_eos": True}
        plain = httpx.post(bytes_server.url + "/v1/completions", json=body, timeout=60).json()
        with httpx.stream("POST", bytes_server.url + "/v1/completions",
                          json={**body, "stream": True}, timeout=60) as resp:
            chunks = sse(resp)
        pieces = [c["choices"][0]["text"] for c in chunks]
        assert "".join(pieces) == plain["choices"][0]["text"] == want[s].text, s
        assert not any(p.endswith(REPLACEMENT) for p in pieces[:-1])


# ---------------------------------------------------------------- stop strings

def _greedy(server, prompt: str, n: int = 40) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()[
        "choices"][0]["text"]


def test_stop_strings_with_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    prompt = "Once upon a time the shepherd"
    full = _greedy(server, prompt)
    stop = full[12:15]
    cut = full[:full.find(stop)]
    before = parse_metrics(httpx.get(server.url + "/metrics").text)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                    stop=[stop, "never appears"],
                                    extra_body={"ignore_eos": True})
    c = got.choices[0]
    assert c.text == cut and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    assert got.usage.completion_tokens < 40
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                              temperature=0, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert not any(stop in ch.choices[0].text for ch in streamed)
    wait_until(lambda: idle(server.engine))          # aborted at the match: KV freed
    after = parse_metrics(httpx.get(server.url + "/metrics").text)
    key = ("vllm:request_success_total",
           (("engine", "0"), ("finished_reason", "stop"), ("model_name", MODEL)))
    assert after[key] - before[key] == 2
    # chat, streamed with the client's own parser
    msgs = [{"role": "user", "content": "tell me"}]
    text = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30,
                                          temperature=0).choices[0].message.content
    stop = text[8:11]
    parts = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30,
                                                temperature=0, stop=stop, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == text[:text.find(stop)]
    assert parts[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- n > 1, prompt arrays, chat

def test_n_streams_one_choice_per_chunk_and_prompt_arrays(server):
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 12, "temperature": 1.0,
            "seed": 7, "n": 3, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        chunks = sse(resp)
    assert all(len(c["choices"]) == 1 for c in chunks)
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks
                        if c["choices"][0]["index"] == i) for i in range(3)}
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    # an array of prompts: choice prompt * n + sample, each as if sent alone
    arr = httpx.post(server.url + "/v1/completions", json={
        **body, "prompt": ["The river", "Once upon a time"], "n": 2}, timeout=60).json()
    assert [c["index"] for c in arr["choices"]] == [0, 1, 2, 3]
    alone = httpx.post(server.url + "/v1/completions", json={
        **body, "prompt": "Once upon a time", "n": 2}, timeout=60).json()
    assert [c["text"] for c in arr["choices"][2:]] == [c["text"] for c in alone["choices"]]
    assert arr["usage"]["completion_tokens"] == 4 * 12
    assert arr["usage"]["prompt_tokens"] == sum(
        len(server.engine.tokenizer.encode(p)) for p in ("The river", "Once upon a time"))


def test_chat_content_forms_roles_and_default_length(server):
    def chat(messages, **kw):
        return httpx.post(server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "temperature": 0, **kw}, timeout=120).json()

    plain = chat([{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": "hello\nworld"},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": "again"}], max_tokens=8)
    parts = chat([{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                  {"role": "user", "content": [{"type": "text", "text": "hello"},
                                               {"type": "text", "text": "world"}]},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": "again"}], max_tokens=8)
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]
    bad = chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    assert bad["error"]["param"] == "messages" and "image_url" in bad["error"]["message"]
    # no max_tokens: generation_config.json's max_new_tokens (128, vLLM's server default)
    # clamped to the rest of this 128-token context
    rest = chat([{"role": "user", "content": "hi"}], ignore_eos=True)
    u = rest["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == server.engine.max_model_len
    assert rest["choices"][0]["finish_reason"] == "length"


def test_models_route_by_id(server):
    got = httpx.get(f"{server.url}/v1/models/{MODEL}")
    assert got.status_code == 200 and got.json()["id"] == MODEL
    miss = httpx.get(f"{server.url}/v1/models/gpt-9")
    assert miss.status_code == 404 and miss.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- structured outputs

def test_structured_outputs_over_http(server):
    def complete(**kw):
        return httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Answer:", "max_tokens": 40, "temperature": 0, **kw},
            timeout=120).json()["choices"][0]["text"]

    assert complete(guided_choice=["yes", "no"]) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", complete(structured_outputs={"regex": "[0-9]{3}"}))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    doc = json.loads(complete(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}, max_tokens=60))
    assert set(doc) == {"ok"} and isinstance(doc["ok"], bool)
    obj = complete(response_format={"type": "json_object"}, max_tokens=100)
    assert obj.startswith("{")


# ---------------------------------------------------------------- the event loop stays free

def test_tokenization_runs_once_and_off_the_event_loop(server, monkeypatch):
    """While one request's tokenization is stuck, the server still answers others; each
    request is tokenized exactly once."""
    tok = server.engine.tokenizer
    real = tok.encode
    gate, entered = threading.Event(), threading.Event()
    calls = []

    def slow_encode(text, **kw):
        calls.append(text)
        if text == "BLOCK ME":
            entered.set()
            assert gate.wait(60)
        return real(text, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    result = {}

    def blocked():
        result["r"] = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "BLOCK ME", "max_tokens": 2}, timeout=60)

    t = threading.Thread(target=blocked)
    t.start()
    try:
        assert entered.wait(60)
        other = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "The river", "max_tokens": 3}, timeout=30)
        assert other.status_code == 200
    finally:
        gate.set()
        t.join(60)
    assert result["r"].status_code == 200
    assert calls.count("BLOCK ME") == 1 and calls.count("The river") == 1


# ---------------------------------------------------------------- slow readers

def _scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "headers": [(b"content-type", b"application/json")], "query_string": b"",
            "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("t", 1),
            "root_path": "", "asgi": {"version": "3.0"}}


def test_a_stalled_reader_is_aborted_with_bounded_queue():
    """An ASGI client that stops reading after its first events: the handler blocks in send
    while the engine keeps producing. The stream's queue never owes more than the bound plus
    one step, then the request is aborted and its KV freed; a reader beside it finishes."""
    engine = LLMEngine(EngineArgs(MODEL, max_model_len=256, max_num_seqs=16))
    limit = 40
    aeng = AsyncEngine(engine, model_name=MODEL, max_backlog_tokens=limit)
    app = build_app(aeng, MODEL)

    def body(**kw) -> bytes:
        return json.dumps({"model": MODEL, "prompt": "The river", "ignore_eos": True,
                           "stream": True, **kw}).encode()

    def client(raw: bytes, stall_after: int | None, stalled: asyncio.Event | None):
        sent: list[dict] = []
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()          # never disconnects

        async def send(message):
            sent.append(message)
            if stall_after is not None and len(sent) >= stall_after:
                stalled.set()
                await asyncio.Event().wait()      # stopped reading: send never returns

        return receive, send, sent

    peak = 0

    async def scenario():
        nonlocal peak
        aeng.start()
        try:
            stalled = asyncio.Event()
            r1, s1, _ = client(body(max_tokens=200, n=4), 3, stalled)
            slow = asyncio.ensure_future(app(_scope(), r1, s1))
            await stalled.wait()
            r2, s2, sent2 = client(body(max_tokens=30), None, None)
            reader = asyncio.ensure_future(app(_scope(), r2, s2))
            while aeng.slow_aborts == 0:
                peak = max(peak, aeng.queued_tokens())
                await asyncio.sleep(0.002)
            await asyncio.wait_for(reader, 120)
            slow.cancel()
            return sent2
        finally:
            aeng.shutdown()

    sent2 = asyncio.run(scenario())
    events = [json.loads(m["body"][5:]) for m in sent2 if m["type"] == "http.response.body"
              and m.get("body", b"").startswith(b"data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert aeng.slow_aborts == 1
    # one step adds at most one token per sample (n = 4): the abort comes within one step
    assert limit < aeng.last_slow_backlog <= limit + 4 and peak <= limit + 4
    assert aeng.queued_tokens() == 0
    wait_until(lambda: idle(engine))
    check_engine(engine)
    text = aeng.metrics.render()
    # each of the n = 4 samples ends once, as vLLM counts each child request
    assert parse_metrics(text)[("vllm:request_success_total", (
        ("engine", "0"), ("finished_reason", "abort"), ("model_name", MODEL)))] == 4


# ---------------------------------------------------------------- kvlab bench as a client

def test_bench_counts_tokens_from_usage_and_fails_loudly(server, capsys, tmp_path):
    from kvlab.entrypoints import bench

    out = tmp_path / "b.json"
    rc = bench.main(["--base-url", server.url, "--model", MODEL, "--num-prompts", "4",
                     "--text-prompts", "--input-len", "fixed:6", "--output-len", "fixed:4",
                     "--no-progress", "--result-json", str(out)])
    assert rc == 0
    reqs = json.loads(out.read_text())["requests"]
    # text prompts: the token counts are the server's (usage), not 0
    assert all(r["prompt_tokens"] > 0 and r["output_tokens"] == 4 for r in reqs)
    shown = re.search(r"Total input tokens:\s+(\d+)", capsys.readouterr().out)
    assert int(shown.group(1)) == sum(r["prompt_tokens"] for r in reqs)
    # every request refused (prompts longer than the context): exit 2, the server's message
    rc = bench.main(["--base-url", server.url, "--model", MODEL, "--num-prompts", "3",
                     "--input-len", "fixed:200", "--output-len", "fixed:4", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "3 of 3 requests failed" in err and "maximum context length" in err


def test_stop_token_sets_stop_reason_to_its_id(server):
    prompt = "Once upon a time the shepherd"
    ref = LLMEngine(EngineArgs(MODEL, max_model_len=128))
    ref.add_request("r", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    while ref.has_unfinished_requests():
        outs = ref.step()
    ids = outs[0].outputs[0].token_ids
    stop_id = ids[4]
    first = ids.index(stop_id)
    got = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "stop_token_ids": [stop_id]}, timeout=60).json()
    c = got["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop_id
    assert got["usage"]["completion_tokens"] == first + 1     # the stop token is counted ...
    # ... and its text left out, unless include_stop_str_in_output (vLLM 0.32:
    # BaseIncrementalDetokenizer.update in vllm/v1/engine/detokenizer.py skips the last token
    # of a stop-terminated request)
    assert c["text"] == ref.tokenizer.decode(ids[:first])
    kept = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "stop_token_ids": [stop_id], "include_stop_str_in_output": True},
        timeout=60).json()["choices"][0]
    assert kept["text"] == ref.tokenizer.decode(ids[:first + 1]) != c["text"]


def test_penalties_and_min_tokens_over_http(server):
    """The OpenAI client's ``presence_penalty`` / ``frequency_penalty`` and vLLM's
    ``repetition_penalty`` / ``min_tokens`` reach the sampler: the server's answer equals
    ``LLM``-level generation with the same parameters; bad values are 400s naming the field."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    prompt = "Once upon a time the shepherd"
    ids = server.engine.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            presence_penalty=0.6, frequency_penalty=1.1,
                            repetition_penalty=1.3, min_tokens=5)
    ref = LLMEngine(EngineArgs(MODEL, max_model_len=128))
    ref.add_request("r", ids, params)
    while ref.has_unfinished_requests():
        outs = ref.step()
    want = outs[0].outputs[0]
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, presence_penalty=0.6,
        frequency_penalty=1.1, extra_body={"ignore_eos": True, "repetition_penalty": 1.3,
                                           "min_tokens": 5})
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 24
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text != want.text            # the penalties changed the answer
    for extra, field in (({"presence_penalty": 3}, "presence_penalty"),
                         ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"min_tokens": 30, "max_tokens": 24}, "min_tokens"),
                         ({"min_tokens": 500, "max_tokens": None}, "min_tokens")):
        body = {"model": MODEL, "prompt": prompt, **{"max_tokens": 24, **extra}}
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (extra, r.text)
    wait_until(lambda: idle(server.engine))
